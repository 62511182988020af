"""Online leak detector: one `Sample` in, one `Verdict` out. Pure: no threads, no I/O, no torch.

How it reads memory (and why):

1. Buckets of training steps. A reading lands at a random point inside a step, so any single
   reading is floor + some fraction of the step's activations. The minimum over a bucket of steps
   is the resident floor; the maximum minus the minimum is the transient excursion (activations,
   eval buffers, checkpoint spikes). Per sample the work is one comparison each way.
2. Bounded history that covers the whole run. Closed buckets go into a list of at most
   `max_buckets`; when it is full, neighbours merge pairwise (floor = min, peak = max) and the
   bucket width doubles. Memory is constant and the number of bucket closes grows only with the
   logarithm of the run length, so the heavier statistics run rarely: O(1) amortised per sample.
   Beside it, a recent tier keeps the newest buckets at a fixed width (`recent_bucket_steps`):
   60k steps into a run the whole-run buckets are ~500 steps wide, and a leak that starts there
   and runs out in 2,000 steps would be over before they resolve it.
3. Robust trend. At a bucket close, once a 32nd of the history's span (at most
   `recent_bucket_steps`) has passed since the last analysis (early, narrow buckets close more
   often than the verdict needs to change), the newest suffixes of the history (all of it, the
   newest half, quarter, ... down to `min_window_buckets`, then the recent tier's shorter ones)
   are fitted with a median of pairwise slopes (pairs half a window apart: a Theil-Sen estimator
   that is linear in the window). Spikes and outliers do not move a median; the interval is the
   distribution-free confidence interval of that median.
4. What counts as a leak. A window is a leak candidate when the low edge of the slope interval
   is above zero, the rise across the window stands out of the residual noise, the rise is spread
   over the window (every quarter contributes: a one-off level shift puts it all in one quarter),
   and it is not levelling off (the newest quarters, extrapolated as a geometric slowdown, would
   not stop short of the limit: a cache that fills and stops; nor would a staircase whose lumps
   come further and further apart, `staircase_rise`). A candidate is also held back (suspect,
   never projected) while the whole history since the baseline is a fill levelling off short of
   the limit, judged by likelihood (`saturation_rise`: a saturating curve explains its floors far
   better than a line, with no steady rise beside it; a cache filling towards its size, whose
   newest windows are near enough to straight that a line through them reaches the limit). Its
   upper edge follows a newest tail that rises clearly faster than the window (`faster_evidence`:
   acceleration, which a window's median of slopes is too slow for). A suffix window that begins after
   a level shift is its new baseline. The OOM projection (status `oom_projected`) also needs it within
   `max_extrapolation` times the span the growth was seen over (a line is not extrapolated far
   beyond its evidence), and the candidate must hold for `confirm_closes` closes and
   `confirm_fraction` of its span without its slope falling by `max_slope_drop` (or for half the
   steps left to the projected OOM, when that is shorter: confirming past the OOM helps nobody).
   The leak report (`leak_detected`, a warning) is the other signal: a candidate that holds long
   enough (`_leak_report`) however far its OOM. It raises only growth too far off for the projection's
   rule; growth near enough to project from is the projection's to call, and is reported with it. Once
   up, it stays up while a candidate holds, whichever window shows it.
5. The newest evidence wins. A window's median of slopes describes the window as a whole, so a
   candidate's newest buckets are compared with it (`trend.newest_evidence`): the rise of its
   newest 4, 6, 9, ... buckets (the recent tier's first) against what the window's slope says
   they should have risen, allowing one lump (the largest rise that stays, so growth in lumps
   such as an allocator's heap growth or buffers added in blocks is not misread either way) and
   the noise of neighbouring floors. When even their pessimistic rate is below the window's
   central one, their rate is the one projected: a concave fill is not extrapolated linearly to
   the limit. When their rate is no confident rise, the growth has stopped: healthy.
   Recovery bound: after a leak of slope s stops, the first analysis for which the newest k
   buckets of the finest tier (buckets at most `recent_bucket_steps` wide) all lie after the stop
   and s times their span exceeds the largest lump plus the noise allowance says healthy, and so
   does every later one while memory stays flat. For a leak whose growth over three buckets stands
   out of that allowance the 4-bucket tail does it: healthy within five buckets of the stop plus
   one sample, at most 5 * `recent_bucket_steps` + sample interval (320 steps and a sample with the
   defaults) however long the run, fewer early on while buckets are 8-32 steps wide; a slower
   leak needs a longer tail (6 or 9 buckets: within 7 or 10). tests/test_detector.py checks it.
6. Projection. OOM happens at the peak, so the fitted floor plus the largest excursion seen
   (the runtime's high-water mark included, plus `excursion_margin`: samples rarely catch the very
   top of a transient) is projected against the limit minus `headroom_bytes`, with the central
   slope and, for actions, the pessimistic (high) edge of the interval. The floor projected from
   is never above the floor measured in the newest buckets (a line through fast-then-slower growth
   overshoots it), and the central projection never says the limit is reached while the measured
   peak is below it: its margin takes at most half the room the measured peak leaves, and a
   projected step that comes before the next analysis counts down again from the open bucket.
7. Phases. Samples from a bounded phase of the training loop (an evaluation: `update_transient`)
   only raise the open bucket's peak: what the phase holds until it ends is a transient above the
   training floor (`watchdog.core.phase`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from watchdog.core.errors import ConfigError
from watchdog.core.numbers import check_settings
from watchdog.core.sample import Sample
from watchdog.core.trend import (
    SEGMENTS,
    TAIL_BUCKETS,
    Series,
    Trend,
    crossing,
    excursion_at,
    faster_evidence,
    fit_trend,
    largest_excursion,
    newest_evidence,
    plateau_rise,
    saturation_rise,
    staircase_rise,
    window_sizes,
    with_level,
)
from watchdog.core.units import format_bytes, format_duration, format_limit
from watchdog.core.verdict import Status, Verdict

INF = math.inf
URGENT_SHARE = 0.5  # an imminent OOM is confirmed within this share of the steps left to it
REFRESHES_PER_SPAN = 32  # analyses are a 32nd of the history's span apart (at most a recent bucket)


@dataclass(frozen=True)
class DetectorConfig:
    headroom_bytes: int = 0
    """Keep this much below the limit: the projection aims at limit - headroom."""
    warmup_samples: int = 16
    """The first samples are ignored (compilation, weights and optimizer state being allocated)."""
    bucket_steps: int = 8
    """Initial bucket width in training steps; doubles each time the history fills."""
    max_buckets: int = 128
    """Bucket floors kept (even); memory and the cost of one analysis are bounded by it."""
    recent_bucket_steps: int = 64
    """Width of the recent buckets, which stay this fine however long the run: a leak that starts
    late in a long run and runs out fast is seen in them before the whole-run buckets resolve it.
    The verdict is refreshed at least once per this many steps."""
    recent_buckets: int = 64
    """Recent buckets kept (the newest `recent_buckets * recent_bucket_steps` steps)."""
    min_window_buckets: int = 16
    """Buckets needed before a verdict other than warming_up, and the smallest window fitted."""
    rise_sigmas: float = 6.0
    """The rise across a window must exceed this many residual standard deviations."""
    consistency: float = 0.15
    """Each quarter of a window must rise by at least this share of the mean quarter's rise."""
    decay_ratio: float = 0.4
    """The newest quarter must rise by at least this share of the fastest quarter (else: plateau)."""
    max_extrapolation: float = 2.0
    """Project an OOM only when it lies within this many times the span the growth was seen over."""
    excursion_margin: float = 0.1
    """Samples rarely catch a transient at its very top: the excursion is taken this much larger
    (in the central projection, by at most half the room the measured peak leaves)."""
    confirm_closes: int = 3
    """Consecutive bucket closes a leak candidate must survive before an OOM is projected ..."""
    confirm_fraction: float = 0.25
    """... and for at least this share of its window's span in steps, ..."""
    max_slope_drop: float = 0.25
    """... without its slope falling by more than this share of the highest seen meanwhile."""
    interval_z: float = 1.96
    """Width of the slope interval in standard normal units (1.96: a 95% interval)."""
    min_leak_share: float = 0.01
    """A leak is reported (whatever its OOM's distance) only once the floor has risen by this share of
    the limit (of the floor, when no limit is known) over the window that shows it ..."""
    leak_age_fraction: float = 1.0
    """... and its candidate has held for this share of the steps watched since the baseline (as well
    as `confirm_fraction` of its window): a cache or compile cache filling early in a run looks like
    a leak until it stops, and this is the time it is given to."""

    def __post_init__(self) -> None:
        check_settings(self, "detector")
        _check(self.headroom_bytes >= 0, "headroom_bytes", "must not be negative")
        _check(self.warmup_samples >= 0, "warmup_samples", "must not be negative")
        _check(self.bucket_steps >= 1, "bucket_steps", "must be at least 1")
        _check(self.recent_bucket_steps >= self.bucket_steps, "recent_bucket_steps", "must be at least bucket_steps")
        _check(self.recent_buckets >= self.min_window_buckets, "recent_buckets", "must be at least min_window_buckets")
        _check(self.min_window_buckets >= 2 * SEGMENTS, "min_window_buckets", f"must be at least {2 * SEGMENTS}")
        _check(self.max_buckets >= 2 * self.min_window_buckets and self.max_buckets % 2 == 0, "max_buckets",
               "must be even and at least twice min_window_buckets")
        for name in ("rise_sigmas", "max_extrapolation", "interval_z"):
            _check(getattr(self, name) > 0, name, "must be positive")
        _check(self.confirm_fraction >= 0, "confirm_fraction", "must not be negative")
        _check(self.excursion_margin >= 0, "excursion_margin", "must not be negative")
        for name in ("consistency", "decay_ratio", "max_slope_drop", "min_leak_share", "leak_age_fraction"):
            _check(0 <= getattr(self, name) <= 1, name, "must be between 0 and 1")
        _check(self.confirm_closes >= 1, "confirm_closes", "must be at least 1")


