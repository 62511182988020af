"""Online leak detector (placeholder interface; the real algorithm lands with issue 3).

Pure: no threads, no I/O, no torch. Fed one `Sample` at a time, returns a `Verdict`.
"""

from __future__ import annotations

from dataclasses import dataclass

from watchdog.errors import ConfigError
from watchdog.sample import Sample
from watchdog.verdict import Status, Verdict


@dataclass(frozen=True)
class DetectorConfig:
    headroom_bytes: int = 0
    warmup_samples: int = 16

    def __post_init__(self) -> None:
        if self.headroom_bytes < 0:
            raise ConfigError("detector.headroom_bytes", "must not be negative")
        if self.warmup_samples < 1:
            raise ConfigError("detector.warmup_samples", "must be at least 1")


class LeakDetector:
    def __init__(self, config: DetectorConfig | None = None, memory_limit_bytes: int | None = None):
        self.config = config or DetectorConfig()
        self.memory_limit_bytes = memory_limit_bytes
        self.reset()

    def reset(self) -> None:
        """Forget history (after a reinit brought memory back down): a new baseline."""
        self._count = 0

    def update(self, sample: Sample) -> Verdict:
        self._count += 1
        status = Status.WARMING_UP if self._count < self.config.warmup_samples else Status.HEALTHY
        return Verdict(step=sample.step, timestamp=sample.timestamp, status=status,
                       floor_bytes=float(sample.bytes_used))
