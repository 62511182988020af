"""hbm-watchdog as a PyTorch Lightning callback.

    callback = HbmWatchdogCallback(WatchdogConfig(sample_every=10), checkpoint_dir="ckpt")
    trainer = L.Trainer(callbacks=[callback])
    trainer.fit(model, ckpt_path=callback.resume_path())
    sys.exit(callback.exit_code)        # 42 when the watchdog asked for a restart

Lightning owns the training loop, so a rebuild in process is not ours to do: both checkpoint
actions save an atomic checkpoint, stop `fit` at the step boundary, and set `exit_code` to 42
for the supervisor, torchrun or JobSet to restart the job, which resumes from `resume_path()`.
With several ranks (`strategy="ddp"`, FSDP, a TPU slice) every rank's watchdog agrees on the
action, so every rank saves (a collective) and stops at the same step. `exit_code` belongs to the
newest `fit`. Without validation, `max_steps` tells the policy where the run ends: an OOM
projected past it is a warning.

The watchdog only ever sees step counts: unlike `self.log(tensor)`, it reads no tensor, so on TPU
it adds no compilation and no device-to-host transfer. What the trainer's own loop gets, this gets
through the same `Watchdog`: what is leaking (`leak_suspects`, with holder and creation site),
the action's block on the terminal, the recompilation finding on XLA.

Lightning's tuner (`Tuner.lr_find`, `Tuner.scale_batch_size`) runs its trial steps before `fit`
with the trainer's callbacks swapped out for its own, then ends that `fit` early: this callback
sees none of those steps, and starts its watchdog only with the real training (a second `fit`
with the same callback stops the watchdog of the first). It keeps no tensor, so nothing of it can
be left on the wrong device by the tuner's teardown.

Validation runs under the watchdog's "eval" phase, said to last as many batches as Lightning
plans for it: what validation holds on the device until it ends (predictions collected for an
epoch-end metric) is judged against the peak it reaches by its end, not extrapolated as a leak.
The watchdog's counter is `global_step` plus the validation batches run so far, so it keeps
rising through validation (where `global_step` stands still).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from lightning.pytorch import Callback

from watchdog.actions.checkpoint import is_regular_file, set_aside
from watchdog.core.config import WatchdogConfig
from watchdog.core.errors import EXIT_OK, EXIT_RESTART_REQUESTED, ConfigError
from watchdog.fileio import replacing_path
from watchdog.logs import get_logger
from watchdog.runtime import xla_stats
from watchdog.runtime.sidecar import Watchdog
from watchdog.readers.sources import MemorySource

log = get_logger(__name__)

CHECKPOINT_NAME = "hbm-watchdog-last.ckpt"


class HbmWatchdogCallback(Callback):
    def __init__(self, config: WatchdogConfig | None = None, *, checkpoint_dir: str | os.PathLike[str],
                 source: MemorySource | None = None):
        self.config = config or WatchdogConfig()
        self.checkpoint_dir = Path(checkpoint_dir)
        if self.checkpoint_dir.exists() and not self.checkpoint_dir.is_dir():  # said now, not at the first action
            raise ConfigError("checkpoint_dir", f"{self.checkpoint_dir} exists and is not a directory")
        self.source = source
        self.watchdog: Watchdog | None = None
        self.exit_code = EXIT_OK
        self.action_step: int | None = None
        self._validation_batches = 0  # run so far in this process: the watchdog's counter adds them
        self._phase = None  # the eval phase scope while validation runs
        self._resumed: dict | None = None  # the watchdog's state from the checkpoint fit resumed from

    @property
    def checkpoint_path(self) -> Path:
        return self.checkpoint_dir / CHECKPOINT_NAME

    def resume_path(self) -> str | None:
        """The checkpoint a restarted job should resume from, if one was saved.

        Only a regular file in `checkpoint_dir` is trusted, as for the trainer's checkpoints: a
        symbolic link (another run's checkpoint under this name) or a FIFO is not resumed from; it
        is renamed aside (never deleted) so this run's next save does not land on it, and logged.
        """
        path = self.checkpoint_path
        if is_regular_file(path):
            return str(path)
        if path.is_symlink() or path.exists():
            log.warning("checkpoint_skipped", path=str(path), reason="not a regular file in the directory: not trusted")
            set_aside(path, "not trusted: not a regular file in the checkpoint directory")
        return None

    def setup(self, trainer, pl_module, stage: str) -> None:
        # Before the strategy runs any graph (Lightning's first one checks the dataloader's length):
        # torch_xla reads its compile analysis setting once, at its first graph.
        if self.config.recompilation.explain and _on_xla(trainer):
            xla_stats.prepare_compile_analysis()

    def on_train_start(self, trainer, pl_module) -> None:
        # Called on the training thread, after the strategy has put the model on its device. The
        # strategy names that device: guessing from what is imported would start torch_xla's
        # runtime (and, on a TPU VM, claim the chips) for a CPU or GPU fit that merely has it installed.
        config = self.config
        if config.device is None:
            config = dataclasses.replace(config, device=str(trainer.strategy.root_device))
        self._stop()  # a watchdog left from an earlier fit with this callback
        self._validation_batches, self._phase = 0, None
        self.exit_code, self.action_step = EXIT_OK, None  # what this fit asks for, not an earlier one's
        self.watchdog = Watchdog(config, source=self.source, logs_outcomes=True)
        self.watchdog.ends_at(_last_step(trainer))
        if self._resumed is not None:
            self.watchdog.load_state_dict(self._resumed)
            self._resumed = None  # consumed: a later fit resumes from its own checkpoint, or starts afresh
        # Every rank starts its watchdog here, together: with several ranks they agree on every action.
        self.watchdog.start()

    def state_dict(self) -> dict:
        """Saved in every Lightning checkpoint: the watchdog's restarts in a row and the newest one's
        step, so its restart budget and window span the processes of the job."""
        return self.watchdog.state_dict() if self.watchdog is not None else dict(self._resumed or {})

    def load_state_dict(self, state_dict: dict) -> None:
        """Lightning hands back what `state_dict` saved when `fit` resumes, before `on_train_start`."""
        self._resumed = Watchdog.saved_state(state_dict or None, "the Lightning checkpoint's callback state")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.watchdog is None:
            return
        action = self.watchdog.step(trainer.global_step + self._validation_batches)
        if action is not None:
            self._checkpoint_and_stop(trainer, action)

    def on_validation_start(self, trainer, pl_module) -> None:
        if self.watchdog is None:  # the sanity check runs before training (and the watchdog) starts
            return
        planned = sum(trainer.num_val_batches) if trainer.num_val_batches else 0
        steps = int(planned) if math.isfinite(planned) and planned > 0 else None
        self._phase = self.watchdog.phase("eval", steps=steps)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.watchdog is None:
            return
        self._validation_batches += 1
        # Validation cannot stop here: an action handed over waits on its record until it ends.
        self.watchdog.step(trainer.global_step + self._validation_batches)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._phase is not None:
            self._phase.end()  # back to training
            self._phase = None
        action = self.watchdog.actions.waiting if self.watchdog is not None else None
        if action is not None:
            self._checkpoint_and_stop(trainer, action)

    def _checkpoint_and_stop(self, trainer, action) -> None:
        """Either checkpoint action: saved and a restart asked for (Lightning's loop is not ours to rebuild)."""
        self.watchdog.carry_out(action, save=lambda: self._save_atomically(trainer))
        self.action_step = trainer.global_step
        self.exit_code = self.watchdog.last_action.exit_code or EXIT_RESTART_REQUESTED
        trainer.should_stop = True
        log.error("lightning_checkpoint_and_stop", action=action.value, step=trainer.global_step,
                  checkpoint=str(self.checkpoint_path), exit_code=self.exit_code)

    def _save_atomically(self, trainer) -> Path:
        """Lightning writes the checkpoint (on global rank zero) to a temporary that becomes the real
        name only once whole (watchdog/fileio.py: a random name no link can be planted under).
        `save_checkpoint` is collective, so every rank passes rank zero's path."""
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        if not trainer.is_global_zero:
            trainer.save_checkpoint(trainer.strategy.broadcast(None))
            return self.checkpoint_path
        with replacing_path(self.checkpoint_path) as temporary:
            trainer.save_checkpoint(trainer.strategy.broadcast(str(temporary)))
        return self.checkpoint_path

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._stop(exception)

    def _stop(self, exception: BaseException | None = None) -> None:
        if self.watchdog is not None:  # idempotent; the stopped watchdog stays readable (telemetry, suspects)
            self.watchdog.stop_leaving(exception)


def _last_step(trainer) -> int | None:
    """Where the watchdog's counter ends: `max_steps`, when no validation adds batches to it."""
    planned = sum(trainer.num_val_batches) if trainer.num_val_batches else 0
    if trainer.max_steps is None or trainer.max_steps < 0 or planned:
        return None
    return trainer.max_steps


def _on_xla(trainer) -> bool:
    try:
        return trainer.strategy.root_device.type == "xla"
    except Exception:  # noqa: BLE001 - a strategy without a device yet is not on XLA as far as we know
        return False
