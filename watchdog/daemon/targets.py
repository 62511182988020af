"""Which process to watch (`--pid`, `--cmd-pattern`, `--pidfile`), and knowing it is still that one.

A process is identified by its PID *and* its start time: PIDs are reused, and a daemon that runs
for days will see its target's PID handed to someone else. Where the kernel offers it (Linux 5.3+)
the identified process is also held by a pidfd, which keeps naming that process after it exits:
a signal sent through it can never reach a newcomer with the same PID.

With a pattern, several processes often match: a supervisor and its child (`supervise -- python
train.py` carries the child's command line), a launcher and its job (`bash -c 'python train.py'`,
`torchrun train.py`), a trainer and its forked data-loader workers. The watchdog's own commands
(`hbm-watchdog supervise`, `watch`, supervise's guard) are never targets. A matching process with a
matching descendant whose command line is not its own (not a fork of it) is a launcher: the job is
the descendant, which holds the memory, and it is chosen at once, however small it still is while
it starts. Among the rest, the one holding the most memory is watched (a trainer, not its workers).
The others are remembered as passed over, so that while the child restarts, its launcher, still
matching, is not mistaken for it. A watched process that later starts a matching child that is not
its fork, or one larger than itself, hands the watch down to that child.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Protocol

import psutil

from watchdog.core.errors import InputError
from watchdog.core.inputs import open_regular
from watchdog.core.numbers import parse_pid, shown
from watchdog.logs import get_logger

log = get_logger(__name__)

_CMDLINE_LOGGED = 200  # characters of a command line worth a log field
_PIDFILE_SLACK_SECONDS = 1.0  # a pidfile is written after its process starts; clocks are coarse
_PIDFILE_MAX_CHARS = 64  # a PID and its newline; a huge file is not a pidfile, and is not read whole


def running(process: psutil.Process) -> bool:
    """Whether `process` still runs: the process it was (not a newcomer with its PID), and no zombie.
    A zombie is gone: it only waits for its parent to read its status, and has nothing left to
    watch or signal. Every finder and the daemon ask this one question."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class WatchedProcess:
    """One identified process: psutil's handle (PID + start time) and, where possible, a pidfd."""

    def __init__(self, process: psutil.Process):
        self.process = process
        self.pid = process.pid
        self.started = process.create_time()
        self._pidfd: int | None = None
        if hasattr(os, "pidfd_open"):
            try:
                fd = os.pidfd_open(self.pid)
            except OSError:
                fd = None  # an old kernel, or already gone: the start-time check still guards
            if fd is not None:
                if self._same_process():
                    self._pidfd = fd
                else:
                    os.close(fd)

    def _same_process(self) -> bool:
        try:
            return psutil.Process(self.pid).create_time() == self.started
        except psutil.Error:
            return False

    def alive(self) -> bool:
        """Still running and still the process identified (not a newcomer with the same PID)."""
        return running(self.process)

    @property
    def identity(self) -> tuple[int, float]:
        """PID and start time: what names this process and no other, ever."""
        return self.pid, self.started

    def signal(self, signum: int) -> None:
        """Send `signum` (0: only check permission) to this very process; ProcessLookupError when it
        is gone, PermissionError when not ours to signal."""
        if self._pidfd is not None:
            signal.pidfd_send_signal(self._pidfd, signum)
            return
        if not self._same_process():
            raise ProcessLookupError(f"PID {self.pid} is no longer the process identified")
        os.kill(self.pid, signum)

    def own_rss(self) -> int:
        try:
            return self.process.memory_info().rss
        except psutil.Error:
            return 0

    def command_line(self) -> str:
        return _command_line(self.process)[:_CMDLINE_LOGGED]

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __repr__(self) -> str:
        return f"WatchedProcess(pid={self.pid}, started={self.started})"


def _command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


class Finder(Protocol):
    """Finds the process to watch; None while there is none (yet)."""

    description: str  # for logs and the give-up message, e.g. "--cmd-pattern 'train\\.py'"
    comes_back: bool  # whether a process that exits can be followed by another one

    def find(self) -> psutil.Process | None: ...

    def why_not_found(self) -> str: ...

    def handover(self, watched: psutil.Process) -> psutil.Process | None: ...


class PidFinder:
    """`--pid PID`: that process (and its children, for memory); once it exits the watch is over."""

    comes_back = False

    def __init__(self, pid: int):
        self.description = f"--pid {pid}"
        try:
            parse_pid(str(pid))  # the command line's parser checked it; a caller in code gets the same rule
        except InputError as exc:
            raise InputError(f"--pid: {exc}") from None
        if pid == os.getpid():
            raise InputError(f"--pid {pid}: not a process this daemon can watch (the daemon itself)")
        try:
            self._process = psutil.Process(pid)
            self._process.create_time()
        except psutil.NoSuchProcess:
            raise InputError(f"--pid {pid}: no such process") from None
        except psutil.AccessDenied:
            raise InputError(f"--pid {pid}: not allowed to inspect this process") from None

    def find(self) -> psutil.Process | None:
        return self._process if running(self._process) else None

    def why_not_found(self) -> str:
        return f"process {self._process.pid} has exited"

    def handover(self, watched: psutil.Process) -> psutil.Process | None:
        return None


