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
   not stop short of the limit: a cache that fills and stops). A suffix window that begins after
   a level shift is its new baseline. The alarm (`leaking`) also needs the projected OOM within
   `max_extrapolation` times the span the growth was seen over (a line is not extrapolated far
   beyond its evidence), and the candidate must hold for `confirm_closes` closes and
   `confirm_fraction` of its span without its slope falling by `max_slope_drop` (or for half the
   steps left to the projected OOM, when that is shorter: confirming past the OOM helps nobody).
5. Projection. OOM happens at the peak, so the fitted floor plus the largest excursion seen
   (the runtime's high-water mark included, plus `excursion_margin`: samples rarely catch the very
   top of a transient) is projected against the limit minus `headroom_bytes`, with the central
   slope and, for actions, the pessimistic (high) edge of the interval.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from watchdog.errors import ConfigError
from watchdog.sample import Sample
from watchdog.units import format_bytes
from watchdog.verdict import Status, Verdict

INF = math.inf
SEGMENTS = 4  # a window is split in quarters to tell spread-out growth from a one-off shift
IQR_TO_SIGMA = 1.349
SQRT2 = math.sqrt(2.0)
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
    """Alarm only when the projected OOM is within this many times the span the growth was seen over."""
    excursion_margin: float = 0.1
    """Samples rarely catch a transient at its very top: the excursion is taken this much larger."""
    confirm_closes: int = 3
    """Consecutive bucket closes a leak candidate must survive before the alarm goes up ..."""
    confirm_fraction: float = 0.25
    """... and for at least this share of its window's span in steps, ..."""
    max_slope_drop: float = 0.25
    """... without its slope falling by more than this share of the highest seen meanwhile."""
    interval_z: float = 1.96
    """Width of the slope interval in standard normal units (1.96: a 95% interval)."""

    def __post_init__(self) -> None:
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
        for name in ("consistency", "decay_ratio", "max_slope_drop"):
            _check(0 <= getattr(self, name) <= 1, name, "must be between 0 and 1")
        _check(self.confirm_closes >= 1, "confirm_closes", "must be at least 1")


def _check(ok: bool, name: str, problem: str) -> None:
    if not ok:
        raise ConfigError(f"detector.{name}", problem)


# ------------------------------------------------------------------------------ pure statistics

def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


class Trend(NamedTuple):
    """A robust line through bucket floors, and how leak-like the window looks."""

    slope: float  # bytes per step
    low: float
    high: float
    level: float  # fitted floor at the window's newest bucket (NaN until `with_level` when low <= 0)
    x_last: float  # step of the newest bucket
    span: float  # steps between the oldest and newest bucket
    sigma: float  # robust scale of the residuals
    increments: tuple[float, ...]  # rise of each quarter's median floor over the previous one;
    # () when the slope's low edge is not above zero: no rise to split, and most fits end there


