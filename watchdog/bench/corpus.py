"""The labelled synthetic corpus: TPU-like training memory, hard negatives and leaks with true OOM steps.

Labels are honest by construction: `leak=True` iff the rendered job really reaches its memory
limit inside the trace or shortly after its end (the generator computes the step), and every
negative is checked never to reach it. `growing` negatives rise for real, so an alarm on them is
fair and an action is not: a genuine but slow leak that would need several times the run to
exhaust memory, a leak that stops, an evaluation ramp recorded without its phase.

Growth that stops by itself has three hard-negative families: a cache that fills with decreasing
speed in memory that grows in lumps, evaluations that keep their outputs on the device until they
end (with and without the phase label a loop using `Watchdog.phase` records), and a leak that runs
for a while and stops. Each levels off 5-25% of the limit below it. Some growth is worth acting
on whatever it turns out to be, so the families leave it out: a ramp that would reach the limit
within a few checkpoint times (each leaves the job more than `NOT_IMMINENT_MARGINS` checkpoint
times at its steepest), and, where the watchdog cannot know the ramp will stop (no phase label,
a leak that stops), a ramp that has already risen by more than it leaves.

Each family draws its parameters from ranges seen in practice (16/32 GiB HBM, 0.15-2 s steps,
3k-80k steps, activations 15-35% of the footprint); `synthetic_corpus(seed)` is deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from watchdog.bench.memory_model import (
    GiB,
    KiB,
    LevelShift,
    LinearLeak,
    LumpyFill,
    MemoryModel,
    MiB,
    SaturatingGrowth,
    StepwiseLeak,
    render,
)
from watchdog.core.sample import Sample

SOON_AFTER_FRACTION = 0.2  # an OOM at most this far (fraction of the run) past the end still counts as a leak
NOT_IMMINENT_MARGINS = 12  # growth that stops leaves this many checkpoint times at its steepest (3x imminent)


@dataclass
class LabelledTrace:
    """One trace with its ground truth."""

    name: str
    kind: str
    family: str  # "synthetic" | "real" | "real_injected"
    samples: list[Sample]
    limit_bytes: int
    leak: bool  # an OOM-bound leak the detector must act on
    onset_step: int | None
    oom_step: int | None  # true step at which the PEAK reaches the limit
    checkpoint_margin_steps: int  # an action at least this many steps before oom_step prevents the OOM
    growing: bool = False  # negative whose floor really rises, too slowly to matter: alarm fair, action not
    description: str = ""
    meta: dict = field(default_factory=dict)
    floor_leak: bool | None = None
    """The leak report's truth: True when the floor rises steadily to the end (every OOM-bound leak,
    and leaks too slow to run out: the report must come, at or after `onset_step`); False when
    nothing leaks (any report is false); None for growth that stops (a report is fair, not owed).
    Left None at construction, it follows `leak` and `growing`."""

    def __post_init__(self) -> None:
        if self.floor_leak is None and not self.growing:
            self.floor_leak = self.leak

    @property
    def hard_negative(self) -> bool:
        """A negative with nothing growing: any alarm on it is a false alarm."""
        return not self.leak and not self.growing


# ---------------------------------------------------------------------------------------------- jobs

LENGTHS = (3_000, 5_000, 8_000, 12_000, 20_000, 40_000, 80_000)


def _sample_every(steps: int) -> int:
    """A sample per step on short runs, every few steps on long ones (an 80k-step job gives 10k samples)."""
    return 1 if steps <= 12_000 else 2 if steps <= 20_000 else 4 if steps <= 40_000 else 8


def _log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(math.exp(rng.uniform(math.log(low), math.log(high))))


def _job(rng: np.random.Generator, steps: int, limit: int, headroom: float, *, noise: str = "normal",
         growth: tuple = ()) -> MemoryModel:
    """A plausible job whose steady peak leaves `headroom` bytes below the limit."""
    peak0 = limit - headroom
    runtime = int(limit * rng.uniform(0.02, 0.05))
    transient = peak0 * rng.uniform(0.15, 0.35)
    if rng.random() < 0.3:  # evaluation is the largest transient (bigger eval batch)
        eval_bytes, activations = transient, transient * rng.uniform(0.8, 0.95)
    else:
        activations, eval_bytes = transient, transient * rng.uniform(0.4, 0.9)
    state = peak0 - runtime - transient
    assert state > 0, "headroom leaves no room for the model"
    step_seconds = _log_uniform(rng, 0.15, 2.0)
    checkpoint_seconds = float(rng.uniform(10, 90))
    heavy, quiet = noise == "heavy", noise == "quiet"
    jitter = (0.008, 0.02) if heavy else (0.0001, 0.0005) if quiet else (0.0003, 0.002)
    drift = (0.006, 0.012) if heavy else (0.0, 0.0005) if quiet else (0.0, 0.002)
    return MemoryModel(
        steps=steps, limit_bytes=limit, runtime_bytes=runtime, state_bytes=int(state),
        activation_bytes=int(activations), sample_every=_sample_every(steps),
        state_step=int(rng.integers(1, 3)),
        activation_spread=float(rng.uniform(0.4, 0.7)) if heavy else float(rng.uniform(0.0, 0.1)),
        eval_every=int(rng.choice([250, 500, 1000, 2000])), eval_span=int(rng.integers(1, 5)),
        eval_bytes=int(eval_bytes),
        checkpoint_every=int(rng.choice([500, 1000, 2000, 5000])),
        checkpoint_bytes=int(transient * rng.uniform(0.2, 0.8)),
        jitter_bytes=limit * rng.uniform(*jitter), drift_bytes=limit * rng.uniform(*drift),
        drift_correlation_steps=float(rng.uniform(300, 3000)),
        step_seconds=step_seconds, compile_seconds=float(rng.uniform(20, 180)),
        eval_seconds=float(rng.uniform(10, 120)), checkpoint_seconds=checkpoint_seconds,
        report_peak=bool(rng.random() < 0.5), growth=growth,
    )


def _margin_steps(model: MemoryModel) -> int:
    """Steps a checkpoint needs: its seconds over the step time, at least two samples' worth."""
    return max(2 * model.sample_every, 10, math.ceil(model.checkpoint_seconds / model.step_seconds))