def _check(ok: bool, name: str, problem: str) -> None:
    if not ok:
        raise ConfigError(f"detector.{name}", problem)


def leak_shape(trend: Trend, config: DetectorConfig, room: float = INF) -> str | None:
    """None when the window looks like a leak, else the reason it does not (for the explanation).

    `room` is what is left between the fitted peak and the limit: growth that is slowing down and
    would stop before using it up is a cache filling, not a leak.
    """
    if trend.low <= 0:
        return "no confident rise"
    if trend.slope * trend.span < config.rise_sigmas * trend.sigma:
        return "rise within noise"
    incs = trend.increments
    mean_rise = sum(incs) / len(incs)
    if mean_rise <= 0 or min(incs) < config.consistency * mean_rise:
        return "a one-off step, not steady growth"
    if incs[-1] < config.decay_ratio * max(incs):
        return "growth slowing towards a plateau"
    if plateau_rise(trend) < room:
        return "growth slowing, levelling off below the limit"
    return None


def _slowed(newest: Trend, window: Trend, config: DetectorConfig) -> str | None:
    """Why a leak-shaped window whose newest buckets grow slower is no leak; None if it still is."""
    if newest.low <= 0:
        return (f"growth stopped: {format_bytes(window.slope)}/step over {window.span:,.0f} steps, "
                f"{format_bytes(max(newest.slope, 0.0))}/step in the newest buckets")
    if newest.slope * window.span < config.rise_sigmas * window.sigma:
        return f"growth slowed to {format_bytes(newest.slope)}/step, within noise"
    return None


