"""The daemon's action: the preemption signal, sent only to the process it identified.

Almost every serious trainer checkpoints when it gets SIGTERM, because that is how preemption
is delivered (Lightning, TorchTitan, Orbax / MaxText, torch_xla's preemption sync, our own
trainer). So the daemon sends `--signal` (TERM) to the watched process, or to its process group
with `--signal-group`, early enough for that checkpoint; the supervisor above it (`supervise`,
JobSet) restarts the job with its memory fresh. A group that also holds the daemon, or any
ancestor of the target (a supervisor started from the same shell), is never signalled: the
process alone is, and the log says why.

If the process is still there after `--grace-seconds` and its memory is still above what it was
when signalled, the daemon escalates once (`--escalate`, KILL by default; `none` only waits).
A process that is alive but no longer growing is saving: it gets another grace period.
"""

from __future__ import annotations

import enum
import os
import signal
from dataclasses import dataclass

import psutil

from watchdog.core.errors import InputError
from watchdog.core.numbers import whole_number
from watchdog.daemon.targets import WatchedProcess
from watchdog.logs import get_logger

log = get_logger(__name__)


def parse_signal(text: str, flag: str = "--signal") -> signal.Signals:
    """`TERM`, `SIGTERM`, `term` or `15` -> signal.SIGTERM; anything else is one line for the user."""
    name = text.strip().upper()
    try:
        if name[:1].isdigit():
            return signal.Signals(whole_number(name, "a signal number", 1, 64))  # not int(): '١' is not SIGHUP
        return signal.Signals[name if name.startswith("SIG") else "SIG" + name]
    except (KeyError, ValueError):  # InputError is a ValueError
        raise InputError(f"{flag} {text!r}: not a signal (use a name such as TERM, INT, USR1 or KILL)") from None


def parse_escalation(text: str) -> signal.Signals | None:
    return None if text.strip().lower() == "none" else parse_signal(text, "--escalate")


class Disposition(enum.Enum):
    """What a process does with a signal, as the kernel says (`/proc/PID/status`)."""

    CAUGHT = "caught"  # a handler of its own: a trainer's save-on-SIGTERM, Python's KeyboardInterrupt
    IGNORED = "ignored"
    DEFAULT = "default"  # the default action: for TERM, INT, HUP, USR1, death where it stands
    UNKNOWN = "unknown"  # not Linux, or the file could not be read


def disposition(pid: int, signum: int, status_text: str | None = None) -> Disposition:
    """Read from `SigCgt` and `SigIgn` (hexadecimal masks, bit N-1 for signal N)."""
    if status_text is None:
        try:
            with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as handle:
                status_text = handle.read(65536)
        except OSError:
            return Disposition.UNKNOWN
    masks = {}
    for line in status_text.splitlines():
        name, _, value = line.partition(":")
        if name in ("SigCgt", "SigIgn"):
            try:
                masks[name] = int(value.strip()[:16], 16)
            except ValueError:
                return Disposition.UNKNOWN
    if len(masks) != 2:
        return Disposition.UNKNOWN
    bit = 1 << (signum - 1)
    if masks["SigCgt"] & bit:
        return Disposition.CAUGHT
    return Disposition.IGNORED if masks["SigIgn"] & bit else Disposition.DEFAULT


def unhandled_words(pid: int, signum: signal.Signals, found: Disposition) -> str | None:
    """What to tell the user of a target that will not save on the signal (None: it may)."""
    name = signum.name
    if found is Disposition.DEFAULT:
        return (f"pid {pid} does not handle {name}: a signal ends it without a checkpoint. Give it a handler "
                f"that saves and exits 42 (most trainers have one), or --signal one it saves on (INT, for a "
                f"script that saves on KeyboardInterrupt); under supervise it is restarted from its newest "
                f"checkpoint, if it keeps one (--on-restart-args adds its resume flag)")
    if found is Disposition.IGNORED:
        return (f"pid {pid} ignores {name}: the signal does nothing, and the escalation (--escalate) ends it "
                f"without a checkpoint after --grace-seconds")
    return None


class Step(enum.Enum):
    WAIT = "wait"  # nothing pending, or still inside the grace period
    ESCALATE = "escalate"  # send the escalation signal now
    EXTEND = "extend"  # alive but not growing: saving, presumably; another grace period
    GIVE_UP = "give_up"  # grace over, nothing to escalate to (or escalated already)


class Escalation:
    """After a signal: wait `grace_seconds`; then escalate once if the process still grows. Pure."""

    def __init__(self, grace_seconds: float, escalate_to: signal.Signals | None):
        self.grace_seconds = grace_seconds
        self.escalate_to = escalate_to
        self._deadline: float | None = None
        self._bytes_at_signal = 0
        self._escalated = False

    @property
    def pending(self) -> bool:
        return self._deadline is not None

    def signalled(self, now: float, bytes_used: int) -> None:
        if self._deadline is None:  # a repeated signal does not move the deadline
            self._deadline, self._bytes_at_signal, self._escalated = now + self.grace_seconds, bytes_used, False

    def check(self, now: float, bytes_used: int) -> Step:
        """Called with every sample of the same process after the signal."""
        if self._deadline is None or now < self._deadline:
            return Step.WAIT
        if bytes_used <= self._bytes_at_signal:
            self._deadline = now + self.grace_seconds
            return Step.EXTEND
        if self.escalate_to is None or self._escalated:
            self._deadline = None
            return Step.GIVE_UP
        self._escalated = True
        self._deadline = now + self.grace_seconds
        return Step.ESCALATE

    def reset(self) -> None:
        """The process is gone (restarted): nothing is pending any more."""
        self._deadline = None
        self._escalated = False


@dataclass(frozen=True, slots=True)
class Sent:
    signal: signal.Signals
    pid: int
    group: int | None  # the process group signalled, None when only the process was


def group_to_signal(target: WatchedProcess) -> int | None:
    """The target's process group, if signalling it spares the daemon and every ancestor of the target."""
    try:
        pgid = os.getpgid(target.pid)
        ancestors = target.process.parents()
    except (OSError, psutil.Error):
        return None
    protected = {os.getpgrp()}
    for ancestor in ancestors:
        try:
            protected.add(os.getpgid(ancestor.pid))
        except OSError:
            continue
    if pgid in protected:
        log.warning("signal_group_refused", pid=target.pid, pgid=pgid,
                    note="the group also holds the daemon or an ancestor of the target (its supervisor): "
                         "signalling the process alone")
        return None
    return pgid


def send(target: WatchedProcess, signum: signal.Signals, group: bool) -> Sent:
    """Signal the identified process (or its group). ProcessLookupError: it is gone (or is no longer
    the process identified); PermissionError: not ours to signal. Never signals anyone else."""
    pgid = group_to_signal(target) if group else None
    if pgid is not None:
        target.signal(0)  # identity (through the pidfd) and permission, before touching the group
        os.killpg(pgid, signum)
    else:
        target.signal(signum)
    return Sent(signum, target.pid, pgid)
