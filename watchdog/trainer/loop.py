"""The training loop, written to read as the story it tells.

    build the state (model, AdamW, LR schedule, data position, RNG)
    -> resume from the newest checkpoint, if asked and there is one
    -> for each step: batch, forward, backward, optimizer step, (leak), sync, ask the watchdog
       -> every `eval_every` steps, a small evaluation under the watchdog's "eval" phase (evaluator.py)
       -> carry out what it asks for, between steps, through the watchdog's one action path
          (`Watchdog.carry_out`, actions/action_path.py) with the checkpointer's save:
          checkpoint-and-reinit: save, drop every reference to the state, collect, rebuild
                                 from the checkpoint (the watchdog re-measures the floor)
          checkpoint-and-restart: save, exit 42 (a supervisor or the cluster restarts the job)
          SIGTERM (preemption): save at the next step boundary, exit 42 (stop_signals.py)
          SIGINT (Ctrl-C): save at the next step boundary, exit 130 (a second Ctrl-C stops at once)
       -> else a periodic save when one is due (checkpointer.py)
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
never initialised twice. An unwatched run (`TrainConfig.watchdog=None`) gets `Unwatched` in the
watchdog's place, which reads nothing and still carries out drills and stop signals: the loop
never tests for a missing watchdog.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch

from watchdog.actions import agreement
from watchdog.actions.action_path import projected_oom
from watchdog.actions.agreement import Agreement
from watchdog.actions.checkpoint import CheckpointManager, restore_rng_state
from watchdog.core.config import WatchdogConfig
from watchdog.core.errors import EXIT_FUTILE, EXIT_INTERRUPTED, EXIT_OK, EXIT_RESTART_REQUESTED, EXIT_UNSAVED, InputError
from watchdog.core.restarts import RunState
from watchdog.core.verdict import Action
from watchdog.logs import get_logger
from watchdog.records import job_ledger
from watchdog.records.job_ledger import JobLedger
from watchdog.runtime.footprint import retained_bytes
from watchdog.runtime.sidecar import Watchdog
from watchdog.runtime.unwatched import Unwatched
from watchdog.station.blocks import RunSummary
from watchdog.station.telemetry import Telemetry
from watchdog.trainer import leaks
from watchdog.trainer.checkpointer import CHECKPOINT_FORMAT, Checkpointer
from watchdog.trainer.data import Batch, TokenSource
from watchdog.trainer.evaluator import Evaluator
from watchdog.trainer.leaks import LeakSinks, LeakSpec
from watchdog.trainer.model import ModelConfig, TransformerLM
from watchdog.trainer.progress import Progress
from watchdog.trainer.stop_signals import StopSignals

log = get_logger(__name__)

CHECKPOINT_KEYS = ("step", "data_position", "model", "optimizer", "scheduler", "rng")  # what a resume reads


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

    def __init__(self, config: TrainConfig, *, telemetry: Telemetry | None = None, replica: Replica = Replica(),
                 strategy: Strategy | None = None):
        self.config = config
        self.telemetry = telemetry
        self.replica = replica
        # The device is created once per process; every rebuild reuses it.
        self.strategy = strategy or SingleDevice(select_device(config.device))
        self.device = self.strategy.device
        if self.device.type == "xla" and config.watchdog is not None and config.watchdog.recompilation.explain:
            from watchdog.runtime import xla_stats

            xla_stats.prepare_compile_analysis()  # before the first graph: torch_xla reads it only then
        self._sync = _sync_function(self.device)
        self.checkpointer = Checkpointer(config, self.strategy, replica)
        # Replicas read disjoint shards of the data; SPMD processes all feed the same global batch.
        shard, shards = (replica.rank, replica.world) if replica.replicated else (0, 1)
        self.data = TokenSource(batch_size=config.batch_size, seq_len=config.model.seq_len,
                                vocab_size=config.model.vocab_size, seed=config.seed,
                                text_file=config.text_file, shard=shard, num_shards=shards)
        self.evaluator = Evaluator(config, self.data, self.strategy.to_device, self._sync,
                                   lambda step: watch_step(config, step) + 1)
        self.signals = StopSignals()
        self._optimizer_step = _optimizer_step_function(replica.replicated)
        self._loader = None  # several replicas: MpDeviceLoader batches, rebuilt with the state
        self.state: TrainerState | None = None
        self.watchdog: Watchdog | Unwatched = Unwatched()  # run() makes the run's (Unwatched without a watchdog config)
        self._agreement: Agreement | None = None  # several processes: one decision (made at run())
        self.ledger: JobLedger | None = None  # where this process's time goes, for the job's goodput
        self._restore_seconds = 0.0
        self.reinits = 0
        self.restarts_at_start = 0  # every restart of the job before this process (supervise's count, or the checkpoint's)
        # Under --hlo-source-lines, the first step's program goes into the flight record (op -> your line).
        self._program_due = (self.device.type == "xla" and self._trace_file is not None
                             and os.environ.get("XLA_HLO_DEBUG") == "1")

    @property
    def _trace_file(self) -> Path | None:
        return self.config.watchdog.trace_file if self.config.watchdog is not None else None

    @property
    def eval_losses(self) -> dict[int, float]:
        return self.evaluator.losses

    # -- the story --

    def run(self) -> TrainResult:
        self._claim_the_job_file()  # a foreign job file is refused before anything of this run is written
        self.state, saved = self._start_state()
        first_step = self.state.step
        self._agreement = self._join_agreement()
        self.watchdog = self._start_watchdog(saved)
        self.ledger = self._open_ledger(first_step)
        self.checkpointer.join(self.watchdog, self._agreement, self.ledger)
        progress = Progress(self.config.steps, first_step, self.config.log_every, self.config.progress_bar)
        exit_code, loss, finished, footprint = EXIT_OK, None, False, None
        started = time.perf_counter()
        try:
            with self.signals:
                while self.state.step < self.config.steps and exit_code == EXIT_OK:
                    step = self.state.step
                    loss = self._one_step(step)
                    if footprint is None and self.watchdog.watches:
                        footprint = retained_bytes(self.watchdog)  # what the watchdog holds, after the first step
                    action = self._ask(step)  # one decision, on every process at the same step
                    if action is None and self.evaluator.due(step):
                        with self._timed("eval", step):
                            action = self.evaluator.run(self.state.model, step, self.watchdog)
                    if action is not None and action.needs_checkpoint:
                        exit_code = self._carry_out(step, action)
                    else:
                        self.checkpointer.save_if_due(self.state, self._payload())
                    progress.update(step, loss, self.watchdog)
                if exit_code == EXIT_OK and not self.checkpointer.save_at_end(self.state, first_step, self._payload()):
                    exit_code = EXIT_UNSAVED  # the finished state is not on disk: redo it from the last one
            finished = True
            if exit_code in (EXIT_RESTART_REQUESTED, EXIT_UNSAVED, EXIT_FUTILE):  # nothing lost
                self.checkpointer.keep()
        finally:
            self._end(finished, exit_code, first_step, progress, footprint)
        return self._result(exit_code, first_step, loss, progress, time.perf_counter() - started)

    def close(self) -> None:
        self.checkpointer.close()

    # -- the chapters --

    def _start_state(self) -> tuple[TrainerState, dict | None]:
        """The state to train from, and the watchdog's state its checkpoint kept (None: a fresh start)."""
        started = time.perf_counter()
        loaded = self.checkpointer.open_run()
        if loaded is None:
            seed_everything(self.config.seed, self.device)
            state = self.strategy.build_state(self.config)
            self._sync()
            return state, None
        state, payload = loaded
        self.reinits = int(payload.get("reinits", 0))
        self._sync()
        self._restore_seconds = time.perf_counter() - started
        kept = payload.get("watchdog")  # one nested entry; a checkpoint of before kept its keys flat
        if not isinstance(kept, dict):
            kept = {key: payload[key] for key in RunState.KEPT if key in payload}
        saved = Watchdog.saved_state(kept, str(self.checkpointer.checkpoints.directory))
        log.info("resumed", step=state.step, restarts_so_far=(saved or {}).get("restarts_so_far", 0),
                 checkpoint_dir=str(self.checkpointer.checkpoints.directory))
        return state, saved

    def _claim_the_job_file(self) -> None:
        """A job file that is not ours is one line and exit 2 before anything of this run is written."""
        path = job_ledger.path_for(self._trace_file)
        if path is not None and self.replica.rank == 0:
            job_ledger.existing_records(path)

    def _join_agreement(self) -> Agreement | None:
        """Several processes in one torch.distributed group: the agreement the watchdog's actions,
        the drills, the signals and the saves' outcomes go through (None: this process alone)."""
        if self.replica.world == 1 or (self.config.watchdog is not None and not self.config.watchdog.agree_across_ranks):
            return None
        watch = self.config.watchdog or WatchdogConfig()
        return agreement.join(watch.agreement_timeout_seconds)

    def _start_watchdog(self, saved: dict | None) -> Watchdog | Unwatched:
        """The run's watchdog; without a watchdog config, one that reads nothing but still carries out
        drills and stop signals. It counts steps as `watch_step` does, evaluations included."""
        forced = tuple((watch_step(self.config, step), action) for step, action in self.config.forced_actions)
        watch = self.config.watchdog
        if watch is None:
            watchdog = Unwatched(forced, agreement=self._agreement, telemetry=self.telemetry)
        else:
            # the trainer's own device: a CPU run in a process that imported torch_xla was watched as xla:0
            config = dataclasses.replace(watch, rank=self.replica.rank, forced_actions=watch.forced_actions + forced,
                                         device=watch.device or str(self.device))
            watchdog = Watchdog(config, telemetry=self.telemetry, logs_outcomes=True, agreement=self._agreement)
        watchdog.ends_at(watch_step(self.config, self.config.steps))
        if saved is not None:
            watchdog.load_state_dict(saved)
        self.restarts_at_start = watchdog.state_dict()["restarts_so_far"]
        return watchdog.start()

    def _open_ledger(self, first_step: int) -> JobLedger | None:
        """The job file, written by rank 0 (the replicas run in lockstep), beside the trace or where
        supervise said (`HBMWATCH_JOB_FILE`)."""
        path = job_ledger.path_for(self._trace_file)
        if path is None or self.replica.rank != 0:
            return None
        compile_seconds = lambda: None  # noqa: E731 - off XLA nothing compiles
        if self.device.type == "xla":
            from watchdog.runtime import xla_stats

            compile_seconds = xla_stats.compile_seconds
        ledger = JobLedger(path, checkpoint_every=self.config.checkpoint_every, compile_seconds=compile_seconds,
                           telemetry=self.watchdog.telemetry)
        ledger.begin(first_step, restore_seconds=self._restore_seconds)
        return ledger

    def _timed(self, cause: str, step: int):
        """A span of the job's time that is not training steps (see records/job_ledger.py)."""
        return self.ledger.span(cause, step) if self.ledger is not None else nullcontext()

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
        if self.ledger is not None:
            self.ledger.step_done(state.step)
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

    def _ask(self, step: int) -> Action | None:
        """The action every process takes after `step`: the watchdog's, a drill's, or a save and
        exit 42 for a stop signal (a preemption), agreed across processes."""
        self.signals.propose_to(self.watchdog)
        return self.watchdog.step(watch_step(self.config, step))

    def _carry_out(self, step: int, action: Action) -> int:
        """A checkpoint action, through the watchdog's one action path: saved, then rebuilt in process
        (a reinit) or handed over as exit 42 (a restart); the status to end with (0: training goes on)."""
        if self.signals.caught is None:
            self._record_action(action)
        self.signals.say(step)
        reinit = action is Action.CHECKPOINT_REINIT
        save = lambda: self.checkpointer.save(self.state, self._payload(reinits=self.reinits + reinit))  # noqa: E731
        if self.watchdog.carry_out(action, save=save, rebuild=self._rebuild if reinit else None):
            return EXIT_OK
        return self.signals.exit_code(self.watchdog.last_action.exit_code or EXIT_RESTART_REQUESTED)

    def _record_action(self, action: Action) -> None:
        """The action, with the OOM it was taken against in training steps, for what it saved."""
        if self.ledger is None:
            return
        decided = self.watchdog.last_action
        verdict = decided.verdict if decided is not None else None
        self.ledger.action(action.value, self.state.step, projected_oom(self.state.step, verdict))

    def _payload(self, reinits: int | None = None) -> dict:
        """What the trainer adds to a checkpoint beside the state and the watchdog's state."""
        return {"reinits": self.reinits if reinits is None else reinits}

    def _rebuild(self) -> None:
        """Drop every reference to the state (its leaks included), collect, rebuild from the checkpoint
        just saved. The watchdog then measures what came back (`reinit_finished`)."""
        step = self.state.step
        self.reinits += 1
        with self._timed("reinit", step):
            self.state = self._loader = None
            gc.collect()
            self._sync()
            loaded = self.checkpointer.load_latest()
            if loaded is None or loaded[0].step != step:
                raise RuntimeError(f"reinit: the checkpoint just saved for step {step} does not load back")
            self.state, _ = loaded
            del loaded
            self._sync()
        log.warning("reinitialised", step=step, reinits=self.reinits)

    # -- the end --

    def _end(self, finished: bool, exit_code: int, first_step: int, progress: Progress, footprint: int | None) -> None:
        step = self.state.step if self.state is not None else first_step
        if self.ledger is not None:
            self.ledger.end(_ENDINGS.get(exit_code, "restart") if finished else "error", step)
        progress.close()
        self.watchdog.drain()
        self.watchdog.stop(clean=finished)
        if footprint is not None:
            log.info("watchdog_footprint", first_step=first_step, step=step, retained_bytes_at_start=footprint,
                     retained_bytes_at_end=retained_bytes(self.watchdog))
        if self._agreement is not None:
            self._agreement.close()
            self._agreement = None

    def _result(self, exit_code: int, first_step: int, loss, progress: Progress, elapsed: float) -> TrainResult:
        verdict = self.watchdog.verdict
        result = TrainResult(
            exit_code=exit_code, first_step=first_step, step=self.state.step, steps_total=self.config.steps,
            reinits=self.reinits, restarts=self.restarts_at_start,
            final_loss=float(loss.item()) if loss is not None else None,
            verdict=verdict.status.value if verdict is not None else "none", source=self.watchdog.source_name,
            steps_per_second=(self.state.step - first_step) / elapsed if elapsed > 0 else 0.0,
            losses=progress.losses)
        result.table = self.run_summary(result).block()
        return result

    def run_summary(self, result: "TrainResult") -> RunSummary:
        """How the run ended, for the last lines of the terminal."""
        telemetry = self.watchdog.telemetry
        outcome = {EXIT_OK: "done", EXIT_INTERRUPTED: "interrupted, checkpoint saved (exit 130)"}.get(
            result.exit_code, f"restart requested (exit {result.exit_code})")
        return RunSummary(
            command="train", outcome=outcome, steps_done=result.step, steps_total=result.steps_total,
            first_step=result.first_step, steps_per_second=result.steps_per_second, reinits=result.reinits,
            restarts=result.restarts, peak_bytes=telemetry.peak_bytes_seen if telemetry and telemetry.sample else None,
            limit_bytes=self.watchdog.limit_bytes, verdict=self.watchdog.verdict,
            trace_file=str(self._trace_file) if self._trace_file else None,
            checkpoint_dir=None if self.checkpointer.temporary else str(self.checkpointer.checkpoints.directory),
            newest_checkpoint_step=self.checkpointer.checkpoints.latest_step())


_ENDINGS = {EXIT_OK: "done", EXIT_INTERRUPTED: "interrupted", EXIT_FUTILE: "futile"}  # else a restart (42, 44)


def train(config: TrainConfig, **kwargs) -> TrainResult:
    trainer = Trainer(config, **kwargs)
    try:
        return trainer.run()
    finally:
        trainer.close()
