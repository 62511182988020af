"""The `Sample` record and the trace CSV every other part reads and writes.

Format (watchdog/ARCHITECTURE.md): header `step,timestamp,bytes_used,bytes_limit,peak_bytes_used`,
then an optional `phase` column (the loop's phase label, `watchdog.core.phase`; empty: training or
not said); `timestamp` is Unix seconds as a float; `bytes_limit` and `peak_bytes_used` may be
empty. Traces without the phase column read as before. A writer appends to an existing trace, so
a resumed run continues the same file, in the columns that file has.

A writer killed mid-row (SIGKILL, the OOM killer, a full disk) leaves a last line without its
newline. Readers skip that torn line with a warning (a row cut inside its last field can still
have five fields, so only the missing newline tells), and a writer cuts it off before appending,
so the next row never glues onto it. Lines are read with a bound, so a file with no newline is a
one-line error, not a MemoryError; and a trace path that names no regular file (a FIFO, a
directory, `/dev/zero`) is refused before anything waits on it (`watchdog.core.inputs`).

Numbers are ASCII and bounded (`watchdog.core.numbers`): a step below 2**52, byte counts below
2**63; `int()` and `float()` would read `'١'` as 1, and a step of 2**60 would make neighbouring
steps one float. A row outside them is an error naming the file and line, like any other defect.
"""

from __future__ import annotations

import csv
import errno
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, Iterator

from watchdog.core.errors import InputError, TraceFormatError
from watchdog.core.inputs import LineTooLong, NotARegularFile, drop_torn_tail, open_regular
from watchdog.core.numbers import MAX_SIZE, MAX_STEP, whole_number

TRACE_HEADER = ("step", "timestamp", "bytes_used", "bytes_limit", "peak_bytes_used")
BOM = "\ufeff"  # a UTF-8 byte order mark, as spreadsheets write it before the header
TRACE_HEADER_WITH_PHASE = TRACE_HEADER + ("phase",)
MAX_LINE_CHARS = 4096  # a row is about 100 characters; a longer line is not a trace
_LINE_ENDS = ("\n", "\r")
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?")  # ASCII: 1073741824, 1073741824.0, 1.07e9
_BOUNDS = {"step": ("a step", MAX_STEP), "bytes_used": ("a size", MAX_SIZE), "bytes_limit": ("a size", MAX_SIZE),
           "peak_bytes_used": ("a size", MAX_SIZE)}  # each integer column: what it names, and the bound it is below
# open() failures that are the configuration's fault (exit 2), not the disk's (best effort, retried)
_NOT_APPENDABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.EISDIR, errno.ENOTDIR, errno.ENOENT,
                   errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP}

_log = logging.getLogger(__name__)  # core stays free of our logging layer; stdlib records render the same


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
    """One integer column: ASCII digits (or a whole number in decimal or exponent form, as a
    spreadsheet may write it), below its column's bound; else the TraceFormatError saying why."""
    if text == "" and optional:
        return None
    what, bound = _BOUNDS[name]
    number = text.strip()
    if number.startswith("-") and _DECIMAL.fullmatch(number[1:]):
        raise TraceFormatError(path, line, f"{name} must not be negative: {text!r}")
    if not _DECIMAL.fullmatch(number):
        raise TraceFormatError(path, line, f"{name} is not a number in the digits 0-9: {text[:40]!r}")
    if not number.isdigit():  # 1.0e9: a float first, and only a whole one
        as_float = float(number)
        if not math.isfinite(as_float) or as_float != int(as_float):
            raise TraceFormatError(path, line, f"{name} is not a whole number: {text!r}")
        number = str(int(as_float))
    try:
        return whole_number(number, what, 0, bound - 1)
    except InputError as exc:
        raise TraceFormatError(path, line, f"{name}: {exc}") from None


