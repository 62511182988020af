"""A training job's device memory, step by step: the generator behind the synthetic corpus.

Why a model and not recorded TPU traces: a benchmark needs the TRUE answer (does this job run
out of memory, and at which step?), and only a generator knows it exactly. The model follows what
HBM does in a PyTorch/XLA job:

- runtime/program memory from step 0, weights + optimizer state allocated at step 1-2;
- per-step activations: a sample lands at a random point inside a step, so readings jump
  between the floor and floor + activations (and sometimes the idle gap between steps);
- periodic evaluation and checkpoint spikes (both also stretch the wall clock); an evaluation
  may keep each batch's outputs on the device until it ends (`eval_accumulates`), and the
  samples taken in it may carry the phase label a loop using `Watchdog.phase` records;
- allocator jitter (white) and fragmentation drift (slow, bounded);
- `growth` components added to the floor: leaks, level shifts, caches that fill and stop.

The true OOM step is the first step at which floor + that step's largest transient reaches the
limit. Jitter is a reading artifact and does not count towards it; drift is held memory and does.
Pure: numpy in, `Sample`s out, deterministic given the generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from watchdog.core.sample import Sample

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

START_TIMESTAMP = 1_735_689_600.0  # 2025-01-01T00:00:00Z: fixed, so traces are reproducible
IDLE_PROBABILITY = 0.15  # a reading taken in the host-side gap between two steps sees no activations
DRIFT_KNOT_STEPS = 64  # fragmentation drift is an AR(1) on knots this far apart, interpolated


@dataclass(frozen=True)
class LinearLeak:
    """Small tensors kept every step (a list of losses, a held graph): `bytes_per_step` from onset,
    until `stop_step` if it stops (the code path that leaked ran its course)."""

    onset_step: int
    bytes_per_step: float
    stop_step: int | None = None

    def bytes_at(self, steps: np.ndarray) -> np.ndarray:
        until = steps if self.stop_step is None else np.minimum(steps, self.stop_step)
        return np.maximum(until - self.onset_step, 0) * self.bytes_per_step


@dataclass(frozen=True)
class StepwiseLeak:
    """A chunk kept every `every` steps (a cache keyed by something that never repeats)."""

    onset_step: int
    every: int
    chunk_bytes: float

    def bytes_at(self, steps: np.ndarray) -> np.ndarray:
        return np.where(steps >= self.onset_step,
                        ((steps - self.onset_step) // self.every + 1) * self.chunk_bytes, 0.0)


@dataclass(frozen=True)
class LevelShift:
    """A one-off allocation that stays (eval buffers, a compile cache entry), spread over `ramp_steps`."""

    at_step: int
    size_bytes: float
    ramp_steps: int = 0

    def bytes_at(self, steps: np.ndarray) -> np.ndarray:
        if self.ramp_steps <= 0:
            return np.where(steps >= self.at_step, self.size_bytes, 0.0)
        return np.clip((steps - self.at_step) / self.ramp_steps, 0.0, 1.0) * self.size_bytes


@dataclass(frozen=True)
class SaturatingGrowth:
    """A cache that fills and stops: exponential approach to `size_bytes` with time constant `tau_steps`."""

    onset_step: int
    size_bytes: float
    tau_steps: float

    def bytes_at(self, steps: np.ndarray) -> np.ndarray:
        elapsed = np.maximum(steps - self.onset_step, 0)
        return self.size_bytes * -np.expm1(-elapsed / self.tau_steps)


@dataclass(frozen=True)
class LumpyFill:
    """A cache that fills with decreasing speed (entries drawn at random: each step finds fewer new
    ones), held in memory that grows in lumps of `lump_bytes` (an allocator's heap growth, buffers
    added in blocks): `size_bytes * (1 - exp(-t / tau))`, rounded up to whole lumps."""

    onset_step: int
    size_bytes: float
    tau_steps: float
    lump_bytes: float

    def bytes_at(self, steps: np.ndarray) -> np.ndarray:
        elapsed = np.maximum(steps - self.onset_step, 0)
        filled = self.size_bytes * -np.expm1(-elapsed / self.tau_steps)
        return np.minimum(np.ceil(filled / self.lump_bytes - 1e-9) * self.lump_bytes, self.size_bytes)


Growth = LinearLeak | StepwiseLeak | LevelShift | SaturatingGrowth | LumpyFill


@dataclass(frozen=True)
class MemoryModel:
    """Everything that shapes one job's memory trace. Sizes in bytes, times in seconds."""

    steps: int  # planned length of the run in training steps
    limit_bytes: int
    runtime_bytes: int
    state_bytes: int  # weights + optimizer state
    activation_bytes: int  # largest per-step transient above the floor
    sample_every: int = 1
    state_step: int = 1
    activation_spread: float = 0.0  # per-step transient scale drawn from [1 - spread, 1] (data-dependent)
    eval_every: int = 0  # 0: no evaluation
    eval_span: int = 2  # steps an evaluation's buffers are live
    eval_bytes: int = 0
    eval_accumulates: bool = False  # outputs kept on the device batch by batch: eval_bytes by its end
    eval_phase_label: str = ""  # the phase label samples taken in an evaluation carry ("": none)
    checkpoint_every: int = 0  # 0: no checkpoints
    checkpoint_bytes: int = 0
    jitter_bytes: float = 0.0  # sd of white allocator jitter on each reading
    drift_bytes: float = 0.0  # sd of the bounded fragmentation wander (held memory)
    drift_correlation_steps: float = 2000.0
    step_seconds: float = 0.5
    compile_seconds: float = 60.0  # the first step compiles
    eval_seconds: float = 30.0
    checkpoint_seconds: float = 20.0
    report_peak: bool = True  # the runtime reports a high-water mark (TPU does)
    growth: tuple[Growth, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class RenderedTrace:
    samples: list[Sample]
    oom_step: int | None  # first step whose peak reaches the limit (may lie past the last sample)
    floor_bytes: np.ndarray  # per step, for pictures and tests
    peak_bytes: np.ndarray  # per step: floor + that step's largest transient


def _drift(model: MemoryModel, horizon: int, rng: np.random.Generator) -> np.ndarray:
    if model.drift_bytes <= 0:
        return np.zeros(horizon)
    knots = horizon // DRIFT_KNOT_STEPS + 2
    phi = math.exp(-DRIFT_KNOT_STEPS / model.drift_correlation_steps)
    shocks = rng.normal(0.0, model.drift_bytes * math.sqrt(1 - phi * phi), knots)
    values = np.empty(knots)
    values[0] = rng.normal(0.0, model.drift_bytes)
    for i in range(1, knots):  # a few thousand knots at most
        values[i] = phi * values[i - 1] + shocks[i]
    values = np.clip(values, -2.5 * model.drift_bytes, 2.5 * model.drift_bytes)  # bounded, not a trend
    return np.interp(np.arange(horizon), np.arange(knots) * DRIFT_KNOT_STEPS, values)


def _phase_masks(model: MemoryModel, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    evals = np.zeros(steps.shape, dtype=bool)
    if model.eval_every:
        # Spikes of a few steps run from step 1 on; an evaluation that keeps its outputs runs for
        # hundreds of steps, so the first waits for a trained model (and a weights allocation
        # inside it would be no evaluation growth).
        first = model.eval_every if model.eval_accumulates else 1
        evals = (steps >= first) & (steps % model.eval_every < model.eval_span)
    checkpoints = np.zeros(steps.shape, dtype=bool)
    if model.checkpoint_every:
        checkpoints = (steps > 0) & (steps % model.checkpoint_every == 0) & ~evals
    return evals, checkpoints


def render(model: MemoryModel, rng: np.random.Generator, horizon_factor: float = 1.5) -> RenderedTrace:
    """Draw one trace. The envelope is computed past the planned end, so an OOM just after it is known."""
    horizon = int(model.steps * horizon_factor) + 1
    steps = np.arange(horizon)
    floor = model.runtime_bytes + np.where(steps >= model.state_step, float(model.state_bytes), 0.0)
    for component in model.growth:
        floor = floor + component.bytes_at(steps)
    floor = floor + _drift(model, horizon, rng)

    evals, checkpoints = _phase_masks(model, steps)
    scale = 1.0 - model.activation_spread * rng.random(horizon)
    eval_peak = float(model.eval_bytes)
    if model.eval_accumulates:
        # Outputs kept batch by batch are held memory while the evaluation runs (freed at its end);
        # each batch's forward pass adds its activations on top, as a transient.
        kept = np.minimum((steps % max(model.eval_every, 1) + 1) / model.eval_span, 1.0)
        floor = floor + np.where(evals, model.eval_bytes * kept, 0.0)
        eval_peak = 0.5 * model.activation_bytes * scale
    transient_peak = np.where(evals, eval_peak,
                              np.where(checkpoints, float(model.checkpoint_bytes),
                                       model.activation_bytes * scale))
    transient_peak[steps < model.state_step] = 0.0  # nothing trains before the state exists
    peak = floor + transient_peak

    over = np.flatnonzero(peak >= model.limit_bytes)
    oom_step = int(over[0]) if over.size else None
    end = model.steps if oom_step is None else min(model.steps, oom_step)  # the job dies at its OOM

    sampled = steps[:end:model.sample_every]
    # Where inside the step the reading lands: triangle up (forward) then down (backward); sometimes idle.
    position = 1.0 - np.abs(2.0 * rng.random(sampled.size) - 1.0)
    position[rng.random(sampled.size) < IDLE_PROBABILITY] = 0.0
    used = floor[sampled] + transient_peak[sampled] * position
    used = used + rng.normal(0.0, model.jitter_bytes, sampled.size) if model.jitter_bytes else used
    used = np.clip(used, 0, model.limit_bytes - 1).astype(np.int64)  # a reading never exceeds capacity
    high_water = np.minimum(np.maximum.accumulate(peak[:end]), model.limit_bytes)[sampled].astype(np.int64)

    timestamps = _timestamps(model, horizon, evals, checkpoints, rng)[sampled]
    labels = (np.where(evals[sampled], model.eval_phase_label, "").tolist() if model.eval_phase_label
              else [""] * sampled.size)
    peaks = high_water.tolist() if model.report_peak else [None] * sampled.size
    # A million samples per corpus: positional arguments and plain Python numbers (tolist) build
    # them about twice as fast as keywords and per-item conversion, with the same values.
    limit = model.limit_bytes
    samples = [Sample(s, round(t, 6), u, limit, p, label)
               for s, t, u, p, label in zip(sampled.tolist(), timestamps.tolist(), used.tolist(), peaks, labels)]
    return RenderedTrace(samples=samples, oom_step=oom_step, floor_bytes=floor[:end], peak_bytes=peak[:end])


def _timestamps(model: MemoryModel, horizon: int, evals: np.ndarray, checkpoints: np.ndarray,
                rng: np.random.Generator) -> np.ndarray:
    """Wall clock at the end of each step: jittery step time, a slow first step, eval and checkpoint pauses."""
    durations = model.step_seconds * np.exp(rng.normal(0.0, 0.04, horizon))
    durations[0] += model.compile_seconds
    eval_starts = evals & ~np.roll(evals, 1)
    durations = durations + eval_starts * model.eval_seconds + checkpoints * model.checkpoint_seconds
    return START_TIMESTAMP + np.cumsum(durations)
