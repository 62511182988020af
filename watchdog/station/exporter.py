"""Prometheus exporter: a collector over the `Telemetry` cache (endpoint.py serves it).

Why a custom collector and not module-level Gauges: a scrape must never call into the XLA
runtime (a scrape arriving mid-step would read device state on the wrong thread, and could
force a sync). The sidecar writes the cache; a scrape only turns that cache into text. Each
exporter has its own `CollectorRegistry`, so several watchdogs in one process (tests, one per
local rank) never clash, and no default process/GC metrics sneak in.

Labels are bounded on purpose: `device` and `rank` on every series, `action` on
`hbmwatch_actions_total`, `version` and `source` on `hbmwatch_build_info`. Values are base
units (bytes, seconds, steps); "no OOM in sight" is +Inf, which Prometheus and PromQL handle.
"""

from __future__ import annotations

import math
import time
from typing import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)

from watchdog import __version__
from watchdog.station.endpoint import DEFAULT_ADDRESS, DEFAULT_PORT, EndpointLimits, MetricsServer, serve_registry
from watchdog.station.telemetry import Telemetry

PREFIX = "hbmwatch_"
BASE_LABELS = ("device", "rank")

# Gauges read straight off the verdict: (name, help, how to get the value). Absent until the
# detector has produced a verdict, so "unknown" never masquerades as 0.
_VERDICT_GAUGES: tuple[tuple[str, str, object], ...] = (
    ("memory_floor_bytes", "Resident floor of device memory: the fitted trend at the newest sample.",
     lambda v: v.floor_bytes),
    ("memory_excursion_bytes", "Transient excursion above the floor (activations, eval buffers) used for the projection.",
     lambda v: v.excursion_bytes),
    ("leak_slope_bytes_per_step", "Fitted growth of the memory floor, bytes per training step.",
     lambda v: v.slope_bytes_per_step),
    ("leak_slope_low_bytes_per_step", "Low edge of the 95% interval of the floor slope.",
     lambda v: v.slope_low_bytes_per_step),
    ("leak_slope_high_bytes_per_step", "High edge of the 95% interval of the floor slope (what actions use).",
     lambda v: v.slope_high_bytes_per_step),
    ("leak_slope_bytes_per_second", "Fitted growth of the memory floor, bytes per second.",
     lambda v: v.slope_bytes_per_second),
    ("leak_window_steps", "Span of training steps the slope was fitted over.",
     lambda v: v.window_steps),
    ("projected_oom_steps_pessimistic", "Steps left before the peak reaches the limit at the high edge of the slope interval; +Inf when none.",
     lambda v: v.projected_oom_steps_pessimistic),
)


class TelemetryCollector:
    """Turns one `Telemetry` into metric families at scrape time. Reads the cache, nothing else.

    A device's telemetry that carries the host's series (`host_series`) serves it too, merged
    family by family: one family per metric, one series per `device` ("host" among them). The
    figures a component owns (`Telemetry.parts`: checkpoints, compilations, the job's time) are
    that component's own collectors; they are served beside the series they are labelled with."""

    def __init__(self, telemetry: Telemetry):
        self.telemetry = telemetry

    def describe(self) -> list[Metric]:
        # Registering must not run collect() against a half-filled cache; names are not needed
        # because this registry holds only this collector.
        return []

    def collect(self) -> Iterator[Metric]:
        t = self.telemetry
        series = [t] if t.host_series is None else [t, t.host_series]
        yield from merge_families([self._families(s) for s in series]
                                  + [part.collect() for s in series for part in s.parts()])

    @staticmethod
    def _families(t: Telemetry) -> Iterator[Metric]:
        sample, verdict = t.sample, t.verdict  # read each field once: the sidecar replaces them whole
        labels = [t.device, str(t.rank)]

        def gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
            return gauge_family(name, doc, labels, value)

        def counter(name: str, doc: str, value: float | None) -> Iterator[Metric]:
            return counter_family(name, doc, labels, value)

        build = GaugeMetricFamily(PREFIX + "build_info", "Always 1: version and memory source in use.",
                                  labels=(*BASE_LABELS, "version", "source"))
        build.add_metric([*labels, __version__, t.source], 1.0)
        yield build

        if sample is not None:
            yield from gauge("memory_used_bytes", "Device memory in use at the newest sample.", sample.bytes_used)
            yield from gauge("memory_peak_bytes", "Runtime's high-water mark of device memory, where it reports one.",
                             sample.peak_bytes_used)
            yield from gauge("last_sample_timestamp_seconds", "Unix time of the newest memory sample.",
                             sample.timestamp)
        yield from _chip_gauges(t, str(t.rank))
        yield from _host_gauges(t, labels)
        yield from gauge("memory_limit_bytes", "Effective memory limit: the smaller of the device's and the configured budget.",
                         verdict.limit_bytes if verdict is not None else None)
        yield from gauge("leak_detected", "1 while a leak is reported (confident steady floor growth, however "
                         "far the OOM; a warning, never an action), else 0.",
                         1.0 if verdict is not None and verdict.leak_detected else 0.0)
        yield from gauge("oom_projected", "1 while an OOM is projected near enough to act on (the action path), else 0.",
                         1.0 if verdict is not None and verdict.oom_projected else 0.0)
        yield from gauge("projected_oom_steps", "Training steps left before the projected peak reaches the limit; +Inf when none.",
                         verdict.projected_oom_steps if verdict is not None else math.inf)
        yield from gauge("projected_oom_seconds", "Seconds left before the projected peak reaches the limit; +Inf when none.",
                         verdict.projected_oom_seconds if verdict is not None else math.inf)
        if verdict is not None:
            for name, doc, read in _VERDICT_GAUGES:
                yield from gauge(name, doc, read(verdict))  # type: ignore[operator]

        step = max(t.training_step, sample.step if sample is not None else 0)
        yield from gauge("training_step", "Newest training step the watchdog has seen.", step)
        yield from gauge("training_stalled", "1 when the loop has not stepped for longer than the stall threshold.",
                         1.0 if t.stalled else 0.0)
        yield from gauge("seconds_since_last_step", "Seconds since the step counter last moved (resolution: the stall check interval).",
                         max(0.0, time.monotonic() - t.last_step_monotonic))

        actions = CounterMetricFamily(PREFIX + "actions", "Actions the policy asked for, by kind.",
                                      labels=(*BASE_LABELS, "action"))
        for action, count in t.actions_snapshot().items():
            actions.add_metric([*labels, action.value], float(count))
        yield actions

        yield from counter("restarts", "Restarts this job has had (carried across processes).", t.restarts_total)
        yield from counter("samples", "Memory samples taken.", t.samples_total)
        yield from counter("sample_errors", "Failed memory reads and sidecar errors.", t.sample_errors_total)
        yield from counter("trace_errors", "Failed writes of the trace file (disk full, read-only); training goes on.",
                           t.trace_errors_total)


