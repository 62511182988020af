"""The host's series inside a training process: read, judged by a `Judge` of its own, recorded.

The sidecar thread drives it beside the device's series, on its own cadence (every
`host_sample_every` steps). It owns what the host's memory needs and the device's does not share:
its `HostMemory` reader and a `Station` of its own, with its own Judge (the same two signals: a
leak reported, an OOM projected), telemetry (`device="host"` on /metrics) and trace
(`trace.host.csv` beside the trace). The verdict and action go back to the sidecar, which acts on
them as on the device's.

Its policy restarts from the first checkpoint action (`prefer_restart`): host memory a process
took (heap arenas, a checkpointer's buffers, pinned staging copies) is seldom all given back in
process, and a new process always gives it back.

Where the device's memory is the host's (PJRT CPU and CPU: the `rss` source), there is one
memory and one series: the host is not judged apart (`judged=False`); the device's series is
judged against the tighter of the two budgets instead (`merge_into_rss`), and the host's figures
(the process tree's memory, the machine's available memory) go on the device's telemetry.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from watchdog.core.config import WatchdogConfig
from watchdog.core.errors import InputError
from watchdog.core.judge import Judge, effective_limit
from watchdog.core.sample import Sample, labelled_trace_path
from watchdog.core.verdict import Action, Verdict
from watchdog.logs import get_logger
from watchdog.readers.host_memory import HOST_DEVICE, HostMemory, HostReading
from watchdog.station.station import Station
from watchdog.station.telemetry import Telemetry
from watchdog.station.trace_sink import TraceSink

log = get_logger(__name__)

HOST = HOST_DEVICE


class HostWatch:
    def __init__(self, config: WatchdogConfig, telemetry: Telemetry, *, judged: bool = True,
                 trace_retry_seconds=lambda: 30.0, memory: HostMemory | None = None):
        """`judged`: the host's own series, judge and trace, on `telemetry` (the host's); else only its
        figures, on `telemetry` (the device's, whose series is this same memory)."""
        self.memory = memory or HostMemory(limit_bytes=config.host_memory_limit_bytes)
        self.telemetry = telemetry
        self.every = config.host_sample_every or config.sample_every
        self.reading: HostReading | None = None
        self._next_step = 0
        self.station: Station | None = None
        if not judged:
            return
        judge = Judge(config.detector, dataclasses.replace(config.policy, prefer_restart=True),
                      memory_limit_bytes=self.memory.limit_bytes)  # the Watchdog gives it the run's state
        telemetry.device, telemetry.source, telemetry.rank = HOST, f"host-{self.memory.domain}", config.rank
        trace = None
        if config.trace_file is not None:
            trace = TraceSink(labelled_trace_path(config.trace_file, HOST), telemetry, trace_retry_seconds,
                              named_by_user=False)
        self.station = Station(judge, telemetry, trace, memory=HOST)
        log.info("host_memory_watched", **self.memory.describe(), sample_every=self.every,
                 trace_file=str(trace.path) if trace else None)

    def due(self, step: int) -> bool:
        return step >= self._next_step or step < self._next_step - self.every  # a step going back: a new run

    def observe(self, step: int, phase: str, act: Callable[[Action, Verdict], None] | None = None
                ) -> tuple[Verdict, Action] | None:
        """Read the host, judge it, record it (None: read only, not judged); an action goes to `act`
        first (`Station.observe`). Raises what the reading raises (the sidecar counts it)."""
        self._next_step = step + self.every
        if self.station is None:  # one memory: the device's source has just read it
            reading = self.reading = self.memory.last or self.memory.read()
            self.telemetry.host_reading = reading
            return None
        reading = self.reading = self.memory.read()
        self.telemetry.host_reading = reading
        return self.station.observe(Sample(step, time.time(), reading.bytes_used, reading.bytes_limit,
                                           reading.peak_bytes_used, phase), act)

    def reinit_finished(self, reading: HostReading | None, took_steps: int | None = None, held: bool = False) -> None:
        """After a reinit in process: what it gave back of the host's memory too (`reading`, taken
        between steps after freed pages were handed back; `held`: the census found what it named still held)."""
        if self.station is not None and reading is not None:
            self.station.reinit_finished(float(reading.bytes_used), took_steps, held)

    def close(self) -> None:
        if self.station is not None:
            self.station.close()


def merge_into_rss(source, config: WatchdogConfig, telemetry: Telemetry) -> HostWatch:
    """PJRT CPU and CPU: the device's memory is the job's memory in host RAM, the host's. One series,
    judged against every limit over it: the tighter of `--memory-limit` and the host's budget, and
    the kernel's (a cgroup's, RLIMIT_AS, RLIMIT_DATA; the machine's where none is). Said once. The
    host's figures are read on (returned: not judged) onto the device's telemetry."""
    budget = effective_limit(config.memory_limit_bytes, config.host_memory_limit_bytes)
    memory = source.memory = HostMemory(limit_bytes=budget, tree=source.tree)
    log.info("host_memory_is_device_memory", source=source.name, **_said(memory.describe()),
             memory_limit_bytes=config.memory_limit_bytes,
             note="one memory, one series: judged against the tightest of its limits")
    return HostWatch(config, telemetry, judged=False, memory=memory)


def watch_the_host(source, config: WatchdogConfig, telemetry: Telemetry,
                   trace_retry_seconds: Callable[[], float]) -> HostWatch | None:
    """The host's series beside the device's (its telemetry the device's `host_series`), or one
    series where they are the same memory (the `rss` source); None where the host cannot be read
    (no /proc: not Linux), said once: the device is still watched."""
    try:
        if source.name == "rss":
            return merge_into_rss(source, config, telemetry)
        host_telemetry = Telemetry()
        watch = HostWatch(config, host_telemetry, trace_retry_seconds=trace_retry_seconds)
        telemetry.host_series = host_telemetry
        return watch
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - no /proc (not Linux): the device is still watched
        log.warning("host_memory_unwatched", error=f"{type(exc).__name__}: {exc}")
        return None


def _said(described: dict) -> dict:
    """The start-up line's words for what is judged against what (`HostMemory.describe`)."""
    return {f"host_{key}" if key in ("domain", "limit_bytes") else key: value for key, value in described.items()}
