"""A caching allocator's figures, served beside the series it drives (PyTorch's on CUDA).

The `cuda` source judges what the allocator cannot hand back (tensors, and the free remainders of
blocks split for them) and reads the rest from the same breakdown of the allocator's statistics;
the sidecar keeps the newest breakdown here (`Telemetry.part(AllocatorFigures)`), served by its own
`collect()`: `hbmwatch_allocator_allocated_bytes`, `hbmwatch_allocator_split_bytes` and
`hbmwatch_allocator_reserved_bytes`. Split remainders growing while the tensors' bytes do not is
fragmentation; reserved growing alone is cache, which the allocator empties before an OOM.

The source reads the breakdown only when it is needed (readers/breakdown_plan.py); a sample that
carried the series brings no figures, and the newest ones stay. `hbmwatch_allocator_breakdowns_total`
counts the samples that read one: against `hbmwatch_samples_total`, the share that paid for it.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import Metric

from watchdog.core.readings import AllocatorMemory
from watchdog.station.exporter import counter_family, gauge_family


class AllocatorFigures:
    def __init__(self, labels: Callable[[], list[str]]):
        self._labels = labels
        self.newest: AllocatorMemory | None = None  # replaced whole: one read gives a consistent set
        self.breakdowns = 0  # samples that read the allocator's breakdown

    def observe(self, figures: AllocatorMemory) -> None:
        self.newest = figures
        self.breakdowns += 1

    def collect(self) -> Iterator[Metric]:
        figures, labels = self.newest, self._labels()
        if figures is None:
            return
        yield from gauge_family("allocator_allocated_bytes", "Bytes live tensors hold in the device's caching "
                                "allocator, at the newest breakdown.", labels, figures.allocated_bytes)
        yield from gauge_family("allocator_split_bytes", "Free remainders of the allocator's blocks split for "
                                "live tensors: held, and usable only by requests that fit (fragmentation).",
                                labels, figures.split_bytes)
        yield from gauge_family("allocator_reserved_bytes", "All the allocator holds from the device, its cache "
                                "included (the cache is handed back before an OOM).", labels, figures.reserved_bytes)
        yield from counter_family("allocator_breakdowns", "Samples that read the allocator's breakdown; the others "
                                  "read the device's free memory and carried the series.", labels, self.breakdowns)
