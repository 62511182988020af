"""When the `cuda` source reads the allocator's breakdown, and when its device reading is enough.

Pure: no torch, no threads; `CudaSource` (readers/sources.py) asks it once a sample.

The two readings, as measured on an H100 (tests/data/cuda/README.md):

- the device reading, `torch.cuda.mem_get_info`: the device's free and total bytes (6.5-8.7 us a
  call, the GIL released around the driver's call). What it sees of this process is what the
  allocator reserved, so it moves when the allocator reserves a segment or hands one back, and
  when any other memory on the device changes;
- the breakdown, the allocator's own statistics: what tensors hold, the split remainders, what it
  reserved, its peak. `memory_stats()` took 80-155 us a call, every figure built as a Python dict
  with the GIL held, then flattened and sorted in Python; the source reads
  `memory_stats_as_nested_dict()`, the same dicts unflattened (its cost is the device check's
  `reads` case to measure). Only the breakdown tells tensors from cache.

Tensors can grow inside what the allocator already reserved (its cache) without the device
reading moving: that growth is bounded by the cache, and reading the breakdown is what measures
it. So the breakdown is read:

- at the first reading, and at a reading that must measure everything (`restart`: after a rebuild);
- every `every`-th reading and every `seconds` at least, whichever comes first (a leak inside the
  cache is seen that late at most; samples 100 ms apart or more, the default `sample_every` of 10
  beside steps of 10 ms or more, are all breakdowns, as before the plan);
- when the device reading moved by `moved_bytes` or more since the newest breakdown (the
  allocator reserved or handed back a segment, or other memory on the device changed: the series,
  its limit, or both may have moved);
- while the series climbs: from a breakdown whose series passed the highest since the plan started
  by `moved_bytes` or more, until `every` breakdowns in a row have not (a leak filling the cache is
  read at every sample while it makes new highs, though the sidecar's reading lands at a random
  moment of a step, below its activations' peak as often as not: the judge's pace, its limit rule
  for a leak too fast for the detector, sees every reading of the climb, as it did when every
  reading was a breakdown);
- near the limit: while what the allocator reserved, the most the series can reach unseen, is
  `near_limit` of the limit or more.

A reading between breakdowns carries the lowest series the breakdowns read since the series last
climbed, raised by what the device grew since (a segment reserved for a leak raises the floor as
much), never past the newest breakdown's. Not the newest breakdown's series: the sidecar reads at a
random moment of a step, so a breakdown is the floor plus some of the step's activations, and ten
readings carrying one taken at the step's peak would raise the detector's floors (its buckets keep
their lowest reading) where nothing grew. The limit is read fresh (the device's free bytes). A
reading that carries the series says so: `MemoryReading.allocator` is None; its peak is the series
it carries (the peak in between is unknown: as where the allocator's lifetime peak did not rise,
the current value stands in).

What it costs the judgement, on the device check's cases replayed on a model of the allocator
(tests/test_cuda_fixtures.py): nothing (the same verdict and action at every sample). A slow leak
inside the cache, read at samples closer than `seconds`, is reported later (the breakdowns are the
only readings that see it, and there are fewer).
"""

from __future__ import annotations

BREAKDOWN_EVERY = 10  # readings: a breakdown at least once every ten ...
BREAKDOWN_SECONDS = 0.1  # ... and once every 100 ms: up to 0.16% of the time at the H100's dearest breakdown
MOVED_BYTES = 2 << 20  # the least the caching allocator reserves at a time (a small block's segment)
NEAR_LIMIT = 0.9  # reserved at this share of the limit or more: every reading is a breakdown


class BreakdownPlan:
    __slots__ = ("every", "seconds", "moved_bytes", "near_limit", "_carried", "_read_at", "_device_used", "_reserved",
                 "_highest", "_since_high", "_lowest")

    def __init__(self, every: int = BREAKDOWN_EVERY, seconds: float = BREAKDOWN_SECONDS, moved_bytes: int = MOVED_BYTES,
                 near_limit: float = NEAR_LIMIT):
        if every < 1 or not seconds >= 0.0 or moved_bytes < 0 or not 0.0 <= near_limit <= 1.0:
            raise ValueError(f"every {every} (from 1), seconds {seconds} (from 0), moved_bytes {moved_bytes} "
                             f"(from 0), near_limit {near_limit} (0 to 1)")
        self.every, self.seconds, self.moved_bytes, self.near_limit = every, seconds, moved_bytes, near_limit
        self._read_at = 0.0  # when the newest breakdown was read (the caller's clock)
        self._carried: int | None = None  # readings carried since the newest breakdown; None: none read yet
        self._device_used = self._reserved = 0  # at the newest breakdown
        self._highest: int | None = None  # the highest series since the plan started ...
        self._since_high = every  # ... and how many breakdowns ago it was last passed (every: not climbing)
        self._lowest = 0  # the lowest series since the newest climb: what a reading between breakdowns carries

    def due(self, device_used: int, limit: int, now: float) -> bool:
        """Whether this reading must be a breakdown: `device_used` is the device's total less its
        free bytes now, `limit` what the allocator may hold (its reserved bytes plus the free),
        `now` the time on the caller's clock (seconds)."""
        carried = self._carried
        return (carried is None or self._since_high < self.every or carried + 1 >= self.every
                or now - self._read_at >= self.seconds
                or abs(device_used - self._device_used) >= self.moved_bytes
                or self._reserved >= self.near_limit * limit)

    def carried(self) -> int:
        """This reading carries the series: the lowest a breakdown read since the series last climbed."""
        self._carried = (self._carried or 0) + 1
        return self._lowest

    def read(self, series: int, reserved: int, device_used: int, now: float) -> None:
        """A breakdown was read at `now`: the series, what the allocator reserved, the device reading with it."""
        grown = device_used - self._device_used if self._carried is not None else 0
        self._carried, self._read_at, self._device_used, self._reserved = 0, now, device_used, reserved
        highest = self._highest
        if highest is None or series > highest:
            climbed = highest is not None and series >= highest + self.moved_bytes
            self._highest = series
        else:
            climbed = False
        self._since_high = 0 if climbed else min(self._since_high + 1, self.every)
        if highest is None:
            self._lowest = series
        else:  # the floor may have risen as much as the device grew or the series' high did, never past what was read
            self._lowest = min(series, self._lowest + max(grown, series - highest if climbed else 0, 0))

    def restart(self) -> None:
        """The state was rebuilt: the next reading is a breakdown, and the highs before describe
        the state that was dropped (a refill up to them is a climb)."""
        self._carried = self._highest = None
        self._since_high = self.every
