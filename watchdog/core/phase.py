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

A phase that keeps more every time it runs (an evaluation that keeps its outputs: metatrain#1014,
karpathy/nanochat#295, which lost 29 hours to an eval's OOM) leaks *peaks*: the floor between runs
stays flat and each run's growth ends below the limit, but each run peaks higher. `PeakClimb`
keeps each run's peak and tells where the next one will start and peak, so the action comes
between runs, before the run that would cross: the checkpoint before eval nanochat asked for.

A phase travels with each sample as a label: the name, and `/STEPS` when the loop said how long it
runs (`eval/300`). The label is the trace CSV's optional `phase` column, so `analyze` replays what
the sidecar decided.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from typing import NamedTuple

from watchdog.core.errors import ConfigError, InputError
from watchdog.core.numbers import parse_step
from watchdog.core.trend import Series, Trend, fit_trend, newest_evidence

TRAIN = "train"
STEADY_LABELS = frozenset(("", TRAIN))  # no phase given, or training: the detector's floor
SAVE = "save"  # the bounded phase a save runs in: its end's peak is the save's own memory (core/action_time.py)
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,31}")
POINT_SAMPLES = 4  # samples per point at first: their minimum is the floor under the phase's transients
MIN_PHASE_POINTS = 8  # a line through fewer points says too little to act on
MAX_POINTS = 64  # points kept per phase run (neighbours merge beyond)
MAX_PHASES = 64  # bounded phases remembered (how long each ran, its runs' peaks): the newest names


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
    if not isinstance(name, str) or not _NAME.fullmatch(name):
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
    try:
        planned = parse_step(steps)  # ASCII digits, bounded: a trace's '²' or 5,000 digits is a name, not a crash
    except InputError:
        return Phase(label, None)
    return Phase(name, planned) if planned > 0 else Phase(label, None)


class NewestPhases(OrderedDict):
    """What a judge remembers per bounded phase, for the `MAX_PHASES` phases named most recently.

    A loop has a handful of phases (an evaluation, a checkpoint, a profiler window), but a trace
    names what it likes: one whose every other row named a new phase made every phase change scan
    every name seen so far (50,000 names: `analyze` took 120 s for 10^5 rows). Whatever the input
    names, the memory, and the work at a phase change, stay bounded; a phase run again after
    `MAX_PHASES` others is met as new (its length unknown, its runs' peaks counted from its next)."""

    def __setitem__(self, name: str, value) -> None:
        super().__setitem__(name, value)
        self.move_to_end(name)
        if len(self) > MAX_PHASES:
            self.popitem(last=False)


class PhaseForecast(NamedTuple):
    """An OOM projected inside a bounded phase."""

    slope: float  # bytes per step: the phase's floor growth, as its newest samples tell it
    high: float  # the pessimistic edge of that slope
    oom_x: float  # step at which the phase's peak reaches the limit at `slope`
    oom_x_high: float  # ... at `high`
    end_step: float | None  # where the phase is expected to end; None: unknown
    seconds_per_step: float


class NextRun(NamedTuple):
    """Where the next run of a phase whose peaks climb is expected."""

    start: float  # the step it starts at: the newest run's start plus the newest gap between starts
    peak: float  # the peak it reaches: the newest peak plus the median climb between runs
    climb: float  # that climb, bytes per run
    seen_over: float  # steps from the oldest run's start to the next's: what the climb was seen over


CLIMB_RUNS = 4  # runs whose peaks must each climb: three climbs, as the pace rule asks four quarters


