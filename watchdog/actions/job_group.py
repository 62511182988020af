"""The supervised job's process group: signal it, end it, and end it even when `supervise` is killed.

`supervise` starts its child in a session and process group of its own, so whatever the child
starts (a shell's commands, data-loader workers) is in that group too, and one `killpg` reaches the
whole job: a forwarded stop signal, SIGKILL once the grace is over, and the sweep of what is left
after the child has exited, so no orphan of the job outlives it or lingers into the next run.

A `supervise` killed by SIGKILL can do none of that, so a guard does it: a small process started
with `supervise`, in a session of its own (a signal to the supervisor's group or terminal does not
reach it), told each job group through a pipe. When the pipe closes with a group still held (the
supervisor is gone) it ends that group the same way: SIGTERM (a trainer saves), SIGKILL after the
grace. It imports only the standard library and runs as `python -I job_group.py GRACE`: no
package to find, no site to load, started in milliseconds.

What stays out of reach: a process that leaves the group (setsid, setpgid: a daemon by design),
and everything at once when the guard is killed together with the supervisor (then only the
kernel's parent-death signal to the direct child holds, see `supervisor.py`). `supervise` is not
a child subreaper: the group reaches the job's orphans wherever they were re-parented, and a
subreaper would have to reap them while `subprocess` owns the child's exit status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

_POLL_SECONDS = 0.05
_AFTER_KILL_SECONDS = 5.0  # SIGKILL cannot be refused, but a process in uninterruptible sleep dies late


def signal_group(pgid: int, signum: int) -> bool:
    """Send `signum` to process group `pgid`; False when nothing is left in it. Safe in a signal handler."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member that changed its user: the group is not empty
        return True
    return True


def group_alive(pgid: int) -> bool:
    """Whether a live process is left in the group, after reaping the members that are our children.

    Only once the group's leader has been waited for: reaping here could otherwise take the
    child's exit status from `subprocess`. Members are our children when we are PID 1 (a
    container's supervisor adopts every orphan). A dead member that nobody reaps (a container's
    PID 1 that is no init) still counts for kill(); on Linux /proc tells it apart, elsewhere it counts.
    """
    while True:
        try:
            pid, _ = os.waitpid(-pgid, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    if not signal_group(pgid, 0):
        return False
    try:
        with os.scandir("/proc") as entries:
            return any(_live_member(entry.name, pgid) for entry in entries if entry.name.isdigit())
    except OSError:
        return True


def _live_member(pid: str, pgid: int) -> bool:
    """Whether /proc says process `pid` is in group `pgid` and not dead (a zombie, Z, or exiting, X)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:  # procfs: a regular file that never blocks
            stat = handle.read()
    except OSError:
        return False
    fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": the name may hold spaces and ")"
    return len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X")


def _gone_by(pgid: int, deadline: float) -> bool:
    while group_alive(pgid):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(left, _POLL_SECONDS))
    return True


def end_group(pgid: int, grace: float, *, signalled_at: float | None = None) -> signal.Signals | None:
    """End what is left of process group `pgid`: SIGTERM, then SIGKILL if anything is left `grace` s later.

    `signalled_at` (time.monotonic()) says a stop signal already reached the group then, so the
    grace runs from that moment. Returns the last signal this call sent, None when it sent none
    (the group was empty, or emptied within the grace already running). Bounded: after SIGKILL it
    waits at most a few seconds more.
    """
    if not group_alive(pgid):
        return None
    sent = None
    if signalled_at is None:
        signal_group(pgid, signal.SIGTERM)
        sent, signalled_at = signal.SIGTERM, time.monotonic()
    if _gone_by(pgid, signalled_at + grace):
        return sent
    signal_group(pgid, signal.SIGKILL)
    _gone_by(pgid, time.monotonic() + _AFTER_KILL_SECONDS)
    return signal.SIGKILL


# --- the guard ------------------------------------------------------------------------------------

class Guard:
    """The supervisor's end of the guard: `hold(pgid)` when a job group starts, `release(pgid)` once
    it is gone, `close()` at the end. A guard that died only costs its protection (logged by the caller)."""

    def __init__(self, process: subprocess.Popen):
        self._process = process
        self.alive = True

    def hold(self, pgid: int) -> bool:
        return self._send(f"+{pgid}\n")

    def release(self, pgid: int) -> bool:
        return self._send(f"-{pgid}\n")

    def _send(self, line: str) -> bool:
        if self.alive:
            try:
                self._process.stdin.write(line.encode())
                self._process.stdin.flush()
            except (BrokenPipeError, ValueError):
                self.alive = False
        return self.alive

    def close(self) -> None:
        """Every group released: the guard exits at once when its pipe closes."""
        try:
            self._process.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self._process.wait(timeout=_AFTER_KILL_SECONDS)
        except subprocess.TimeoutExpired:
            pass  # it goes on its own; the supervisor need not wait for it


def start_guard(grace: float) -> Guard:
    """Start the guard process (OSError if it cannot be). Call before any job process exists."""
    process = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), repr(float(grace))],
                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
    return Guard(process)


def guard(grace: float, pipe=None) -> None:
    """The guard's life: follow the groups the supervisor holds; when its pipe closes, end those left."""
    held: set[int] = set()
    for line in pipe if pipe is not None else sys.stdin.buffer:
        text = line.strip()
        if text[:1] == b"+":
            held.add(int(text[1:]))
        elif text[:1] == b"-":
            held.discard(int(text[1:]))
    for pgid in sorted(held):
        sent = end_group(pgid, grace)
        if sent is not None:
            how = "SIGTERM" if sent == signal.SIGTERM else f"SIGTERM, then SIGKILL after {grace:g} s"
            print(f"hbm-watchdog supervise: the supervisor is gone; ended its job's process group {pgid} ({how})",
                  file=sys.stderr, flush=True)


if __name__ == "__main__":
    guard(float(sys.argv[1]))