def _limit(rng: np.random.Generator, needed_headroom: float = 0.0) -> int:
    """16 or 32 GiB HBM (v5e / v4 per chip); 32 when the headroom would not fit in 16."""
    if needed_headroom > 0.5 * 16 * GiB:
        return 32 * GiB
    return int(rng.choice([16 * GiB, 32 * GiB]))


def _noise_floor(model: MemoryModel) -> float:
    """How far jitter and drift can push a reading: negatives keep at least this much spare."""
    return 5.0 * model.jitter_bytes + 2.5 * model.drift_bytes


# --------------------------------------------------------------------------------------- negatives

def _clean(rng, steps):
    limit = _limit(rng)
    return _job(rng, steps, limit, limit * rng.uniform(0.08, 0.35)), "steady training: sawtooth, evals, checkpoints"


def _clean_high_utilisation(rng, steps):
    limit = _limit(rng)
    return (_job(rng, steps, limit, limit * rng.uniform(0.025, 0.06)),
            "batch size tuned to fill HBM: peaks at 94-97% of the limit, nothing grows")


def _level_shift(rng, steps):
    limit = _limit(rng)
    headroom = limit * rng.uniform(0.15, 0.35)
    shift = headroom * rng.uniform(0.3, 0.6)
    at = int(steps * rng.uniform(0.15, 0.7))
    growth = (LevelShift(at, shift, ramp_steps=int(rng.integers(0, 40))),)
    return _job(rng, steps, limit, headroom, growth=growth), f"one-off level shift of {shift / GiB:.2f} GiB"


def _eval_buffers_kept(rng, steps):
    limit = _limit(rng)
    headroom = limit * rng.uniform(0.15, 0.35)
    model = _job(rng, steps, limit, headroom)
    kept = headroom * rng.uniform(0.25, 0.5)
    growth = (LevelShift(model.eval_every, kept),)
    return replace(model, growth=growth), "eval buffers kept after the first evaluation"


def _compile_warmup(rng, steps):
    """Recompilations fill the compile cache early in the run (shapes settling), then nothing more."""
    limit = _limit(rng)
    headroom = limit * rng.uniform(0.15, 0.35)
    total = headroom * rng.uniform(0.3, 0.6)
    count = int(rng.integers(3, 10))
    span = steps * rng.uniform(0.03, 0.2)
    at = np.sort(span * np.geomspace(0.02, 1.0, count) * rng.uniform(0.8, 1.0, count)).astype(int) + 3
    sizes = rng.dirichlet(np.ones(count)) * total
    growth = tuple(LevelShift(int(a), float(s)) for a, s in zip(at, sizes))
    return (_job(rng, steps, limit, headroom, growth=growth),
            f"compile-cache warm-up: {count} steps up over the first {span:.0f} steps, then a plateau")