class PatternFinder:
    """`--cmd-pattern REGEX`, searched in each process's full command line (like `pgrep -f`). A pattern
    that matches an empty command line (`''`, `.*`) would match every process: refused."""

    comes_back = True

    def __init__(self, pattern: str):
        try:
            self.regex = re.compile(pattern)
        except re.error as exc:
            raise InputError(f"--cmd-pattern {shown(pattern)}: not a regular expression ({exc})") from None
        except (OverflowError, RecursionError):  # `x{4294967296}`, 1,500 nested groups: past what re compiles
            raise InputError(f"--cmd-pattern {shown(pattern)}: too large a regular expression to compile") from None
        if self.regex.search("") is not None:  # '', '.*', 'x?': it matches whatever the command line
            raise InputError(f"--cmd-pattern {shown(pattern)}: matches an empty command line, so it would "
                             "match every process on the machine (and watch the largest); give a pattern that "
                             "needs some text, e.g. 'train\\.py'")
        self.description = f"--cmd-pattern {pattern!r}"
        me = psutil.Process()
        self._never = {me.pid, *(p.pid for p in me.parents())}  # the daemon and whoever started it
        self._passed_over: set[psutil.Process] = set()  # matched, but not the one holding the memory
        self._descendants: dict[psutil.Process, str] = {}  # descendant of the watched one -> _OTHER, _FORK, _LAUNCHED

    def _matches(self, process: psutil.Process, cmdline: list[str] | None = None) -> bool:
        if cmdline is None:
            try:
                cmdline = process.cmdline()
            except psutil.Error:
                return False
        return bool(cmdline) and self.regex.search(" ".join(cmdline)) is not None

    def find(self) -> psutil.Process | None:
        matching: list[tuple[int, psutil.Process]] = []
        commands: dict[psutil.Process, list[str]] = {}
        for process in psutil.process_iter(["cmdline"]):
            cmdline = process.info["cmdline"]
            if process.pid in self._never or not self._matches(process, cmdline) or is_ours(cmdline):
                continue
            try:
                matching.append((process.memory_info().rss, process))
            except psutil.Error:
                continue
            commands[process] = cmdline
        self._passed_over &= {p for _, p in matching}  # forget the ones that are gone: the set stays small
        self._passed_over |= _launchers(commands)
        candidates = [(rss, p) for rss, p in matching if p not in self._passed_over]
        if not candidates:
            return None
        rss, chosen = max(candidates, key=lambda c: c[0])
        others = [p for _, p in candidates if p != chosen]
        self._passed_over.update(others)
        launchers = sorted(p.pid for p in self._passed_over if p in commands and p not in others)
        if others or launchers:
            log.info("target_chosen", pid=chosen.pid, rss_bytes=rss, passed_over=sorted(p.pid for p in others),
                     launchers=launchers,
                     note="several processes match: watching the job a launcher started, else the one holding "
                          "the most memory")
        return chosen

    def why_not_found(self) -> str:
        return f"{self.description} matched no process" + (
            f" besides {len(self._passed_over)} passed over" if self._passed_over else "")

    def handover(self, watched: psutil.Process) -> psutil.Process | None:
        """A matching descendant with a command line of its own (the job `watched` launched), else a
        matching one that holds more memory than `watched` itself, or None.

        Each descendant's command line is read once; the cache keeps only live descendants.
        """
        try:
            descendants = watched.children(recursive=True)
            own = watched.memory_info().rss
        except psutil.Error:
            return None
        known = self._descendants
        self._descendants = {p: known[p] if p in known else self._kind(p, watched) for p in descendants}
        best, best_rss = None, own
        for process, kind in self._descendants.items():
            if kind == _OTHER:
                continue
            try:
                rss = process.memory_info().rss
            except psutil.Error:
                continue
            if kind == _LAUNCHED:  # the job a launcher started: the target, however small it still is
                rss += _LAUNCHED_FIRST
            if rss > best_rss:
                best, best_rss = process, rss
        if best is not None:
            self._passed_over.add(watched)
        return best

    def _kind(self, descendant: psutil.Process, watched: psutil.Process) -> str:
        """What a descendant of the watched process is to the pattern (read once per descendant)."""
        try:
            cmdline = descendant.cmdline()
            own = watched.cmdline()
        except psutil.Error:
            return _OTHER
        if not self._matches(descendant, cmdline) or is_ours(cmdline):
            return _OTHER
        return _FORK if cmdline == own else _LAUNCHED


