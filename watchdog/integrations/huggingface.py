"""hbm-watchdog as a Hugging Face Transformers callback.

    from watchdog.integrations.huggingface import HbmWatchdogCallback

    callback = HbmWatchdogCallback(WatchdogConfig(sample_every=10))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint=resume)   # True once a checkpoint exists in output_dir
    sys.exit(callback.exit_code)                   # 42 when the watchdog asked for a restart

The `Trainer` owns the loop, so a rebuild in process is not ours to do: on either checkpoint
action the callback asks the `Trainer` to save its own checkpoint at this step
(`control.should_save`) and to stop (`control.should_training_stop`), skips an evaluation due at
that step (it would only add memory), and sets `exit_code` to 42 for `hbm-watchdog supervise`,
torchrun or JobSet to restart the job; `trainer.train(resume_from_checkpoint=True)` then resumes
from it. With several ranks (DDP, FSDP, DeepSpeed under torchrun or accelerate) every rank's
watchdog agrees on the action, so every rank saves and stops at the same step. `exit_code`
belongs to the newest `train()`. Without evaluation, `max_steps` tells the policy where the run
ends: an OOM projected past it is a warning.

The callback reads step counts from `state.global_step`, never a tensor, so on TPU it adds no
compilation and no device-to-host transfer. Evaluation and prediction run under the watchdog's
"eval" phase, said to last as many batches as the evaluation's dataloader holds; the counter is
`global_step` plus the evaluation batches run so far, so it keeps rising through them.

Hugging Face's prediction loop keeps every batch's predictions on the device until the
evaluation ends, unless `eval_accumulation_steps` is set (transformers#8508 on TPU, #7232): when
an action comes while an evaluation runs, the finding says so and names that setting.

On TPU: with torch_xla installed, `Trainer` puts the model on the XLA device by itself (`USE_TORCH_XLA=0`
in the environment keeps it off XLA, e.g. for a CPU run on a TPU VM). Its default optimizer there
is a fused AdamW that torch_xla cannot run: pass `optim="adamw_torch"` in `TrainingArguments`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from transformers import TrainerCallback

from watchdog.core import strict_json
from watchdog.core.config import WatchdogConfig
from watchdog.core.errors import EXIT_OK, EXIT_RESTART_REQUESTED, InputError
from watchdog.core.inputs import open_regular
from watchdog.fileio import write_atomically
from watchdog.logs import get_logger
from watchdog.runtime import xla_stats
from watchdog.runtime.sidecar import Watchdog
from watchdog.readers.sources import MemorySource

log = get_logger(__name__)

STATE_FILE = "hbm-watchdog.json"  # in each checkpoint-N folder: the watchdog's restarts in a row (state_dict)

EVAL_ACCUMULATION_FINDING = (
    "memory grew while an evaluation ran: Hugging Face's prediction loop keeps every batch's "
    "predictions on the device until the evaluation ends unless eval_accumulation_steps is set; "
    "TrainingArguments(eval_accumulation_steps=N) moves them to the CPU every N batches")


class HbmWatchdogCallback(TrainerCallback):
    def __init__(self, config: WatchdogConfig | None = None, *, source: MemorySource | None = None):
        self.config = config or WatchdogConfig()
        self.source = source
        if self.config.recompilation.explain and "torch_xla" in sys.modules:
            # Made before the Trainer, so before its first graph: torch_xla reads this setting only then.
            xla_stats.prepare_compile_analysis()
        self.watchdog: Watchdog | None = None
        self.exit_code = EXIT_OK
        self.action_step: int | None = None
        self.findings: list[str] = []
        self._eval_batches = 0  # run so far in this process: the watchdog's counter adds them
        self._phase = None  # the eval phase scope while an evaluation runs

    # ---- training ------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # On the training thread, once the Trainer has placed the model: its device is the one to
        # watch (a guess from what is imported would start torch_xla's runtime for a CPU run).
        config = self.config
        if config.device is None and model is not None:
            parameter = next(model.parameters(), None)
            if parameter is not None:
                config = dataclasses.replace(config, device=str(parameter.device))  # metadata, no transfer
        self._stop()  # a watchdog left from an earlier train() with this callback
        self._eval_batches, self._phase = 0, None
        self.exit_code, self.action_step, self.findings = EXIT_OK, None, []  # this train()'s, not an earlier one's
        # Every rank starts its watchdog here, together: with several ranks they agree on every action.
        self.watchdog = Watchdog(config, source=self.source, logs_outcomes=True)
        self.watchdog.ends_at(_last_step(args, state))
        saved = _saved_state(args, state)
        if saved is not None:
            self.watchdog.load_state_dict(saved)
        self.watchdog.start()

    def on_step_end(self, args, state, control, **kwargs):
        if self.watchdog is None:
            return
        action = self.watchdog.step(state.global_step + self._eval_batches)
        if action is not None and action.needs_checkpoint:
            self._checkpoint_and_stop(args, state, control, action)

    def on_save(self, args, state, control, **kwargs):
        """Beside the Trainer's checkpoint: the watchdog's restarts in a row and the newest one's step,
        so its restart budget and window span the processes of the job (read back on resume)."""
        if self.watchdog is None or not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            write_atomically(folder / STATE_FILE, strict_json.dumps(self.watchdog.state_dict()))

    def on_train_end(self, args, state, control, **kwargs):
        self._end_evaluation()
        self._stop()

    # ---- evaluation and prediction -------------------------------------------------------------

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if self.watchdog is None:  # an evaluate() or predict() outside train(): nothing watches it
            return
        if self._phase is None:
            self._phase = self.watchdog.phase("eval", steps=_planned_batches(eval_dataloader))
        self._eval_batches += 1
        # The evaluation cannot be stopped from here: an action handed over waits on its record until it ends.
        self.watchdog.step(state.global_step + self._eval_batches)

    def on_evaluate(self, args, state, control, **kwargs):
        self._after_evaluation(args, state, control)

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        self._after_evaluation(args, state, control)

    def _after_evaluation(self, args, state, control) -> None:
        self._end_evaluation()
        action = self.watchdog.actions.waiting if self.watchdog is not None else None
        if action is not None and self.exit_code == EXIT_OK:
            if args.eval_accumulation_steps is None:
                self.findings.append(EVAL_ACCUMULATION_FINDING)
                log.warning("evaluation_growth", step=state.global_step, finding=EVAL_ACCUMULATION_FINDING)
            self._checkpoint_and_stop(args, state, control, action)

    def _end_evaluation(self) -> None:
        if self._phase is not None:
            self._phase.end()  # back to training
            self._phase = None

    # ---- the action ----------------------------------------------------------------------------

    def _checkpoint_and_stop(self, args, state, control, action) -> None:
        control.should_save = True  # the Trainer saves its own checkpoint at this step...
        control.should_training_stop = True  # ...and stops at the step boundary
        control.should_evaluate = False  # an evaluation now would only add memory
        self.action_step = state.global_step
        self.exit_code = EXIT_RESTART_REQUESTED
        checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        log.error("huggingface_checkpoint_and_stop", action=action.value, step=state.global_step,
                  checkpoint=checkpoint, exit_code=self.exit_code)
        decided = self.watchdog.last_action
        if decided is not None and self.findings:
            decided.suspects = [*self.findings[-1:], *decided.suspects]
        self.watchdog.carry_out(action, checkpoint=checkpoint)  # the Trainer saves it itself, after this step

    def _stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()  # idempotent; the stopped watchdog stays readable (telemetry, suspects)


def _saved_state(args, state) -> dict | None:
    """What `on_save` kept beside the checkpoint this run resumed from (None: a first start, or none
    kept); one that cannot be read is logged and left out, never a reason to stop training."""
    if not state.global_step:
        return None
    path = Path(args.output_dir) / f"checkpoint-{state.global_step}" / STATE_FILE
    try:
        with open_regular(path, "rb", what="watchdog state ") as handle:
            saved = strict_json.loads(handle.read(4096))
    except FileNotFoundError:
        return None
    except (OSError, InputError, ValueError) as exc:
        log.warning("watchdog_state_unread", path=str(path), error=type(exc).__name__,
                    note="the restart budget counts every restart of the job instead")
        return None
    return Watchdog.saved_state(saved, str(path))  # its types and bounds, the same rule as Lightning's


def _last_step(args, state) -> int | None:
    """Where the watchdog's counter ends: `max_steps`, when no evaluation adds batches to it."""
    evaluates = str(getattr(args, "eval_strategy", "no")).lower() not in ("no", "intervalstrategy.no")
    if evaluates or not state.max_steps or state.max_steps < 0:
        return None
    return state.max_steps


def _planned_batches(dataloader) -> int | None:
    try:
        planned = len(dataloader)
    except TypeError:  # an iterable dataset: no length known, the phase lasts as long as last time
        return None
    return planned if planned > 0 else None
