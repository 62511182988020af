"""The `Sample` record and the trace CSV every other part reads and writes.

Format (watchdog/ARCHITECTURE.md): header `step,timestamp,bytes_used,bytes_limit,peak_bytes_used`,
then an optional `phase` column (the loop's phase label, `watchdog.core.phase`; empty: training or
not said); `timestamp` is Unix seconds as a float; `bytes_limit` and `peak_bytes_used` may be
empty. Traces without the phase column read as before. A writer appends to an existing trace, so
a resumed run continues the same file, in the columns that file has.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, Iterator

from watchdog.core.errors import TraceFormatError

TRACE_HEADER = ("step", "timestamp", "bytes_used", "bytes_limit", "peak_bytes_used")
TRACE_HEADER_WITH_PHASE = TRACE_HEADER + ("phase",)


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of device memory, taken after training step `step`."""

    step: int
    timestamp: float
    bytes_used: int
    bytes_limit: int | None = None
    peak_bytes_used: int | None = None
    phase: str = ""  # the loop's phase label (`watchdog.core.phase`); "": training, or not said

    def to_row(self, with_phase: bool = True) -> list[str]:
        row = [
            str(self.step),
            f"{self.timestamp:.6f}",
            str(self.bytes_used),
            "" if self.bytes_limit is None else str(self.bytes_limit),
            "" if self.peak_bytes_used is None else str(self.peak_bytes_used),
        ]
        if with_phase:
            row.append(self.phase)
        return row


def _int_field(text: str, name: str, path: str, line: int, optional: bool) -> int | None:
    if text == "" and optional:
        return None
    try:
        value = int(text)
    except ValueError:
        try:
            as_float = float(text)
        except ValueError:
            raise TraceFormatError(path, line, f"{name} is not a number: {text!r}") from None
        if not math.isfinite(as_float) or as_float != int(as_float):
            raise TraceFormatError(path, line, f"{name} is not a whole number of bytes: {text!r}")
        value = int(as_float)
    if value < 0:
        raise TraceFormatError(path, line, f"{name} must not be negative: {text!r}")
    return value


def parse_rows(rows: Iterable[list[str]], path: str) -> Iterator[Sample]:
    """Parse CSV rows (header first) into samples; any defect raises TraceFormatError."""
    rows = iter(rows)
    header = next(rows, None)
    if header is None:
        raise TraceFormatError(path, 1, "empty file, expected the header " + ",".join(TRACE_HEADER))
    columns = tuple(h.strip() for h in header)
    if columns not in (TRACE_HEADER, TRACE_HEADER_WITH_PHASE):
        raise TraceFormatError(
            path, 1, f"expected header {','.join(TRACE_HEADER)!r} (then optionally ',phase'), got {','.join(header)!r}"
        )
    fields = len(columns)
    line = 1
    for row in rows:
        line += 1
        if not row:
            continue
        if len(row) != fields:
            raise TraceFormatError(path, line, f"expected {fields} fields, got {len(row)}")
        step = _int_field(row[0], "step", path, line, optional=False)
        try:
            timestamp = float(row[1])
        except ValueError:
            raise TraceFormatError(path, line, f"timestamp is not a number: {row[1]!r}") from None
        if not math.isfinite(timestamp):
            raise TraceFormatError(path, line, f"timestamp is not finite: {row[1]!r}")
        yield Sample(
            step=step,  # type: ignore[arg-type]
            timestamp=timestamp,
            bytes_used=_int_field(row[2], "bytes_used", path, line, optional=False),  # type: ignore[arg-type]
            bytes_limit=_int_field(row[3], "bytes_limit", path, line, optional=True),
            peak_bytes_used=_int_field(row[4], "peak_bytes_used", path, line, optional=True),
            phase=row[5].strip() if fields > 5 else "",
        )


def read_trace(path: str | os.PathLike[str]) -> Iterator[Sample]:
    """Stream the samples of a trace file, one at a time (1M-sample traces stay cheap)."""
    name = str(path)
    try:
        handle = open(path, newline="", encoding="utf-8")
    except OSError as exc:
        raise TraceFormatError(name, 0, f"cannot read: {exc.strerror or exc}") from None
    with handle:
        try:
            yield from parse_rows(csv.reader(handle), name)
        except UnicodeDecodeError:
            raise TraceFormatError(name, 1, "not a text CSV file") from None
        except csv.Error as exc:
            raise TraceFormatError(name, 0, f"malformed CSV: {exc}") from None


def load_trace(path: str | os.PathLike[str]) -> list[Sample]:
    return list(read_trace(path))


class TraceWriter:
    """Appends samples to a trace CSV; writes the header only into a new or empty file.

    Used from the sidecar thread only, never from the training step.
    """

    def __init__(self, path: str | os.PathLike[str], flush_every: int = 64):
        self.path = Path(path)
        self.flush_every = flush_every
        self._pending = 0
        self._with_phase = self._check_existing_header()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle: IO[str] = open(self.path, "a", newline="", encoding="utf-8")
        self._writer = csv.writer(self._handle)
        if self._handle.tell() == 0:
            self._writer.writerow(TRACE_HEADER_WITH_PHASE)
            self._handle.flush()

    def _check_existing_header(self) -> bool:
        """Whether rows carry the phase column: a new file does; an old trace keeps its five."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return True
        with open(self.path, newline="", encoding="utf-8") as handle:
            first = tuple(handle.readline().strip().split(","))
        if first not in (TRACE_HEADER, TRACE_HEADER_WITH_PHASE):
            raise TraceFormatError(str(self.path), 1, "exists but is not a trace CSV; refusing to append")
        return first == TRACE_HEADER_WITH_PHASE

    def write(self, sample: Sample) -> None:
        self._writer.writerow(sample.to_row(self._with_phase))
        self._pending += 1
        if self._pending >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        self._handle.flush()
        self._pending = 0

    def close(self) -> None:
        if not self._handle.closed:
            self._handle.flush()
            self._handle.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_trace(path: str | os.PathLike[str], samples: Iterable[Sample]) -> None:
    """Write a whole trace (tests, the benchmark corpus); appends like the live writer."""
    with TraceWriter(path, flush_every=1 << 30) as writer:
        for sample in samples:
            writer.write(sample)