def _saturating_cache(rng, steps):
    limit = _limit(rng)
    headroom = limit * rng.uniform(0.2, 0.4)
    size = headroom * rng.uniform(0.4, 0.65)
    tau = steps * rng.uniform(0.05, 0.25)
    onset = int(steps * rng.uniform(0.0, 0.2))
    growth = (SaturatingGrowth(onset, size, tau),)
    return (_job(rng, steps, limit, headroom, growth=growth),
            f"cache filling towards {size / GiB:.2f} GiB (time constant {tau:.0f} steps)")


def _heavy_noise(rng, steps):
    limit = _limit(rng)
    return (_job(rng, steps, limit, limit * rng.uniform(0.2, 0.35), noise="heavy"),
            "heavy noise (data-dependent activations, fragmentation), no trend")


def _slow_growth(rng, steps):
    """A genuine leak far too slow to matter in this run: it would need 3-8 runs to fill the headroom."""
    limit = _limit(rng)
    headroom = limit * rng.uniform(0.15, 0.3)
    rate = headroom / (steps * rng.uniform(3.0, 8.0))
    growth = (LinearLeak(int(steps * 0.05), rate),)
    return (_job(rng, steps, limit, headroom, growth=growth),
            f"slow growth {rate / KiB:.2f} KiB/step, not OOM-bound within the run")


def _small_leak(rng, steps):
    """A genuine leak whose whole growth over the run is 2-5% of the limit, starting anywhere in the
    first 60% of it: the smallest leak the leak report is meant to catch, nowhere near an OOM."""
    limit = _limit(rng)
    headroom = limit * rng.uniform(0.15, 0.3)
    onset = int(steps * rng.uniform(0.05, 0.6))
    rate = limit * rng.uniform(0.02, 0.05) / (steps - onset)
    growth = (LinearLeak(onset, rate),)
    return (_job(rng, steps, limit, headroom, growth=growth),
            f"small leak of {rate / KiB:.2f} KiB/step from step {onset}: "
            f"{rate * (steps - onset) / limit:.1%} of the limit by the end, no OOM near")


def _stopping_limit(rng, *, rises_less_than_it_leaves: bool) -> tuple[int, float, float]:
    """(limit, spare, rise) for growth that stops 5-20% of the limit below it, having risen by
    8-25% of the limit; or, when it must rise by less than it leaves (what the watchdog cannot
    tell from the start of a leak: see the module docstring), 8-25% below, by 50-90% of that."""
    limit = _limit(rng)
    if rises_less_than_it_leaves:
        spare = limit * rng.uniform(0.08, 0.25)
        return limit, spare, spare * rng.uniform(0.5, 0.9)
    return limit, limit * rng.uniform(0.05, 0.2), limit * rng.uniform(0.08, 0.25)


def _not_imminent_steps(model: MemoryModel, rise: float, spare: float) -> int:
    """The fewest steps a ramp of `rise` may take so that, at its rate, the `spare` it leaves (less
    the tenth of the largest transient a watchdog keeps for tops its samples miss) lasts
    `NOT_IMMINENT_MARGINS` checkpoint times."""
    usable = max(spare - 0.1 * max(model.activation_bytes, model.eval_bytes), 0.25 * spare)
    return math.ceil(NOT_IMMINENT_MARGINS * _margin_steps(model) * rise / usable)


def _lumpy_cache_fill(rng, steps):
    """Entries drawn at random fill a cache (each step finds fewer new ones) in memory that grows
    in lumps, 5-10 of them: concave, and a staircase whose newest quarters can look alike. (With
    fewer, a fill is a handful of level shifts that nothing tells from a stepwise leak's start.)"""
    limit, spare, size = _stopping_limit(rng, rises_less_than_it_leaves=False)
    model = _job(rng, steps, limit, spare + size)
    lumps = int(rng.integers(5, 11))
    # At its steepest (the start) it adds size / tau per step.
    tau = max(steps * rng.uniform(0.05, 0.3), _not_imminent_steps(model, size, spare))
    onset = int(steps * rng.uniform(0.0, 0.2))
    growth = (LumpyFill(onset, size, tau, size / lumps),)
    return (replace(model, growth=growth),
            f"cache filling towards {size / GiB:.2f} GiB in {lumps} lumps (time constant {tau:.0f} steps)")


