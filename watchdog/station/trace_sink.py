"""A trace CSV written as best-effort telemetry: a failing disk never reaches training.

An I/O error writing it (disk full, read-only file system) is logged once per kind and counted
(`hbmwatch_trace_errors_total` of its telemetry), the file is reopened a while later (its torn last
row cut off), and nothing of it ever reaches training or its exit status. At start, a path that
cannot be a trace is the user's error (InputError, exit 2). Every station writes its trace through
one: the sidecar's device and host series, and each device the `watch` daemon reads.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from watchdog.core.errors import InputError
from watchdog.core.sample import Sample, TraceWriter
from watchdog.logs import OncePerKind, get_logger
from watchdog.station.telemetry import Telemetry

log = get_logger(__name__)


class TraceSink:
    def __init__(self, path: Path, telemetry: Telemetry, retry_seconds: Callable[[], float], *, flush_every: int = 64,
                 named_by_user: bool = True):
        """`retry_seconds`: read at each failure, so a test may shorten the wait on a live watchdog.
        `flush_every`: rows kept before a flush (the daemon, at one row a second, flushes sooner).
        `named_by_user=False`: a name the tool chose (`TRACE.host.csv`, a device's trace in `watch`),
        never written through a link."""
        self.path = path
        self._follow = named_by_user
        self._flush_every = flush_every
        self.samples_missed = 0
        self._telemetry = telemetry
        self._retry_seconds = retry_seconds
        self._writer: TraceWriter | None = None
        self._retry_at = 0.0
        self._error_log = OncePerKind(log, "trace_write_failed", level="error")
        self._open(at_start=True)

    def _open(self, *, at_start: bool = False) -> bool:
        try:
            self._writer = TraceWriter(self.path, flush_every=self._flush_every, follow_symlinks=self._follow)
            return True
        except InputError:
            if at_start:
                raise
            self._failed("trace_open", None)
        except OSError as exc:
            self._failed("trace_open", exc)
        return False

    def write(self, sample: Sample) -> None:
        if self._writer is None:
            if time.monotonic() < self._retry_at or not self._open():
                self.samples_missed += 1
                return
            log.info("trace_resumed", path=str(self.path), step=sample.step, samples_missing=self.samples_missed)
        try:
            self._writer.write(sample)  # type: ignore[union-attr]
        except OSError as exc:
            self._failed("trace_write", exc)

    def close(self) -> None:
        """Flush and close; never raises (a full disk at the end must not turn a finished run into a failure)."""
        if self._writer is None:
            return
        try:
            self._writer.close()
            self._writer = None
        except OSError as exc:
            self._failed("trace_close", exc)

    def _failed(self, kind: str, exc: OSError | None) -> None:
        if self._writer is not None:
            self.samples_missed += self._writer.abandon()
            self._writer = None
        retry = self._retry_seconds()
        self._retry_at = time.monotonic() + retry
        self._telemetry.trace_errors_total += 1
        reason = "cannot append to it" if exc is None else (exc.strerror or type(exc).__name__)
        self._error_log(kind, reason, path=str(self.path), error=reason, errno=getattr(exc, "errno", None),
                     note=f"training goes on; the trace is retried every {retry:g} s, and {OncePerKind.NOTE}")
