"""The cache between the sidecar (writer) and the exporter / reports (readers).

Scrapes read this and nothing else: they never call into the XLA runtime. Fields are
replaced whole (immutable samples and verdicts), so readers need no lock to see a
consistent value; counters only grow.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from watchdog.core.goodput import Account
from watchdog.core.readings import DeviceMemory, HostReading
from watchdog.core.sample import Sample
from watchdog.core.verdict import Action, Verdict

CHECKPOINT_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Histogram:
    """Cumulative histogram in Prometheus's shape: bucket upper bounds, counts, sum."""

    bounds: tuple[float, ...] = CHECKPOINT_SECONDS_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1


@dataclass
class Telemetry:
    device: str = "unknown"
    rank: int = 0
    source: str = "none"
    sample: Sample | None = None
    chips: tuple[DeviceMemory, ...] = ()  # every chip of a multi-chip source (SPMD on TPU), newest sample
    verdict: Verdict | None = None
    training_step: int = 0
    last_step_monotonic: float = field(default_factory=time.monotonic)
    stalled: bool = False
    actions_total: Counter = field(default_factory=Counter)
    restarts_total: int = 0
    sample_errors_total: int = 0
    trace_errors_total: int = 0
    samples_total: int = 0
    peak_bytes_seen: int = 0  # the highest usage or high-water mark any sample showed (the run summary)
    xla_compilations_total: int | None = None
    recompilation_detected: bool | None = None  # None: not watched (off XLA)
    steps_per_recompilation: float | None = None  # since warm-up; inf while none
    recompilation: dict | None = None  # the newest `recompilation` finding, as logged
    checkpoint_seconds: Histogram = field(default_factory=Histogram)
    checkpoint_disk_free_bytes: int | None = None  # free space where checkpoints go (the trainer fills it)
    checkpoint_size_bytes: int | None = None  # the newest checkpoint's size: what the next one needs
    host_reading: HostReading | None = None  # the host's series only: its newest reading in full
    host_series: Telemetry | None = None  # the device's: the host's series, served beside it
    goodput: Account | None = None  # the job's time so far, where a job file is kept (runtime/job_ledger.py)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count_action(self, action: Action) -> None:
        with self._lock:
            self.actions_total[action] += 1

    def observe_checkpoint(self, seconds: float) -> None:
        with self._lock:
            self.checkpoint_seconds.observe(seconds)

    def actions_snapshot(self) -> dict[Action, int]:
        with self._lock:
            return {action: self.actions_total.get(action, 0) for action in Action if action is not Action.NONE}

    def checkpoint_snapshot(self) -> tuple[tuple[float, ...], list[int], float, int]:
        with self._lock:
            h = self.checkpoint_seconds
            return h.bounds, list(h.counts), h.total, h.count
