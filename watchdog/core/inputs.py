"""Opening a file someone named: a regular file, or a one-line InputError; never a hang.

A path from the command line, the environment or a checkpoint directory can name anything. A
plain `open()` of a FIFO waits for a writer for good (and a signal handler cannot end that wait
cleanly), `/dev/zero` never ends, a directory fails late with a confusing error. So every reader
opens through `open_regular`: the open itself never blocks (O_NONBLOCK), the descriptor is then
checked for what it is (fstat on the descriptor opened: no window between the check and the use),
and only a regular file is handed back, in blocking mode. `follow_symlinks=False` also refuses a
symbolic link (O_NOFOLLOW): a checkpoint must live in its directory, not point elsewhere.
"""

from __future__ import annotations

import os
import stat
from typing import IO, Any

from watchdog.core.errors import InputError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link"))
# open()'s modes -> os.open flags; only the ones the project uses
_FLAGS = {"r": os.O_RDONLY, "r+": os.O_RDWR, "a": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
          "a+": os.O_RDWR | os.O_APPEND | os.O_CREAT}


class NotARegularFile(InputError):
    """A path names something other than a regular file; `kind` says what ("a FIFO (named pipe)")."""

    def __init__(self, path: str | os.PathLike[str], kind: str, what: str = ""):
        super().__init__(f"{what}{os.fspath(path)}: {kind}, not a regular file")
        self.path, self.kind = os.fspath(path), kind


def kind_of(mode: int) -> str | None:
    """What a file of this st_mode is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a file of a known kind")


def open_regular(path: str | os.PathLike[str], mode: str = "rb", *, what: str = "",
                 follow_symlinks: bool = True, **text: Any) -> IO:
    """`open(path, mode, **text)` for a regular file only; anything else raises NotARegularFile at once.

    `mode` is one of r, r+, a, a+ (with b or not); `what` prefixes the error (e.g. "--pidfile "). Other
    failures (no such file, no permission) are the OSError they always were: callers decide what
    those mean (a pidfile not written yet is waited for, a missing trace is an error).
    """
    flags = _FLAGS[mode.replace("b", "").replace("t", "")] | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o666)
    except OSError:
        # a socket (ENXIO), a FIFO opened to write with no reader (ENXIO), a symbolic link refused
        # (ELOOP), a directory opened to write (EISDIR): say what it is, not the errno's words
        kind = _kind_at(path, follow_symlinks)
        if kind is not None:
            raise NotARegularFile(path, kind, what) from None
        raise
    try:
        kind = kind_of(os.fstat(fd).st_mode)
        if kind is not None:
            raise NotARegularFile(path, kind, what)
        os.set_blocking(fd, True)  # a regular file: reads behave as always
        return os.fdopen(fd, mode, **text)
    except BaseException:
        os.close(fd)
        raise


def _kind_at(path: str | os.PathLike[str], follow_symlinks: bool) -> str | None:
    try:
        return kind_of(os.stat(path, follow_symlinks=follow_symlinks).st_mode)
    except OSError:
        return None


class LineTooLong(ValueError):
    """A file's last line is longer than its format allows: not a file of that format."""


def drop_torn_tail(path: str | os.PathLike[str], max_line_chars: int, *, header: bool = False,
                   follow_symlinks: bool = True) -> bytes:
    """Cut off a last line its writer never finished (no newline), so an append starts on a line of
    its own; returns the fragment cut (empty: nothing was torn, or no file).

    A line-per-record file (a trace, a job file) killed mid-write keeps a fragment that carries
    nothing to keep. `header`: the file's first line is a header, kept even without its newline
    (it is ended instead). LineTooLong when the last line is longer than `max_line_chars`.
    """
    if not os.path.exists(path):
        return b""
    with open_regular(path, "rb+", follow_symlinks=follow_symlinks) as handle:
        end = handle.seek(0, os.SEEK_END)
        if end == 0:
            return b""
        handle.seek(end - 1)
        if handle.read(1) in (b"\n", b"\r"):
            return b""
        start = max(0, end - 4 * max_line_chars)
        handle.seek(start)
        tail = handle.read()
        cut = max(tail.rfind(b"\n"), tail.rfind(b"\r"))
        if cut < 0 and start > 0:
            raise LineTooLong(path)
        if cut < 0 and header:
            handle.write(b"\n")  # the header alone, its newline missing: end it
            return b""
        handle.truncate(start + cut + 1)
        return tail[cut + 1:]



def folder_to_write(text: str) -> str:
    """A folder a command writes into, named by a user: absent (made when written) or a directory
    (through links); anything else (a file, a FIFO, a dangling link) is one InputError now, before
    the work whose results it would hold."""
    if not text:
        raise InputError("an empty path, not a folder to write into")
    if os.path.lexists(text):
        try:
            mode = os.stat(text).st_mode
        except OSError as exc:
            raise InputError(f"{text}: {exc.strerror or exc}, not a folder to write into") from None
        if not stat.S_ISDIR(mode):
            raise InputError(f"{text}: {kind_of(mode) or 'a regular file'}, not a folder to write into")
    return text


def file_to_write(text: str) -> str:
    """A file a command writes whole, named by a user: never a directory (the write would fail only
    at the end of the work); its folder is made when it is written."""
    if not text:
        raise InputError("an empty path, not a file to write")
    if os.path.isdir(text):
        raise InputError(f"{text}: a directory, not a file to write")
    return text