class PeakClimb:
    """The peaks of one bounded phase's newest runs, and the next run's, when they climb.

    A climb is believed only when each of the newest `CLIMB_RUNS` runs peaked higher than the one
    before. The next run is then expected one newest gap after the newest start, to peak the median
    climb above the newest peak. A run's peak is its highest reading, which a sparse sampling of a
    ramp places anywhere in its last gap: one loop's runs read +32, +18, +74, +11, +41 and +57 MiB
    apart for a steady +40 MiB, so the climbs are not asked to be alike, only all upwards. Runs of a
    healthy job peak high or low at random; three climbs in a row come one time in six, but then
    with a next peak that only matters within a climb of the limit."""

    __slots__ = ("_starts", "_peaks")

    def __init__(self) -> None:
        self._starts: list[float] = []
        self._peaks: list[float] = []

    def add(self, start: float, peak: float) -> None:
        self._starts = [*self._starts[1 - CLIMB_RUNS:], start]
        self._peaks = [*self._peaks[1 - CLIMB_RUNS:], peak]

    @property
    def climbing(self) -> bool:
        """The newest three runs each peaked higher than the one before: worth naming what a run holds
        at its end, a run before a climb is believed."""
        peaks = self._peaks[-3:]
        return len(peaks) == 3 and peaks[0] < peaks[1] < peaks[2]

    def next_run(self) -> NextRun | None:
        starts, peaks = self._starts, self._peaks
        if len(peaks) < CLIMB_RUNS:
            return None
        climbs = sorted(b - a for a, b in zip(peaks, peaks[1:]))
        if climbs[0] <= 0 or starts[-1] <= starts[-2]:
            return None
        climb = climbs[len(climbs) // 2]
        start = starts[-1] + (starts[-1] - starts[-2])
        return NextRun(start, peaks[-1] + climb, climb, start - starts[0])


class PhaseEpisode:
    """One run of a bounded phase, watched with the detector's robust statistics in miniature.

    Samples become points, `POINT_SAMPLES` each at first (a point's floor is their minimum: a
    reading lands anywhere in a batch's transient), then neighbours merge pairwise once there are
    `MAX_POINTS`, so memory and the cost of a forecast are bounded. The forecast is a
    median-of-slopes line through the points' floors (a jump when the phase allocates its buffers,
    then nothing, is no slope) whose rise must stand out of their noise by `rise_sigmas`, believing
    the newest points when they show a slowdown (`newest_evidence`); it is refreshed once the
    phase has a quarter more samples than at the last refresh: O(1) amortised per sample.
    """

    __slots__ = ("phase", "expected_steps", "first_step", "last_step", "last_gap", "first_time", "last_time",
                 "peak", "n", "_xs", "_floors", "_span", "_next_refresh", "_trend")

    def __init__(self, phase: Phase, expected_steps: float | None, step: int, timestamp: float):
        self.phase = phase
        self.expected_steps = expected_steps  # planned, or learned from the last run of this phase
        self.first_step = self.last_step = step
        self.first_time = self.last_time = timestamp
        self.last_gap = 0
        self.peak = -math.inf
        self.n = 0  # samples seen
        self._xs: list[float] = []
        self._floors: list[float] = []
        self._span = POINT_SAMPLES  # samples per point (doubles when the points merge)
        self._next_refresh = POINT_SAMPLES * MIN_PHASE_POINTS
        self._trend: Trend | None = None

    def add(self, step: int, timestamp: float, used: int, peak: int | None = None) -> None:
        """A reading in the phase: `used` now, and `peak` since the previous reading where the source
        keeps one (what a copy made and freed in between held: an evaluation's end-of-pass concatenation)."""
        if self.n:
            self.last_gap = step - self.last_step
        self.last_step, self.last_time = step, timestamp
        high = used if peak is None or peak < used else peak
        if high > self.peak:
            self.peak = high
        if self.n % self._span == 0:  # a new point
            self._xs.append(float(step))
            self._floors.append(float(used))
            if len(self._xs) > MAX_POINTS:
                xs, fl = self._xs, self._floors
                self._xs = [0.5 * (xs[i] + xs[i + 1]) for i in range(0, len(xs) - 1, 2)]
                self._floors = [min(fl[i], fl[i + 1]) for i in range(0, len(fl) - 1, 2)]
                self._span *= 2
        elif used < self._floors[-1]:
            self._floors[-1] = float(used)
        self.n += 1

    @property
    def staged(self) -> float:
        """How far the phase's peak rose above where its newest readings left memory: what it held
        and let go of before it ended (a save's staging copy); 0 before a reading."""
        return max(0.0, self.peak - self._floors[-1]) if self._floors else 0.0

    @property
    def span(self) -> int:
        """Steps the phase ran, as sampled (first to last sample, plus one sample interval)."""
        return self.last_step - self.first_step + self.last_gap

    def _growth(self, z: float, rise_sigmas: float) -> Trend | None:
        """The phase's floor growth, refreshed every quarter more samples; None while too few
        points, or when the floor shows no confident rise out of its noise."""
        if self.n >= self._next_refresh and len(self._xs) >= MIN_PHASE_POINTS:
            self._next_refresh = self.n + max(1, self.n // 4)
            trend = fit_trend(self._xs, self._floors, z)
            if trend.low > 0 and trend.slope * trend.span >= rise_sigmas * trend.sigma:
                trend = newest_evidence(trend, Series(self._xs, self._floors), z)
                self._trend = trend if trend.low > 0 else None
            else:
                self._trend = None
        return self._trend

    def forecast(self, room: float, z: float, rise_sigmas: float, max_extrapolation: float) -> PhaseForecast | None:
        """Where the phase's peak reaches the limit, if it does before the phase ends.

        `room` is limit - headroom - the highest reading in the phase. None when the phase's
        growth is no threat: too few samples, no confident rise, a peak that stays below the limit
        until the phase's end (when it is known), or an OOM further ahead than
        `max_extrapolation` times the steps the phase has been seen over (the detector's rule for
        floor growth). As for the floor, the central slope decides and the pessimistic edge is
        what the policy's horizon reads.
        """
        trend = self._growth(z, rise_sigmas)
        if trend is None:
            return None
        x = float(self.last_step)
        elapsed = self.last_step - self.first_step
        end = None if self.expected_steps is None else self.first_step + self.expected_steps
        oom_x = x + max(room, 0.0) / trend.slope
        oom_x_high = x + max(room, 0.0) / trend.high
        if end is not None and oom_x > end:
            return None  # the phase ends before its peak reaches the limit
        if oom_x - x > max_extrapolation * max(elapsed, 1):
            return None  # a line is not extrapolated far beyond its evidence, as for floor growth
        seconds = (self.last_time - self.first_time) / elapsed if elapsed > 0 else 0.0
        return PhaseForecast(trend.slope, trend.high, oom_x, oom_x_high, end, max(seconds, 0.0))
