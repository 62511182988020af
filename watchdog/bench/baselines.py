"""The baselines the detector must beat, with the same `update(sample) -> Verdict` protocol as LeakDetector.

- `StaticThreshold`: alarm when a reading passes 90% of the limit (the most common memory alert).
- `PredictLinear`: Prometheus `predict_linear` as the node-exporter mixin's
  NodeFilesystemSpaceFillingUp rule uses it: an ordinary least-squares line over a time window
  (6h), extrapolated a horizon ahead (24h), must cross the limit while usage is already above 60%
  (the mixin's "less than 40% available"), continuously for the `for:` hold (1h). Time-based, as
  Prometheus is: on a training job steps map to time through the sample timestamps.
- `LinearBackwardRegression` (LBR, Jindal et al.): regress backward from the newest sample over
  windows of growing length (20%..100% of the history); a leak when some window rises with
  R² >= 0.8.
- `Gpulse`: the leak rule of gpulse, a GPU memory monitor that shows a time to OOM, at its
  published defaults (an OLS line over 5 minutes with R² >= 0.7 and >= 1 MB/s), with its spike
  rule (+20% within 30 s).

They are deliberately faithful, failure modes included: a threshold fires on one spike, a
least-squares line over a window that contains a level shift or a filling cache points at an OOM
that never comes, and R² rewards a cache that fills smoothly. Pure, no I/O; memory of LBR grows
with the trace (it is a benchmark baseline, not shipped in the sidecar).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from watchdog.core.judge import effective_limit
from watchdog.core.sample import Sample
from watchdog.core.verdict import Status, Verdict

HOUR = 3600.0


class Detector(Protocol):
    def update(self, sample: Sample) -> Verdict: ...

    def reset(self) -> None: ...


def _verdict(sample: Sample, status: Status, limit: int | None, explanation: str, *, slope_per_step: float = 0.0,
             slope_per_second: float = 0.0, level: float | None = None, projected_oom_steps: float = math.inf,
             projected_oom_seconds: float = math.inf) -> Verdict:
    projected = sample.step + math.ceil(projected_oom_steps) if math.isfinite(projected_oom_steps) else None
    return Verdict(step=sample.step, timestamp=sample.timestamp, status=status,
                   floor_bytes=level, limit_bytes=limit, slope_bytes_per_step=slope_per_step,
                   slope_low_bytes_per_step=slope_per_step, slope_high_bytes_per_step=slope_per_step,
                   slope_bytes_per_second=slope_per_second, projected_oom_step=projected,
                   projected_oom_steps=projected_oom_steps, projected_oom_seconds=projected_oom_seconds, explanation=explanation)


class StaticThreshold:
    """Alarm while usage is at or above `fraction` of the limit; no trend, no projection."""

    def __init__(self, fraction: float = 0.9, memory_limit_bytes: int | None = None):
        self.fraction = fraction
        self.memory_limit_bytes = memory_limit_bytes

    def reset(self) -> None:
        pass

    def update(self, sample: Sample) -> Verdict:
        limit = effective_limit(sample.bytes_limit, self.memory_limit_bytes)
        if limit is None:
            return _verdict(sample, Status.WARMING_UP, None, "no memory limit known")
        if sample.bytes_used >= self.fraction * limit:
            return _verdict(sample, Status.OOM_PROJECTED, limit, f"usage at or above {self.fraction:.0%} of the limit",
                            level=float(sample.bytes_used))
        return _verdict(sample, Status.HEALTHY, limit, "below the threshold", level=float(sample.bytes_used))


@dataclass
class _SlidingLeastSquares:
    """Running sums for an OLS line over a sliding window; x relative to the first x seen, y to the first y."""

    x0: float | None = None
    y0: float = 0.0
    n: int = 0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    syy: float = 0.0

    samples: deque = field(default_factory=deque)  # what `slide` keeps in the window

    def slide(self, sample: Sample, window_seconds: float) -> None:
        """Add `sample` and drop the samples `window_seconds` or more older than it."""
        samples = self.samples
        samples.append(sample)
        self.add(sample.timestamp, sample.bytes_used)
        while samples[0].timestamp <= sample.timestamp - window_seconds:
            old = samples.popleft()
            self.add(old.timestamp, old.bytes_used, sign=-1)

    def add(self, x: float, y: float, sign: int = 1) -> None:
        if self.x0 is None:
            self.x0, self.y0 = x, y
        x, y = x - self.x0, y - self.y0
        self.n += sign
        self.sx += sign * x
        self.sy += sign * y
        self.sxx += sign * x * x
        self.sxy += sign * x * y
        self.syy += sign * y * y

    def line(self) -> tuple[float, float] | None:
        """(slope, fitted value at the mean x) or None when the x values do not spread."""
        if self.n < 2 or self.x0 is None:
            return None
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        spread = self.sxx - self.n * mean_x * mean_x
        if spread <= 1e-12 * max(1.0, self.sxx):
            return None
        return (self.sxy - self.n * mean_x * mean_y) / spread, mean_y

    def r_squared(self) -> float:
        """The share of the window's variance the line explains (0 when y does not vary)."""
        n = self.n
        vx, vy = self.sxx - self.sx * self.sx / n, self.syy - self.sy * self.sy / n
        if vx <= 0 or vy <= 0:
            return 0.0
        cxy = self.sxy - self.sx * self.sy / n
        return cxy * cxy / (vx * vy)

    def value_at(self, x: float) -> float:
        slope, mean_y = self.line()  # type: ignore[misc]
        return self.y0 + mean_y + slope * (x - self.x0 - self.sx / self.n)


