"""Prometheus exporter: a collector over the `Telemetry` cache and an HTTP endpoint for it.

Why a custom collector and not module-level Gauges: a scrape must never call into the XLA
runtime (a scrape arriving mid-step would read device state on the wrong thread, and could
force a sync). The sidecar writes the cache; a scrape only turns that cache into text. Each
exporter has its own `CollectorRegistry`, so several watchdogs in one process (tests, one per
local rank) never clash, and no default process/GC metrics sneak in.

Labels are bounded on purpose: `device` and `rank` on every series, `action` on
`hbmwatch_actions_total`, `version` and `source` on `hbmwatch_build_info`. Values are base
units (bytes, seconds, steps); "no OOM in sight" is +Inf, which Prometheus and PromQL handle.

The endpoint listens on loopback unless told otherwise (`--metrics-address`, like node-exporter's
`--web.listen-address`): a workstation's training job should not serve the network; a pod sets
all interfaces (deploy/k8s). It serves from a fixed pool of threads with an idle timeout, so no
number of clients, slow or half-open, can grow its threads or file descriptors.
"""

from __future__ import annotations

import errno
import math
import queue
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import make_wsgi_app

from watchdog import __version__
from watchdog.core.errors import InputError
from watchdog.logs import get_logger
from watchdog.runtime.telemetry import Telemetry

log = get_logger(__name__)

PREFIX = "hbmwatch_"
DEFAULT_PORT = 9400  # clear of libtpu's 8431, the TPU runtime's 8471 and 8476-8479
DEFAULT_ADDRESS = "127.0.0.1"  # this machine only; a pod listens on all interfaces (deploy/k8s)
SCRAPE_WORKERS = 4  # connections served at once; a scrape takes about a millisecond
MAX_SCRAPES_PER_SECOND = 10.0  # Prometheus scrapes every 15-60 s; more than this is a storm, paced
IDLE_TIMEOUT_SECONDS = 3.0  # a client silent (or not reading) for this long is dropped
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
    """Turns one `Telemetry` into metric families at scrape time. Reads the cache, nothing else."""

    def __init__(self, telemetry: Telemetry):
        self.telemetry = telemetry

    def describe(self) -> list[Metric]:
        # Registering must not run collect() against a half-filled cache; names are not needed
        # because this registry holds only this collector.
        return []

    def collect(self) -> Iterator[Metric]:
        t = self.telemetry
        sample, verdict = t.sample, t.verdict  # read each field once: the sidecar replaces them whole
        labels = [t.device, str(t.rank)]

        def gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
            if value is None:
                return
            family = GaugeMetricFamily(PREFIX + name, doc, labels=BASE_LABELS)
            family.add_metric(labels, float(value))
            yield family

        def counter(name: str, doc: str, value: float | None) -> Iterator[Metric]:
            if value is None:
                return
            family = CounterMetricFamily(PREFIX + name, doc, labels=BASE_LABELS)
            family.add_metric(labels, float(value))
            yield family

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
        yield from counter("xla_compilations", "XLA graphs compiled in this process (absent off XLA).",
                           t.xla_compilations_total)
        detected = t.recompilation_detected
        yield from gauge("recompilation_detected", "1 while XLA keeps compiling new graphs after warm-up (the "
                         "watchdog's `recompilation` finding, which names the cause), else 0; absent off XLA.",
                         None if detected is None else float(detected))
        yield from gauge("steps_per_recompilation", "Training steps per XLA compilation since warm-up; +Inf when "
                         "none (absent off XLA).", t.steps_per_recompilation)

        yield from gauge("checkpoint_disk_free_bytes", "Free bytes on the file system checkpoints are written to.",
                         t.checkpoint_disk_free_bytes)
        yield from gauge("checkpoint_size_bytes", "Size of the newest checkpoint: about what the next one needs.",
                         t.checkpoint_size_bytes)

        bounds, counts, total, count = t.checkpoint_snapshot()
        histogram = HistogramMetricFamily(PREFIX + "checkpoint_seconds", "Time to write a checkpoint.",
                                          labels=BASE_LABELS)
        buckets = [(_bucket_label(b), float(c)) for b, c in zip(bounds, counts)] + [("+Inf", float(count))]
        histogram.add_metric(labels, buckets, total)
        yield histogram


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


def _bucket_label(bound: float) -> str:
    return str(float(bound))