# ----------------------------------------------------------------------------------- the detector

class _Analysis(NamedTuple):
    """What the last bucket close concluded; samples until the next close reuse it."""

    status: Status
    trend: Trend | None
    floor: float
    excursion: float
    seconds_per_step: float
    reason: str
    leak_detected: bool = False


class _Streak:
    """How long a leak candidate has held: closes in a row, since which step, its highest slope."""

    __slots__ = ("closes", "since", "top_slope")

    def __init__(self) -> None:
        self.closes, self.since, self.top_slope = 0, 0.0, 0.0

    def reset(self) -> None:
        self.closes = 0

    def held(self, trend: Trend, config: "DetectorConfig", hold_steps: float) -> str:
        """'' once `trend` has held `confirm_closes` closes and `hold_steps` steps without its slope
        falling by `max_slope_drop` of the highest seen meanwhile; else why not yet."""
        if self.closes == 0:
            self.since, self.top_slope = trend.x_last, trend.slope
        self.closes += 1
        self.top_slope = max(self.top_slope, trend.slope)
        if trend.high < (1.0 - config.max_slope_drop) * self.top_slope:
            self.closes = 0
            return "growth slowing while being confirmed"
        if self.closes < config.confirm_closes or trend.x_last - self.since < hold_steps:
            return "not yet confirmed"
        return ""


class _PendingBucket:
    """Closed recent buckets gathering into one whole-run bucket until it spans the history's width."""

    __slots__ = ("first_step", "last_step", "first_time", "last_time", "floor", "peak")

    def __init__(self, first_step: float, last_step: float, first_time: float, last_time: float,
                 floor: float, peak: float):
        self.first_step, self.last_step = first_step, last_step
        self.first_time, self.last_time = first_time, last_time
        self.floor, self.peak = floor, peak


class _Projection(NamedTuple):
    """What every verdict shares until the next analysis or limit change (unpacked once per sample)."""

    shared: Verdict  # the analysis's fields, by name; each sample's verdict is `shared.at(...)`
    slope: float
    high: float
    intercept: float  # the fitted floor line's value at step 0
    excursion: float
    seconds_per_step: float
    oom_x: float  # step at which the peak reaches the limit at the central slope (inf: never)
    oom_x_high: float  # ... at the high edge of the slope interval
    oom_step: int | None


