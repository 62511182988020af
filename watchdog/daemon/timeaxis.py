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

Every setting is bounded (`core/numbers.py`): durations 0 to MAX_SECONDS, the interval from
MIN_INTERVAL, so every count of samples made here is a finite whole number far below 2**52.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from watchdog.core.detector import DetectorConfig
from watchdog.core.errors import ConfigError
from watchdog.core.numbers import MAX_SECONDS, MIN_INTERVAL
from watchdog.core.policy import PolicyConfig

UNLIMITED_RESTARTS = 2**31 - 1
"""The daemon never rations its signals: the restart budget is the supervisor's (or JobSet's).
A signal before the OOM always beats the OOM, even for a job that will not be restarted."""


@dataclass(frozen=True)
class TimeAxis:
    interval_seconds: float = 2.0
    """One sample every this many seconds."""
    checkpoint_seconds: float = 60.0
    """How long the job takes to save and exit after the signal."""
    safety_seconds: float | None = None
    """Added to the checkpoint time; default two intervals (a decision can come one interval late,
    and the signal and the handler's reaction to it take time too)."""
    warmup_seconds: float = 30.0
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

    def detector_config(self) -> DetectorConfig:
        return replace(self.base_detector, warmup_samples=self.warmup_samples)

    def policy_config(self) -> PolicyConfig:
        return replace(self.base_policy, checkpoint_margin_steps=max(1, self.samples(self.margin_seconds)),
                        cooldown_steps=self.samples(self.grace_seconds),  # type: ignore[arg-type]
                        prefer_restart=True, max_restarts=UNLIMITED_RESTARTS)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
