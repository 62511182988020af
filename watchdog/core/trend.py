"""Robust statistics on bucket floors: the trend fit, its confidence interval, excursions.

Pure functions on plain lists of floats, no state: the detector (`watchdog.core.detector`)
decides what to fit and when; this module only says what a window of floors looks like.

Why these estimators:
- a median of pairwise slopes (pairs half a window apart, a Theil-Sen estimator linear in the
  window) is not moved by spikes and outliers, and the distribution-free confidence interval of
  that median needs no assumption about the noise;
- a transient's height is measured against the floors on both sides of it, so a bucket in which
  the floor itself moved is not mistaken for a transient;
- a window is split in quarters (`SEGMENTS`) to tell growth spread over it from a one-off shift,
  and the newest quarters tell a filling cache (geometric slowdown) from a leak; in memory that
  grows in lumps, the gaps between them do (`staircase_rise`);
- the newest buckets are compared with the whole window by their rise, allowing one lump: memory
  that grows in lumps (an allocator's heap growth, buffers added in blocks) can make two quarters
  look alike while the growth is slowing, and a median of slopes counts a single lump as a slope
  over the pairs that straddle it (`newest_evidence`).
"""

from __future__ import annotations

import math
from operator import mul, sub
from typing import NamedTuple

INF = math.inf
SEGMENTS = 4  # a window is split in quarters to tell spread-out growth from a one-off shift
IQR_TO_SIGMA = 1.349
MAD_TO_SIGMA = 1.4826
MEDIAN_EFFICIENCY = 1.2533  # the standard error of a median of normal values, over that of their mean
SQRT2 = math.sqrt(2.0)
SQRT3 = math.sqrt(3.0)


