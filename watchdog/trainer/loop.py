"""The training loop, written to read as the story it tells.

    build the state (model, AdamW, LR schedule, data position, RNG)
    -> resume from the newest checkpoint, if asked and there is one
    -> for each step: batch, forward, backward, optimizer step, (leak), sync, ask the watchdog
       -> carry out what it asks for, between steps:
          checkpoint-and-reinit: save, drop every reference to the state, collect, rebuild
                                 from the checkpoint, tell the watchdog (it re-measures the floor)
          checkpoint-and-restart: save, exit 42 (a supervisor or the cluster restarts the job)
          SIGTERM (preemption): save at the next step boundary, exit 42

A step depends only on the state, the RNG and the data position, and all three are in the
checkpoint, so a reinit or a restart continues bit for bit where the run would have been.
The device object is created once per process and reused by every rebuild: the XLA runtime is
never initialised twice.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import math
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from watchdog.actions.checkpoint import CheckpointManager, capture_rng_state, restore_rng_state
from watchdog.actions.coordination import agree_on_action
from watchdog.actions.supervisor import RESTART_COUNT_ENV
from watchdog.core.config import WatchdogConfig
from watchdog.core.errors import EXIT_OK, EXIT_RESTART_REQUESTED, InputError
from watchdog.core.verdict import Action
from watchdog.logs import get_logger
from watchdog.runtime import forensics
from watchdog.runtime.creation_sites import CreationSites
from watchdog.runtime.telemetry import Telemetry
from watchdog.trainer import leaks
from watchdog.trainer.data import TokenSource
from watchdog.trainer.leaks import LeakSinks, LeakSpec
from watchdog.trainer.model import ModelConfig, TransformerLM
from watchdog.trainer.progress import Progress

log = get_logger(__name__)

CHECKPOINT_FORMAT = 1


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
    log_every: int = 50
    progress_bar: bool | None = None  # None: on a TTY
    forced_actions: tuple[tuple[int, Action], ...] = ()  # drills: (step, action) as if the watchdog asked
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

    def summary(self) -> str:
        loss = "n/a" if self.final_loss is None else f"{self.final_loss:.4f}"
        outcome = "done" if self.exit_code == EXIT_OK else f"restart requested (exit {self.exit_code})"
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
        return torch_xla.device()
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
                       restarts_so_far: int, reinits: int) -> dict:
    return {
        "format": CHECKPOINT_FORMAT,
        "step": state.step,
        "data_position": state.data_position,
        "model": state.model.state_dict(),
        "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict(),
        "rng": capture_rng_state(device),
        "restarts_so_far": restarts_so_far,
        "reinits": reinits,
        "model_config": dataclasses.asdict(config.model),
        "seed": config.seed,
    }


def restore_state(payload: dict, config: TrainConfig, device: torch.device) -> TrainerState:
    """Rebuild from a checkpoint onto `device`: every parameter and optimizer tensor lands there."""
    saved_model = payload.get("model_config")
    if saved_model is not None and saved_model != dataclasses.asdict(config.model):
        changed = sorted(k for k in saved_model if saved_model[k] != dataclasses.asdict(config.model).get(k))
        raise InputError(f"the checkpoint was written for a different model ({', '.join(changed)} differ); "
                         "use the same model flags, another --checkpoint-dir, or --resume never")
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


def _optimizer_step_function(replicated: bool) -> Callable[[torch.optim.Optimizer], object]:
    if not replicated:
        return lambda optimizer: optimizer.step()
    import torch_xla.core.xla_model as xm

    return xm.optimizer_step


def release_host_memory() -> None:
    """Hand freed heap pages back to the OS (glibc), so an RSS reading sees what a reinit freed."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---- the run -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Replica:
    """This replica's place in a data-parallel run (torch_xla.launch); one replica by default."""

    rank: int = 0
    world: int = 1
    replicated: bool = False  # MpDeviceLoader + xm.optimizer_step (launched replicas, even just one)

    def barrier(self, tag: str) -> None:
        if self.world > 1:
            import torch_xla.core.xla_model as xm

            xm.rendezvous(tag)