def _eval_ramp(rng, steps, labelled: bool):
    limit, spare, kept = _stopping_limit(rng, rises_less_than_it_leaves=not labelled)
    model = _job(rng, steps, limit, spare + kept)
    span = int(rng.integers(150, 600))
    if not labelled:
        span = max(span, _not_imminent_steps(model, kept, spare))
    every = int(span * rng.uniform(2.5, 6.0))  # the first early, when a ramp spans many buckets
    label = f"eval/{span}" if labelled else ""
    model = replace(model, eval_every=every, eval_span=span, eval_bytes=int(kept), eval_accumulates=True,
                    eval_phase_label=label)
    return model, (f"evaluation of {span} steps every {every} keeping {kept / GiB:.2f} GiB of outputs until it ends"
                   + (f" (phase label {label})" if labelled else " (no phase label)"))


def _eval_outputs_kept(rng, steps):
    """Evaluations keep each batch's outputs on the device until they end, with the phase label."""
    return _eval_ramp(rng, steps, labelled=True)


def _first_eval_ramp(rng, steps):
    """The same without the phase label: the first one climbs like a leak's start."""
    return _eval_ramp(rng, steps, labelled=False)


def _leak_that_stops(rng, steps):
    """A leak runs for 10-30% of the run, then its code path stops and memory stays flat."""
    limit, spare, grown = _stopping_limit(rng, rises_less_than_it_leaves=True)
    model = _job(rng, steps, limit, spare + grown)
    duration = max(int(steps * rng.uniform(0.1, 0.3)), _not_imminent_steps(model, grown, spare))
    onset = int(steps * rng.uniform(0.1, 0.4))
    rate = grown / duration
    growth = (LinearLeak(onset, rate, onset + duration),)
    return (replace(model, growth=growth),
            f"leak of {rate / KiB:.1f} KiB/step from step {onset} that stops after {duration} steps")


# ------------------------------------------------------------------------------------------- leaks

def _leak_window(rng, steps, onset_range, oom_range) -> tuple[int, int]:
    onset = int(steps * rng.uniform(*onset_range))
    oom = int(steps * rng.uniform(*oom_range))
    return onset, max(oom, onset + 1500)


def _fit_rate(rng, steps, rate, onset, oom, max_fraction=0.5) -> tuple[int, float, float]:
    """Choose limit and headroom so a leak of `rate` bytes/step starting at `onset` fills it by `oom`."""
    headroom = rate * (oom - onset)
    limit = _limit(rng, headroom)
    if headroom > max_fraction * limit:  # too fast for this run: the leak ends the job earlier
        headroom = max_fraction * limit
    return limit, headroom, headroom / (oom - onset)


def _linear_small(rng, steps):
    onset, oom = _leak_window(rng, steps, (0.0, 0.3), (0.6, 1.1))
    limit, headroom, rate = _fit_rate(rng, steps, _log_uniform(rng, 4 * KiB, 64 * KiB), onset, oom)
    return (_job(rng, steps, limit, headroom, noise="quiet", growth=(LinearLeak(onset, rate),)), onset,
            f"linear leak {rate / KiB:.1f} KiB/step")


def _linear_large(rng, steps):
    onset, oom = _leak_window(rng, steps, (0.0, 0.3), (0.5, 1.1))
    limit, headroom, rate = _fit_rate(rng, steps, _log_uniform(rng, 256 * KiB, 4 * MiB), onset, oom)
    return (_job(rng, steps, limit, headroom, growth=(LinearLeak(onset, rate),)), onset,
            f"linear leak {rate / MiB:.2f} MiB/step")


def _stepwise(rng, steps):
    onset, oom = _leak_window(rng, steps, (0.0, 0.3), (0.6, 1.1))
    every = int(rng.choice([20, 50, 100, 250, 500, 1000]))
    limit, headroom, rate = _fit_rate(rng, steps, _log_uniform(rng, 32 * KiB, 2 * MiB), onset, oom)
    chunk = rate * every
    return (_job(rng, steps, limit, headroom, growth=(StepwiseLeak(onset, every, chunk),)), onset,
            f"stepwise leak: {chunk / MiB:.1f} MiB every {every} steps")


