"""The training loop, written to read as the story it tells.

    build the state (model, AdamW, LR schedule, data position, RNG)
    -> resume from the newest checkpoint, if asked and there is one
    -> for each step: batch, forward, backward, optimizer step, (leak), sync, ask the watchdog
       -> every `eval_every` steps, a small evaluation under the watchdog's "eval" phase
       -> carry out what it asks for, between steps:
          checkpoint-and-reinit: save, drop every reference to the state, collect, rebuild
                                 from the checkpoint, tell the watchdog (it re-measures the floor)
          checkpoint-and-restart: save, exit 42 (a supervisor or the cluster restarts the job)
          SIGTERM (preemption): save at the next step boundary, exit 42
          SIGINT (Ctrl-C): save at the next step boundary, exit 130 (a second Ctrl-C stops at once)
    -> a checkpoint the disk refuses is logged (path, bytes needed, bytes free) and training goes
       on; if an action, a signal or the last step needed it, a restart is still requested, as
       exit 44: nothing new was saved, so a restarter that counts it bounds a disk that refuses
       every write (exit 42 is reserved for a saved checkpoint)

A step depends only on the state, the RNG and the data position, and all three are in the
checkpoint, so a reinit or a restart continues bit for bit where the run would have been. An
evaluation reads the model and draws nothing from the RNG, so it changes no training step.

The watchdog's step counter keeps rising through evaluations: it is the training step plus the
evaluation batches run before it (`watch_step`), a pure function of the step, so a resumed run
counts as the uninterrupted one would have.
The device object is created once per process and reused by every rebuild: the XLA runtime is
never initialised twice.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch

from watchdog.actions.checkpoint import (
    CheckpointManager,
    CheckpointSaveError,
    capture_rng_state,
    restore_rng_state,
)
from watchdog.core.config import WatchdogConfig
from watchdog.core.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_RESTART_REQUESTED, EXIT_UNSAVED, InputError
from watchdog.core.policy import restarts_in_a_row
from watchdog.core.restarts import restarts_so_far
from watchdog.core.verdict import Action
from watchdog.logs import get_logger
from watchdog.forensics.follower import LeakFollower
from watchdog.station.blocks import ActionOutcome, RunSummary
from watchdog.runtime import agreement, job_ledger
from watchdog.runtime.agreement import Agreement
from watchdog.runtime.checkpoint_figures import CheckpointFigures
from watchdog.runtime.footprint import retained_bytes
from watchdog.runtime.job_ledger import JobLedger
from watchdog.runtime.sidecar import REINITIALISED, RESTART_REQUESTED, Watchdog, log_action_outcome
from watchdog.runtime.sources import release_host_memory
from watchdog.station.telemetry import Telemetry
from watchdog.trainer import leaks
from watchdog.trainer.data import Batch, TokenSource
from watchdog.trainer.leaks import LeakSinks, LeakSpec
from watchdog.trainer.model import ModelConfig, TransformerLM
from watchdog.trainer.progress import Progress

log = get_logger(__name__)

CHECKPOINT_FORMAT = 1
CHECKPOINT_KEYS = ("step", "data_position", "model", "optimizer", "scheduler", "rng")  # what a resume reads
EVAL_POSITION = 1 << 40  # held out: the same batches every evaluation, at positions no training step reaches


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 600
    model: ModelConfig = field(default_factory=ModelConfig)
    batch_size: int = 8
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    seed: int = 0
    device: str = "auto"
    text_file: Path | None = None
    leaks: tuple[LeakSpec, ...] = ()
    checkpoint_dir: Path | None = None  # None: a temporary directory (reinit works, resume cannot)
    checkpoint_every: int = 0  # 0: only when an action asks, on SIGTERM and at the end
    keep_checkpoints: int = 3
    resume: str = "auto"
    overwrite_checkpoints: bool = False  # start over another run's checkpoints (deleted after the first save)
    log_every: int = 50
    progress_bar: bool | None = None  # None: on a TTY
    forced_actions: tuple[tuple[int, Action], ...] = ()  # drills: (step, action) as if the watchdog asked
    eval_every: int = 0  # an evaluation after every this many training steps; 0: none
    eval_steps: int = 20  # batches per evaluation
    eval_keep_outputs: bool = False  # keep each eval batch's logits on the device until the evaluation ends
    watchdog: WatchdogConfig | None = field(default_factory=WatchdogConfig)  # None: train unwatched


@dataclass
class TrainerState:
    """Everything a reinit drops and rebuilds. The in-state leaks live here too, so they go with it."""

    model: TransformerLM
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: int  # steps completed = index of the next step
    data_position: int  # position of the next batch
    sinks: LeakSinks = field(default_factory=leaks.new_sinks)


@dataclass
class TrainResult:
    exit_code: int
    first_step: int  # where this process started (after a resume)
    step: int  # steps completed in all
    steps_total: int
    reinits: int
    restarts: int
    final_loss: float | None
    verdict: str
    source: str
    steps_per_second: float
    losses: dict[int, float]  # read at log steps only (a read is a device-to-host transfer)
    table: str = ""  # the end-of-run summary a person reads on a terminal (RunSummary.block)

    def summary(self) -> str:
        loss = "n/a" if self.final_loss is None else f"{self.final_loss:.4f}"
        outcome = {EXIT_OK: "done", EXIT_INTERRUPTED: "interrupted (exit 130)"}.get(
            self.exit_code, f"restart requested (exit {self.exit_code})")
        return (f"train: {outcome}: steps {self.step}/{self.steps_total} (this run from {self.first_step}), "
                f"reinits {self.reinits}, restarts {self.restarts}, final loss {loss}, "
                f"{self.steps_per_second:.1f} steps/s, watchdog {self.verdict} (source {self.source})")


# ---- the device: chosen and created once per process --------------------------------------------

def select_device(name: str) -> torch.device:
    """`auto`: XLA when a TPU (or PJRT_DEVICE) is there, else CUDA, else XLA on PJRT CPU, else CPU."""
    if name == "auto":
        name = _auto_device()
    if name == "xla":
        if not os.environ.get("PJRT_DEVICE"):
            os.environ["PJRT_DEVICE"] = "TPU" if _has_tpu() else "CPU"
        try:
            import torch_xla
        except ImportError as exc:
            raise InputError(f"--device xla: torch_xla is not importable ({exc})") from None
        try:
            return torch_xla.device()
        except RuntimeError as exc:  # "No PjRtPlugin registered for: X": the runtime could not start
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InputError(f"--device xla with PJRT_DEVICE={os.environ.get('PJRT_DEVICE')!r}: "
                             f"{first.split('. ')[0]}") from None
    if name == "cuda":
        if not torch.cuda.is_available():
            raise InputError("--device cuda: CUDA is not available on this machine")
        return torch.device("cuda", torch.cuda.current_device())
    if name == "cpu":
        return torch.device("cpu")
    raise InputError(f"--device {name!r}: expected auto, xla, cuda or cpu")


def _auto_device() -> str:
    if os.environ.get("PJRT_DEVICE") or _has_tpu():
        return "xla"
    if torch.cuda.is_available():
        return "cuda"
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return "cpu"
    return "xla"


def _has_tpu() -> bool:
    return any(Path("/dev").glob("accel*")) or any(Path("/dev/vfio").glob("[0-9]*"))


def _sync_function(device: torch.device) -> Callable[[], None]:
    if device.type == "xla":
        import torch_xla

        return torch_xla.sync
    return lambda: None


# ---- state: build fresh, save, restore -----------------------------------------------------------

def seed_everything(seed: int, device: torch.device) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device.type == "xla":
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed, str(device))


def build_state(config: TrainConfig, device: torch.device) -> TrainerState:
    """A fresh model and optimizer on `device`, at step 0."""
    model = TransformerLM(config.model).to(device).train()
    # capturable keeps AdamW's step counter on the device too (XLA, CUDA), not on the host.
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate,
                                  weight_decay=config.weight_decay,
                                  capturable=device.type in ("xla", "cuda"))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_schedule(config))
    return TrainerState(model, optimizer, scheduler, step=0, data_position=0)


def _lr_schedule(config: TrainConfig) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to 10% at the last step."""
    warmup, total = max(1, config.warmup_steps), max(1, config.steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def checkpoint_payload(state: TrainerState, config: TrainConfig, device: torch.device, *,
                       restarts_so_far: int, reinits: int, watchdog_restarts: int = 0,
                       watchdog_restart_step: int | None = None) -> dict:
    return {
        "format": CHECKPOINT_FORMAT,
        "step": state.step,
        "data_position": state.data_position,
        "model": state.model.state_dict(),
        "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict(),
        "rng": capture_rng_state(device),
        "restarts_so_far": restarts_so_far,
        "watchdog_restarts": watchdog_restarts,  # restarts the watchdog asked for in a row: its budget counts these
        "watchdog_restart_step": watchdog_restart_step,
        "reinits": reinits,
        "model_config": dataclasses.asdict(config.model),
        "seed": config.seed,
    }


def check_same_model(payload: dict, config: TrainConfig) -> None:
    saved_model = payload.get("model_config")
    if saved_model is not None and saved_model != dataclasses.asdict(config.model):
        changed = sorted(k for k in saved_model if saved_model[k] != dataclasses.asdict(config.model).get(k))
        raise InputError(f"the checkpoint was written for a different model ({', '.join(changed)} differ); "
                         "use the same model flags, or a fresh --checkpoint-dir")


def restore_state(payload: dict, config: TrainConfig, device: torch.device,
                  state: TrainerState | None = None) -> TrainerState:
    """Rebuild from a checkpoint onto `device`: every parameter and optimizer tensor lands there.

    `state`: a sharded checkpoint was already read into this state's own tensors (the payload's
    tensors are those); what remains is the host side.
    """
    check_same_model(payload, config)
    if state is None:
        state = build_state(config, device)
        state.model.load_state_dict(payload["model"])
    state.optimizer.load_state_dict(payload["optimizer"])  # casts state to each parameter's device
    state.scheduler.load_state_dict(payload["scheduler"])
    state.step, state.data_position = int(payload["step"]), int(payload["data_position"])
    restore_rng_state(payload["rng"], device)  # building the model drew from the RNG: put it back
    return state


def off_device_tensors(state: TrainerState, device: torch.device) -> list[str]:
    """Names of model or optimizer tensors that are not on `device` (should be none)."""
    wrong = [f"model.{name}" for name, t in state.model.state_dict().items() if t.device != device]
    for index, per_param in enumerate(state.optimizer.state.values()):
        wrong += [f"optimizer.state[{index}].{key}" for key, value in per_param.items()
                  if isinstance(value, torch.Tensor) and value.device != device]
    return wrong


# ---- one step ----------------------------------------------------------------------------------

def train_step(state: TrainerState, tokens: torch.Tensor, targets: torch.Tensor,
               optimizer_step: Callable[[torch.optim.Optimizer], object]) -> torch.Tensor:
    state.optimizer.zero_grad(set_to_none=True)
    _, loss = state.model(tokens, targets)
    loss.backward()
    optimizer_step(state.optimizer)  # several replicas: xm.optimizer_step all-reduces the gradients
    state.scheduler.step()
    return loss.detach()


def _pending_state(state: TrainerState) -> list[torch.Tensor]:
    """What a step updates besides its loss: the parameters and the optimizer's state."""
    tensors = list(state.model.parameters())
    for per_param in state.optimizer.state.values():
        tensors += [value for value in per_param.values() if isinstance(value, torch.Tensor)]
    return tensors


def _optimizer_step_function(replicated: bool) -> Callable[[torch.optim.Optimizer], object]:
    if not replicated:
        return lambda optimizer: optimizer.step()
    import torch_xla.core.xla_model as xm

    return xm.optimizer_step


def eval_step(model: TransformerLM, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One evaluation batch: (logits, loss), no autograd graph."""
    with torch.no_grad():
        logits, loss = model(tokens, targets)
    return logits, loss


def watch_step(config: TrainConfig, step: int) -> int:
    """The watchdog's counter at training step `step`: the step plus every evaluation batch run
    before it (evaluations run after steps eval_every - 1, 2 * eval_every - 1, ...)."""
    if not config.eval_every:
        return step
    return step + (step // config.eval_every) * config.eval_steps


# ---- where the state lives ----------------------------------------------------------------------

class Strategy(Protocol):
    """What the loop asks about where the state lives: `SingleDevice` below, or `--spmd`'s sharded
    one (watchdog/trainer/spmd.py). The story of the loop is the same for both."""

    device: torch.device
    sharded_checkpoints: bool  # every process writes its own shards (else rank 0 writes one file)

    def build_state(self, config: TrainConfig) -> TrainerState: ...
    def to_device(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]: ...
    def shard_new_tensor(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def checkpoint_manager(self, directory: Path, keep_last: int): ...
    def open_run(self, checkpoints, config: TrainConfig, *, writer: bool = True
                 ) -> tuple[TrainerState, dict] | None: ...  # at start: the resume and "nothing lost" rules

    def load_latest(self, checkpoints, config: TrainConfig) -> tuple[TrainerState, dict] | None: ...  # a reinit


class SingleDevice:
    """The state on one device per process (one replica per device under torch_xla.launch)."""

    sharded_checkpoints = False  # one writer (rank 0), one file per checkpoint

    def __init__(self, device: torch.device):
        self.device = device

    def build_state(self, config: TrainConfig) -> TrainerState:
        return build_state(config, self.device)

    def to_device(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return batch.tokens.to(self.device), batch.targets.to(self.device)

    def shard_new_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def checkpoint_manager(self, directory: Path, keep_last: int) -> CheckpointManager:
        return CheckpointManager(directory, keep_last=keep_last, format=CHECKPOINT_FORMAT,
                                 required_keys=CHECKPOINT_KEYS)

    def open_run(self, checkpoints: CheckpointManager, config: TrainConfig, *,
                 writer: bool = True) -> tuple[TrainerState, dict] | None:
        """The state to continue from, if this run continues one (see CheckpointManager.open_run)."""
        payload = checkpoints.open_run(resume=config.resume == "auto", overwrite=config.overwrite_checkpoints,
                                       writer=writer)
        return None if payload is None else (restore_state(payload, config, self.device), payload)

    def load_latest(self, checkpoints: CheckpointManager, config: TrainConfig) -> tuple[TrainerState, dict] | None:
        payload = checkpoints.load_latest()
        return None if payload is None else (restore_state(payload, config, self.device), payload)


# ---- the run -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Replica:
    """This process's place in a multi-process run: a data-parallel replica (torch_xla.launch), or a
    host of an SPMD job (not replicated: one sharded program). One process by default."""

    rank: int = 0
    world: int = 1
    replicated: bool = False  # MpDeviceLoader + xm.optimizer_step (launched replicas, even just one)

    def barrier(self, tag: str) -> None:
        """Wait for every process: over torch.distributed when the processes share a group (the
        one they agree on actions over), else at an XLA rendezvous."""
        if self.world == 1:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
        else:
            import torch_xla.core.xla_model as xm

            xm.rendezvous(tag)


class Trainer:
    """Runs one replica's share of the training; `run()` returns how it ended."""

    def __init__(self, config: TrainConfig, *, telemetry: Telemetry | None = None,
                 on_watchdog_started: Callable[[object], None] | None = None, replica: Replica = Replica(),
                 strategy: Strategy | None = None):
        self.config = config
        self.telemetry = telemetry
        self.on_watchdog_started = on_watchdog_started
        self.replica = replica
        # The device is created once per process; every rebuild reuses it.
        self.strategy = strategy or SingleDevice(select_device(config.device))
        self.device = self.strategy.device
        if self.device.type == "xla" and config.watchdog is not None and config.watchdog.recompilation.explain:
            from watchdog.runtime import xla_stats

            xla_stats.prepare_compile_analysis()  # before the first graph: torch_xla reads it only then
        self._sync = _sync_function(self.device)
        # No --checkpoint-dir: a temporary one, removed at the end unless a restart needs what is in it.
        self._temporary_dir: Path | None = None
        if config.checkpoint_dir is None:
            self._temporary_dir = Path(tempfile.mkdtemp(prefix="hbm-watchdog-ckpt-"))
        directory = config.checkpoint_dir or self._temporary_dir
        self.checkpoints = self.strategy.checkpoint_manager(directory, config.keep_checkpoints)
        # Replicas read disjoint shards of the data; SPMD processes all feed the same global batch.
        shard, shards = (replica.rank, replica.world) if replica.replicated else (0, 1)
        self.data = TokenSource(batch_size=config.batch_size, seq_len=config.model.seq_len,
                                vocab_size=config.model.vocab_size, seed=config.seed,
                                text_file=config.text_file, shard=shard, num_shards=shards)
        self._agreement: Agreement | None = None  # several processes: one decision (made at run())
        self.eval_losses: dict[int, float] = {}
        self._optimizer_step = _optimizer_step_function(replica.replicated)
        self._loader = None  # several replicas: MpDeviceLoader batches, rebuilt with the state
        self.forced = dict(config.forced_actions)  # unwatched runs only: the watchdog takes them otherwise
        self.state: TrainerState | None = None
        self.watchdog = None
        self.ledger: JobLedger | None = None  # where this process's time goes, for the job's goodput
        self._restore_seconds = 0.0
        self._saved_at: int | None = None  # the step of the newest checkpoint this process saved
        self.reinits = 0
        self.restarts_so_far = 0  # every restart of the job (supervise's count, or the checkpoint's)
        self.watchdog_restarts = 0  # those the watchdog asked for, in a row: what its restart budget counts
        self.watchdog_restart_step: int | None = None  # the training step of its newest restart
        self._stop_signal: int | None = None
        # What is leaking: driven here rather than inside the watchdog, since an action may come from
        # the ranks' agreement or be forced, not only from this rank's watchdog.
        self._follower = LeakFollower()
        # Under --hlo-source-lines, the first step's program goes into the flight record (op -> your line).
        self._program_due = (self.device.type == "xla" and config.watchdog is not None
                             and config.watchdog.trace_file is not None and os.environ.get("XLA_HLO_DEBUG") == "1")

    # -- the story --

    def run(self) -> TrainResult:
        self._claim_the_job_file()  # a foreign job file is refused before anything of this run is written
        self.state = self._start_state()
        first_step = self.state.step
        self._agreement = self._join_agreement()
        self.watchdog = self._start_watchdog()
        self.ledger = self._open_ledger(first_step)
        self._check_disk()
        progress = Progress(self.config.steps, first_step, self.config.log_every, self.config.progress_bar)
        previous_handlers = self._catch_stop_signals()
        exit_code, loss, finished = EXIT_OK, None, False
        footprint_at_start = None  # what the watchdog itself holds, after the first step (runtime/footprint.py)
        started = time.perf_counter()
        try:
            while self.state.step < self.config.steps:
                step = self.state.step
                loss = self._one_step(step)
                if self.ledger is not None:
                    self.ledger.step_done(self.state.step)
                if footprint_at_start is None and self.watchdog is not None:
                    footprint_at_start = retained_bytes(self.watchdog)
                if self._follower.baseline_due:  # after one step, so the optimizer state is in the baseline
                    self._follower.take_baseline(step)
                action = self._ask(step)  # one decision, on every process at the same step
                if action is None and self._evaluation_due(step):
                    with self._timed("eval", step):
                        action = self._evaluate(step)
                suspects = self._follow_the_leak(step, action if self._stop_signal is None else None)
                decided = None
                if suspects is not None:
                    decided = self._outcome(step, action, suspects)
                if action is not None and action.needs_checkpoint and self._stop_signal is None:
                    self._record_action(action, decided)
                if action is Action.CHECKPOINT_RESTART:
                    interrupted = self._stop_signal == signal.SIGINT
                    if self._stop_signal is not None:
                        log.warning("interrupted" if interrupted else "preempted",
                                    signal=signal.Signals(self._stop_signal).name, step=step)
                    saved = self._save(restart=self._stop_signal is None)  # a preemption is not the watchdog's restart
                    exit_code = EXIT_INTERRUPTED if interrupted else EXIT_RESTART_REQUESTED if saved else EXIT_UNSAVED
                    self._tell(decided, saved, RESTART_REQUESTED if saved or interrupted else UNSAVED)
                elif action is Action.CHECKPOINT_REINIT:
                    reinitialised = self._reinit()
                    if not reinitialised:  # no checkpoint to rebuild from: only a new process frees memory
                        exit_code = EXIT_UNSAVED
                    self._tell(decided, reinitialised, REINITIALISED if reinitialised else UNSAVED)
                elif self.config.checkpoint_every and self.state.step % self.config.checkpoint_every == 0:
                    self._save()  # a failure is logged; the next one may fit
                progress.update(step, loss, self.watchdog)
                if exit_code != EXIT_OK:
                    break
            else:
                saved_now = self._saved_at == self.state.step  # a periodic save at the last step: not twice
                if (self.state.step > first_step or self.checkpoints.latest_step() is None) and not saved_now:
                    if not self._save():  # the finished state is not on disk: redo it from the last one
                        exit_code = EXIT_UNSAVED
            finished = True
            if exit_code in (EXIT_RESTART_REQUESTED, EXIT_UNSAVED) and self._temporary_dir is not None:
                self._keep_the_temporary_checkpoints()
        finally:
            elapsed = time.perf_counter() - started
            if self.ledger is not None:
                self.ledger.end(_ENDINGS.get(exit_code, "restart") if finished else "error",
                                self.state.step if self.state is not None else first_step)
            progress.close()
            self._follower.close()
            self._restore_signals(previous_handlers)
            if self.watchdog is not None:
                self.watchdog.drain()
                self.watchdog.stop(clean=finished)
                if footprint_at_start is not None:
                    log.info("watchdog_footprint", first_step=first_step, step=self.state.step if self.state else None,
                             retained_bytes_at_start=footprint_at_start,
                             retained_bytes_at_end=retained_bytes(self.watchdog))
            if self._agreement is not None:
                self._agreement.close()
                self._agreement = None
        final_loss = float(loss.item()) if loss is not None else None
        verdict = self.watchdog.verdict if self.watchdog is not None else None
        result = TrainResult(
            exit_code=exit_code, first_step=first_step, step=self.state.step, steps_total=self.config.steps,
            reinits=self.reinits, restarts=self.restarts_so_far, final_loss=final_loss,
            verdict=verdict.status.value if verdict is not None else "none",
            source=self.watchdog.source_name if self.watchdog is not None else "none",
            steps_per_second=(self.state.step - first_step) / elapsed if elapsed > 0 else 0.0,
            losses=progress.losses)
        result.table = self.run_summary(result).block()
        return result

    def close(self) -> None:
        if self._temporary_dir is not None:
            shutil.rmtree(self._temporary_dir, ignore_errors=True)

    def _keep_the_temporary_checkpoints(self) -> None:
        """A restart asked for without --checkpoint-dir: its checkpoints stay (nothing lost), and the
        log says where and how to resume from them."""
        directory, self._temporary_dir = self._temporary_dir, None
        log.warning("checkpoints_kept", checkpoint_dir=str(directory),
                    note=f"the restart resumes from them only with --checkpoint-dir {directory} --resume auto")

    # -- the chapters --

    def _start_state(self) -> TrainerState:
        self.restarts_so_far = restarts_so_far(os.environ)
        started = time.perf_counter()
        loaded = self.strategy.open_run(self.checkpoints, self.config, writer=self.replica.rank == 0)
        if loaded is None:
            seed_everything(self.config.seed, self.device)
            state = self.strategy.build_state(self.config)
            self._sync()
            return state
        state, payload = loaded
        self.restarts_so_far = max(self.restarts_so_far, int(payload.get("restarts_so_far", 0)))
        # a checkpoint from before this count: every restart it records was the watchdog's to spend
        self.watchdog_restarts = int(payload.get("watchdog_restarts", payload.get("restarts_so_far", 0)))
        restart_step = payload.get("watchdog_restart_step")
        self.watchdog_restart_step = None if restart_step is None else int(restart_step)
        self.reinits = int(payload.get("reinits", 0))
        self._sync()
        self._restore_seconds = time.perf_counter() - started
        log.info("resumed", step=state.step, restarts_so_far=self.restarts_so_far,
                 checkpoint_dir=str(self.checkpoints.directory))
        return state

    def _claim_the_job_file(self) -> None:
        """A job file that is not ours is one line and exit 2 before anything of this run is written."""
        path = job_ledger.path_for(self.config.watchdog.trace_file if self.config.watchdog is not None else None)
        if path is not None and self.replica.rank == 0:
            job_ledger.existing_records(path)

    def _join_agreement(self) -> Agreement | None:
        """Several processes in one torch.distributed group: the agreement the watchdog's actions,
        the drills, the signals and the saves' outcomes go through (None: this process alone)."""
        if self.replica.world == 1 or (self.config.watchdog is not None and not self.config.watchdog.agree_across_ranks):
            return None
        watch = self.config.watchdog or WatchdogConfig()
        return agreement.join(watch.agreement_timeout_seconds)

    def _start_watchdog(self):
        if self.config.watchdog is None:
            return None
        forced = tuple((watch_step(self.config, step), action) for step, action in self.config.forced_actions)
        config = dataclasses.replace(self.config.watchdog.ending_at(watch_step(self.config, self.config.steps)),
                                     restarts_so_far=self.restarts_so_far, watchdog_restarts=self.watchdog_restarts,
                                     watchdog_restart_step=self.watchdog_restart_step,
                                     rank=self.replica.rank, forced_actions=self.config.watchdog.forced_actions + forced,
                                     # the trainer's own device: a CPU run in a process that imported
                                     # torch_xla was watched as xla:0
                                     device=self.config.watchdog.device or str(self.device))
        # The loop follows the leak itself and reports every action; the watchdog shares its censuses.
        watchdog = Watchdog(config, telemetry=self.telemetry, logs_outcomes=True, follower=self._follower,
                            agreement=self._agreement).start()
        if self.on_watchdog_started is not None:
            self.on_watchdog_started(watchdog)
        return watchdog

    def _open_ledger(self, first_step: int) -> JobLedger | None:
        """The job file, written by rank 0 (the replicas run in lockstep), beside the trace or where
        supervise said (`HBMWATCH_JOB_FILE`)."""
        trace = self.config.watchdog.trace_file if self.config.watchdog is not None else None
        path = job_ledger.path_for(trace)
        if path is None or self.replica.rank != 0:
            return None
        compile_seconds = lambda: None  # noqa: E731 - off XLA nothing compiles
        if self.device.type == "xla":
            from watchdog.runtime import xla_stats

            compile_seconds = xla_stats.compile_seconds
        telemetry = self.watchdog.telemetry if self.watchdog is not None else self.telemetry
        ledger = JobLedger(path, checkpoint_every=self.config.checkpoint_every, compile_seconds=compile_seconds,
                           telemetry=telemetry)
        ledger.begin(first_step, restore_seconds=self._restore_seconds)
        return ledger

    def _timed(self, cause: str, step: int):
        """A span of the job's time that is not training steps (see runtime/job_ledger.py)."""
        return self.ledger.span(cause, step) if self.ledger is not None else nullcontext()

    def _record_action(self, action: Action, decided: ActionOutcome | None) -> None:
        """The action, with the OOM it was taken against in training steps, for what it saved."""
        if self.ledger is None:
            return
        verdict = decided.verdict if decided is not None else None
        projected = None
        if verdict is not None and verdict.projected_oom_step is not None and math.isfinite(verdict.projected_oom_step):
            projected = self.state.step + max(0, round(verdict.projected_oom_step - verdict.step))
        self.ledger.action(action.value, self.state.step, projected)

    def _one_step(self, step: int) -> torch.Tensor:
        state = self.state
        tokens, targets = self._next_batch(state)
        loss = train_step(state, tokens, targets, self._optimizer_step)
        leaks.inject(self.config.leaks, step, state.sinks, self.device,
                     forward_loss=lambda: self._extra_forward(state), model=state.model,
                     place=self.strategy.shard_new_tensor)
        if self._program_due:  # the first step's program, with Python lines: for a post-mortem
            self._program_due = False
            self.watchdog.record_program([loss, *_pending_state(state)])
        self._sync()  # XLA: the step's graph runs here, leaks materialised with it
        state.step, state.data_position = step + 1, state.data_position + 1
        return loss

    def _next_batch(self, state: TrainerState) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.replica.replicated:
            return self.strategy.to_device(self.data.batch_at(state.data_position))
        if self._loader is None:  # prefetches onto the device from the state's data position on
            from torch_xla.distributed.parallel_loader import MpDeviceLoader

            batches = ((b.tokens, b.targets) for b in self.data.batches_from(state.data_position))
            self._loader = iter(MpDeviceLoader(batches, self.device))
        return next(self._loader)

    def _extra_forward(self, state: TrainerState) -> torch.Tensor:
        return state.model(*self.strategy.to_device(self.data.batch_at(state.data_position)))[1]

    def _evaluation_due(self, step: int) -> bool:
        return bool(self.config.eval_every) and (step + 1) % self.config.eval_every == 0

    def _evaluate(self, step: int) -> Action | None:
        """`eval_steps` held-out batches under the watchdog's "eval" phase, after training step
        `step`. With `eval_keep_outputs` each batch's logits stay on the device until the
        evaluation ends (the "predictions accumulated on the device" pattern): memory climbs through
        the evaluation and falls back after it. An action the watchdog asks for meanwhile ends the
        evaluation early and is returned, to be carried out between steps."""
        config, state = self.config, self.state
        first = watch_step(config, step) + 1
        kept: list[torch.Tensor] = []
        losses: list[torch.Tensor] = []
        action = None
        phase = self.watchdog.phase("eval", steps=config.eval_steps) if self.watchdog is not None else nullcontext()
        state.model.eval()
        try:
            with phase:
                for index in range(config.eval_steps):
                    batch = self.data.batch_at(EVAL_POSITION + index)
                    logits, loss = eval_step(state.model, *self.strategy.to_device(batch))
                    losses.append(loss)
                    if config.eval_keep_outputs:
                        kept.append(logits)
                    del logits
                    self._sync()
                    action = self.watchdog.step(first + index) if self.watchdog is not None else None
                    if action is not None:
                        log.warning("evaluation_stopped", step=step, batches=index + 1, action=action.value)
                        break
        finally:
            state.model.train()
        kept_bytes = sum(t.numel() * t.element_size() for t in kept)
        del kept
        value = float(torch.stack(losses).mean().item())  # one read per evaluation, after its last sync
        self.eval_losses[step] = value
        log.info("evaluated", step=step, loss=round(value, 4), batches=len(losses), kept_output_bytes=kept_bytes)
        return action

    def _ask(self, step: int) -> Action | None:
        """The action every process takes after `step`: the watchdog's, a drill's, or a save and
        exit 42 for a stop signal (a preemption), agreed across processes."""
        stopping = Action.CHECKPOINT_RESTART if self._stop_signal is not None else None
        if self.watchdog is not None:
            if stopping is not None:
                self.watchdog.propose(stopping, "stop signal")
            return self.watchdog.step(watch_step(self.config, step))
        proposal = stopping or self.forced.get(step)  # unwatched: drills and signals, agreed every step
        if self._agreement is None:
            return proposal
        agreed = self._agreement.decide(step, proposal, own=stopping is None)
        return agreed.action if agreed is not None else None

    def _follow_the_leak(self, step: int, action: Action | None) -> list[str] | None:
        """Name the leak when an action comes (its suspects are returned for the action block). The
        first WARN or action, or a leak reported far from any OOM, also arms a capture of creation
        sites for a few steps; when it ends, the census names what holds the leak and where it was
        made."""
        follower = self._follower
        follower.between_steps(step)
        if action is not None or (self.watchdog is not None and self.watchdog.leak_suspected):
            follower.arm()  # once until the next reinit
        if action is not None and action.needs_checkpoint:
            return follower.name(step) + (self.watchdog.processes_grown() if self.watchdog is not None else [])
        return None

    def _outcome(self, step: int, action: Action, suspects: list[str]) -> ActionOutcome:
        """The record of an action for its outcome's block: the verdict it was decided on, and which memory
        asked for it, where this rank's watchdog handed it over at this step (else the newest)."""
        handed = self.watchdog.last_action if self.watchdog is not None else None
        if handed is not None and handed.step == watch_step(self.config, step) and handed.action is action:
            return ActionOutcome(step, action, handed.verdict, suspects=suspects, memory=handed.memory,
                                 origin=handed.origin)
        return ActionOutcome(step, action, self.watchdog.verdict if self.watchdog else None, suspects=suspects)

    def _tell(self, decided: ActionOutcome | None, saved: bool, outcome: str) -> None:
        """The action's outcome, its block: what the watchdog saw, what is leaking, what was done
        and, after a reinit, what it gave back (the watchdog measures that)."""
        checkpoint = str(self.checkpoints.list()[-1]) if saved and self.checkpoints.latest_step() is not None else None
        if decided is None:  # a stop signal's restart, proposed to the watchdog: its block says so
            if self.watchdog is not None:
                self.watchdog.log_outcome(outcome, checkpoint=checkpoint)
            return
        if self.watchdog is not None:
            self.watchdog.log_outcome(outcome, checkpoint=checkpoint, decided=decided)
        else:
            decided.outcome, decided.checkpoint = outcome, checkpoint
            log_action_outcome(decided)

    def run_summary(self, result: "TrainResult") -> RunSummary:
        """How the run ended, for the last lines of the terminal."""
        telemetry = self.watchdog.telemetry if self.watchdog is not None else None
        watch = self.config.watchdog
        newest = self.checkpoints.latest_step()
        outcome = {EXIT_OK: "done", EXIT_INTERRUPTED: "interrupted, checkpoint saved (exit 130)"}.get(
            result.exit_code, f"restart requested (exit {result.exit_code})")
        return RunSummary(
            command="train", outcome=outcome, steps_done=result.step, steps_total=result.steps_total,
            first_step=result.first_step, steps_per_second=result.steps_per_second, reinits=result.reinits,
            restarts=result.restarts, peak_bytes=telemetry.peak_bytes_seen if telemetry and telemetry.sample else None,
            limit_bytes=self.watchdog.limit_bytes if self.watchdog is not None else None,
            verdict=self.watchdog.verdict if self.watchdog is not None else None,
            trace_file=str(watch.trace_file) if watch is not None and watch.trace_file else None,
            checkpoint_dir=str(self.checkpoints.directory) if self._temporary_dir is None else None,
            newest_checkpoint_step=newest)

    def _save(self, *, restart: bool = False) -> bool:
        """A checkpoint of the state as it is now; a restart's records the restart it asks for.

        False when the disk refused it (logged with path, bytes needed and bytes free; the older
        checkpoints are intact). Every rank gets the same answer.
        """
        with self._timed("checkpoint_save", self.state.step):
            saved = self._write_checkpoint(restart)
        if saved:  # every rank agreed on it
            self._saved_at = self.state.step
        self._check_disk()
        return saved

    def _write_checkpoint(self, restart: bool) -> bool:
        started = time.perf_counter()
        saved = True
        # Sharded: every process writes its own shards (a collective save). Else one writer, rank 0:
        # the replicas' states are identical.
        if self.strategy.sharded_checkpoints or self.replica.rank == 0:
            payload = checkpoint_payload(self.state, self.config, self.device,
                                         restarts_so_far=self.restarts_so_far + int(restart), reinits=self.reinits,
                                         **self._watchdog_state(restart))
            try:
                self.checkpoints.save(payload, self.state.step)
                leaks.after_save(self.config.leaks, self.state.step)
            except CheckpointSaveError as exc:
                saved = False
                log.error("checkpoint_save_failed", path=str(exc.path), step=self.state.step, error=exc.reason,
                          bytes_needed=exc.bytes_needed, bytes_free=exc.bytes_free,
                          note="older checkpoints are intact; training goes on")
            del payload
        if not self.strategy.sharded_checkpoints:
            self.replica.barrier(f"checkpoint-{self.state.step}")
        if self._agreement is not None:  # every process learns whether every process's save landed
            saved = self._agreement.decide(self.state.step, None if saved else Action.CHECKPOINT_RESTART) is None
        if saved and self.watchdog is not None:
            self.watchdog.observe_checkpoint(time.perf_counter() - started)
        return saved

    def _watchdog_state(self, restart: bool) -> dict:
        """The watchdog's restarts in a row and the newest one's step, as the checkpoint records them:
        the watchdog counts a restart it hands over; unwatched, a drill's restart is counted here, for
        the watchdog of a later run resumed from this checkpoint."""
        if self.watchdog is not None:
            return self.watchdog.state_dict()
        count, step = self.watchdog_restarts, self.watchdog_restart_step
        if restart:
            count, step = restarts_in_a_row(count, step, self.state.step, window=0), self.state.step
        return {"watchdog_restarts": count, "watchdog_restart_step": step}

    def _check_disk(self) -> None:
        """Free space against the newest checkpoint's size: logged when short, exported always."""
        if self.replica.rank != 0:
            return
        space = self.checkpoints.disk_space()
        telemetry = self.watchdog.telemetry if self.watchdog is not None else self.telemetry
        if telemetry is not None:
            telemetry.part(CheckpointFigures).observe_space(space.free_bytes, space.checkpoint_bytes)

    def _reinit(self) -> bool:
        """Save, drop every reference to the state (its leaks included), collect, rebuild from disk.

        False, with the state untouched, when the checkpoint could not be saved.
        """
        step = self.state.step
        self.reinits += 1
        if not self._save():
            self.reinits -= 1
            return False
        with self._timed("reinit", step):
            self._rebuild(step)
        if self.watchdog is not None:
            self.watchdog.reinit_finished()
        return True

    def _rebuild(self, step: int) -> None:
        self.state = self._loader = None
        self._follower.rebuilt()
        gc.collect()
        self._sync()
        release_host_memory()
        loaded = self.strategy.load_latest(self.checkpoints, self.config)
        if loaded is None or loaded[0].step != step:
            raise RuntimeError(f"reinit: the checkpoint just saved for step {step} does not load back")
        self.state, _ = loaded
        del loaded
        self._sync()
        log.warning("reinitialised", step=step, reinits=self.reinits)

    # -- signals --

    def _catch_stop_signals(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def remember(signum, _frame):
            if signum == signal.SIGINT and self._stop_signal == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now (a save in flight leaves no debris)
            self._stop_signal = signum  # acted on at the next step boundary, never mid-step

        return {signum: signal.signal(signum, remember) for signum in (signal.SIGTERM, signal.SIGINT)}

    @staticmethod
    def _restore_signals(previous: dict) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


_ENDINGS = {EXIT_OK: "done", EXIT_INTERRUPTED: "interrupted"}  # else a restart was asked for (exit 42 or 44)
UNSAVED = "the checkpoint failed: exit 44 to restart from the newest one"


def train(config: TrainConfig, **kwargs) -> TrainResult:
    trainer = Trainer(config, **kwargs)
    try:
        return trainer.run()
    finally:
        trainer.close()