# What a descendant of the watched process is to a pattern: no match, a matching fork (a worker with
# its parent's command line), or a matching process with a command line of its own (the job it launched).
_OTHER, _FORK, _LAUNCHED = "other", "fork", "launched"
_LAUNCHED_FIRST = 1 << 62  # added to a launched job's memory: it is handed the watch before any fork
_PYTHON_OPTIONS_WITH_VALUE = frozenset({"-X", "-W", "-Q"})
_OUR_MODULES = frozenset({"watchdog", "watchdog.commands.cli"})  # `python -m watchdog ...` is `hbm-watchdog ...`
_NEVER_TARGETS = frozenset({"supervise", "watch"})  # our subcommands that run beside a job (`train` is one)
_GLOBAL_OPTIONS_WITH_VALUE = frozenset({"--log-format", "--log-level", "--log-file"})


def is_ours(cmdline: list[str] | None) -> bool:
    """Whether a command line is one of the watchdog's own commands that run beside a job
    (`hbm-watchdog supervise ...`, `python -m watchdog watch ...`, supervise's guard): never a
    target, whatever it carries of the job's command line. The instrumented trainer
    (`hbm-watchdog train`) is a job like any other."""
    if not cmdline:
        return False
    program = os.path.basename(cmdline[0])
    if program == "hbm-watchdog":
        return _subcommand(cmdline[1:]) in _NEVER_TARGETS
    if not program.startswith("python"):
        return False
    arguments = iter(cmdline[1:])
    for argument in arguments:
        if argument == "-m":
            return next(arguments, "") in _OUR_MODULES and _subcommand(list(arguments)) in _NEVER_TARGETS
        if argument in _PYTHON_OPTIONS_WITH_VALUE:
            next(arguments, None)
        elif argument == "-c" or argument == "-":
            return False
        elif not argument.startswith("-"):  # the script
            path = Path(argument)
            if path.parts[-3:] == ("watchdog", "actions", "job_group.py"):
                return True
            return path.name == "hbm-watchdog" and _subcommand(list(arguments)) in _NEVER_TARGETS
    return False


def _subcommand(arguments: list[str]) -> str | None:
    """The subcommand of `hbm-watchdog [global options] SUBCOMMAND ...`."""
    words = iter(arguments)
    for word in words:
        if word in _GLOBAL_OPTIONS_WITH_VALUE:
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def _launchers(commands: dict[psutil.Process, list[str]]) -> set[psutil.Process]:
    """The matching processes that started another matching one with a command line of their own:
    launchers (a supervisor, a shell, torchrun), whose job is the descendant. A fork that keeps its
    parent's command line (a data-loader worker) makes no launcher of its parent."""
    launchers = set()
    for process, cmdline in commands.items():
        try:
            ancestors = process.parents()
        except psutil.Error:
            continue
        launchers.update(a for a in ancestors if a in commands and commands[a] != cmdline)
    return launchers


class PidfileFinder:
    """`--pidfile F`: the process whose PID the job writes there; a new one after each restart.

    A PID read from the file names the process only if that process started before the file was
    last written: otherwise the job is gone and its PID went to someone else (a stale pidfile).
    """

    comes_back = True

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.description = f"--pidfile {self.path}"
        self._why = f"{self.path} does not exist yet"

    def find(self) -> psutil.Process | None:
        try:  # a FIFO, a directory or a device here is a mistake (exit 2), never a wait on open()
            with open_regular(self.path, "r", what="--pidfile ", errors="replace") as handle:
                text = handle.read(_PIDFILE_MAX_CHARS).strip()
                written = os.fstat(handle.fileno()).st_mtime
        except FileNotFoundError:
            self._why = f"{self.path} does not exist"
            return None
        except OSError as exc:
            self._why = f"cannot read {self.path}: {exc.strerror or exc}"
            return None
        try:
            pid = parse_pid(text)  # ASCII digits only: int() would read '١' as PID 1, init
        except InputError as exc:
            self._why = f"{self.path}: not a PID to watch ({exc})"  # maybe being written: asked again
            return None
        if pid == os.getpid():  # as --pid refuses it: the daemon would judge, and signal, itself
            self._why = f"{self.path} names PID {pid}, the daemon itself: not a process it can watch"
            return None
        try:
            process = psutil.Process(pid)
            started = process.create_time()
        except psutil.Error:
            self._why = f"{self.path} names PID {pid}, which is not running"
            return None
        if started > written + _PIDFILE_SLACK_SECONDS:
            self._why = f"{self.path} is stale: PID {pid} started after the file was written"
            return None
        if not running(process):
            self._why = f"{self.path} names PID {pid}, which has exited (a zombie its parent has not reaped)"
            return None
        return process

    def why_not_found(self) -> str:
        return self._why

    def handover(self, watched: psutil.Process) -> psutil.Process | None:
        return None