def _share_of_limit(rng, share: tuple[float, float], onset: int, oom: int) -> tuple[int, float, float]:
    """(limit, headroom, rate): headroom is a random share of the limit, used up between onset and oom."""
    limit = _limit(rng)
    headroom = limit * rng.uniform(*share)
    return limit, headroom, headroom / (oom - onset)


def _late_onset(rng, steps):
    onset, oom = _leak_window(rng, steps, (0.4, 0.7), (0.85, 1.1))
    limit, headroom, rate = _share_of_limit(rng, (0.05, 0.3), onset, oom)
    return (_job(rng, steps, limit, headroom, growth=(LinearLeak(onset, rate),)), onset,
            f"late-onset leak from step {onset}: {rate / KiB:.1f} KiB/step")


def _noisy_leak(rng, steps):
    onset, oom = _leak_window(rng, steps, (0.0, 0.3), (0.6, 1.1))
    limit, headroom, rate = _share_of_limit(rng, (0.2, 0.4), onset, oom)
    return (_job(rng, steps, limit, headroom, noise="heavy", growth=(LinearLeak(onset, rate),)), onset,
            f"leak under heavy noise: {rate / KiB:.1f} KiB/step")


def _leak_after_shift(rng, steps):
    """Eval buffers kept at the first eval AND a leak later: the shift must not hide or fake the leak."""
    onset, oom = _leak_window(rng, steps, (0.3, 0.5), (0.75, 1.1))
    limit = _limit(rng)
    headroom = limit * rng.uniform(0.2, 0.4)
    shift = headroom * rng.uniform(0.2, 0.4)
    rate = (headroom - shift) / (oom - onset)
    model = _job(rng, steps, limit, headroom)
    growth = (LevelShift(model.eval_every, shift), LinearLeak(onset, rate))
    return replace(model, growth=growth), onset, f"kept eval buffers, then a leak of {rate / KiB:.1f} KiB/step"


# ---------------------------------------------------------------------------------------- assembly

Negative = Callable[[np.random.Generator, int], tuple[MemoryModel, str]]
Positive = Callable[[np.random.Generator, int], tuple[MemoryModel, int, str]]

# (kind, generator, count, allowed lengths)
NEGATIVES: tuple[tuple[str, Negative, int, tuple[int, ...]], ...] = (
    ("clean", _clean, 8, LENGTHS),
    ("clean_high_utilisation", _clean_high_utilisation, 6, LENGTHS),
    ("level_shift", _level_shift, 6, LENGTHS),
    ("eval_buffers_kept", _eval_buffers_kept, 5, LENGTHS[2:]),
    ("compile_warmup", _compile_warmup, 6, LENGTHS),
    ("saturating_cache", _saturating_cache, 7, LENGTHS),
    ("heavy_noise", _heavy_noise, 7, LENGTHS),
    ("slow_growth", _slow_growth, 4, LENGTHS[2:]),
    ("lumpy_cache_fill", _lumpy_cache_fill, 6, LENGTHS[:5]),
    ("eval_outputs_kept", _eval_outputs_kept, 5, LENGTHS[1:5]),
    ("first_eval_ramp", _first_eval_ramp, 5, LENGTHS[1:5]),
    ("leak_that_stops", _leak_that_stops, 6, LENGTHS[1:5]),
    ("small_leak", _small_leak, 8, LENGTHS[2:]),  # last: the families before keep their seeds
)
GROWING = frozenset(("slow_growth", "first_eval_ramp", "leak_that_stops", "small_leak"))  # alarms fair, actions not
FLOOR_LEAKS = frozenset(("slow_growth", "small_leak"))  # leaks that never run out: the leak report is owed
POSITIVES: tuple[tuple[str, Positive, int, tuple[int, ...]], ...] = (
    ("linear_small_leak", _linear_small, 8, LENGTHS[4:]),
    ("linear_large_leak", _linear_large, 8, LENGTHS[:5]),
    ("stepwise_leak", _stepwise, 8, LENGTHS),
    ("late_onset_leak", _late_onset, 8, LENGTHS[1:]),
    ("noisy_leak", _noisy_leak, 8, LENGTHS),
    ("leak_after_shift", _leak_after_shift, 5, LENGTHS[2:]),
)

MAX_ATTEMPTS = 50


def _pick_length(rng: np.random.Generator, lengths: tuple[int, ...]) -> int:
    # Long runs are the point, but they cost replay time: weight towards the middle.
    weights = np.array([1.0 if n <= 40_000 else 0.5 for n in lengths])
    return int(rng.choice(lengths, p=weights / weights.sum()))