def parse_rows(rows: Iterable[list[str]], path: str) -> Iterator[Sample]:
    """Parse CSV rows (header first) into samples; any defect raises TraceFormatError."""
    rows = iter(rows)
    header = next(rows, None)
    if header is None:
        raise TraceFormatError(path, 1, "empty file, expected the header " + ",".join(TRACE_HEADER))
    columns = tuple(h.strip().lstrip(BOM) for h in header)  # an Excel export starts with a BOM
    if columns not in (TRACE_HEADER, TRACE_HEADER_WITH_PHASE):
        raise TraceFormatError(
            path, 1, f"expected header {','.join(TRACE_HEADER)!r} (then optionally ',phase'), got {','.join(header)!r}"
        )
    fields = len(columns)
    line = 1
    isfinite = math.isfinite
    for row in rows:
        line += 1
        if not row:
            continue
        if len(row) != fields:
            raise TraceFormatError(path, line, f"expected {fields} fields, got {len(row)}")
        digits = row[0] + row[2] + row[3] + row[4]
        if digits.isascii() and digits.isdigit() and row[1].isascii() and "_" not in row[1] and row[0] and row[2]:
            # the rows a writer of ours wrote: ASCII digits (so nothing negative), an ASCII timestamp
            try:
                timestamp = float(row[1])
            except ValueError:
                timestamp = math.nan  # the careful way below says what is wrong
            step, used = int(row[0]), int(row[2])
            limit = int(row[3]) if row[3] else None
            peak = int(row[4]) if row[4] else None
            if (step < MAX_STEP and used < MAX_SIZE and isfinite(timestamp) and (limit is None or limit < MAX_SIZE)
                    and (peak is None or peak < MAX_SIZE)):
                yield Sample(step, timestamp, used, limit, peak, row[5].strip() if fields > 5 else "")
                continue
        yield _careful_row(row, fields, path, line)  # says what is wrong, or accepts "1e9"


def _careful_row(row: list[str], fields: int, path: str, line: int) -> Sample:
    """One row the fast path of `parse_rows` did not take: a Sample, or the TraceFormatError saying why not."""
    step = _int_field(row[0], "step", path, line, optional=False)
    try:
        if not row[1].isascii() or "_" in row[1]:
            raise ValueError  # float() reads other scripts' digits too, and Python's digit groups (1_000)
        timestamp = float(row[1])
    except ValueError:
        raise TraceFormatError(path, line, f"timestamp is not a number: {row[1][:40]!r}") from None
    if not math.isfinite(timestamp):
        raise TraceFormatError(path, line, f"timestamp is not finite: {row[1]!r}")
    return Sample(
        step=step,  # type: ignore[arg-type]
        timestamp=timestamp,
        bytes_used=_int_field(row[2], "bytes_used", path, line, optional=False),  # type: ignore[arg-type]
        bytes_limit=_int_field(row[3], "bytes_limit", path, line, optional=True),
        peak_bytes_used=_int_field(row[4], "peak_bytes_used", path, line, optional=True),
        phase=row[5].strip() if fields > 5 else "",
    )


def bounded_lines(handle: IO[str], path: str) -> Iterator[str]:
    """The lines of `handle`, none longer than MAX_LINE_CHARS; a torn last line is skipped with a warning.

    Only the last line can lack its newline, and only a writer that died mid-row leaves one. The
    header is exempt: a trace with no rows may end right after it.
    """
    readline = handle.readline
    number = 0
    while line := readline(MAX_LINE_CHARS):
        number += 1
        if not line.isascii():  # read with surrogateescape: a byte that is no UTF-8 is found on its own line
            try:
                line.encode("utf-8")
            except UnicodeEncodeError:
                raise TraceFormatError(path, number, "not UTF-8 text: not a trace CSV") from None
        if not line.endswith(_LINE_ENDS):
            if len(line) >= MAX_LINE_CHARS:
                raise TraceFormatError(path, number, f"line longer than {MAX_LINE_CHARS} characters: not a trace CSV")
            if number > 1:
                _log.warning("%s:%d: skipped a torn last line (no newline: its writer stopped mid-row): %r",
                             path, number, line[:80])
                return
        yield line


def read_trace(path: str | os.PathLike[str]) -> Iterator[Sample]:
    """Stream the samples of a trace file, one at a time (1M-sample traces stay cheap)."""
    name = str(path)
    try:
        handle = open_regular(path, "r", newline="", encoding="utf-8", errors="surrogateescape")
    except OSError as exc:
        raise TraceFormatError(name, 0, f"cannot read: {exc.strerror or exc}") from None
    with handle:
        try:
            yield from parse_rows(csv.reader(bounded_lines(handle, name)), name)
        except UnicodeDecodeError:
            raise TraceFormatError(name, 1, "not a text CSV file") from None
        except csv.Error as exc:
            raise TraceFormatError(name, 0, f"malformed CSV: {exc}") from None
        except OSError as exc:  # a disk that fails mid-read
            raise TraceFormatError(name, 0, f"cannot read: {exc.strerror or exc}") from None


