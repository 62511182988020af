"""The daemon's time axis: outside the process there is no step counter, only a clock.

The detector and the policy count in steps. The daemon feeds them one sample every `interval`
seconds and numbers the samples by tick (tick k is taken `k * interval` seconds into the
segment; a tick missed on a loaded machine is skipped, not squeezed in), so one step is one
interval and every setting a person gives in seconds becomes a number of samples here, rounded
up: a margin must never shrink in translation. Pure: no clock is read here.

    checkpoint margin = --checkpoint-seconds + --safety-seconds   (the policy acts at least this
                        long before the pessimistic projection of the OOM; its lead factor adds room)
    cooldown          = --grace-seconds   (one signal per grace period; escalation owns the wait)
    warmup            = --warmup-seconds  (a new process's start-up: imports, weights, compilation)

What the interval and the warm-up can protect (`Reach`, said at start and at the first leak): the
limit rule acts on the newest readings' pace from the twelfth reading on, warm-up or not, a few
samples before the limit; the trend, whose projection leaves the checkpoint margin, comes only after
the warm-up and sixteen buckets. So a leak that fills its headroom in fewer than 12 samples is
signalled only at the limit, one that takes 20 or more before it (docs/detection.md, "How early").
The defaults (0.1 s, 30 s) come from measurement: a script leaking 2 MiB every 12 ms with 500 MiB
of headroom (3 s to fill it, tests/jobs/gpt_script.py) was signalled over its limit at 2 s and 0.5
s, at 0.25 s only where its start-up's own climb stood in for the leak's first readings, and at 0.1
s 96-145 MiB below it in every run; the warm-up changed nothing for it (5 s and 30 s alike).

Every setting is bounded (`core/numbers.py`): durations 0 to MAX_SECONDS, the interval from
MIN_INTERVAL, so every count of samples made here is a finite whole number far below 2**52.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from watchdog.core.detector import DetectorConfig
from watchdog.core.errors import ConfigError
from watchdog.core.numbers import MAX_SECONDS, MIN_INTERVAL
from watchdog.core.pace import PACE_SAMPLES
from watchdog.core.policy import PolicyConfig
from watchdog.core.units import format_bytes

DEFAULT_INTERVAL_SECONDS = 0.1
DEFAULT_WARMUP_SECONDS = 30.0
BEFORE_THE_LIMIT_SAMPLES = 20  # a leak this many samples from the limit is acted on before it (docs/detection.md)
UNLIMITED_RESTARTS = 2**31 - 1
"""The daemon never rations its signals: the restart budget is the supervisor's (or JobSet's).
A signal before the OOM always beats the OOM, even for a job that will not be restarted."""


@dataclass(frozen=True)
class TimeAxis:
    interval_seconds: float = DEFAULT_INTERVAL_SECONDS
    """One sample every this many seconds."""
    checkpoint_seconds: float = 60.0
    """How long the job takes to save and exit after the signal."""
    safety_seconds: float | None = None
    """Added to the checkpoint time; default two intervals (a decision can come one interval late,
    and the signal and the handler's reaction to it take time too)."""
    warmup_seconds: float = DEFAULT_WARMUP_SECONDS
    """A new process's first seconds are no trend: imports, weights and compilation are not a leak
    (memory over the limit is acted on even then: the judge's limit rule needs no trend)."""
    grace_seconds: float | None = None
    """After a signal, how long to wait before escalating; default twice the checkpoint time."""
    base_detector: DetectorConfig = field(default_factory=DetectorConfig)
    base_policy: PolicyConfig = field(default_factory=PolicyConfig)

    def __post_init__(self) -> None:
        if not _number(self.interval_seconds) or not MIN_INTERVAL <= self.interval_seconds <= MAX_SECONDS:
            raise ConfigError("--interval", f"must be a number of seconds from {MIN_INTERVAL:g} to {MAX_SECONDS:,}, "
                                            f"got {self.interval_seconds!r}")
        for name in ("checkpoint_seconds", "safety_seconds", "warmup_seconds", "grace_seconds"):
            value = getattr(self, name)
            if value is not None and (not _number(value) or not 0 <= value <= MAX_SECONDS):
                flag = "--" + name.replace("_", "-")
                raise ConfigError(flag, f"must be a number of seconds from 0 to {MAX_SECONDS:,}, got {value!r}")
        if self.safety_seconds is None:
            object.__setattr__(self, "safety_seconds", 2.0 * self.interval_seconds)
        if self.grace_seconds is None:
            object.__setattr__(self, "grace_seconds", 2.0 * self.checkpoint_seconds)

    def samples(self, seconds: float) -> int:
        """Seconds -> samples, rounded up (a small float error never costs a whole extra sample)."""
        return max(0, math.ceil(seconds / self.interval_seconds - 1e-9))

    @property
    def margin_seconds(self) -> float:
        return self.checkpoint_seconds + self.safety_seconds  # type: ignore[operator]

    @property
    def warmup_samples(self) -> int:
        return max(self.base_detector.warmup_samples, self.samples(self.warmup_seconds))

    @property
    def reach(self) -> "Reach":
        detector = self.base_detector
        trend = self.warmup_samples + detector.min_window_buckets * detector.bucket_steps
        return Reach(self.interval_seconds, PACE_SAMPLES * self.interval_seconds,
                     BEFORE_THE_LIMIT_SAMPLES * self.interval_seconds, trend * self.interval_seconds,
                     self.warmup_seconds)

    def detector_config(self) -> DetectorConfig:
        return replace(self.base_detector, warmup_samples=self.warmup_samples)

    def policy_config(self) -> PolicyConfig:
        return replace(self.base_policy, checkpoint_margin_steps=max(1, self.samples(self.margin_seconds)),
                        cooldown_steps=self.samples(self.grace_seconds),  # type: ignore[arg-type]
                        prefer_restart=True, max_restarts=UNLIMITED_RESTARTS)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Reach:
    """What an interval and a warm-up can protect, in seconds of a leak's time to fill its headroom."""

    interval_seconds: float
    only_at_limit_below: float  # a leak filling the headroom faster is signalled only at the limit
    before_limit_from: float  # one this slow or slower is signalled before it
    trend_after: float  # seconds into a process before the trend (and its checkpoint margin) can act
    warmup_seconds: float

    def words(self) -> str:
        return (f"a leak filling the headroom in less than {self.only_at_limit_below:g} s is signalled only at the "
                f"limit, one taking {self.before_limit_from:g} s or more before it (--interval "
                f"{self.interval_seconds:g}); the trend, which leaves --checkpoint-seconds of margin, starts "
                f"{self.trend_after:g} s into each process (--warmup-seconds {self.warmup_seconds:g} and 16 buckets), "
                "before that the signal comes a few samples before the limit")

    def seen(self, rate_bytes_per_second: float, left_bytes: float) -> tuple[bool, str]:
        """A leak seen rising at `rate_bytes_per_second` with `left_bytes` to the limit: whether it is
        beyond this reach (it may be signalled only at the limit), and the words that say so."""
        if rate_bytes_per_second <= 0:
            return False, "no rise measured yet"
        left = max(0.0, left_bytes)
        needs = rate_bytes_per_second * self.before_limit_from  # the headroom this reach needs at that rate
        said = f"rising {format_bytes(rate_bytes_per_second)}/s with {format_bytes(left)} left to the limit"
        if left >= needs:
            return False, (f"{said}: within this watch's reach (at this rate it needs {format_bytes(needs)}, "
                           f"{self.before_limit_from:g} s of it)")
        fix = (f"--interval {max(MIN_INTERVAL, left / rate_bytes_per_second / BEFORE_THE_LIMIT_SAMPLES):.2g} or less "
               "reaches it" if left > 0 else "give it more headroom or a shorter --interval")
        return True, (f"{said}: a leak filling the headroom in less than {self.before_limit_from:g} s "
                      f"({format_bytes(needs)} at this rate) may be signalled only at the limit; {fix}")