def _negative(kind: str, make: Negative, rng: np.random.Generator, lengths, index: int) -> LabelledTrace:
    for _ in range(MAX_ATTEMPTS):  # redraw the rare job whose noise could brush the limit
        steps = _pick_length(rng, lengths)
        model, description = make(rng, steps)
        rendered = render(model, rng)
        spare = model.limit_bytes - float(rendered.peak_bytes.max())
        if rendered.oom_step is None and spare > _noise_floor(model):
            growing, floor_leak = kind in GROWING, kind in FLOOR_LEAKS
            return LabelledTrace(
                name=f"{kind}-{index:02d}", kind=kind, family="synthetic", samples=rendered.samples,
                limit_bytes=model.limit_bytes, leak=False,
                onset_step=model.growth[0].onset_step if floor_leak else None, oom_step=None,
                checkpoint_margin_steps=_margin_steps(model), growing=growing, description=description,
                meta=_meta(model), floor_leak=True if floor_leak else None)
    raise RuntimeError(f"could not draw a clean {kind} trace")  # a generator bug, not user input


def _positive(kind: str, make: Positive, rng: np.random.Generator, lengths, index: int) -> LabelledTrace:
    for _ in range(MAX_ATTEMPTS):
        steps = _pick_length(rng, lengths)
        model, onset, description = make(rng, steps)
        rendered = render(model, rng)
        oom = rendered.oom_step
        # Honest label: it must really run out, after the leak began, and not long after the run ends.
        if oom is not None and oom > onset + 500 and oom <= steps * (1 + SOON_AFTER_FRACTION):
            return LabelledTrace(
                name=f"{kind}-{index:02d}", kind=kind, family="synthetic", samples=rendered.samples,
                limit_bytes=model.limit_bytes, leak=True, onset_step=onset, oom_step=oom,
                checkpoint_margin_steps=_margin_steps(model), description=description, meta=_meta(model))
    raise RuntimeError(f"could not draw an OOM-bound {kind} trace")


def _meta(model: MemoryModel) -> dict:
    leak_rate = sum(g.bytes_per_step if isinstance(g, LinearLeak) else g.chunk_bytes / g.every
                    for g in model.growth if isinstance(g, (LinearLeak, StepwiseLeak)))  # while it runs
    return {"steps": model.steps, "sample_every": model.sample_every, "step_seconds": model.step_seconds,
            "leak_bytes_per_step": leak_rate}


def synthetic_corpus(seed: int = 0) -> list[LabelledTrace]:
    """The whole labelled synthetic corpus; the same seed gives the same traces, sample for sample."""
    return [_draw(seed, positive, family, i) for positive, families in enumerate((NEGATIVES, POSITIVES))
            for family, (_, _, count, _) in enumerate(families) for i in range(count)]


def synthetic_trace(name: str, seed: int = 0) -> LabelledTrace:
    """One trace of `synthetic_corpus(seed)` by its name (`compile_warmup-04`), without drawing the rest."""
    kind, _, index = name.rpartition("-")
    for positive, families in enumerate((NEGATIVES, POSITIVES)):
        for family, (family_kind, _, count, _) in enumerate(families):
            if family_kind == kind and index.isascii() and index.isdigit() and int(index) < count:
                return _draw(seed, positive, family, int(index))
    raise KeyError(name)


def _draw(seed: int, positive: int, family: int, index: int) -> LabelledTrace:
    """Trace `index` of a family: its own generator, so each trace is the same whichever others are drawn."""
    kind, make, _, lengths = (POSITIVES if positive else NEGATIVES)[family]
    rng = np.random.default_rng([seed, positive, family, index])
    return (_positive if positive else _negative)(kind, make, rng, lengths, index)  # type: ignore[arg-type]


def corpus_summary(traces: list[LabelledTrace]) -> dict:
    """Counts a reader wants before trusting a score: traces, leaks, samples, per kind."""
    kinds: dict[str, int] = {}
    for trace in traces:
        kinds[trace.kind] = kinds.get(trace.kind, 0) + 1
    return {
        "traces": len(traces),
        "leaks": sum(t.leak for t in traces),
        "negatives": sum(not t.leak for t in traces),
        "samples": sum(len(t.samples) for t in traces),
        "kinds": kinds,
    }
