"""The daemon's Prometheus view: the sidecar's metrics for every device it watches, plus its own.

Each device keeps a `Telemetry` exactly as the sidecar fills it, turned into metric families by the
sidecar's own `TelemetryCollector` (with any component's figures, `Telemetry.part`); families of the same name are merged, so several devices (the
chips of a TPU host) come out as one family with one series per `device`. Labels stay bounded:
`device` (`process`, or `tpu:N`) and `rank`. The watched PID changes with every restart, so it
is a gauge's value, never a label; the Prometheus target labels (`job`, `pod`) name the job.

Daemon-only series:
    hbmwatch_watched_pid                 the PID watched now (0 while waiting for the target)
    hbmwatch_target_attachments_total    attachments, the first included (a restart is one more)
    hbmwatch_signals_total{signal}       signals sent (escalations included), by name
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from watchdog.station.exporter import PREFIX, TelemetryCollector, merge_families
from watchdog.station.telemetry import Telemetry


@dataclass
class WatchState:
    """What the daemon itself did; written by the daemon's loop, read by scrapes."""

    watched_pid: int = 0
    attachments: int = 0
    signals: Counter = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count_signal(self, name: str) -> None:
        with self._lock:
            self.signals[name] += 1

    def signals_snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.signals)


class WatchCollector:
    """Every device's telemetry (merged by family) and the daemon's own series."""

    def __init__(self, state: WatchState, devices: Mapping[str, Telemetry]):
        self.state = state
        self.devices = devices  # the daemon adds a device the first time a reader reports it

    def describe(self) -> list[Metric]:
        return []  # as TelemetryCollector: registering must not collect a half-filled cache

    def collect(self) -> Iterator[Metric]:
        yield from merge_families([TelemetryCollector(t).collect() for t in list(self.devices.values())])
        state = self.state
        pid = GaugeMetricFamily(PREFIX + "watched_pid", "PID of the process watched now; 0 while waiting for it.")
        pid.add_metric([], float(state.watched_pid))
        yield pid
        attachments = CounterMetricFamily(PREFIX + "target_attachments",
                                          "Times the daemon attached to a target process (a restart adds one).")
        attachments.add_metric([], float(state.attachments))
        yield attachments
        signals = CounterMetricFamily(PREFIX + "signals", "Signals the daemon sent to its target, by name.",
                                      labels=("signal",))
        for name, count in sorted(state.signals_snapshot().items()):
            signals.add_metric([name], float(count))
        yield signals


def build_watch_registry(state: WatchState, devices: Mapping[str, Telemetry]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WatchCollector(state, devices))
    return registry