class LeakDetector:
    """Feed samples in step order with `update`; `reset` after a reinit brought memory down.

    The limit projections aim at comes from outside (`set_limit`): the `Judge` owns the rule that
    picks it from the device's limit and the configured budget. The detector never reads
    `sample.bytes_limit`.
    """

    def __init__(self, config: DetectorConfig | None = None, limit_bytes: int | None = None):
        self.config = config or DetectorConfig()
        self._limit = limit_bytes
        self._warmup_samples = self.config.warmup_samples  # read once per sample: kept at hand
        self._recent_width = self.config.recent_bucket_steps
        self.reset()

    def reset(self) -> None:
        """Forget history: a new baseline (the old trend described the old process state)."""
        self._seen = 0
        self._previous_step: float = -INF
        self._width = self.config.bucket_steps
        self._xs: list[float] = []  # bucket centre (step)
        self._ts: list[float] = []  # bucket centre (timestamp)
        self._floors: list[float] = []
        self._peaks: list[float] = []
        self._recent: deque[tuple[float, float, float]] = deque(maxlen=self.config.recent_buckets)  # (x, floor, peak)
        self._history_trends: list[tuple] | None = None  # (fit, window) of the history since it last changed
        self._fill_rest: float | None = None  # the history's `saturation_rise` since it last changed
        self._settled_excursion = -INF  # largest excursion of the buckets before the newest
        self._pending: _PendingBucket | None = None  # closed buckets not yet a whole-run bucket
        self._end: float = -INF  # the open bucket takes samples until this step (-INF: none open yet)
        self._b_high_water: int | None = None
        self._next_analysis = 0  # no analysis before this step
        self._streak = _Streak()  # the action path's confirmation: starts once the OOM is near enough
        self._leak_streak = _Streak()  # the leak report's: whatever the OOM's distance
        self._misses = 0  # closes in a row without a leak-shaped window
        self._leak_seen = (-INF, 0.0)  # (step, span) of the newest leak-shaped window
        self._analysis: _Analysis | None = None
        self.status = Status.WARMING_UP  # the status of every verdict until the next analysis
        self.leak_detected = False  # the leak report of every verdict until the next analysis
        self.rising_bytes_per_step = 0.0  # the projection's pessimistic rate while an OOM is projected, else 0 (the limit rule's)
        self.floor_noise = 0.0  # the robust scale of the floors about the newest analysis's line (0: none yet)
        self._projection: _Projection | None = None  # what verdicts share until the next close or limit change

    # -- per sample: a couple of comparisons --------------------------------------------------

    def update(self, sample: Sample) -> Verdict:
        self.absorb(sample)
        return self.verdict(sample)

    def absorb(self, sample: Sample) -> None:
        """`update` without building the verdict: a replay asks for one only while `status` says an
        OOM is projected (the verdict is a pure function of the state this leaves and the sample)."""
        step = sample.step
        if step < self._previous_step:
            self.reset()  # steps went back: a restarted process appending to the same trace
        self._previous_step = step
        self._seen += 1
        if self._seen <= self._warmup_samples:
            return
        used = sample.bytes_used
        if step < self._end:
            self._b_last = step
            self._b_t1 = sample.timestamp
            if used < self._b_min:
                self._b_min = used
            elif used > self._b_max:
                self._b_max = used
            self._raise_high_water(sample.peak_bytes_used)
        else:  # this sample starts a new bucket
            if self._end > -INF:
                self._close_bucket()
            self._end = step + min(self._width, self._recent_width)
            self._b_first = self._b_last = step
            self._b_t0 = self._b_t1 = sample.timestamp
            self._b_min = self._b_max = used
            self._b_high_water = sample.peak_bytes_used

    def _raise_high_water(self, peak: int | None) -> None:
        """A sample's peak since the previous reading raises the open bucket's: every one of the
        bucket's gaps counts, not only its last (a lifetime mark, as old traces carry, only rises)."""
        if peak is not None and (self._b_high_water is None or peak > self._b_high_water):
            self._b_high_water = peak

    def update_transient(self, sample: Sample) -> Verdict:
        """A sample from a bounded phase (an evaluation): a transient, not a floor reading.

        It can only raise the open bucket's peak, never its floor, and never opens a bucket of
        its own: what the phase holds on the device while it runs is an excursion above the
        training floor (it counts in every projection, since the next run of the phase reaches it
        again), and its growth is judged by the phase's own end (`watchdog.core.phase`), never
        extrapolated as floor growth. A phase that kept memory after it ended shows up in the
        training floor after it, where a leak belongs.
        """
        step = sample.step
        if step < self._previous_step:
            self.reset()
        self._previous_step = step
        self._seen += 1
        if self._seen > self._warmup_samples and self._end > -INF:
            if sample.bytes_used > self._b_max:
                self._b_max = sample.bytes_used
            self._raise_high_water(sample.peak_bytes_used)
        return self.verdict(sample)

    @property
    def limit_bytes(self) -> int | None:
        return self._limit

    @property
    def seconds_per_step(self) -> float:
        """The pace over the whole history, as of the newest analysis (0 before one): steady where
        one gap between readings is not (a reading the sidecar took late, the next one early)."""
        analysis = self._analysis
        return analysis.seconds_per_step if analysis is not None else 0.0

    def set_limit(self, limit_bytes: int | None) -> None:
        """The limit projections aim at (the judge owns the rule that picks it); None: unknown."""
        self._limit = limit_bytes
        self._projection = None

    # -- per closed bucket: the statistics ----------------------------------------------------

    def _close_bucket(self) -> None:
        """A bucket (at most `recent_bucket_steps` wide) closed: it joins the recent tier, and the
        pending whole-run bucket, which joins the history once it spans the history's width."""
        # The runtime's high-water mark sees every step's peak, not just the sampled moments; it
        # can only under-state the transient above today's floor while the floor rises.
        high_water = self._b_high_water
        peak = float(self._b_max if high_water is None else max(self._b_max, high_water))
        floor = float(self._b_min)
        self._recent.append((0.5 * (self._b_first + self._b_last), floor, peak))
        pending = self._pending
        if pending is None:
            pending = self._pending = _PendingBucket(self._b_first, self._b_last, self._b_t0, self._b_t1, floor, peak)
        else:
            pending.last_step, pending.last_time = self._b_last, self._b_t1
            pending.floor, pending.peak = min(pending.floor, floor), max(pending.peak, peak)
        if self._end >= pending.first_step + self._width:  # the pending bucket spans the history's width
            self._pending = None
            self._xs.append(0.5 * (pending.first_step + pending.last_step))
            self._ts.append(0.5 * (pending.first_time + pending.last_time))
            self._floors.append(pending.floor)
            self._peaks.append(pending.peak)
            if len(self._xs) >= self.config.max_buckets:
                self._merge_pairs()
                self._settled_excursion = largest_excursion(self._floors[:-1], self._peaks[:-1])
            elif len(self._xs) >= 2:  # the bucket before the new one has both neighbours now
                self._settled_excursion = max(self._settled_excursion,
                                              excursion_at(self._floors, self._peaks, len(self._xs) - 2))
            self._history_trends = self._fill_rest = None
        elif not self._recent_active():
            return  # nothing new to look at
        if self._end < self._next_analysis:
            return  # the verdict was refreshed recently enough for the span it is drawn from
        history_span = self._xs[-1] - self._xs[0] if self._xs else 0.0
        self._next_analysis = self._end + min(self._recent_width, history_span / REFRESHES_PER_SPAN)
        analysis = self._analysis = self._analyse()
        self.status = analysis.status
        self.leak_detected = analysis.leak_detected
        # Only a rise the projection believes: a suspect one may be a compile cache or a ramp that stops.
        self.rising_bytes_per_step = analysis.trend.high if analysis.status is Status.OOM_PROJECTED else 0.0
        self.floor_noise = analysis.trend.sigma if analysis.trend is not None else 0.0
        self._projection = None

    def _recent_active(self) -> bool:
        """The recent tier is finer than the whole-run history (else it would repeat its windows)."""
        return self._width > self.config.recent_bucket_steps

    def _merge_pairs(self) -> None:
        """Halve the history: neighbours merge (floor = min, peak = max); buckets get twice as wide."""
        xs, ts, fl, pk = self._xs, self._ts, self._floors, self._peaks
        self._xs = [0.5 * (xs[i] + xs[i + 1]) for i in range(0, len(xs), 2)]
        self._ts = [0.5 * (ts[i] + ts[i + 1]) for i in range(0, len(ts), 2)]
        self._floors = [min(fl[i], fl[i + 1]) for i in range(0, len(fl), 2)]
        self._peaks = [max(pk[i], pk[i + 1]) for i in range(0, len(pk), 2)]
        self._width *= 2

    def _analyse(self) -> _Analysis:
        cfg = self.config
        xs, floors, n = self._xs, self._floors, len(self._xs)
        # The newest bucket has no neighbour after it: the newest recent bucket's floor stands in,
        # or a floor that rose inside the bucket would count as a transient (a leak's own growth).
        newest_excursion = self._peaks[-1] - max(floors[-2:] + [self._recent[-1][1]])
        excursion = max(self._settled_excursion, newest_excursion)  # as measured; `_room` adds the margin
        seconds_per_step = _seconds_per_step(xs, self._ts)
        if n < cfg.min_window_buckets:
            return _Analysis(Status.WARMING_UP, None, floors[-1], excursion, seconds_per_step,
                             f"warming up: {n} of {cfg.min_window_buckets} buckets")
        candidate: Trend | None = None
        stopped: Trend | None = None  # the newest evidence of a window whose growth stopped
        reason = ""
        fine = None  # the newest evidence comes from the finest buckets: the recent tier once it is finer
        if self._recent_active() and len(self._recent) >= 2 * TAIL_BUCKETS:
            fine = Series(buckets=self._recent)  # drawn only if a window needs it
        for trend, window in self._trends():
            room = self._room(trend.level, excursion) if trend.low > 0 else INF  # no rise: room is not looked at
            why_not = leak_shape(trend, cfg, room)
            if why_not is None:
                newest = newest_evidence(trend, window, cfg.interval_z, fine)
                why_not = _slowed(newest, trend, cfg) if newest is not trend else None
                if why_not is None and staircase_rise(trend, window) < room:
                    why_not = "growth in lumps further and further apart, levelling off below the limit"
                if why_not is None:
                    # The fitted line may run above the floor measured now: the projection starts from
                    # what was measured (a line through fast-then-slower growth overshoots it).
                    candidate = newest._replace(level=min(newest.level, max(window.ys[-3:])))
                    if newest is trend:  # not slower: perhaps faster, and its upper edge then is the newest rate
                        candidate = faster_evidence(candidate, window, cfg.interval_z, fine)
                    break
                if newest.low <= 0 and stopped is None:
                    stopped = newest
            reason = reason or why_not
        if candidate is not None:
            self._misses = 0
            self._leak_seen = (candidate.x_last, candidate.span)
            reported = self._leak_report(candidate)
            too_far = self._too_far(candidate, excursion)
            why_not = too_far or self._levelling(candidate, excursion) or self._confirm(candidate, excursion)
            status = Status.SUSPECT if why_not else Status.OOM_PROJECTED
            # Growth near enough to project an OOM from is the projection's to call: its confirmation
            # is what tells a fill levelling off below the limit from a leak. The report raises only
            # growth too far from the limit for that, and stays up once raised while a candidate
            # holds, whatever window shows it now (a short one may not yet rise by `min_leak_share`).
            leak = (reported and bool(too_far)) or self.leak_detected
            return _Analysis(status, candidate, candidate.level, excursion, seconds_per_step, why_not,
                             leak or status is Status.OOM_PROJECTED)
        # No leak: describe the newest window (after a level shift, that is the new baseline), or,
        # when a leak-shaped window's newest buckets show its growth has stopped, those buckets.
        self._misses += 1
        if self._misses >= cfg.confirm_closes:  # one noisy close does not undo a confirmation
            self._streak.reset()
        if stopped is not None or xs[-1] - self._leak_seen[0] > cfg.confirm_fraction * self._leak_seen[1]:
            # A slow leak's candidate comes and goes with the windows' noise: its report waits for
            # the growth to stop, or to go unseen for as long as a confirmation takes.
            self._leak_streak.reset()
        # One noisy close does not take a leak report down either; growth that stopped does.
        still = self._leak_streak.closes > 0 and self.leak_detected
        if stopped is not None:
            return _Analysis(Status.HEALTHY, stopped, stopped.level, excursion, seconds_per_step, reason)
        newest = with_level(trend, window.xs, window.ys)
        rising = newest.low > 0 and newest.slope * newest.span >= cfg.rise_sigmas * newest.sigma
        if rising:  # a short window that still holds the end of a stopped climb: its newest buckets say
            evidence = newest_evidence(newest, window, cfg.interval_z, fine)
            if evidence.low <= 0:
                return _Analysis(Status.HEALTHY, evidence, evidence.level, excursion, seconds_per_step,
                                 _slowed(evidence, newest, cfg) or reason)
        return _Analysis(Status.SUSPECT if rising else Status.HEALTHY, newest, newest.level, excursion,
                         seconds_per_step, reason, still and rising)

    def _trends(self):
        """(fit, window as a `Series`) of the whole history, its newest half, quarter, ..., then of
        the recent tier's windows.

        The history's fits (and their windows' lumps and noise, once measured) change only when it
        gains a bucket, so they are kept between its closes; the recent tier, which closes more
        often, is fitted afresh.
        """
        cfg = self.config
        xs, floors, n = self._xs, self._floors, len(self._xs)
        if self._history_trends is None:
            windows = [(xs[n - size:], floors[n - size:]) for size in window_sizes(n, cfg.min_window_buckets)]
            self._history_trends = [(fit_trend(wx, wy, cfg.interval_z), Series(wx, wy)) for wx, wy in windows]
        yield from self._history_trends
        r = len(self._recent)
        if not self._recent_active() or r < cfg.min_window_buckets:
            return
        shortest_span = self._history_trends[-1][0].span
        recent = list(self._recent)
        for size in window_sizes(r, cfg.min_window_buckets):
            window = recent[r - size:]
            if window[-1][0] - window[0][0] < shortest_span:
                window_xs, window_floors = [b[0] for b in window], [b[1] for b in window]
                yield fit_trend(window_xs, window_floors, cfg.interval_z), Series(window_xs, window_floors)

    def _confirm(self, trend: Trend, excursion: float) -> str:
        """'' once a candidate has held long enough without slowing; else why it is not confirmed.

        Held means `confirm_closes` closes in a row AND `confirm_fraction` of the window's span in
        steps: a cache that fills and stops shows its slope falling while we wait, a leak does not.
        When the projected OOM is nearer than that, half the steps left to it are enough.
        """
        room = self._room(trend.level, excursion)
        hold = min(self.config.confirm_fraction * trend.span, URGENT_SHARE * max(room, 0.0) / trend.slope)
        return self._streak.held(trend, self.config, hold)

    def _levelling(self, candidate: Trend, excursion: float) -> str:
        """'' unless the whole history since the baseline is a fill levelling off and, at the highest
        plateau its floors allow, stops short of the limit (`trend.saturation_rise`, judged by the
        likelihood of a saturating curve against a line: issue 62): a cache filling towards its size
        seen over its whole ramp, which a shorter window's line would project to the limit (issue 54).
        Then the action waits, as for a bounded phase whose end is known; the limit rule still acts
        at the line and at the pace."""
        if self._fill_rest is None:
            self._fill_rest = saturation_rise(self._xs, self._floors)
        rest = self._fill_rest
        room = self._room(candidate.level, excursion)
        if rest >= room:
            return ""
        return (f"growth slowing throughout: a fill levelling off about {format_bytes(rest)} higher at most, "
                f"{format_bytes(room - rest)} below the limit")

    def _leak_report(self, trend: Trend) -> bool:
        """The other signal: a candidate that held as a projection's would, however far its OOM.

        A warning, never an action: the floor has risen steadily and confidently over the window, by
        at least `min_leak_share` of the limit (growth too small to matter in a run of any length is
        not worth a page), is still rising at the newest evidence, and has held for
        `leak_age_fraction` of the steps watched (growth that fills a cache and stops early in a run
        has stopped by then).
        """
        cfg = self.config
        material = trend.slope * trend.span >= cfg.min_leak_share * self._scale(trend.level)
        streak = self._leak_streak
        watched = (streak.since if streak.closes else trend.x_last) - self._xs[0]  # when it was first seen
        hold = max(cfg.confirm_fraction * trend.span, cfg.leak_age_fraction * watched)
        return not streak.held(trend, cfg, hold) and material

    def _scale(self, level: float) -> float:
        """What a leak's size is measured against: the limit, or the floor itself when none is known."""
        return float(self._limit) if self._limit else level

    def _room(self, level: float, excursion: float) -> float:
        """Bytes between the peak now and limit - headroom (inf when no limit is known).

        The peak is floor `level` + the measured `excursion` taken `excursion_margin` larger:
        samples rarely catch a transient at its very top. Every decision and the pessimistic
        projection (what actions use) aim at this peak; it may reach the limit while the peak
        measured is still below it.
        """
        limit = self._limit
        if limit is None:
            return INF
        return limit - self.config.headroom_bytes - level - (1.0 + self.config.excursion_margin) * excursion

    def _room_measured(self, level: float, excursion: float) -> float:
        """`_room` for the central projection, which never says the limit is reached while the peak
        measured is below it: the margin takes at most half of the room the measured peak leaves.
        (<= 0 exactly when the measured peak is at the limit.)"""
        limit = self._limit
        if limit is None:
            return INF
        measured = limit - self.config.headroom_bytes - level - excursion
        if measured <= 0:
            return measured
        return measured - min(self.config.excursion_margin * excursion, 0.5 * measured)

    def _too_far(self, trend: Trend, excursion: float) -> str:
        """A reason not to project the OOM yet when the OOM lies far beyond the evidence; '' when it does not."""
        room = self._room(trend.level, excursion)
        if room == INF:
            return "no memory limit known"
        if room <= 0:
            return ""
        steps = room / trend.slope
        if steps > self.config.max_extrapolation * max(trend.span, 1.0):
            self._streak.reset()  # confirmation starts once the OOM is near enough to call
            return f"OOM too far ahead to call ({steps:,.0f} steps; growth seen over {trend.span:,.0f})"
        return ""

    # -- the verdict ----------------------------------------------------------------------------

    def verdict(self, sample: Sample) -> Verdict:
        """The verdict on `sample`, the newest one absorbed."""
        projection = self._projection
        if projection is None:  # a bucket closed, or the limit changed, since the last verdict
            analysis = self._analysis
            if analysis is None or analysis.status is Status.WARMING_UP:
                return Verdict(step=sample.step, timestamp=sample.timestamp, status=Status.WARMING_UP,
                               floor_bytes=float(sample.bytes_used), limit_bytes=self._limit,
                               explanation=analysis.reason if analysis else "warming up: no history yet")
            projection = self._projection = self._project(analysis, self._limit)
        shared, slope, high, intercept, excursion, seconds_per_step, oom_x, oom_x_high, oom_step = projection
        step = sample.step
        if oom_x < INF:
            if step < oom_x:
                projected_oom_steps, projected = oom_x - step, oom_step
            else:
                projected_oom_steps = self._overdue(self._room_measured(self._b_min, excursion), slope)
                projected = math.ceil(step + projected_oom_steps)
            projected_oom_seconds = projected_oom_steps * seconds_per_step if seconds_per_step > 0 else INF
        else:
            projected_oom_steps, projected, projected_oom_seconds = INF, None, INF
        if oom_x_high < INF:
            pessimistic = oom_x_high - step if step < oom_x_high else self._overdue(self._room(self._b_min, excursion), high)
        else:
            pessimistic = INF
        return shared.at(step, sample.timestamp, floor_bytes=intercept + slope * step, projected_oom_step=projected,
                         projected_oom_steps=projected_oom_steps, projected_oom_seconds=projected_oom_seconds,
                         projected_oom_steps_pessimistic=pessimistic)

    @staticmethod
    def _overdue(room: float, slope: float) -> float:
        """Steps to the OOM once the step a projection named has come before the next analysis:
        the countdown starts again from the floor measured in the open bucket (`room` from it), so
        only a peak at the limit is "reached". Rare: analyses are at most a recent bucket apart, so
        only a projection shorter than that can run out between them."""
        if room <= 0:
            return 0.0
        return room / slope if slope > 0 else INF

    def _project(self, analysis: _Analysis, limit: int | None) -> _Projection:
        """Everything a verdict needs that changes only at a bucket close (or when the limit does)."""
        trend = analysis.trend
        assert trend is not None
        oom_x = oom_x_high = INF
        if limit is not None and analysis.status is not Status.HEALTHY:
            oom_x = crossing(trend.x_last, self._room_measured(trend.level, analysis.excursion), trend.slope)
            oom_x_high = crossing(trend.x_last, self._room(trend.level, analysis.excursion), trend.high)
        sps = analysis.seconds_per_step
        shared = Verdict(step=0, timestamp=0.0, status=analysis.status, excursion_bytes=analysis.excursion,
                         limit_bytes=limit, slope_bytes_per_step=trend.slope, slope_low_bytes_per_step=trend.low,
                         slope_high_bytes_per_step=trend.high, slope_bytes_per_second=trend.slope / sps if sps > 0 else 0.0,
                         explanation=explain(analysis, limit, oom_x), window_steps=trend.span,
                         leak_detected=analysis.leak_detected)
        return _Projection(shared, trend.slope, trend.high, trend.level - trend.slope * trend.x_last, analysis.excursion,
                           sps, oom_x, oom_x_high, math.ceil(oom_x) if oom_x < INF else None)