def load_trace(path: str | os.PathLike[str]) -> list[Sample]:
    return list(read_trace(path))


class TraceWriter:
    """Appends samples to a trace CSV; writes the header only into a new or empty file.

    Used from the sidecar thread only, never from the training step. `write` and `flush` raise
    the disk's OSError (the sidecar decides what a failure means); a path that cannot be appended
    to at all (a directory, a FIFO, a device, a read-only file system, no permission) is an
    InputError, and no open of it waits (a FIFO's would, for a reader).
    """

    def __init__(self, path: str | os.PathLike[str], flush_every: int = 64, *, follow_symlinks: bool = True):
        """`follow_symlinks=False` for a name the tool chose itself (the host's trace beside the
        user's, a device's in `watch`): a link planted there is refused, never written through."""
        self.path = Path(path)
        self.flush_every = flush_every
        self._follow = follow_symlinks
        self._pending = 0
        try:
            self._with_phase = self._check_existing_header()
            self._drop_torn_tail()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle: IO[str] = open_regular(self.path, "a", newline="", encoding="utf-8",
                                                 follow_symlinks=follow_symlinks)
        except NotARegularFile as exc:
            raise InputError(f"trace file {self.path}: cannot append to it: {exc.kind}, not a regular file") from None
        except OSError as exc:
            if exc.errno in _NOT_APPENDABLE:
                raise InputError(f"trace file {self.path}: cannot append to it: {exc.strerror or exc}") from None
            raise
        self._writer = csv.writer(self._handle)
        if self._handle.tell() == 0:
            self._writer.writerow(TRACE_HEADER_WITH_PHASE)
            self._handle.flush()

    def _check_existing_header(self) -> bool:
        """Whether rows carry the phase column: a new file does; an old trace keeps its five."""
        if not (self.path.exists() if self._follow else os.path.lexists(self.path)):
            return True
        with open_regular(self.path, "r", newline="", encoding="utf-8", errors="replace",
                          follow_symlinks=self._follow) as handle:
            line = handle.readline(MAX_LINE_CHARS)
        if not line:  # an empty file: a new trace
            return True
        first = tuple(line.strip().lstrip(BOM).split(","))
        if first not in (TRACE_HEADER, TRACE_HEADER_WITH_PHASE):
            raise TraceFormatError(str(self.path), 1, "exists but is not a trace CSV; refusing to append")
        return first == TRACE_HEADER_WITH_PHASE

    def _drop_torn_tail(self) -> None:
        """Cut off a last row its writer never finished, so the next row starts on a line of its own.

        The fragment is a row that was never complete (its last field may be cut short and still
        parse), so it carries nothing to keep; it is logged, not silently dropped.
        """
        try:
            fragment = drop_torn_tail(self.path, MAX_LINE_CHARS, header=True, follow_symlinks=self._follow)
        except LineTooLong:
            raise TraceFormatError(str(self.path), 0, f"last line longer than {MAX_LINE_CHARS} "
                                   "characters: not a trace CSV; refusing to append") from None
        if fragment:
            _log.warning("%s: cut off a torn last row before appending (its writer stopped mid-row): %r",
                         self.path, fragment[:80].decode("utf-8", "replace"))

    def write(self, sample: Sample) -> None:
        self._writer.writerow(sample.to_row(self._with_phase))
        self._pending += 1
        if self._pending >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        self._handle.flush()
        self._pending = 0

    def abandon(self) -> int:
        """After a failed write: let go of the file without raising. Returns the rows that may not
        have reached it; a row left half-written is cut off by the next writer."""
        unflushed = self._pending
        try:
            self._handle.close()  # tries one last flush, and closes the file whether or not it works
        except OSError:
            pass
        self._pending = 0
        return unflushed

    def close(self) -> None:
        if not self._handle.closed:
            self._handle.flush()
            self._handle.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def labelled_trace_path(base: str | os.PathLike[str], label: str) -> Path:
    """The trace of another series beside `base`: `trace.host.csv`, `trace.tpu-0.csv` beside `trace.csv`."""
    base = Path(base)
    safe = "".join(c if c.isalnum() else "-" for c in label)
    return base.with_name(f"{base.stem}.{safe}{base.suffix}")


def write_trace(path: str | os.PathLike[str], samples: Iterable[Sample]) -> None:
    """Write a whole trace (tests, the benchmark corpus); appends like the live writer."""
    with TraceWriter(path, flush_every=1 << 30) as writer:
        for sample in samples:
            writer.write(sample)
