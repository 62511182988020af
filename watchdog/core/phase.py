"""Phases of a training loop, and the watch kept over a bounded one. Pure: no threads, no I/O.

A loop runs in phases. Training is the steady one: what it allocates and keeps is what the leak
detector extrapolates. Any other phase (an evaluation, a checkpoint, a profiler window) is
bounded: it ends, and what it allocated while it ran goes when it ends, like the eval
predictions a loop keeps on the device until the evaluation is over.

So samples taken in a bounded phase are no floor samples: the detector counts them as a transient
of the bucket they fall in (what they reach counts towards the peak every projection adds to the
floor, because the next evaluation will reach it again), and the growth inside the phase is
judged here, against the peak it will reach by the phase's end:

- the end is known when the loop says how long the phase runs (`Watchdog.phase("eval",
  steps=len(loader))`), else from the last time a phase of that name ran; growth whose projected
  peak stays below the limit until then is no threat, however steep, and growth that would reach
  the limit before the end is an OOM to act on;
- the first time a phase of unknown length runs, its growth is extrapolated as a line, no further
  than the detector would extrapolate floor growth (`max_extrapolation` times the steps it was
  seen over); the policy's caution for a first ramp (a WARN first, unless imminent) applies.

A phase travels with each sample as a label: the name, and `/STEPS` when the loop said how long it
runs (`eval/300`). The label is the trace CSV's optional `phase` column, so `analyze` replays what
the sidecar decided.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

from watchdog.core.errors import ConfigError

TRAIN = "train"
STEADY_LABELS = frozenset(("", TRAIN))  # no phase given, or training: the detector's floor
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,31}$")
MIN_PHASE_SAMPLES = 6  # a line through fewer in-phase samples says too little to act on


class Phase(NamedTuple):
    name: str
    planned_steps: int | None  # how long the loop said it runs; None: not said

    @property
    def bounded(self) -> bool:
        return self.name not in STEADY_LABELS


def phase_label(name: str, steps: int | None = None) -> str:
    """The label a sample carries: `eval`, or `eval/300` for a phase said to run 300 steps.

    Raises ConfigError on a name that would not survive a CSV cell or a Prometheus label value
    (a letter, then up to 31 letters, digits, `_`, `.` or `-`) or a length that is not positive.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError("phase", f"name must be a letter then up to 31 of [A-Za-z0-9_.-], got {name!r}")
    if steps is None or name == TRAIN:
        return name
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError("phase", f"steps must be a positive integer, got {steps!r}")
    return f"{name}/{steps}"


def parse_label(label: str) -> Phase:
    """A sample's label back into a phase; lenient, since traces come from anywhere: text that is
    not NAME/STEPS is all name, of unknown length."""
    name, _, steps = label.partition("/")
    if steps.isdigit() and int(steps) > 0:
        return Phase(name, int(steps))
    return Phase(label, None)


class PhaseForecast(NamedTuple):
    """An OOM projected inside a bounded phase."""

    slope: float  # bytes per step, least squares through the phase's samples
    high: float  # the pessimistic edge of that slope
    oom_x: float  # step at which the phase's peak reaches the limit at `slope`
    oom_x_high: float  # ... at `high`
    end_step: float | None  # where the phase is expected to end; None: unknown
    seconds_per_step: float


class PhaseEpisode:
    """One run of a bounded phase: a line through its samples (O(1) per sample: running sums) and
    the highest reading, projected to the phase's end."""

    __slots__ = ("phase", "expected_steps", "first_step", "last_step", "last_gap", "first_time", "last_time",
                 "peak", "n", "sx", "sy", "sxx", "sxy", "syy")

    def __init__(self, phase: Phase, expected_steps: float | None, step: int, timestamp: float):
        self.phase = phase
        self.expected_steps = expected_steps  # planned, or learned from the last run of this phase
        self.first_step = self.last_step = step
        self.first_time = self.last_time = timestamp
        self.last_gap = 0
        self.peak = -math.inf
        self.n = 0
        self.sx = self.sy = self.sxx = self.sxy = self.syy = 0.0

    def add(self, step: int, timestamp: float, used: int) -> None:
        if self.n:
            self.last_gap = step - self.last_step
        self.last_step, self.last_time = step, timestamp
        if used > self.peak:
            self.peak = used
        x = float(step - self.first_step)  # centred on the phase's start: sums stay well conditioned
        y = float(used)
        self.n += 1
        self.sx += x
        self.sy += y
        self.sxx += x * x
        self.sxy += x * y
        self.syy += y * y

    @property
    def span(self) -> int:
        """Steps the phase ran, as sampled (first to last sample, plus one sample interval)."""
        return self.last_step - self.first_step + self.last_gap

    def forecast(self, room: float, z: float, max_extrapolation: float) -> PhaseForecast | None:
        """Where the phase's peak reaches the limit, if it does before the phase ends.

        `room` is limit - headroom - the highest reading in the phase. None when the phase's
        growth is no threat: too few samples, not rising, or (end known) even the pessimistic
        slope leaves the peak below the limit at the phase's end; or (end unknown) the OOM lies
        further ahead than `max_extrapolation` times the steps the phase has been seen over.
        """
        n = self.n
        if n < MIN_PHASE_SAMPLES:
            return None
        sxx = self.sxx - self.sx * self.sx / n
        if sxx <= 0:
            return None
        sxy = self.sxy - self.sx * self.sy / n
        slope = sxy / sxx
        if slope <= 0:
            return None
        residual = max(0.0, (self.syy - self.sy * self.sy / n) - slope * sxy)
        high = slope + z * math.sqrt(residual / (n - 2) / sxx)
        x = float(self.last_step)
        end = None if self.expected_steps is None else self.first_step + self.expected_steps
        oom_x = x + max(room, 0.0) / slope
        oom_x_high = x + max(room, 0.0) / high
        if end is not None:
            if oom_x_high > end:
                return None  # the phase ends before its peak reaches the limit
        elif oom_x - x > max_extrapolation * max(self.last_step - self.first_step, 1):
            return None
        elapsed = self.last_step - self.first_step
        seconds = (self.last_time - self.first_time) / elapsed if elapsed > 0 else 0.0
        return PhaseForecast(slope, high, oom_x, oom_x_high, end, max(seconds, 0.0))
