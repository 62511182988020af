"""The checkpoints' figures: how long saves take, and the space the next one needs.

Owned by whoever saves (the Watchdog times every save a loop reports; the trainer reads the disk),
kept once per series (`Telemetry.part(CheckpointFigures)`) and served by their own `collect()`:
`hbmwatch_checkpoint_seconds` (a histogram), `hbmwatch_checkpoint_disk_free_bytes`,
`hbmwatch_checkpoint_size_bytes`. The histogram is there from the series' first scrape (all zeros)
so that the first save is an increase to Prometheus, not the series appearing.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator

from prometheus_client.core import HistogramMetricFamily, Metric

from watchdog.station.exporter import BASE_LABELS, PREFIX, gauge_family

SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class CheckpointFigures:
    def __init__(self, labels: Callable[[], list[str]]):
        self._labels = labels
        self._counts = [0] * len(SECONDS_BUCKETS)  # cumulative, as Prometheus's buckets
        self._total = 0.0
        self._count = 0
        self.disk_free_bytes: int | None = None  # free space where checkpoints go (the trainer reads it)
        self.size_bytes: int | None = None  # the newest checkpoint's size: about what the next one needs
        self._lock = threading.Lock()  # saves are timed on the training thread, scraped on another

    def observe_save(self, seconds: float) -> None:
        with self._lock:
            for i, bound in enumerate(SECONDS_BUCKETS):
                if seconds <= bound:
                    self._counts[i] += 1
            self._total += seconds
            self._count += 1

    def observe_space(self, free_bytes: int | None, checkpoint_bytes: int | None) -> None:
        self.disk_free_bytes, self.size_bytes = free_bytes, checkpoint_bytes

    @property
    def saves(self) -> int:
        """Saves timed so far."""
        return self._count

    def collect(self) -> Iterator[Metric]:
        labels = self._labels()
        yield from gauge_family("checkpoint_disk_free_bytes", "Free bytes on the file system checkpoints are "
                                "written to.", labels, self.disk_free_bytes)
        yield from gauge_family("checkpoint_size_bytes", "Size of the newest checkpoint: about what the next "
                                "one needs.", labels, self.size_bytes)
        with self._lock:
            counts, total, count = list(self._counts), self._total, self._count
        histogram = HistogramMetricFamily(PREFIX + "checkpoint_seconds", "Time to write a checkpoint.",
                                          labels=BASE_LABELS)
        buckets = [(str(float(b)), float(c)) for b, c in zip(SECONDS_BUCKETS, counts)] + [("+Inf", float(count))]
        histogram.add_metric(labels, buckets, total)
        yield histogram