def build_registry(telemetry: Telemetry) -> CollectorRegistry:
    """A registry holding only this telemetry's collector (no process or GC metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TelemetryCollector(telemetry))
    return registry


class _QuietHandler(WSGIRequestHandler):
    timeout = IDLE_TIMEOUT_SECONDS  # set on the socket: a half-open client cannot hold a worker for long

    def log_message(self, format, *args) -> None:  # noqa: A002 - a scrape is not worth a log line
        pass


class PooledWSGIServer(WSGIServer):
    """A WSGI server that costs the training process a bounded share, whatever its clients do.

    prometheus_client's server starts a thread per connection and never times one out: 200
    half-open clients made 219 threads and 206 fds. Here one thread accepts and `workers` serve.
    The acceptor takes a connection only when a worker is free, and at most `max_rate` a second;
    everything else waits in the kernel's listen backlog (or is refused by it) and costs this
    process nothing. A client idle for IDLE_TIMEOUT_SECONDS is dropped. So the endpoint has
    `workers + 1` threads and at most `workers` open connections, and a storm of clients cannot
    take the interpreter from the training loop.
    """

    request_queue_size = 64  # the kernel's listen backlog

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily, *, workers: int = SCRAPE_WORKERS,
                 max_rate: float = MAX_SCRAPES_PER_SECOND):
        self.address_family = family
        self._free = threading.BoundedSemaphore(workers)
        self._handoff: queue.SimpleQueue = queue.SimpleQueue()
        self._interval = 1.0 / max_rate
        self._stopping = threading.Event()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._workers = [threading.Thread(target=self._work, name=f"hbm-watchdog-metrics-worker-{i}", daemon=True)
                         for i in range(workers)]
        for worker in self._workers:
            worker.start()
        super().__init__(address, _QuietHandler)  # a failed bind calls server_close, which stops the workers

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Accept, paced and only for a free worker, until `shutdown`."""
        next_accept = 0.0
        with selectors.DefaultSelector() as selector:
            selector.register(self.socket, selectors.EVENT_READ)
            selector.register(self._wake_reader, selectors.EVENT_READ)
            while not self._stopping.is_set():
                if not self._free.acquire(timeout=poll_interval):
                    continue
                handed_over = False
                try:
                    pause = next_accept - time.monotonic()
                    if (pause > 0 and self._stopping.wait(pause)) or not selector.select():
                        continue
                    if self._stopping.is_set():
                        break
                    try:
                        request, client_address = self.socket.accept()
                    except OSError:  # the client gave up between select and accept
                        continue
                    next_accept = time.monotonic() + self._interval
                    self._handoff.put((request, client_address))
                    handed_over = True
                finally:
                    if not handed_over:
                        self._free.release()

    def shutdown(self) -> None:
        self._stopping.set()
        try:
            self._wake_writer.send(b"x")
        except OSError:
            pass

    def _work(self) -> None:
        while (item := self._handoff.get()) is not None:
            request, client_address = item
            try:
                self.finish_request(request, client_address)
            except Exception:  # noqa: BLE001 - a client that hung up mid-response is its own problem
                pass
            finally:
                self.shutdown_request(request)
                self._free.release()

    def server_close(self) -> None:
        self.shutdown()
        super().server_close()
        for _ in self._workers:
            self._handoff.put(None)
        for worker in self._workers:
            worker.join(timeout=IDLE_TIMEOUT_SECONDS + 1)
        self._wake_reader.close()
        self._wake_writer.close()


@dataclass
class MetricsServer:
    """A running endpoint. `addr` and `port` are the ones actually bound (port 0 asks for any free one)."""

    addr: str
    port: int
    registry: CollectorRegistry
    _httpd: PooledWSGIServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port. Idempotent."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._httpd.server_close()

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(telemetry: Telemetry, port: int = DEFAULT_PORT, *, local_rank: int = 0,
                  addr: str = DEFAULT_ADDRESS) -> MetricsServer:
    """Serve `/metrics` for `telemetry` on `addr`, port `port + local_rank` (port 0: any free port).

    One process per local rank shares a host (and, with hostNetwork on GKE, the node's ports),
    so each rank offsets the base port by its local rank; the actual URL is logged.
    """
    return serve_registry(build_registry(telemetry), port, local_rank=local_rank, addr=addr)


def serve_registry(registry: CollectorRegistry, port: int = DEFAULT_PORT, *, local_rank: int = 0,
                   addr: str = "0.0.0.0") -> MetricsServer:
    """`serve_metrics` for a registry built by the caller (the daemon: one collector over every device)."""
    if not isinstance(port, int) or isinstance(port, bool) or port < 0:
        raise InputError(f"metrics port must be a non-negative integer, got {port!r}")
    if not isinstance(local_rank, int) or local_rank < 0:
        raise InputError(f"local rank must be a non-negative integer, got {local_rank!r}")
    bind_port = port + local_rank if port else 0
    if bind_port > 65535:
        raise InputError(f"metrics port {port} + local rank {local_rank} is above 65535")
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, bind_port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
        httpd = PooledWSGIServer(sockaddr[:2], family)
    except OSError as exc:  # a name that does not resolve (gaierror) included
        if exc.errno == errno.EADDRINUSE:
            raise InputError(f"metrics port {bind_port} on {addr} is already in use "
                             f"(base {port} + local rank {local_rank}); pick another with --metrics-port") from None
        raise InputError(f"cannot serve metrics on {addr}:{bind_port}: {exc.strerror or exc}") from None
    httpd.set_app(make_wsgi_app(registry))
    thread = threading.Thread(target=httpd.serve_forever, name=f"hbm-watchdog-metrics-{local_rank}", daemon=True)
    thread.start()
    server = MetricsServer(str(httpd.server_address[0]), int(httpd.server_port), registry, httpd, thread)
    log.info("metrics_serving", url=server.url, addr=server.addr, port=server.port, local_rank=local_rank)
    return server