class PredictLinear:
    """`predict_linear(used[window], horizon) > limit and used > min_fraction * limit`, held for `hold`."""

    def __init__(self, window_seconds: float = 6 * HOUR, horizon_seconds: float = 24 * HOUR,
                 hold_seconds: float = 1 * HOUR, min_used_fraction: float = 0.6,
                 memory_limit_bytes: int | None = None):
        self.window_seconds = window_seconds
        self.horizon_seconds = horizon_seconds
        self.hold_seconds = hold_seconds
        self.min_used_fraction = min_used_fraction
        self.memory_limit_bytes = memory_limit_bytes
        self.reset()

    def reset(self) -> None:
        self._fit = _SlidingLeastSquares()
        self._pending_since: float | None = None

    def update(self, sample: Sample) -> Verdict:
        self._fit.slide(sample, self.window_seconds)
        limit = effective_limit(sample.bytes_limit, self.memory_limit_bytes)
        line = self._fit.line()
        if limit is None or line is None:
            return _verdict(sample, Status.WARMING_UP, limit, "fewer than two samples in the window")
        slope = line[0]
        now = self._fit.value_at(sample.timestamp)
        predicted = now + slope * self.horizon_seconds
        condition = predicted > limit and sample.bytes_used > self.min_used_fraction * limit
        if not condition:
            self._pending_since = None
        elif self._pending_since is None:
            self._pending_since = sample.timestamp
        held = condition and sample.timestamp - self._pending_since >= self.hold_seconds  # type: ignore[operator]

        first = self._fit.samples[0]
        span = sample.timestamp - first.timestamp
        steps_per_second = (sample.step - first.step) / span if span > 0 else 0.0
        projected_oom_seconds = (limit - now) / slope if slope > 0 and now < limit else (0.0 if now >= limit else math.inf)
        projected_oom_steps = projected_oom_seconds * steps_per_second if steps_per_second > 0 else math.inf
        status = Status.OOM_PROJECTED if held else Status.SUSPECT if condition else Status.HEALTHY
        explanation = (f"linear fit over {self.window_seconds / HOUR:g}h crosses the limit within "
                       f"{self.horizon_seconds / HOUR:g}h" if condition else "linear fit stays below the limit")
        return _verdict(sample, status, limit, explanation, slope_per_step=slope / steps_per_second
                        if steps_per_second > 0 else 0.0, slope_per_second=slope, level=now,
                        projected_oom_steps=projected_oom_steps, projected_oom_seconds=projected_oom_seconds)