class Trainer:
    """Runs one replica's share of the training; `run()` returns how it ended."""

    def __init__(self, config: TrainConfig, *, telemetry: Telemetry | None = None,
                 on_watchdog_started: Callable[[object], None] | None = None, replica: Replica = Replica()):
        self.config = config
        self.telemetry = telemetry
        self.on_watchdog_started = on_watchdog_started
        self.replica = replica
        self.device = select_device(config.device)  # once per process; every rebuild reuses it
        self._sync = _sync_function(self.device)
        self._temporary_dir: tempfile.TemporaryDirectory | None = None
        if config.checkpoint_dir is None:
            self._temporary_dir = tempfile.TemporaryDirectory(prefix="hbm-watchdog-ckpt-")
        directory = config.checkpoint_dir or Path(self._temporary_dir.name)
        self.checkpoints = CheckpointManager(directory, keep_last=config.keep_checkpoints)
        self.data = TokenSource(batch_size=config.batch_size, seq_len=config.model.seq_len,
                                vocab_size=config.model.vocab_size, seed=config.seed,
                                text_file=config.text_file, shard=replica.rank, num_shards=replica.world)
        self._optimizer_step = _optimizer_step_function(replica.replicated)
        self._loader = None  # several replicas: MpDeviceLoader batches, rebuilt with the state
        self.forced = dict(config.forced_actions)
        self.state: TrainerState | None = None
        self.watchdog = None
        self.reinits = 0
        self.restarts_so_far = 0
        self._stop_signal: int | None = None
        self._census: forensics.Census | None = None  # live tensors once the state is built
        self._sites = CreationSites()  # where leaked tensors are created, captured once a leak is suspected

    # -- the story --

    def run(self) -> TrainResult:
        self.state = self._start_state()
        first_step = self.state.step
        self.watchdog = self._start_watchdog()
        progress = Progress(self.config.steps, first_step, self.config.log_every, self.config.progress_bar)
        previous_handler = self._catch_sigterm()
        exit_code, loss = EXIT_OK, None
        started = time.perf_counter()
        try:
            while self.state.step < self.config.steps:
                step = self.state.step
                loss = self._one_step(step)
                if self._census is None:  # after one step, so the optimizer state is in the baseline
                    self._census = forensics.census()
                action = agree_on_action(self._ask(step))
                self._follow_the_leak(step, action)
                if self._stop_signal is not None:
                    log.warning("preempted", signal=signal.Signals(self._stop_signal).name, step=step)
                    self._save()
                    exit_code = EXIT_RESTART_REQUESTED
                elif action is Action.CHECKPOINT_RESTART:
                    self._save(restart=True)
                    exit_code = EXIT_RESTART_REQUESTED
                elif action is Action.CHECKPOINT_REINIT:
                    self._reinit()
                elif self.config.checkpoint_every and self.state.step % self.config.checkpoint_every == 0:
                    self._save()
                progress.update(step, loss, self.watchdog)
                if exit_code != EXIT_OK:
                    break
            else:
                if self.state.step > first_step or self.checkpoints.latest_step() is None:
                    self._save()
        finally:
            elapsed = time.perf_counter() - started
            progress.close()
            self._sites.close()
            self._restore_sigterm(previous_handler)
            if self.watchdog is not None:
                self.watchdog.drain()
                self.watchdog.stop()
        final_loss = float(loss.item()) if loss is not None else None
        verdict = self.watchdog.latest_verdict if self.watchdog is not None else None
        return TrainResult(
            exit_code=exit_code, first_step=first_step, step=self.state.step, steps_total=self.config.steps,
            reinits=self.reinits, restarts=self.restarts_so_far, final_loss=final_loss,
            verdict=verdict.status.value if verdict is not None else "none",
            source=self.watchdog.source_name if self.watchdog is not None else "none",
            steps_per_second=(self.state.step - first_step) / elapsed if elapsed > 0 else 0.0,
            losses=progress.losses)

    def close(self) -> None:
        if self._temporary_dir is not None:
            self._temporary_dir.cleanup()

    # -- the chapters --

    def _start_state(self) -> TrainerState:
        self.restarts_so_far = _restarts_so_far_from_env()
        payload = self.checkpoints.load_latest() if self.config.resume == "auto" else None
        if payload is None:
            seed_everything(self.config.seed, self.device)
            state = build_state(self.config, self.device)
            self._sync()
            return state
        state = restore_state(payload, self.config, self.device)
        self.restarts_so_far = max(self.restarts_so_far, int(payload.get("restarts_so_far", 0)))
        self.reinits = int(payload.get("reinits", 0))
        self._sync()
        log.info("resumed", step=state.step, restarts_so_far=self.restarts_so_far,
                 checkpoint_dir=str(self.checkpoints.directory))
        return state

    def _start_watchdog(self):
        if self.config.watchdog is None:
            return None
        from watchdog.runtime.sidecar import Watchdog

        config = dataclasses.replace(self.config.watchdog, restarts_so_far=self.restarts_so_far,
                                     rank=self.replica.rank)
        watchdog = Watchdog(config, telemetry=self.telemetry).start()
        if self.on_watchdog_started is not None:
            self.on_watchdog_started(watchdog)
        return watchdog

    def _one_step(self, step: int) -> torch.Tensor:
        state = self.state
        tokens, targets = self._next_batch(state)
        loss = train_step(state, tokens, targets, self._optimizer_step)
        leaks.inject(self.config.leaks, step, state.sinks, self.device,
                     forward_loss=lambda: self._extra_forward(state), model=state.model)
        self._sync()  # XLA: the step's graph runs here, leaks materialised with it
        state.step, state.data_position = step + 1, state.data_position + 1
        return loss

    def _next_batch(self, state: TrainerState) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.replica.replicated:
            batch = self.data.batch_at(state.data_position)
            return batch.tokens.to(self.device), batch.targets.to(self.device)
        if self._loader is None:  # prefetches onto the device from the state's data position on
            from torch_xla.distributed.parallel_loader import MpDeviceLoader

            batches = ((b.tokens, b.targets) for b in self.data.batches_from(state.data_position))
            self._loader = iter(MpDeviceLoader(batches, self.device))
        return next(self._loader)

    def _extra_forward(self, state: TrainerState) -> torch.Tensor:
        batch = self.data.batch_at(state.data_position)
        return state.model(batch.tokens.to(self.device), batch.targets.to(self.device))[1]

    def _ask(self, step: int) -> Action | None:
        action = self.watchdog.step(step) if self.watchdog is not None else None
        forced = self.forced.get(step)
        if forced is not None:
            log.warning("forced_action", action=forced.value, step=step)
            return forced
        return action

    def _follow_the_leak(self, step: int, action: Action | None) -> None:
        """Name the leak when an action comes. The first WARN or action also arms a capture of
        creation sites for a few steps; when it ends, the census names where the leak was made."""
        if self._sites.between_steps():
            self._name_the_leak(step)
        if action is not None or (self.watchdog is not None and self.watchdog.telemetry.actions_total):
            self._sites.arm()  # once until the next reinit
        if action is not None and action.needs_checkpoint:
            self._name_the_leak(step)

    def _name_the_leak(self, step: int) -> None:
        """Log what grew since the baseline, what holds it and, after a capture, where it was
        created: the Python to fix."""
        started = time.perf_counter()
        sites = self._sites if self._sites.done else None
        suspects = forensics.explain_leak(self._census, sites=sites) if self._census is not None else []
        log.warning("leak_suspects", step=step, suspects=suspects or ["no growing group of live tensors"],
                    creation_sites=sites is not None, census_seconds=round(time.perf_counter() - started, 3))

    def _save(self, *, restart: bool = False) -> None:
        """A checkpoint of the state as it is now; a restart's records the restart it asks for."""
        started = time.perf_counter()
        if self.replica.rank == 0:  # one writer; the replicas' states are identical
            payload = checkpoint_payload(self.state, self.config, self.device,
                                         restarts_so_far=self.restarts_so_far + int(restart), reinits=self.reinits)
            self.checkpoints.save(payload, self.state.step)
            del payload
        self.replica.barrier(f"checkpoint-{self.state.step}")
        if self.watchdog is not None:
            self.watchdog.observe_checkpoint(time.perf_counter() - started)

    def _reinit(self) -> None:
        """Save, drop every reference to the state (its leaks included), collect, rebuild from disk."""
        step = self.state.step
        self.reinits += 1
        self._save()
        self.state = self._loader = self._census = None
        self._sites.reset()
        gc.collect()
        self._sync()
        release_host_memory()
        payload = self.checkpoints.load_latest()
        if payload is None or int(payload["step"]) != step:
            raise RuntimeError(f"reinit: the checkpoint just saved for step {step} does not load back")
        self.state = restore_state(payload, self.config, self.device)
        del payload
        self._sync()
        log.warning("reinitialised", step=step, reinits=self.reinits)
        if self.watchdog is not None:
            self.watchdog.reinit_finished()

    # -- signals --

    def _catch_sigterm(self):
        if threading.current_thread() is not threading.main_thread():
            return None

        def remember(signum, _frame):
            self._stop_signal = signum  # acted on at the next step boundary, never mid-step

        return signal.signal(signal.SIGTERM, remember)

    @staticmethod
    def _restore_sigterm(previous) -> None:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _restarts_so_far_from_env() -> int:
    text = os.environ.get(RESTART_COUNT_ENV, "0").strip() or "0"
    if not text.isdigit():
        raise InputError(f"{RESTART_COUNT_ENV}={text!r}: expected a non-negative integer")
    return int(text)


def train(config: TrainConfig, **kwargs) -> TrainResult:
    trainer = Trainer(config, **kwargs)
    try:
        return trainer.run()
    finally:
        trainer.close()
