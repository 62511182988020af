"""The trainer's checkpoints: where they go, what goes in one, when one is due, and whether it landed.

One `Checkpointer` per run. It decides the periodic saves and the last step's, writes the payload
(the state, the RNG, the data position and the watchdog's state that spans processes), agrees across
ranks that every save landed, exports the disk's figures and counts each save in the job's time.
An action's save is the watchdog's to time (`Watchdog.carry_out` calls `save`).

Without `--checkpoint-dir` the checkpoints go to a temporary folder, removed at the end unless a
restart needs what is in it.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Protocol

from watchdog.actions.agreement import Agreement
from watchdog.actions.checkpoint import CheckpointSaveError, DiskSpace, capture_rng_state
from watchdog.core.phase import SAVE
from watchdog.core.verdict import Action
from watchdog.logs import get_logger
from watchdog.records.job_ledger import JobLedger
from watchdog.runtime.checkpoint_figures import CheckpointFigures
from watchdog.trainer import leaks

log = get_logger(__name__)

CHECKPOINT_FORMAT = 1


def checkpoint_payload(state, config, device, *, watchdog: dict, reinits: int) -> dict:
    """What a checkpoint holds: everything a step depends on, and the run's state that spans processes
    (`watchdog`: the watchdog's `state_dict()`, one nested entry as every host keeps it)."""
    return {
        "format": CHECKPOINT_FORMAT,
        "step": state.step,
        "data_position": state.data_position,
        "model": state.model.state_dict(),
        "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict(),
        "rng": capture_rng_state(device),
        "watchdog": dict(watchdog),  # restarts so far, the watchdog's own in a row, what each restart bought
        "reinits": reinits,
        "model_config": dataclasses.asdict(config.model),
        "seed": config.seed,
    }


class Checkpoints(Protocol):
    """What the trainer asks of its checkpoint manager, plain (`CheckpointManager`, one writer) or
    sharded (`ShardedCheckpointManager`, every process writes its shards)."""

    directory: Path

    def save(self, payload: dict, step: int) -> Path: ...
    def list(self) -> list[Path]: ...
    def latest_step(self) -> int | None: ...
    def disk_space(self) -> DiskSpace: ...


class Checkpointer:
    def __init__(self, config, strategy, replica):
        self.config, self.strategy, self.replica = config, strategy, replica
        self._temporary_dir = None if config.checkpoint_dir else Path(tempfile.mkdtemp(prefix="hbm-watchdog-ckpt-"))
        self.checkpoints: Checkpoints = strategy.checkpoint_manager(config.checkpoint_dir or self._temporary_dir,
                                                                    config.keep_checkpoints)
        self.saved_at: int | None = None  # the step of the newest checkpoint this process saved
        self._watchdog = self._agreement = self._ledger = None

    @property
    def temporary(self) -> bool:
        return self._temporary_dir is not None

    def open_run(self):
        """The state to start from: the newest checkpoint's (and its payload), or None for a fresh one."""
        return self.strategy.open_run(self.checkpoints, self.config, writer=self.replica.rank == 0)

    def load_latest(self):
        return self.strategy.load_latest(self.checkpoints, self.config)

    def join(self, watchdog, agreement: Agreement | None, ledger: JobLedger | None) -> None:
        """The run's watchdog (its state goes into each payload, its telemetry gets the figures), the
        ranks' agreement and the job's ledger, once the run has them."""
        self._watchdog, self._agreement, self._ledger = watchdog, agreement, ledger
        self.check_disk()

    # ---- when ----------------------------------------------------------------------------------

    def save_if_due(self, state, payload_extra: dict) -> None:
        """The periodic save, every `checkpoint_every` steps; a failure is logged (the next may fit)."""
        every = self.config.checkpoint_every
        if every and state.step % every == 0:
            self._timed_save(state, payload_extra)

    def save_at_end(self, state, first_step: int, payload_extra: dict) -> bool:
        """The finished state, unless it is on disk already; False when the disk refused it (the run
        must then be redone from the newest checkpoint)."""
        if self.saved_at == state.step or (state.step == first_step and self.checkpoints.latest_step() is not None):
            return True
        return self._timed_save(state, payload_extra)

    def _timed_save(self, state, payload_extra: dict) -> bool:
        started = time.perf_counter()
        saved = self.save(state, payload_extra)
        if saved:
            self._watchdog.observe_checkpoint(time.perf_counter() - started)
        return saved is not False

    # ---- how -----------------------------------------------------------------------------------

    def save(self, state, payload_extra: dict) -> Path | bool:
        """A checkpoint of `state` as it is now: its path, or False when the disk refused it (logged with
        path, bytes needed and bytes free; the older checkpoints are intact). Every rank gets the same
        answer. Collective with several ranks: every rank calls it at the same step."""
        span = self._ledger.span("checkpoint_save", state.step) if self._ledger is not None else nullcontext()
        with span, self._watchdog.phase(SAVE):  # its end's reading holds the save's peak (its staging copies)
            saved = self._write(state, payload_extra)
        if saved:
            self.saved_at = state.step
        self.check_disk()
        listing = self.checkpoints.list() if saved else []
        return listing[-1] if listing else saved

    def _write(self, state, payload_extra: dict) -> bool:
        saved = True
        # Sharded: every process writes its own shards (a collective save). Else one writer, rank 0:
        # the replicas' states are identical.
        if self.strategy.sharded_checkpoints or self.replica.rank == 0:
            payload = checkpoint_payload(state, self.config, self.strategy.device,
                                         watchdog=self._watchdog.state_dict(), **payload_extra)
            try:
                self.checkpoints.save(payload, state.step)
                leaks.after_save(self.config.leaks, state.step)
            except CheckpointSaveError as exc:
                saved = False
                log.error("checkpoint_save_failed", path=str(exc.path), step=state.step, error=exc.reason,
                          bytes_needed=exc.bytes_needed, bytes_free=exc.bytes_free,
                          note="older checkpoints are intact; training goes on")
            del payload
        if not self.strategy.sharded_checkpoints:
            self.replica.barrier(f"checkpoint-{state.step}")
        if self._agreement is not None:  # every process learns whether every process's save landed
            saved = self._agreement.decide(state.step, None if saved else Action.CHECKPOINT_RESTART) is None
        return saved

    def check_disk(self) -> None:
        """Free space against the newest checkpoint's size: exported (rank 0)."""
        telemetry = self._watchdog.telemetry  # None: an unwatched run told of no exporter
        if self.replica.rank != 0 or telemetry is None:
            return
        space = self.checkpoints.disk_space()
        telemetry.part(CheckpointFigures).observe_space(space.free_bytes, space.checkpoint_bytes)

    # ---- the end -------------------------------------------------------------------------------

    def keep(self) -> None:
        """A restart asked for without --checkpoint-dir: its checkpoints stay (nothing lost), and the
        log says where and how to resume from them."""
        if self._temporary_dir is None:
            return
        directory, self._temporary_dir = self._temporary_dir, None
        log.warning("checkpoints_kept", checkpoint_dir=str(directory),
                    note=f"the restart resumes from them only with --checkpoint-dir {directory} --resume auto")

    def close(self) -> None:
        if self._temporary_dir is not None:
            shutil.rmtree(self._temporary_dir, ignore_errors=True)