def _seconds_per_step(xs: list[float], ts: list[float]) -> float:
    if len(xs) < 2 or xs[-1] <= xs[0]:
        return 0.0
    return max(0.0, (ts[-1] - ts[0]) / (xs[-1] - xs[0]))


def explain(analysis: _Analysis, limit: float | None, oom_x: float) -> str:
    """One line a person can act on, e.g. 'floor rising 2.0 MiB/step (1.8-2.2); peak reaches ...'."""
    trend = analysis.trend
    if trend is None:
        return analysis.reason
    rate = (f"{format_bytes(trend.slope)}/step ({format_bytes(trend.low)}-{format_bytes(trend.high)})")
    limit_text = f"the {format_limit(limit)} limit" if limit else "no known limit"
    if analysis.status is Status.HEALTHY:
        return (f"floor steady at {format_bytes(trend.level)} (slope {rate}: {analysis.reason}); "
                f"peak {format_bytes(trend.level + analysis.excursion)} of {limit_text}")
    if oom_x < INF:
        steps = max(0.0, oom_x - trend.x_last)
        when = f"at step {math.ceil(oom_x):,}, in {steps:,.0f} steps"
        if analysis.seconds_per_step > 0:
            when += f" ({format_duration(steps * analysis.seconds_per_step)})"
        projection = f"peak reaches {limit_text} {when}"
    else:
        projection = f"peak {format_bytes(trend.level + analysis.excursion)} of {limit_text}"
    text = f"floor rising {rate}; {projection}"
    if analysis.status is Status.SUSPECT and analysis.reason:
        text += f" [{'leak detected, no action' if analysis.leak_detected else 'suspect'}: {analysis.reason}]"
    return text