class Gpulse:
    """gpulse's leak rule, from its published defaults: an ordinary least-squares line over the
    newest `window_seconds` of samples (5 minutes, and a fit only once that much is seen) reports a
    leak when R² >= 0.7 and the slope is at least 1 MB/s, showing a time to OOM; and its spike rule:
    usage up 20% or more within 30 s. Either fires its alert. On the trace's own time axis."""

    def __init__(self, window_seconds: float = 300.0, min_r2: float = 0.7, min_slope_bytes_per_second: float = 1e6,
                 spike_share: float = 0.2, spike_seconds: float = 30.0, spikes: bool = True,
                 memory_limit_bytes: int | None = None):
        self.window_seconds = window_seconds
        self.min_r2 = min_r2
        self.min_slope = min_slope_bytes_per_second
        self.spike_share = spike_share
        self.spike_seconds = spike_seconds
        self.spikes = spikes
        self.memory_limit_bytes = memory_limit_bytes
        self.reset()

    def reset(self) -> None:
        self._recent: deque[Sample] = deque()  # the spike rule's 30 s, lowest first (a monotonic queue)
        self._fit = _SlidingLeastSquares()
        self._started: float | None = None

    def update(self, sample: Sample) -> Verdict:
        now_t, used = sample.timestamp, sample.bytes_used
        if self._started is None:
            self._started = now_t
        self._fit.slide(sample, self.window_seconds)
        recent = self._recent
        while recent and recent[-1].bytes_used >= used:
            recent.pop()
        recent.append(sample)
        while recent[0].timestamp < now_t - self.spike_seconds:
            recent.popleft()
        limit = effective_limit(sample.bytes_limit, self.memory_limit_bytes)
        line = self._fit.line()
        if limit is None or line is None:
            return _verdict(sample, Status.WARMING_UP, limit, "fewer than two samples")
        lowest = recent[0].bytes_used
        if self.spikes and lowest > 0 and used >= (1 + self.spike_share) * lowest:
            return _verdict(sample, Status.OOM_PROJECTED, limit,
                            f"spike: +{used / lowest - 1:.0%} within {self.spike_seconds:g} s", level=float(used))
        slope = line[0]
        if now_t - self._started < self.window_seconds or slope < self.min_slope or self._fit.r_squared() < self.min_r2:
            return _verdict(sample, Status.HEALTHY, limit, "no leak: fit below R² 0.7 or 1 MB/s", level=float(used))
        now = self._fit.value_at(now_t)
        first = self._fit.samples[0]
        span = now_t - first.timestamp
        steps_per_second = (sample.step - first.step) / span if span > 0 else 0.0
        seconds = max(limit - now, 0.0) / slope
        return _verdict(sample, Status.OOM_PROJECTED, limit, f"leak: {slope / 1e6:.1f} MB/s, R² {self._fit.r_squared():.2f}",
                        slope_per_step=slope / steps_per_second if steps_per_second > 0 else 0.0,
                        slope_per_second=slope, level=now, projected_oom_seconds=seconds,
                        projected_oom_steps=seconds * steps_per_second if steps_per_second > 0 else math.inf)