def fit_trend(xs: list[float], ys: list[float], z: float = 1.96) -> Trend:
    """Median of slopes between points half a window apart, with the median's confidence interval.

    Each point is used in one pair only, so the slopes are close to independent and their
    median's order-statistic interval is honest; O(n log n) instead of Theil-Sen's O(n^2). The
    residual scale comes from the spread of the same slopes (each pair difference carries the
    noise of two points), so no second pass over the window is needed.
    """
    n = len(xs)
    half = n // 2
    m = n - half
    slopes = sorted([(y1 - y0) / (x1 - x0) for x0, x1, y0, y1 in zip(xs, xs[half:], ys, ys[half:])])
    slope = slopes[m // 2] if m % 2 else 0.5 * (slopes[m // 2 - 1] + slopes[m // 2])
    k = max(0, int(m / 2 - z * math.sqrt(m) / 2))
    x_last = xs[-1]
    low = slopes[k]
    # Most windows of a healthy run end at `low <= 0`: the level (half a fit's cost) waits until asked.
    level = _level(xs, ys, slope) if low > 0 else math.nan
    pair_distance = (x_last - xs[0]) * half / (n - 1)
    sigma = (slopes[(3 * m) // 4] - slopes[m // 4]) / IQR_TO_SIGMA * pair_distance / SQRT2
    increments: tuple[float, ...] = ()
    if low > 0:
        quarter = n // SEGMENTS
        levels = [_median(ys[j * quarter:(j + 1) * quarter]) for j in range(SEGMENTS)]
        increments = (levels[1] - levels[0], levels[2] - levels[1], levels[3] - levels[2])
    return Trend(slope, low, slopes[m - 1 - k], level, x_last, x_last - xs[0], sigma, increments)


def _level(xs: list[float], ys: list[float], slope: float) -> float:
    """The line's value at the newest point: median intercept of the points under the given slope."""
    return _median([y - slope * x for x, y in zip(xs, ys)]) + slope * xs[-1]


def with_level(trend: Trend, xs: list[float], ys: list[float]) -> Trend:
    """The trend with its level filled in (fit_trend leaves it NaN when the slope's low edge is <= 0)."""
    return trend if trend.level == trend.level else trend._replace(level=_level(xs, ys, trend.slope))


def largest_excursion(floors: list[float], peaks: list[float]) -> float:
    """The highest transient above the floor: each bucket's peak over the floors on both sides of it.

    A transient (activations, an eval buffer, a checkpoint spike) rises from the floor and falls
    back to it, so its height is the same against the neighbouring buckets' floors. A bucket in
    which the floor itself dropped (a freed cache, a workload leaving) or jumped has a peak-to-min
    span that is no transient: against the higher floor next to it, it shrinks to what it is.
    """
    return max((excursion_at(floors, peaks, i) for i in range(len(floors))), default=0.0)


def excursion_at(floors: list[float], peaks: list[float], i: int) -> float:
    """Bucket i's peak over the higher of its own floor and its neighbours'."""
    return peaks[i] - max(floors[max(0, i - 1):i + 2])


def plateau_rise(trend: Trend) -> float:
    """Growth still to come if the newest quarters keep slowing geometrically (inf when not slowing).

    A cache that fills and stops approaches its size exponentially: each quarter adds a fixed
    fraction q of the one before, so the rest adds up to d * q / (1 - q). Only the two newest
    quarters are used, because the oldest may still hold the flat time before the growth began.
    """
    older, newest = trend.increments[-2], trend.increments[-1]
    if newest <= 0:
        return 0.0
    if older <= newest:
        return INF
    q = newest / older
    return newest * q / (1 - q)


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


# ----------------------------------------------------------------------------------- the detector

class _Analysis(NamedTuple):
    """What the last bucket close concluded; samples until the next close reuse it."""

    status: Status
    trend: Trend | None
    floor: float
    excursion: float
    seconds_per_step: float
    reason: str


class LeakDetector:
    """Feed samples in step order with `update`; `reset` after a reinit brought memory down."""

    def __init__(self, config: DetectorConfig | None = None, memory_limit_bytes: int | None = None):
        self.config = config or DetectorConfig()
        self.memory_limit_bytes = memory_limit_bytes
        self._warmup_samples = self.config.warmup_samples  # read once per sample: kept at hand
        self._recent_width = self.config.recent_bucket_steps
        self.reset()

    def reset(self) -> None:
        """Forget history: a new baseline (the old trend described the old process state)."""
        self._seen = 0
        self._last_step: float = -INF
        self._width = self.config.bucket_steps
        self._xs: list[float] = []  # bucket centre (step)
        self._ts: list[float] = []  # bucket centre (timestamp)
        self._floors: list[float] = []
        self._peaks: list[float] = []
        self._recent: deque[tuple[float, float, float]] = deque(maxlen=self.config.recent_buckets)  # (x, floor, peak)
        self._history_trends: list[tuple] | None = None  # (fit, xs, floors) of the history since it last changed
        self._settled_excursion = -INF  # largest excursion of the buckets before the newest
        self._pending: list[float] | None = None  # [first, last, t0, t1, floor, peak]: closed buckets not yet a whole-run bucket
        self._end: float = -INF  # the open bucket takes samples until this step (-INF: none open yet)
        self._b_high_water: int | None = None
        self._next_analysis = 0  # no analysis before this step
        self._streak = 0
        self._misses = 0  # closes in a row without a leak-shaped window
        self._streak_from = 0.0
        self._streak_slope = 0.0
        self._analysis: _Analysis | None = None
        self._projection: tuple | None = None  # what verdicts share until the next close or limit change
        self._limit_seen: int | None = self.memory_limit_bytes
        self._device_limit: int | None = -1  # the last sample's bytes_limit (-1: none seen yet)

    # -- per sample: a couple of comparisons --------------------------------------------------

    def update(self, sample: Sample) -> Verdict:
        step = sample.step
        if step < self._last_step:
            self.reset()  # steps went back: a restarted process appending to the same trace
        self._last_step = step
        if sample.bytes_limit != self._device_limit:
            self._device_limit_changed(sample.bytes_limit)
        self._seen += 1
        if self._seen <= self._warmup_samples:
            return self._verdict(sample)
        used = sample.bytes_used
        if step < self._end:
            self._b_last = step
            self._b_t1 = sample.timestamp
            if used < self._b_min:
                self._b_min = used
            elif used > self._b_max:
                self._b_max = used
        else:  # this sample starts a new bucket
            if self._end > -INF:
                self._close_bucket()
            self._end = step + min(self._width, self._recent_width)
            self._b_first = self._b_last = step
            self._b_t0 = self._b_t1 = sample.timestamp
            self._b_min = self._b_max = used
        self._b_high_water = sample.peak_bytes_used
        return self._verdict(sample)

    def _device_limit_changed(self, device_limit: int | None) -> None:
        """The limit projections aim at: the smaller of the configured budget and the device's own."""
        self._device_limit = device_limit
        limit = device_limit or None
        budget = self.memory_limit_bytes
        if budget and (limit is None or budget < limit):
            limit = budget
        self._limit_seen = limit
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
            pending = self._pending = [self._b_first, self._b_last, self._b_t0, self._b_t1, floor, peak]
        else:
            pending[1], pending[3] = self._b_last, self._b_t1
            pending[4], pending[5] = min(pending[4], floor), max(pending[5], peak)
        if self._end >= pending[0] + self._width:  # the pending bucket spans the history's width
            self._pending = None
            self._xs.append(0.5 * (pending[0] + pending[1]))
            self._ts.append(0.5 * (pending[2] + pending[3]))
            self._floors.append(pending[4])
            self._peaks.append(pending[5])
            if len(self._xs) >= self.config.max_buckets:
                self._merge_pairs()
                self._settled_excursion = largest_excursion(self._floors[:-1], self._peaks[:-1])
            elif len(self._xs) >= 2:  # the bucket before the new one has both neighbours now
                self._settled_excursion = max(self._settled_excursion,
                                              excursion_at(self._floors, self._peaks, len(self._xs) - 2))
            self._history_trends = None
        elif not self._recent_active():
            return  # nothing new to look at
        if self._end < self._next_analysis:
            return  # the verdict was refreshed recently enough for the span it is drawn from
        history_span = self._xs[-1] - self._xs[0] if self._xs else 0.0
        self._next_analysis = self._end + min(self._recent_width, history_span / REFRESHES_PER_SPAN)
        self._analysis = self._analyse()
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
        newest_excursion = excursion_at(floors, self._peaks, n - 1)
        excursion = (1.0 + cfg.excursion_margin) * max(self._settled_excursion, newest_excursion)
        seconds_per_step = _seconds_per_step(xs, self._ts)
        if n < cfg.min_window_buckets:
            return _Analysis(Status.WARMING_UP, None, floors[-1], excursion, seconds_per_step,
                             f"warming up: {n} of {cfg.min_window_buckets} buckets")
        candidate: Trend | None = None
        reason = ""
        for trend, window_xs, window_floors in self._trends():
            room = self._room(trend, excursion) if trend.low > 0 else INF  # no rise: room is not looked at
            why_not = leak_shape(trend, cfg, room)
            if why_not is None:
                candidate = trend
                break
            reason = reason or why_not
        if candidate is not None:
            self._misses = 0
            why_not = self._too_far(candidate, excursion) or self._confirm(candidate, excursion)
            status = Status.SUSPECT if why_not else Status.LEAKING
            return _Analysis(status, candidate, candidate.level, excursion, seconds_per_step, why_not)
        # No leak: describe the newest window (after a level shift, that is the new baseline).
        self._misses += 1
        if self._misses >= cfg.confirm_closes:  # one noisy close does not undo a confirmation
            self._streak = 0
        newest = with_level(trend, window_xs, window_floors)
        rising = newest.low > 0 and newest.slope * newest.span >= cfg.rise_sigmas * newest.sigma
        return _Analysis(Status.SUSPECT if rising else Status.HEALTHY, newest, newest.level, excursion,
                         seconds_per_step, reason)

    def _trends(self):
        """(fit, xs, floors) of the whole history, its newest half, quarter, ..., then of the recent
        tier's windows.

        The history's fits change only when it gains a bucket, so they are kept between its closes;
        the recent tier, which closes more often, is fitted afresh.
        """
        cfg = self.config
        xs, floors, n = self._xs, self._floors, len(self._xs)
        if self._history_trends is None:
            windows = [(xs[n - size:], floors[n - size:]) for size in _window_sizes(n, cfg.min_window_buckets)]
            self._history_trends = [(fit_trend(wx, wy, cfg.interval_z), wx, wy) for wx, wy in windows]
        yield from self._history_trends
        r = len(self._recent)
        if not self._recent_active() or r < cfg.min_window_buckets:
            return
        shortest_span = self._history_trends[-1][0].span
        recent = list(self._recent)
        for size in _window_sizes(r, cfg.min_window_buckets):
            window = recent[r - size:]
            if window[-1][0] - window[0][0] < shortest_span:
                window_xs, window_floors = [b[0] for b in window], [b[1] for b in window]
                yield fit_trend(window_xs, window_floors, cfg.interval_z), window_xs, window_floors

    def _confirm(self, trend: Trend, excursion: float) -> str:
        """'' once a candidate has held long enough without slowing; else why it is not confirmed.

        Held means `confirm_closes` closes in a row AND `confirm_fraction` of the window's span in
        steps: a cache that fills and stops shows its slope falling while we wait, a leak does not.
        When the projected OOM is nearer than that, half the steps left to it are enough.
        """
        cfg = self.config
        if self._streak == 0:
            self._streak_from, self._streak_slope = trend.x_last, trend.slope
        self._streak += 1
        self._streak_slope = max(self._streak_slope, trend.slope)
        if trend.high < (1.0 - cfg.max_slope_drop) * self._streak_slope:
            self._streak = 0
            return "growth slowing while being confirmed"
        room = self._room(trend, excursion)
        hold = min(cfg.confirm_fraction * trend.span, URGENT_SHARE * max(room, 0.0) / trend.slope)
        if self._streak < cfg.confirm_closes or trend.x_last - self._streak_from < hold:
            return "not yet confirmed"
        return ""

    def _room(self, trend: Trend, excursion: float) -> float:
        """Bytes between the fitted peak now and limit - headroom (inf when no limit is known)."""
        limit = self._limit_seen
        if limit is None:
            return INF
        return limit - self.config.headroom_bytes - trend.level - excursion

    def _too_far(self, trend: Trend, excursion: float) -> str:
        """A reason not to alarm yet when the OOM lies far beyond the evidence; '' when it does not."""
        room = self._room(trend, excursion)
        if room == INF:
            return "no memory limit known"
        if room <= 0:
            return ""
        steps = room / trend.slope
        if steps > self.config.max_extrapolation * max(trend.span, 1.0):
            self._streak = 0  # confirmation starts once the OOM is near enough to call
            return f"OOM too far ahead to call ({steps:,.0f} steps; growth seen over {trend.span:,.0f})"
        return ""

    # -- the verdict ----------------------------------------------------------------------------

    def _verdict(self, sample: Sample) -> Verdict:
        projection = self._projection
        if projection is None:  # a bucket closed, or the limit changed, since the last verdict
            analysis = self._analysis
            if analysis is None or analysis.status is Status.WARMING_UP:
                return Verdict(step=sample.step, timestamp=sample.timestamp, status=Status.WARMING_UP,
                               floor_bytes=float(sample.bytes_used), limit_bytes=self._limit_seen,
                               explanation=analysis.reason if analysis else "warming up: no history yet")
            projection = self._projection = self._project(analysis, self._limit_seen)
        (status, slope, low, high, intercept, excursion, limit, seconds_per_step, slope_per_second,
         oom_x, oom_x_high, oom_step, explanation, span) = projection
        step = sample.step
        if oom_x < INF:
            if step < oom_x:
                steps_to_oom, projected = oom_x - step, oom_step
            else:
                steps_to_oom, projected = 0.0, step
            seconds_to_oom = steps_to_oom * seconds_per_step if seconds_per_step > 0 else INF
        else:
            steps_to_oom, projected, seconds_to_oom = INF, None, INF
        pessimistic = (oom_x_high - step if step < oom_x_high else 0.0) if oom_x_high < INF else INF
        # Positional, in Verdict's field order: this runs once per sample.
        return Verdict(step, sample.timestamp, status, intercept + slope * step, excursion, limit, slope, low, high,
                       slope_per_second, projected, steps_to_oom, seconds_to_oom, explanation, pessimistic, span)

    def _project(self, analysis: _Analysis, limit: int | None) -> tuple:
        """Everything a verdict needs that changes only at a bucket close (or when the limit does)."""
        trend = analysis.trend
        assert trend is not None
        oom_x = oom_x_high = INF
        if limit is not None and analysis.status is not Status.HEALTHY:
            room = limit - self.config.headroom_bytes - trend.level - analysis.excursion
            oom_x = _crossing(trend.x_last, room, trend.slope)
            oom_x_high = _crossing(trend.x_last, room, trend.high)
        sps = analysis.seconds_per_step
        return (analysis.status, trend.slope, trend.low, trend.high, trend.level - trend.slope * trend.x_last,
                analysis.excursion, limit, sps, trend.slope / sps if sps > 0 else 0.0, oom_x, oom_x_high,
                math.ceil(oom_x) if oom_x < INF else None, explain(analysis, limit, oom_x), trend.span)


def _window_sizes(n: int, smallest: int) -> list[int]:
    """All of the history, then the newest half, quarter, ... down to `smallest` buckets."""
    sizes = [n]
    while sizes[-1] > smallest:
        sizes.append(max(smallest, sizes[-1] // 2))
    return sizes


def _crossing(x: float, room: float, slope: float) -> float:
    if room <= 0:
        return x
    return x + room / slope if slope > 0 else INF


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
    limit_text = f"the {format_bytes(limit)} limit" if limit else "no known limit"
    if analysis.status is Status.HEALTHY:
        return (f"floor steady at {format_bytes(trend.level)} (slope {rate}: {analysis.reason}); "
                f"peak {format_bytes(trend.level + analysis.excursion)} of {limit_text}")
    if oom_x < INF:
        steps = max(0.0, oom_x - trend.x_last)
        when = f"at step {math.ceil(oom_x):,}, in {steps:,.0f} steps"
        if analysis.seconds_per_step > 0:
            when += f" ({_duration(steps * analysis.seconds_per_step)})"
        projection = f"peak reaches {limit_text} {when}"
    else:
        projection = f"peak {format_bytes(trend.level + analysis.excursion)} of {limit_text}"
    text = f"floor rising {rate}; {projection}"
    if analysis.status is Status.SUSPECT and analysis.reason:
        text += f" [suspect: {analysis.reason}]"
    return text


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
