"""The newest samples' pace: how fast memory rose over the last few readings. Pure: no threads, no I/O.

The detector needs dozens of samples before it projects anything (its warm-up, sixteen buckets,
then a confirmed candidate: about 40 samples, the "how early" table in docs/detection.md). A leak
that fills its headroom in fewer samples, and the same leak again after every reinit (the detector
starts a new baseline each time), would reach the limit before the detector says a word. The limit
rule's margin closes that gap (`core/judge.py`): memory whose next sample could already be past
the line, at the pace seen, is acted on now. Waiting for that sample is waiting for the OOM.

The readings are cut in four quarters of three, and there is a pace only when every quarter's
lowest reading and every quarter's highest rise above the quarter's before: the floor and the peak
both climbing, quarter after quarter, as the detector asks of a window (every quarter contributes).
The pace is then the slower of the two climbs from the first quarter to the last, provided it is
at least twice the spread of the readings within any quarter: a climb must stand out of the noise
(once, on a flat job with a 6 GiB sawtooth, a climb just above one spread came with a new high at
its 5,685th reading: tests/test_detector.py's flat traces). So the pace serves leaks whose rise in a
reading is at least about a quarter of the sawtooth; slower ones are the detector's. Looser tests
acted on healthy jobs on the bench: activations make each reading high or low at random, and on a
sawtooth of several GiB a few low readings at the start of a window (or a transient climbing for
five samples) are a "rise" to the median of consecutive differences and to slopes across the
window alike; a job whose sampled peaks touch 99% of its limit was acted on before its leak began.
A leak that fills its headroom in twenty samples climbs through every quarter; a sawtooth does
that once in hundreds of windows, and then slowly. What stays out of reach: a leak whose rise over
three samples is smaller than the sawtooth's spread over three readings, which only the detector
sees (or the reading at the line). And a climb is looked at only while the newest quarter holds a
new high since the last rebuild: a job whose sampled peaks touch 99.5% of its limit now and then
climbs through four quarters by chance (the bench's linear_small_leak-04, 2,400 steps before its
leak began), but up to a peak it had already reached, while a leak's peak is higher than any before
it (not at every reading: a sawtooth makes some readings low, and waiting for the next new high
missed the last reading before the limit). The test costs one comparison on every other reading:
a replay judges a million samples. The level the pace is added to is the highest reading carried
forward to now at the pace: an OOM happens at the peak, and a sawtooth's newest reading is rarely
its peak.
"""

from __future__ import annotations

import itertools
import math
from collections import deque

QUARTER = 3  # readings in each quarter
PACE_SAMPLES = 4 * QUARTER  # the readings kept
REACH_GAPS = 2.0  # readings looked ahead (see `Pace.reach`)
HANDOVER_STEPS = 3  # steps an action decided at a sample may take to reach the loop (the sidecar judges while training goes on)
STANDS_OUT = 2.0  # the climb must be this many times the widest spread of readings within a quarter
FIRST_TO_LAST = (PACE_SAMPLES - QUARTER) / (PACE_SAMPLES - 1)  # the share of the window's span from the first quarter to the last