def median(values: list[float]) -> float:
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
    level = level_at(xs, ys, slope) if low > 0 else math.nan
    pair_distance = (x_last - xs[0]) * half / (n - 1)
    sigma = (slopes[(3 * m) // 4] - slopes[m // 4]) / IQR_TO_SIGMA * pair_distance / SQRT2
    increments: tuple[float, ...] = ()
    if low > 0:
        quarter = n // SEGMENTS
        levels = [median(ys[j * quarter:(j + 1) * quarter]) for j in range(SEGMENTS)]
        increments = (levels[1] - levels[0], levels[2] - levels[1], levels[3] - levels[2])
    return Trend(slope, low, slopes[m - 1 - k], level, x_last, x_last - xs[0], sigma, increments)


def level_at(xs: list[float], ys: list[float], slope: float) -> float:
    """The line's value at the newest point: median intercept of the points under the given slope."""
    return median([y - slope * x for x, y in zip(xs, ys)]) + slope * xs[-1]


def with_level(trend: Trend, xs: list[float], ys: list[float]) -> Trend:
    """The trend with its level filled in (fit_trend leaves it NaN when the slope's low edge is <= 0)."""
    return trend if trend.level == trend.level else trend._replace(level=level_at(xs, ys, trend.slope))


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


SATURATION_TAUS = 28  # time constants tried, geometrically from a 64th of the window's span to 8 spans
SATURATION_LR = 13.8  # a fill's curve must explain the floors this much better than a line (2 ln 1000) ...
INTERVAL_LR = 3.84  # ... and its plateau is read at the highest of the fits within this of the best (95%)
RESOLUTION = 1e-3  # residuals under this share of the floors' range are below what memory readings resolve
REFINE_STEPS = 12  # golden-section steps refining the best time constant between its grid neighbours


def saturation_rise(xs: list[float], ys: list[float]) -> float:
    """Growth still to come where the floors are a fill levelling off (inf where they are not): a
    cache filling towards its size, seen over its ramp.

    Judged by likelihood, not by counting segments that slow (each of which noise can undo): the
    floors are fitted by least squares with a saturating curve, `a - b e^(-(x - x_last)/tau)` (its
    plateau `a`, `b` still to come from the newest bucket), for each of `SATURATION_TAUS` time
    constants (the best refined between its neighbours), and with a line. The fill is believed where

    - the best curve explains the floors better than the line by a likelihood ratio of
      `SATURATION_LR` (2 ln LR, Gaussian residuals: n ln(RSS_line / RSS_curve)); a steady leak is the
      curve's own limit as tau grows, so it never does;
    - a line added to the curve (`a - b e^(...) + c x`, c rising) does not explain them better by as
      much: growth that slows at first and then goes on steadily (a warm-up, a cache that fills, then
      a leak) is the curve's fill plus a leak, and no plateau;
    - nor does a line of their own explain the newest half by as much better than the curve does
      there: a curve over a whole window can be bent by what happened at its start (a level shift
      before a steady leak, which no smooth curve follows) while its newest half is a line, and a
      fill slows throughout;

    and the growth still to come is then the largest `b` among the curves within `INTERVAL_LR` of
    the best (a profile-likelihood interval of 95%): a plateau only as low as the floors allow.
    Unlike `plateau_rise`, which reads the newest two quarters alone, it reads the whole window.
    O(n) per time constant; the detector asks it at most once per change of its history.
    """
    n = len(xs)
    if n < 8 or xs[-1] <= xs[0]:
        return INF
    mean = sum(ys) / n
    scale = max(abs(y - mean) for y in ys)
    if scale <= 0:
        return INF
    y = [(v - mean) / scale for v in ys]
    span, last = xs[-1] - xs[0], xs[-1]
    t = [(x - last) / span for x in xs]  # -1 .. 0
    line = _least_squares(y, [t])
    if line is None:
        return INF
    floor = RESOLUTION ** 2 * n  # residuals below this share of the rise are no evidence either way
    # No curve leaves less than about the floors' own noise: a line already that close to them (most
    # windows a detector asks about: a leak's) cannot be beaten by the ratio asked, and costs one pass.
    noise = 0.5 * (n - 3) * (neighbour_noise(y) ** 2 / 2.0)
    if n * math.log(max(line[0], floor) / max(noise, floor)) < SATURATION_LR:
        return INF
    half = n // 2
    older, newer = _least_squares(y[:half], [t[:half]]), _least_squares(y[half:], [t[half:]])
    if older is None or newer is None or newer[1][0] >= older[1][0]:
        return INF  # not slowing: no fill's curve, whatever the likelihood of one
    taus = [2.0 ** (-6 + 9 * k / (SATURATION_TAUS - 1)) for k in range(SATURATION_TAUS)]  # in spans
    curves = [fit for fit in (_curve(y, t, tau) for tau in taus) if fit is not None]  # (rss, b, tau)
    if not curves:
        return INF
    curves.append(_refined(min(curves)[2], taus, lambda tau: _curve(y, t, tau)))
    best = min(curves)
    rss = max(best[0], floor)
    if n * math.log(max(line[0], floor) / rss) < SATURATION_LR:
        return INF  # no better than a line
    with_line = [fit for fit in (_curve(y, t, tau, with_line=True) for tau in taus) if fit is not None]
    if with_line:
        with_line.append(_refined(min(with_line)[2], taus, lambda tau: _curve(y, t, tau, with_line=True)))
    steady = min((fit[0] for fit in with_line), default=INF)
    if steady < INF and n * math.log(rss / max(steady, floor)) >= SATURATION_LR:
        return INF  # a fill, and a steady rise beside it
    bent = sum(r * r for r in _curve(y, t, best[2], residuals=True)[half:])
    straight = newer
    floor_half = RESOLUTION ** 2 * (n - half)
    if straight is not None and (n - half) * math.log(max(bent, floor_half) / max(straight[0], floor_half)) \
            >= SATURATION_LR:
        return INF  # the newest half is a line: the curve was bent by the window's start
    rest = max(b for r, b, _ in curves if n * math.log(max(r, floor) / rss) <= INTERVAL_LR)
    return rest * scale


def _curve(y: list[float], t: list[float], tau: float, with_line: bool = False, residuals: bool = False):
    """(residual sum of squares, growth still to come at the newest point, tau) of the saturating
    curve with time constant `tau` (in spans; `t` runs from -1 to 0) through `y`, with a line beside
    it where `with_line` (then only where the line rises); None where the curve does not rise.
    `residuals`: the residuals themselves instead."""
    top = math.exp(1.0 / tau)
    v = [math.exp(-(u + 1.0) / tau) for u in t]  # 1 at the oldest point, 1/top at the newest
    if residuals:
        return _least_squares(y, [v, t] if with_line else [v], True)[1]
    fit = _fit(y, t, v, with_line)
    if fit is None or fit[1] >= 0 or (with_line and fit[2] <= 0):
        return None
    return fit[0], -fit[1] / top, tau


def _fit(y: list[float], t: list[float], v: list[float], with_line: bool):
    """(rss, coefficient of v[, of t]) of `y` on a constant, `v` and (`with_line`) `t`, from sums
    alone: the hot path of `saturation_rise`. None where they are collinear."""
    n = len(y)
    sv, svv, svy = sum(v), sum(map(mul, v, v)), sum(map(mul, v, y))
    sy, syy = sum(y), sum(map(mul, y, y))
    if not with_line:
        det = n * svv - sv * sv
        if det <= 1e-12 * max(1.0, n * svv):
            return None
        c = (n * svy - sv * sy) / det
        a = (sy - c * sv) / n
        return max(syy - a * sy - c * svy, 0.0), c
    st, stt, sty, svt = sum(t), sum(map(mul, t, t)), sum(map(mul, t, y)), sum(map(mul, v, t))
    solution = _solve([[n, sv, st], [sv, svv, svt], [st, svt, stt]], [sy, svy, sty])
    if solution is None:
        return None
    return max(syy - solution[0] * sy - solution[1] * svy - solution[2] * sty, 0.0), solution[1], solution[2]


def _refined(tau: float, taus: list[float], curve) -> tuple[float, float, float]:
    """The best fit near `tau`, a point of the grid `taus`: a golden-section search between its
    neighbours on the grid (the residuals of a fill are smooth in tau)."""
    ratio = taus[1] / taus[0]
    low, high = math.log(tau / ratio), math.log(tau * ratio)
    best = curve(tau)
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(REFINE_STEPS):
        a, b = high - golden * (high - low), low + golden * (high - low)
        fa, fb = curve(math.exp(a)), curve(math.exp(b))
        ra, rb = fa[0] if fa else INF, fb[0] if fb else INF
        for fit in (fa, fb):
            if fit is not None and (best is None or fit[0] < best[0]):
                best = fit
        if ra < rb:
            high = b
        else:
            low = a
    return best


def _least_squares(y: list[float], columns: list[list[float]], residuals: bool = False):
    """(residual sum of squares, coefficients) of `y` on a constant and `columns` (one or two), or
    None where they are collinear; `residuals`: (residual sum of squares, the residuals)."""
    n = len(y)
    cols = [[1.0] * n, *columns]
    k = len(cols)
    gram = [[float(n) if i == j == 0 else math.fsum(map(mul, cols[i], cols[j])) for j in range(k)] for i in range(k)]
    rhs = [math.fsum(map(mul, col, y)) for col in cols]
    solution = _solve(gram, rhs)
    if solution is None:
        return None
    if residuals:
        errors = [yi - sum(c * col[i] for c, col in zip(solution, cols)) for i, yi in enumerate(y)]
        return math.fsum(e * e for e in errors), errors
    # The residuals' sum of squares of a least-squares fit, without a pass over them.
    rss = math.fsum(map(mul, y, y)) - math.fsum(map(mul, solution, rhs))
    return max(rss, 0.0), solution[1:]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on a small system; None when it is singular."""
    k = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12 * max(1.0, max(abs(x) for x in m[col][:k])):
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, k):
            f = m[r][col] / m[col][col]
            for c in range(col, k + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * k
    for r in range(k - 1, -1, -1):
        x[r] = (m[r][k] - sum(m[r][c] * x[c] for c in range(r + 1, k))) / m[r][r]
    return x


LUMP_SIDE = 4  # floors on each side of a lump that measure its height


def staircase_rise(trend: Trend, window: Series) -> float:
    """Growth still to come if memory that grows in lumps adds them ever further apart (inf when it
    does not: no staircase, or one whose newest lumps do not come slower).

    A cache that fills in lumps (an allocator's heap growth, entries added in blocks) with fewer
    new entries each step adds a lump, then takes longer to fill it than the one before. Its
    quarters can each hold a lump and look alike, so `plateau_rise` sees no slowdown; the gaps
    between lumps show it. A gap's rate is the lump that opened it over its length. A fill's rate
    falls in proportion to what it has filled (an exponential approach to its size), so the rates
    of the two newest gaps, against the level each opened at, reach zero at the level where it
    stops (older gaps may hold the time before the fill began); one lump more is allowed for
    rounding up to a whole lump.

    Believed only when lumps carry at least half of the window's rise, the newest gap is slower
    than the one before it even with each lump placed a bucket off, and no gap in the window is
    faster than the one before it by that test (early lumps of a fill come too close together for
    it to tell them apart; a leak's lumps at irregular times are now and then slower, but then also
    faster). A leak's lumps at a steady rate (a staircase, an allocator doubling its heap) are
    never slower. A lump is a rise that stays (from the higher of two neighbouring floors to the
    lower of the next two) above six neighbour noises and three buckets of the window's own growth;
    its height is the median of the floors just after it less that of those just before.
    """
    xs, ys = window.xs, window.ys
    n = len(xs)
    width = (xs[-1] - xs[0]) / (n - 1)
    rises = lasting_rises(ys)
    steady = 3.0 * trend.slope * width
    if sum(rise > steady for rise in rises) < 3:
        return INF  # fewer than three lumps (two gaps to compare); most windows end here
    least = max(6.0 * window.noise, steady)
    edges = [0]  # the first bucket of each stretch between lumps
    for j, rise in enumerate(rises):
        if rise > least and j + 2 - edges[-1] > 1:
            edges.append(j + 2)  # a lump that straddles a bucket's edge shows twice: once is enough
    if len(edges) < 4:
        return INF
    # Heights from the floors next to each lump only: further off, the floor may have moved by
    # lumps too small to count (a heap doubling from a small start).
    ends = edges[1:] + [n]
    heights = [median(ys[e:min(end, e + LUMP_SIDE)]) - median(ys[max(start, e - LUMP_SIDE):e])
               for start, e, end in zip(edges, edges[1:], ends[1:])]
    if sum(heights) < 0.5 * trend.slope * trend.span:
        return INF  # the growth is mostly between the lumps
    levels, rates, slowest, fastest = [], [], [], []
    level = 0.0
    for k, height in enumerate(heights[:-1]):  # the gap after lump k (the next lump closes it)
        gap = xs[edges[k + 2]] - xs[edges[k + 1]]
        level += height
        levels.append(level)
        rates.append(height / gap)
        slowest.append(height / (gap + width))  # with each lump a bucket off
        fastest.append(height / (gap - width))
    if fastest[-1] >= slowest[-2] or any(now > before for before, now in zip(fastest, slowest[1:])):
        return INF
    decline = (rates[-2] - rates[-1]) / (levels[-1] - levels[-2])  # rate lost per byte filled
    if decline <= 0:
        return INF
    stops_at = levels[-1] + rates[-1] / decline
    return max(0.0, stops_at - (level + heights[-1])) + heights[-1]


FASTER_Z = 3.0  # a faster tail must stand out by this many times the interval's z: every analysis compares many tails
FASTER_SHARE = 1.1  # ... and be this much faster than the upper edge: a hair's breadth (rounding, on a noiseless line) moves no action
TAIL_BUCKETS = 4  # the shortest tail of newest buckets compared with its window; then 6, 9, 14, ...


class Series:
    """Bucket steps and floors, their largest lump and neighbour noise measured once, when first
    asked for (most analyses find no leak-shaped window and never ask). `buckets`, if given,
    stands for (step, floor, ...) tuples whose steps and floors are drawn when first needed."""

    __slots__ = ("_xs", "_ys", "_buckets", "_lump", "_noise", "steady_beyond")

    def __init__(self, xs: list[float] | None = None, ys: list[float] | None = None, buckets=None):
        self._xs, self._ys, self._buckets = xs, ys, buckets
        self._lump = self._noise = None
        self.steady_beyond: float | None = None  # no tail longer than this is slower, even against the bounds

    @property
    def xs(self) -> list[float]:
        if self._xs is None:
            self._xs = [b[0] for b in self._buckets]
        return self._xs

    @property
    def ys(self) -> list[float]:
        if self._ys is None:
            self._ys = [b[1] for b in self._buckets]
        return self._ys

    @property
    def lump(self) -> float:
        if self._lump is None:
            self._lump = largest_lump(self.ys)
        return self._lump

    @property
    def noise(self) -> float:
        if self._noise is None:
            self._noise = neighbour_noise(self.ys)
        return self._noise


def newest_evidence(trend: Trend, window: Series, z: float = 1.96, fine: Series | None = None) -> Trend:
    """The trend as the newest buckets tell it, when they show growth slower than the whole window.

    A window's median of slopes describes the window as a whole: growth that has slowed or stopped
    in its newest part still projects at the old rate, and a line through fast-then-slow growth
    even overshoots the floor measured now. So the newest tails (the last 4, 6, 9, 14, ... buckets
    and the newest half, never more than half the window's span) are compared with the window by
    their rise, from the median floor of the tail's first quarter to that of its last quarter:

    - growth in lumps makes any stretch look faster or slower than it is, but a lump counts once,
      at its full height, in a rise: a steady leak's regular lumps leave any stretch at most one
      lump (`largest_lump`) short of or ahead of its rate. So the tail's pessimistic rate adds one
      lump and the noise of its two medians (`z` standard errors, from `neighbour_noise`) to its
      rise, and is held against the window's rate by its rise (first eighth to last) less one
      lump, or its median of slopes if lower (pairs half a window apart can overstate a staircase
      by up to a lump over half the window);
    - when even so the tail is slower, the newest evidence shows a slowdown and is believed: the
      returned trend has the tail's rate (central `rise / span`, low and high edges by those
      allowances) and the floor measured at its end as its level. Of several tails that show it,
      the shortest (the newest evidence) wins: its wider interval is the price of being current.

    `fine` is the `Series` of finer buckets over the newest part (the detector's recent tier), used
    when at least 8 of them lie inside the window: its tails are tried first, so a stop late in a
    long run shows within a few fine buckets, not a few of the window's coarse ones; the window's
    own tails follow (a slowdown that shows only over thousands of steps). The lump is then the
    fine buckets' largest, or the coarse buckets' largest less their own steady growth (a
    staircase whose steps are further apart than the fine buckets reach), whichever is larger.

    A leak that stops leaves a flat tail: its low edge falls to zero or below, so the window is no
    longer a leak. Returns `trend` itself when no tail shows a slowdown. O(n log n) for the lump
    and the noise (once per series), O(1) per tail; run only on windows that look like leaks.
    """
    xs, ys = window.xs, window.ys
    if fine is not None and (len(fine.xs) < 2 * TAIL_BUCKETS or fine.xs[-2 * TAIL_BUCKETS] < xs[0]
                             or (fine.xs[-1] == xs[-1] and fine.xs[1] - fine.xs[0] == xs[1] - xs[0])):
        fine = None  # too few fine buckets inside the window, or the window is made of them
    n = len(xs)
    m = max(1, n // (2 * SEGMENTS))
    span = 0.5 * (xs[n - m] + xs[n - 1] - xs[0] - xs[m - 1])
    if span <= 0:
        return trend
    allowance = _Allowance(trend, window, fine, median(ys[n - m:]) - median(ys[:m]), span)
    if allowance.rate_bound * 0.5 * trend.span <= allowance.lump_bound:
        return trend  # even a flat tail of half the window would not miss more than a lump
    covered = 0.0  # tail spans the fine buckets tried: the window's coarser tails start beyond
    if fine is not None:
        found = _slower_tail(trend, allowance, fine, z, 0.0)
        if found is not None:  # first: newer, and shorter in steps
            return found
        covered = 0.25 * (fine.xs[-1] - fine.xs[0])
    return _slower_tail(trend, allowance, window, z, covered) or trend


def faster_evidence(trend: Trend, window: Series, z: float = 1.96, fine: Series | None = None) -> Trend:
    """The trend with its upper edge raised to the newest buckets' rate, when they rise clearly faster
    than the whole window: growth that accelerates.

    A window's median of slopes is the rate of its middle: growth that accelerates (a leak whose
    every step keeps a little more than the one before, a cache of activations that doubles) is
    already faster at the window's end than its interval's upper edge, and a line at that edge from
    the fitted floor reaches the limit far later than memory does (a quadratic leak: 400 steps
    projected, 25 left). The newest tails (the finer buckets' first, as in `newest_evidence`) are
    compared with the window the other way round: the shortest whose rise, less one lump and the
    noise of its two medians (`FASTER_Z` times the interval's z: every analysis compares a dozen
    tails; at one z, 16 of the bench's 69 leaks got their first action earlier, at three 5, windows
    that still hold the flat stretch before their leak began, whose line is rightly slower than
    the leak), is still faster than the window's upper edge is believed, and its rate (rise over
    span) becomes the upper edge.
    The central slope stays the window's: what was seen over the window, for words and the central
    projection; what an action is timed by (the upper edge, the limit rule's alarm rate) is the newest.
    A steady leak's tails are never faster by more than a lump and their noise, so its interval stays
    as it was. Returns `trend` itself when no tail is clearly faster.
    """
    xs, ys = window.xs, window.ys
    if fine is not None and (len(fine.xs) < 2 * TAIL_BUCKETS or fine.xs[-2 * TAIL_BUCKETS] < xs[0]
                             or (fine.xs[-1] == xs[-1] and fine.xs[1] - fine.xs[0] == xs[1] - xs[0])):
        fine = None
    n = len(xs)
    m = max(1, n // (2 * SEGMENTS))
    span = 0.5 * (xs[n - m] + xs[n - 1] - xs[0] - xs[m - 1])
    if span <= 0:
        return trend
    allowance = _Allowance(trend, window, fine, median(ys[n - m:]) - median(ys[:m]), span)
    for series in (fine, window):
        if series is None:
            continue
        rate = _faster_tail(trend, allowance, series, z)
        if rate is not None:
            return trend._replace(high=rate)
    return trend


def _faster_tail(trend: Trend, allowance: "_Allowance", series: Series, z: float) -> float | None:
    """The rate of the shortest tail of `series` clearly faster than the window's upper edge (see
    `faster_evidence`), or None."""
    xs, ys = series.xs, series.ys
    n = len(xs)
    for k in tail_sizes(n):
        m = max(1, k // SEGMENTS)
        span = 0.5 * (xs[n - m] + xs[n - 1] - xs[n - k] - xs[n - k + m - 1])
        if span <= 0 or span > 0.5 * trend.span:
            break
        head, end = ys[n - k:n - k + m], ys[n - m:]
        if max(end) - min(head) <= trend.high * span:
            continue  # not faster even at its most (most tails of a steady leak end here)
        first, last = median(head), median(end)
        rise = last - first
        noise = FASTER_Z * z * MEDIAN_EFFICIENCY * series.noise / math.sqrt(m)
        if rise - allowance.lump - noise > FASTER_SHARE * trend.high * span:
            return rise / span
    return None


class _Allowance:
    """The lump and the window's rate a tail is held to, with cheap bounds on both (the coarse
    lump alone is a lower bound of the lump, so the rate it gives an upper bound of the rate): a
    tail that is not slower even against the bounds needs neither the fine buckets' lump nor
    their noise, and a steady leak's tails never are, so those are measured only when it matters."""

    __slots__ = ("_fine", "_rise", "_span", "_slope", "lump_bound", "rate_bound", "_lump")

    def __init__(self, trend: Trend, window: Series, fine: Series | None, rise: float, span: float):
        # In the window's coarse buckets steady growth rises by slope * width from one to the next:
        # that is no lump. A lump the fine buckets see counts at its height; one rarer than they
        # reach shows in the coarse buckets well above their own growth.
        coarse = window.lump - trend.slope * (window.xs[1] - window.xs[0]) if fine is not None else window.lump
        self._fine, self._rise, self._span, self._slope = fine, rise, span, trend.slope
        self.lump_bound = coarse
        self.rate_bound = self.rate(coarse)
        self._lump = coarse if fine is None else None

    def rate(self, lump: float) -> float:
        """The window's rate by its rise, less a lump: never above a steady leak's own rate, however
        its lumps fall (a median of slopes can be, by up to a lump over half the window)."""
        return min(self._slope, (self._rise - lump) / self._span)

    @property
    def lump(self) -> float:
        if self._lump is None:
            self._lump = max(self._fine.lump, self.lump_bound)
        return self._lump


def _slower_tail(trend: Trend, allowance: _Allowance, series: Series, z: float, covered: float) -> Trend | None:
    """The shortest tail of `series`, longer than `covered` steps, slower than the window (see
    `newest_evidence`)."""
    if series.steady_beyond is not None and series.steady_beyond <= covered:
        return None  # a window kept between analyses, found steady before (its bounds depend on it alone)
    xs, ys = series.xs, series.ys
    n = len(xs)
    rate_bound, lump_bound = allowance.rate_bound, allowance.lump_bound
    steady = True
    for k in tail_sizes(n):
        m = max(1, k // SEGMENTS)  # buckets in each end group of the tail
        span = 0.5 * (xs[n - m] + xs[n - 1] - xs[n - k] - xs[n - k + m - 1])  # between the groups' middles
        if span <= 0 or span > 0.5 * trend.span:
            break  # longer tails only grow: at most half the window
        if span <= covered or rate_bound * span <= lump_bound:
            continue  # tried in finer buckets already, or could not miss more than a lump
        needed = rate_bound * span - lump_bound  # a tail must rise less than this to be slower
        head, end = ys[n - k:n - k + m], ys[n - m:]
        if min(end) - max(head) >= needed:
            continue  # not slower even against the bounds (and the medians rose at least this much)
        first, last = median(head), median(end)
        rise = last - first
        if rise >= needed:
            continue
        steady = False
        lump = allowance.lump
        noise = z * MEDIAN_EFFICIENCY * series.noise / math.sqrt(m)
        high = (rise + lump + noise) / span
        if high < allowance.rate(lump):
            return trend._replace(slope=rise / span, low=(rise - noise) / span, high=high,
                                  level=min(last, trend.level))
    if steady:
        series.steady_beyond = covered
    return None


def tail_sizes(n: int) -> list[int]:
    """The newest 4, 6, 9, 14, ... buckets (half as many again each time: a flat stretch is found
    to within a third of its length) up to half of a series of n, and that half."""
    sizes, k = [], TAIL_BUCKETS
    while 2 * k <= n:
        sizes.append(k)
        k = (3 * k + 1) // 2
    if n // 2 > (sizes[-1] if sizes else 0) and n // 2 >= TAIL_BUCKETS:
        sizes.append(n // 2)
    return sizes


def neighbour_noise(ys: list[float]) -> float:
    """Robust standard deviation of the difference between two floors, from second differences
    (y[i+1] - 2 y[i] + y[i-1], of variance three times that of a difference): growth at any steady
    rate cancels out of them, so a window whose rate changed (a leak that stopped) or that grows in
    lumps (two outliers per lump, which the median ignores) does not pass for noisy."""
    if len(ys) < 3:
        return 0.0
    seconds = [abs(b - 2.0 * a + c) for a, b, c in zip(ys[1:], ys, ys[2:])]
    return MAD_TO_SIGMA * median(seconds) / SQRT3


def largest_lump(ys: list[float]) -> float:
    """The largest rise that stays (`lasting_rises`): a level that steps up counts at its height;
    one bucket whose samples all missed the floor (a reading noise, gone at the next bucket) does not."""
    return max(0.0, max(lasting_rises(ys), default=0.0))


def lasting_rises(ys: list[float]) -> list[float]:
    """rises[j]: from the higher of floors j and j + 1 to the lower of floors j + 2 and j + 3, the
    rise that stays between buckets j + 1 and j + 2."""
    after = ys[1:]
    highs = [a if a > b else b for a, b in zip(ys, after)]  # highs[i]: the higher of floors i and i + 1
    lows = [a if a < b else b for a, b in zip(ys, after)]
    return list(map(sub, lows[2:], highs))


def window_sizes(n: int, smallest: int) -> list[int]:
    """All of the history, then the newest half, quarter, ... down to `smallest` buckets."""
    sizes = [n]
    while sizes[-1] > smallest:
        sizes.append(max(smallest, sizes[-1] // 2))
    return sizes


def crossing(x: float, room: float, slope: float) -> float:
    """Where a line rising `slope` per step from `x` has used up `room` (x itself when none is left)."""
    if room <= 0:
        return x
    return x + room / slope if slope > 0 else INF