def merge_families(sources: list) -> Iterator[Metric]:
    """Families of the same name from several collectors, merged: one family with every series."""
    families: dict[str, Metric] = {}
    for source in sources:
        for family in source:
            if family.name in families:
                families[family.name].samples.extend(family.samples)
            else:
                families[family.name] = family
    yield from families.values()


def _host_gauges(t: Telemetry, labels: list[str]) -> Iterator[Metric]:
    """The host series' own figures, beside what it judges (`memory_used_bytes{device="host"}`)."""
    reading = t.host_reading
    if reading is None:
        return
    for name, doc, value in (
            ("host_process_resident_bytes", "The training process's resident memory plus its children's private "
             "memory (USS): the process tree, each page counted once.",
             reading.process_bytes),
            ("host_available_bytes", "The machine's available memory (MemAvailable).", reading.available_bytes)):
        family = GaugeMetricFamily(PREFIX + name, doc, labels=BASE_LABELS)
        family.add_metric(labels, float(value))
        yield family
    if reading.oom_kills is not None:
        family = CounterMetricFamily(PREFIX + "host_oom_kills", "Processes the kernel's OOM killer ended in the "
                                     "job's memory cgroup.", labels=BASE_LABELS)
        family.add_metric(labels, float(reading.oom_kills))
        yield family


def _chip_gauges(t: Telemetry, rank: str) -> Iterator[Metric]:
    """Every chip a multi-chip source reads (the `tpu` source under SPMD), each with its own `device`.

    The decision follows the fullest chip (`memory_used_bytes`); these say which one that is
    and how close the others are.
    """
    chips = t.chips  # replaced whole by the sidecar: one read gives a consistent set
    if not chips:
        return
    used = GaugeMetricFamily(PREFIX + "chip_memory_used_bytes",
                             "Memory in use on each local chip at the newest sample.", labels=BASE_LABELS)
    limit = GaugeMetricFamily(PREFIX + "chip_memory_limit_bytes",
                              "Memory capacity of each local chip, as its runtime reports it.", labels=BASE_LABELS)
    for chip in chips:
        used.add_metric([chip.device, rank], float(chip.bytes_used))
        if chip.bytes_limit is not None:
            limit.add_metric([chip.device, rank], float(chip.bytes_limit))
    yield used
    if limit.samples:
        yield limit


def gauge_family(name: str, doc: str, labels: list[str], value: float | None) -> Iterator[Metric]:
    """One gauge of one series (`device`, `rank`); nothing while the value is unknown (None)."""
    if value is not None:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=BASE_LABELS)
        family.add_metric(labels, float(value))
        yield family


def counter_family(name: str, doc: str, labels: list[str], value: float | None) -> Iterator[Metric]:
    """One counter of one series (`device`, `rank`); nothing while the value is unknown (None)."""
    if value is not None:
        family = CounterMetricFamily(PREFIX + name, doc, labels=BASE_LABELS)
        family.add_metric(labels, float(value))
        yield family


def build_registry(telemetry: Telemetry) -> CollectorRegistry:
    """A registry holding only this telemetry's collector (no process or GC metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TelemetryCollector(telemetry))
    return registry


def serve_metrics(telemetry: Telemetry, port: int = DEFAULT_PORT, *, local_rank: int = 0,
                  addr: str = DEFAULT_ADDRESS, limits: EndpointLimits = EndpointLimits()) -> MetricsServer:
    """Serve `telemetry`'s collector on the endpoint (`endpoint.serve_registry`: the port, the address)."""
    return serve_registry(build_registry(telemetry), port, local_rank=local_rank, addr=addr, limits=limits)
