"""Every whole file the project writes, written so that no planted link can redirect it and no
reader ever sees half of it.

Why one helper: a temporary with a predictable name (`.report.png.1234.tmp`) next to its target
can be planted beforehand as a symbolic link by anyone who may create files in that folder (a
shared /tmp, a shared checkpoint mount); opening it for writing follows the link and overwrites
whatever file the link names. So here a temporary is made by `tempfile.mkstemp` in the target's
own folder: `O_CREAT | O_EXCL` (a link or file already at the name is never opened) under a
random name nobody can plant in advance. It is written, given the mode a plain `open(path, "w")`
would have given (0666 less the umask; mkstemp makes it 0600), fsynced, renamed over the target
with `os.replace` (atomic on POSIX; a link at the target is replaced, never followed), and the
folder is fsynced so that the rename itself survives a power cut. On any failure the temporary
is removed and the target is as it was.

- `write_atomically(target, data)`: bytes or text already in memory (reports, JSON, generated files);
  `save_figure(figure, target)`: a matplotlib figure.
- `replacing(target)`: a binary handle for a writer that streams (`torch.save`).
- `replacing_path(target)`: a path, for a writer that insists on opening the file itself
  (Lightning's `save_checkpoint`), and that may even rename its own temporary onto it.
- `temporary_directory(parent, prefix)`: a directory under a random name (sharded checkpoints,
  renamed into place by their caller once complete).
- `link_atomically(target, points_to)`: a symbolic link swapped in atomically.
- `probe_writable(folder, prefix)`: prove a folder writable with a throwaway file.

The one file not written whole is the trace CSV, which the watchdog appends to in place
(core/sample.py): its path is the user's own choice, never a temporary.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import secrets
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator

TEMP_SUFFIX = ".tmp"
_NAME_TRIES = 100  # random names tried before giving up (each clash is a 1 in 36**16 chance, or a plant)


def write_atomically(target: str | os.PathLike, data: bytes | str, *, prefix: str | None = None,
                     suffix: str = TEMP_SUFFIX) -> Path:
    """Put `data` (text is written as UTF-8) at `target` whole; returns the target's path."""
    target = Path(target)
    with replacing(target, prefix=prefix, suffix=suffix) as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)
    return target


def save_figure(figure, target: str | os.PathLike, **options) -> Path:
    """A matplotlib figure written whole, in the format its name ends in (as `savefig(path)` does)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format=Path(target).suffix[1:] or None, **options)
    return write_atomically(target, buffer.getvalue())


@contextlib.contextmanager
def replacing(target: str | os.PathLike, *, prefix: str | None = None,
              suffix: str = TEMP_SUFFIX) -> Iterator[BinaryIO]:
    """A binary handle on a fresh temporary next to `target`, which becomes `target` on a clean exit.

    `prefix` and `suffix` name the temporary (default `.<target name>.<random>.tmp`): a caller
    that clears stale temporaries away (checkpoints) chooses them so it recognises its own.
    """
    target = Path(target)
    fd, temporary = _fresh_file(target, prefix, suffix)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            _settle(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        _discard(temporary)
        raise
    fsync_directory(target.parent)


@contextlib.contextmanager
def replacing_path(target: str | os.PathLike, *, prefix: str | None = None,
                   suffix: str = TEMP_SUFFIX) -> Iterator[Path]:
    """`replacing` for a writer that takes a path: it writes the yielded file (which exists, empty)."""
    target = Path(target)
    fd, temporary = _fresh_file(target, prefix, suffix)
    os.close(fd)
    try:
        yield temporary
        # Opened again by name because the writer may have put another file there (fsspec renames
        # its own temporary onto it); O_NOFOLLOW: never a link, whatever happened meanwhile.
        fd = os.open(temporary, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            _settle(fd)
        finally:
            os.close(fd)
        os.replace(temporary, target)
    except BaseException:
        _discard(temporary)
        raise
    fsync_directory(target.parent)


def temporary_directory(parent: str | os.PathLike, prefix: str) -> Path:
    """A new, empty directory in `parent` under `prefix` and a random name, with the mode a plain
    `mkdir` would have given (mkdtemp makes it 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, 0o777 & ~_umask())
    return path


def link_atomically(target: str | os.PathLike, points_to: str | os.PathLike) -> None:
    """A symbolic link at `target` to `points_to`, in place of whatever was there, in one step.

    `os.symlink` never follows an existing name (it fails on one), so the link is made under a
    random name next to the target and renamed over it.
    """
    target = Path(target)
    for _ in range(_NAME_TRIES):
        temporary = target.with_name(f".{target.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")
        try:
            os.symlink(points_to, temporary)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temporary name next to {target}")
    try:
        os.replace(temporary, target)
    except BaseException:
        _discard(temporary)
        raise


def probe_writable(folder: str | os.PathLike, prefix: str = ".probe.", suffix: str = TEMP_SUFFIX) -> None:
    """Create and remove a throwaway file in `folder`; raises the OSError that says why not."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=folder)
    os.close(fd)
    os.unlink(name)


def fsync_directory(directory: str | os.PathLike) -> None:
    """Make a rename in `directory` durable; some filesystems cannot fsync a directory, which is not an error."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fresh_file(target: Path, prefix: str | None, suffix: str) -> tuple[int, Path]:
    fd, name = tempfile.mkstemp(prefix=f".{target.name}." if prefix is None else prefix, suffix=suffix,
                                dir=target.parent)
    return fd, Path(name)


def _settle(fd: int) -> None:
    """The ordinary mode, and the data on disk before the rename makes it visible."""
    os.fchmod(fd, 0o666 & ~_umask())
    os.fsync(fd)


def _discard(temporary: Path) -> None:
    try:
        os.unlink(temporary)
    except OSError:
        pass


_UMASK: int | None = None


def _umask() -> int:
    """The process's umask, read once. Linux shows it in /proc; elsewhere `os.umask` must set it to
    read it, so it is set to the strictest value for that instant (a file another thread creates
    meanwhile gets fewer permissions, never more)."""
    global _UMASK
    if _UMASK is None:
        try:
            with open("/proc/self/status", encoding="ascii", errors="replace") as status:
                found = re.search(r"^Umask:\s*([0-7]+)$", status.read(), re.MULTILINE)
            _UMASK = int(found.group(1), 8) if found else None
        except OSError:
            pass
        if _UMASK is None:
            _UMASK = os.umask(0o077)
            os.umask(_UMASK)
    return _UMASK