class LinearBackwardRegression:
    """LBR: the newest rising window whose least-squares fit explains at least `r2_threshold` of the variance.

    Cumulative sums make each window's fit O(1); windows are re-examined every `evaluate_every`
    samples, as the original re-runs offline over the history.
    """

    def __init__(self, r2_threshold: float = 0.8, min_samples: int = 60,
                 window_fractions: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8, 1.0), evaluate_every: int = 10,
                 memory_limit_bytes: int | None = None):
        self.r2_threshold = r2_threshold
        self.min_samples = min_samples
        self.window_fractions = window_fractions
        self.evaluate_every = evaluate_every
        self.memory_limit_bytes = memory_limit_bytes
        self.reset()

    def reset(self) -> None:
        self._origin: tuple[int, int] | None = None
        # prefix sums of x, y, xx, xy, yy (x = step, y = MiB, both relative to the first sample)
        self._prefix: list[tuple[float, float, float, float, float]] = [(0.0, 0.0, 0.0, 0.0, 0.0)]
        self._last: tuple[float, float, float] | None = None  # slope MiB/step, value now MiB, r2

    def _add(self, sample: Sample) -> None:
        if self._origin is None:
            self._origin = (sample.step, sample.bytes_used)
        x = float(sample.step - self._origin[0])
        y = (sample.bytes_used - self._origin[1]) / 2**20
        px, py, pxx, pxy, pyy = self._prefix[-1]
        self._prefix.append((px + x, py + y, pxx + x * x, pxy + x * y, pyy + y * y))

    def _fit(self, length: int) -> tuple[float, float, float] | None:
        """(slope, fitted value at the newest x, R²) over the newest `length` samples."""
        end, start = self._prefix[-1], self._prefix[-1 - length]
        n = float(length)
        sx, sy, sxx, sxy, syy = (e - s for e, s in zip(end, start))
        vx, vy, cxy = sxx - sx * sx / n, syy - sy * sy / n, sxy - sx * sy / n
        if vx <= 0 or vy <= 0:
            return None
        slope = cxy / vx
        newest_x = (self._prefix[-1][0] - self._prefix[-2][0])
        return slope, sy / n + slope * (newest_x - sx / n), cxy * cxy / (vx * vy)

    def _evaluate(self) -> tuple[float, float, float] | None:
        history = len(self._prefix) - 1
        best = None
        for fraction in self.window_fractions:
            length = int(history * fraction)
            if length < self.min_samples:
                continue
            fit = self._fit(length)
            if fit and fit[0] > 0 and fit[2] >= self.r2_threshold and (best is None or fit[2] > best[2]):
                best = fit
        return best

    def update(self, sample: Sample) -> Verdict:
        self._add(sample)
        limit = effective_limit(sample.bytes_limit, self.memory_limit_bytes)
        history = len(self._prefix) - 1
        if history < self.min_samples or limit is None:
            return _verdict(sample, Status.WARMING_UP, limit, "not enough history")
        if history % self.evaluate_every == 0:
            self._last = self._evaluate()
        if self._last is None:
            return _verdict(sample, Status.HEALTHY, limit, f"no rising window with R² >= {self.r2_threshold}")
        slope_mib, now_mib, r2 = self._last
        now = self._origin[1] + now_mib * 2**20  # type: ignore[index]
        slope = slope_mib * 2**20
        projected_oom_steps = max(limit - now, 0.0) / slope
        return _verdict(sample, Status.OOM_PROJECTED, limit, f"rising window with R² {r2:.2f}", slope_per_step=slope,
                        level=now, projected_oom_steps=projected_oom_steps)


BaselineFactory = Callable[[int | None], Detector]

BASELINES: dict[str, BaselineFactory] = {
    "threshold_90pct": lambda limit: StaticThreshold(0.9, memory_limit_bytes=limit),
    "predict_linear_mixin": lambda limit: PredictLinear(memory_limit_bytes=limit),
    "predict_linear_1h": lambda limit: PredictLinear(window_seconds=HOUR, horizon_seconds=4 * HOUR,
                                                     hold_seconds=0.25 * HOUR, memory_limit_bytes=limit),
    "lbr_r2_0.8": lambda limit: LinearBackwardRegression(memory_limit_bytes=limit),
    "gpulse": lambda limit: Gpulse(memory_limit_bytes=limit),
    "gpulse_leak_rule": lambda limit: Gpulse(spikes=False, memory_limit_bytes=limit),
}

BASELINE_NOTES = {  # what each baseline models, printed with the bench tables
    "threshold_90pct": "static alert at 90% of the limit",
    "predict_linear_mixin": "node-exporter mixin: predict_linear(x[6h], 24h) past the limit, >60% used, for: 1h",
    "predict_linear_1h": "the same rule rescaled for training jobs: [1h], 4h ahead, for: 15m",
    "lbr_r2_0.8": "linear backward regression, rising window with R² >= 0.8 (Jindal et al.)",
    "gpulse": "gpulse's defaults: OLS over 5 min, R² >= 0.7 and >= 1 MB/s; or usage +20% within 30 s",
    "gpulse_leak_rule": "gpulse's leak rule alone (its spike rule fires on a training step's sawtooth)",
}
