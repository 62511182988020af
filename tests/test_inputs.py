"""Every path the project reads from a user is a regular file, or a one-line error with exit 2: never a hang.

Each input is given a FIFO with no writer (whose plain open() waits for good), a directory, a
device (/dev/zero, which never ends) and a socket. Every call runs under a hang guard: in a
daemon thread, joined with a generous bound, so a regression fails the test instead of hanging
the suite (and a reader stuck on the FIFO is released).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
from conftest import without_hanging

from watchdog.commands.cli import main
from watchdog.core.errors import InputError
from watchdog.core.inputs import NotARegularFile, open_regular

KINDS = {"fifo": "a FIFO (named pipe)", "directory": "a directory", "device": "a character device",
         "socket": "a socket"}


@pytest.fixture(params=sorted(KINDS))
def special(request):
    """(path, kind in words): a path that names no regular file."""
    folder = Path(tempfile.mkdtemp(prefix="hbm-in-"))  # short: a socket's path is at most 107 bytes
    holder = None
    if request.param == "fifo":
        path = folder / "trace.csv"
        os.mkfifo(path)
    elif request.param == "directory":
        path = folder / "trace.csv"
        path.mkdir()
    elif request.param == "device":
        path = Path("/dev/zero")
    else:
        path = folder / "trace.csv"
        holder = socket.socket(socket.AF_UNIX)
        holder.bind(str(path))
    yield path, KINDS[request.param]
    if holder is not None:
        holder.close()
    shutil.rmtree(folder)


def one_line_error(capsys, status, kind):
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and kind in err[0] and "not a regular file" in err[0], err
    return err[0]


def test_the_helper_refuses_what_is_not_a_regular_file_and_says_what_it_is(special):
    path, kind = special
    for mode in ("rb", "r", "rb+", "a"):
        error = without_hanging(lambda: open_regular(path, mode, what="--thing "), fifo=path)
        assert isinstance(error, NotARegularFile) and isinstance(error, InputError), (mode, error)
        assert str(error) == f"--thing {path}: {kind}, not a regular file" and error.kind == kind


def test_the_helper_refuses_a_symbolic_link_when_told_and_opens_a_regular_file(tmp_path):
    target = tmp_path / "real.csv"
    target.write_text("x\n")
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    with open_regular(link, "r") as handle:
        assert handle.read() == "x\n"
    with pytest.raises(NotARegularFile, match="a symbolic link, not a regular file"):
        open_regular(link, "rb", follow_symlinks=False)
    with pytest.raises(FileNotFoundError):  # the ordinary errors stay what they were
        open_regular(tmp_path / "missing.csv")


@pytest.mark.parametrize("command", ["analyze", "report"])
def test_analyze_and_report_refuse_it_in_one_line(special, tmp_path, capsys, command):
    path, kind = special
    argv = [command, str(path)] + (["-o", str(tmp_path / "out.png")] if command == "report" else [])
    line = one_line_error(capsys, without_hanging(lambda: main(argv), fifo=path), kind)
    assert str(path) in line


def test_bench_refuses_it_as_the_real_traces_in_one_line(special, capsys):
    path, kind = special
    status = without_hanging(lambda: main(["bench", "--corpus", "real", "--data", str(path)]), fifo=path)
    if kind == "a directory":  # a folder means "the data file in it": that file is missing
        assert status == 2 and "real traces not found" in capsys.readouterr().err
    else:
        one_line_error(capsys, status, kind)


def test_the_watch_pidfile_is_refused_not_waited_on(special):
    from watchdog.daemon.targets import PidfileFinder

    path, kind = special
    error = without_hanging(PidfileFinder(path).find, fifo=path)
    assert isinstance(error, InputError) and str(error) == f"--pidfile {path}: {kind}, not a regular file"


def test_the_trace_file_to_append_to_is_refused(special):
    from watchdog.core.sample import TraceWriter

    path, kind = special
    error = without_hanging(lambda: TraceWriter(path), fifo=path)
    assert isinstance(error, InputError) and f"{kind}, not a regular file" in str(error)


def test_the_replayed_trace_and_the_training_text_are_refused(special):
    from watchdog.readers.sources import ReplaySource
    from watchdog.trainer.data import _read_text

    path, kind = special
    for call in (lambda: ReplaySource(path), lambda: _read_text(path, 16)):
        error = without_hanging(call, fifo=path)
        assert isinstance(error, InputError) and f"{kind}, not a regular file" in str(error), error


def test_a_compile_analysis_file_that_is_not_a_regular_file_is_never_read(special):
    from watchdog.runtime.xla_stats import AnalysisReader, _users_own_setting

    path, kind = special
    analysis = _users_own_setting("1", str(path))
    assert analysis.path is None and f"{kind}, not a regular file" in analysis.unavailable
    analysis.path, analysis.unavailable = path, None  # had it become one after the start: still not read
    assert without_hanging(lambda: AnalysisReader(analysis).read(), fifo=path) == ""