class Pace:
    """The newest readings, their highest, and the pace they rise at."""

    __slots__ = ("_steps", "_bytes", "_time", "_previous_time", "_highest", "_readings_since_high", "agreement_gaps")

    def __init__(self) -> None:
        self._steps: deque[float] = deque(maxlen=PACE_SAMPLES)
        self._bytes: deque[float] = deque(maxlen=PACE_SAMPLES)
        self._time = self._previous_time = 0.0
        self._highest = -math.inf  # the highest reading since the last clear ...
        self._readings_since_high = 0  # ... and how many readings ago it came
        self.agreement_gaps = 0  # gaps more before an action reaches the loop: 1 where ranks agree on it (actions/agreement.py)

    def clear(self) -> None:
        """Memory was rebuilt or the process replaced: the readings before describe another state."""
        self._steps.clear()
        self._bytes.clear()
        self._highest, self._readings_since_high = -math.inf, 0

    def add(self, step: float, timestamp: float, bytes_used: float) -> bool:
        """Keep a reading; whether `reaches` is worth asking now (a full window with a new high in
        its newest quarter): False for most readings of a replay, at the cost of one comparison."""
        self._steps.append(step)
        self._bytes.append(bytes_used)
        self._previous_time, self._time = self._time, timestamp
        if bytes_used > self._highest:
            self._highest, self._readings_since_high = bytes_used, 0
        else:
            self._readings_since_high += 1
            if self._readings_since_high >= QUARTER:
                return False
        return len(self._bytes) == PACE_SAMPLES

    @property
    def readings(self) -> int:
        return len(self._bytes)

    @property
    def seconds_per_step(self) -> float:
        """Over the newest gap (0 when unknown)."""
        steps = self._steps
        newest = steps[-1] - steps[-2] if len(steps) > 1 else 0.0
        return (self._time - self._previous_time) / newest if newest > 0 else 0.0

    @property
    def gap(self) -> float:
        """Steps between two readings as they come: the median of the kept readings' gaps (0 before two).
        Not the newest alone: a sidecar held up once (on a loaded machine)
        reads again at its usual pace, and a look-ahead of twice that one stall made a climb that
        stops (an optimizer's state for a group unfrozen, and the allocator's heap growing with it,
        +300 MiB in 30 steps) reach the limit on paper: a 16-step stall after it acted, at 785 MiB of
        1.04 GiB (a CI run's trace replayed with the stall; tests/test_judge.py's climb that stops)."""
        steps = self._steps
        if len(steps) < 2:
            return 0.0
        gaps = sorted(b - a for a, b in zip(steps, itertools.islice(steps, 1, None)))
        return gaps[len(gaps) // 2]

    def rate(self) -> float:
        """The slower of the floor's and the peak's climb per step, when both rise through every quarter; else 0."""
        steps, used = self._steps, self._bytes
        if len(used) < PACE_SAMPLES:
            return 0.0
        readings = list(used)
        quarters = [readings[i:i + QUARTER] for i in range(0, PACE_SAMPLES, QUARTER)]
        floors, peaks = [min(q) for q in quarters], [max(q) for q in quarters]
        if any(b <= a for a, b in zip(floors, floors[1:])) or any(b <= a for a, b in zip(peaks, peaks[1:])):
            return 0.0
        climb, span = min(floors[-1] - floors[0], peaks[-1] - peaks[0]), (steps[-1] - steps[0]) * FIRST_TO_LAST
        if climb < STANDS_OUT * max(peak - floor for floor, peak in zip(floors, peaks)) or span <= 0:
            return 0.0  # a climb not well above the readings' spread within a quarter is noise's
        return climb / span

    def spread(self) -> float:
        """What the newest readings span about the line through them (0 before the window is full):
        a sawtooth's height, whatever the detector's buckets saw of it (with a reading a bucket, none:
        a bucket's peak is its floor), and nearly nothing of a ramp, however steep."""
        steps, used = self._steps, self._bytes
        n = len(used)
        if n < PACE_SAMPLES:
            return 0.0
        mean_x, mean_y = sum(steps) / n, sum(used) / n
        dx = [x - mean_x for x in steps]
        var = sum(d * d for d in dx)
        slope = sum(d * (y - mean_y) for d, y in zip(dx, used)) / var if var > 0 else 0.0
        residuals = [y - mean_y - slope * d for d, y in zip(dx, used)]
        return max(residuals) - min(residuals)

    @property
    def reach(self) -> float:
        """Steps to look ahead: to the next reading, a gap more for what the pace underestimates (the
        slower of two climbs, the highest of twelve readings below a sawtooth's very top), and the
        steps an action decided then would take to reach the loop: an action that waits for that
        reading comes after them. Over 81 runs of tests/test_judge.py's refilling leak
        (`sample_every` 1, 10 and 50; 20, 40 and 150 samples to fill; a sawtooth of 0 to 2 samples'
        rise; 3 seeds), one gap and a half let 12 peak at the limit, two gaps 5 (all a 20-sample
        fill under a sawtooth twice a sample's rise), with no false action on the bench's corpora
        nor on 300 flat jobs of tests/test_detector.py. Where ranks agree on actions, an action
        offered at a sampling step is carried out at the next: one gap more (`agreement_gaps`)."""
        return (REACH_GAPS + self.agreement_gaps) * self.gap + HANDOVER_STEPS

    def rise(self) -> float:
        """How fast the readings kept rose from the first to the newest, per step (0 when they did not,
        or fewer than two): what was seen, for the words of a verdict, never a reason to act."""
        steps, used = self._steps, self._bytes
        if len(used) < 2 or steps[-1] <= steps[0]:
            return 0.0
        return max(0.0, (used[-1] - used[0]) / (steps[-1] - steps[0]))

    def reaches(self, line: float, growing_for: float = math.inf) -> bool:
        """Whether, with a new high among the newest quarter's readings, memory could be at or past
        `line` at the pace seen before an action decided at the next reading reaches the loop.
        `growing_for`: steps the climb can last at most (a bounded phase that ends sooner: what it
        allocates stops growing there), when fewer than the reach."""
        used, steps = self._bytes, self._steps
        if self._readings_since_high >= QUARTER or len(used) < PACE_SAMPLES:  # no new high lately
            return False
        reach = min(self.reach, max(growing_for, 0.0))
        highest, span = max(used), (steps[-1] - steps[0]) * FIRST_TO_LAST
        # The pace is at most the readings' whole spread over that span, and the level at most the
        # highest plus that pace over the window: memory that could not reach the line even so needs
        # no quarters (most new highs of a wandering machine's trace).
        bound = (highest - min(used)) / span if span > 0 else 0.0
        if highest + bound * (steps[-1] - steps[0] + reach) < line:
            return False
        rate = self.rate()
        return rate > 0 and self.level(rate) + rate * reach >= line

    def level(self, rate: float) -> float:
        """The highest reading carried forward to the newest step at `rate`: where the peak is now.
        A sawtooth's readings are high or low at random, so the newest is rarely its peak."""
        steps, used = self._steps, self._bytes
        now = steps[-1]
        return max(b + rate * (now - s) for s, b in zip(steps, used))
