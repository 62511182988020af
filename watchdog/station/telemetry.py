"""The cache between the sidecar (writer) and the exporter / reports (readers).

Scrapes read this and nothing else: they never call into the XLA runtime. Fields are
replaced whole (immutable samples and verdicts), so readers need no lock to see a
consistent value; counters only grow.

It holds what every series has (its sample, verdict, actions, counts). A component that owns
figures of its own (the checkpoints, the compile watch, the job ledger) keeps them in an object
of its own with a `collect()`, made once per series by `Telemetry.part` (the exporter yields them
beside the series'): the series' labels are the only thing it takes from here.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from watchdog.core.readings import DeviceMemory, HostReading
from watchdog.core.sample import Sample
from watchdog.core.verdict import Action, Verdict

P = TypeVar("P")


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
    host_reading: HostReading | None = None  # the host's series only: its newest reading in full
    host_series: Telemetry | None = None  # the device's: the host's series, served beside it
    _parts: dict = field(default_factory=dict, repr=False)  # kind -> that component's figures (`part`)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count_action(self, action: Action) -> None:
        with self._lock:
            self.actions_total[action] += 1

    def actions_snapshot(self) -> dict[Action, int]:
        with self._lock:
            return {action: self.actions_total.get(action, 0) for action in Action if action is not Action.NONE}

    def labels(self) -> list[str]:
        """The labels every series of this memory carries: `device`, `rank`."""
        return [self.device, str(self.rank)]

    def part(self, kind: Callable[[Callable[[], list[str]]], P]) -> P:
        """This series' one `kind` of component figures, made (with its labels) the first time asked.

        One per series whoever asks first (the trainer, the Watchdog, a loop): no two copies of a
        component's figures can be served, and a scrape sees them from the moment they exist."""
        with self._lock:
            found = self._parts.get(kind)
            if found is None:
                found = self._parts[kind] = kind(self.labels)
            return found

    def parts(self) -> list:
        """Every component's figures kept for this series, for the exporter."""
        with self._lock:
            return list(self._parts.values())
