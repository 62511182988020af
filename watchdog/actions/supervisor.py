"""The restart half of checkpoint-and-restart (`hbm-watchdog supervise`, in commands/supervise.py).

A leak that survives an in-process reinit (memory held outside the trainer's state) can only be
freed by a new process. The trainer saves a checkpoint and exits 42; this loop starts it again
(with `--resume auto` it picks up the checkpoint). It restarts a rank that exits 43 too (another
rank of its job died or stalled during the watchdog's agreement), and 44 (a restart was due but the
disk refused its checkpoint: the job goes on from the newest one there is). It also restarts a child that crashed out of
memory anyway (RESOURCE_EXHAUSTED / CUDA OOM in its output) or died by a signal (the kernel's
OOM killer sends SIGKILL), within a budget and with capped exponential backoff.

Exit status of the supervisor:
- 0 when the child finishes;
- the child's own status when it fails for any other reason (128+N for death by signal N);
- 1 when a restart was due but the budget (`--max-restarts`) was spent: not 42, so an outer
  restarter (JobSet, torchelastic) does not loop on a job that keeps running out of memory;
- SIGINT/SIGTERM to the supervisor are forwarded to the child's whole process group and end
  supervision; what is still running `--grace-seconds` later gets SIGKILL. The exit status
  is then the child's (42 when it saved on SIGTERM, which tells a cluster to reschedule; 137
  when it had to be killed).

The child sees `HBMWATCH_RESTART_COUNT` = restarts so far (0 for the first run).

A restart runs the same command, unless `restart_args` are given (`--on-restart-args '--resume'`):
they are added to it on every restart once a checkpoint exists, for a script that starts from
scratch unless told its resume flag. A checkpoint exists once `checkpoint` (a file, or a folder
with something in it) does, or, without one named, once a run of the job exited 42 (which says it
saved).

Why a death by a signal is restarted: the kernel's OOM killer ends a job with SIGKILL, and `watch`
ends one that has no handler for its SIGTERM (its log says so, `target_unprepared`): both are the
memory's failures, which a new process fixes, from the job's newest checkpoint if it keeps one.
A signal from someone else (a `kill` by hand) reads the same; stop the job through `supervise`
(SIGTERM or Ctrl-C to it), which then ends it without a restart.

The supervisor owns the job's process group (`job_group.py`): the child starts in a session of
its own, so a shell child's commands, a trainer's workers, anything the job starts, are signalled
with it; once the child has exited, what is left of its group is ended (SIGTERM, SIGKILL after the
grace) before a restart or the supervisor's exit. Nothing of the job outlives the supervisor:
- it stops: as above, the group is ended before it exits;
- it is killed, even by SIGKILL: the guard process (`job_group.py`) sends the group SIGTERM (the
  trainer saves a checkpoint and exits) and SIGKILL after the grace; and on Linux the kernel sends
  the direct child SIGTERM at once (PR_SET_PDEATHSIG), or SIGKILL when no guard could be started.
Out of reach: a process that left the group (setsid), and, if the guard is killed together with
the supervisor, everything but the direct child's parent-death signal.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Sequence

from watchdog.actions.job_group import Guard, end_group, signal_group, start_guard
from watchdog.core.errors import EXIT_FUTILE, EXIT_PEER_LOST, EXIT_RESTART_REQUESTED, EXIT_UNSAVED, InputError
from watchdog.logs import get_logger
from watchdog.core.restarts import RESTART_COUNT_ENV

log = get_logger(__name__)

EXIT_BUDGET_EXHAUSTED = 1
OOM_MARKERS = (b"RESOURCE_EXHAUSTED", b"CUDA out of memory", b"OutOfMemoryError")
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
OUTPUT_TAIL_BYTES = 1 << 20  # of each stream, kept for the post-mortem of a crash
DEFAULT_GRACE_SECONDS = 30.0  # seconds between a forwarded stop and SIGKILL: time for a checkpoint
_WAIT_POLL_SECONDS = 0.5  # how often a wait looks at the grace (a handler cannot wake os.waitpid)
_DRAIN_SECONDS = 5.0  # output still open once the group is gone: held by a process that left it


# --- pure decisions -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ChildOutcome:
    returncode: int  # subprocess convention: -N means killed by signal N
    saw_oom: bool = False  # an out-of-memory marker appeared in its output
    output_tail: bytes = b""  # the last of what it printed (stderr's, then stdout's), for a post-mortem


@dataclass(frozen=True, slots=True)
class Decision:
    restart: bool
    reason: str  # finished | futile | restart_requested | peer_lost | restart_unsaved | out_of_memory | killed_by_signal | failed | budget_exhausted | stopped
    exit_status: int | None = None  # what the supervisor exits with, when not restarting


def decide(outcome: ChildOutcome, restarts_so_far: int, max_restarts: int, stopping: bool = False) -> Decision:
    """Restart or stop, given how the child ended, what it printed, and the budget left."""
    code = outcome.returncode
    if stopping:
        return Decision(False, "stopped", exit_status_of(code))
    if code == 0:
        return Decision(False, "finished", 0)
    if code == EXIT_FUTILE:  # saved, but restarting will not save this job: the leak must be fixed
        return Decision(False, "futile", EXIT_FUTILE)
    if code == EXIT_RESTART_REQUESTED:
        reason = "restart_requested"
    elif code == EXIT_PEER_LOST:  # another rank died or stalled during an agreement: the job starts again
        reason = "peer_lost"
    elif code == EXIT_UNSAVED:  # a restart was due but the disk refused its checkpoint: from the newest one
        reason = "restart_unsaved"
    elif outcome.saw_oom:
        reason = "out_of_memory"
    elif code < 0:
        reason = "killed_by_signal"
    else:
        return Decision(False, "failed", exit_status_of(code))
    if restarts_so_far >= max_restarts:
        return Decision(False, "budget_exhausted", EXIT_BUDGET_EXHAUSTED)
    return Decision(True, reason)


def backoff_seconds(restarts_so_far: int, base: float, cap: float) -> float:
    """base, 2*base, 4*base, ... never more than cap."""
    return min(base * 2.0 ** restarts_so_far, cap)


def exit_status_of(returncode: int) -> int:
    """A shell's view of a child status: death by signal N is 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit {returncode}"


class OomScanner:
    """Finds the OOM markers in a byte stream fed in arbitrary chunks (a marker may straddle two),
    and keeps the stream's last `keep_bytes` (where XLA's out-of-memory message is, at the end)."""

    def __init__(self, markers: Sequence[bytes] = OOM_MARKERS, keep_bytes: int = OUTPUT_TAIL_BYTES):
        self.markers = tuple(markers)
        self._keep = max(len(m) for m in self.markers) - 1
        self._tail = b""
        self.found: bytes | None = None
        self.kept = bytearray()
        self._keep_bytes = keep_bytes

    def feed(self, chunk: bytes) -> bool:
        if self.found is None:
            window = self._tail + chunk
            self.found = next((m for m in self.markers if m in window), None)
            self._tail = window[-self._keep:] if self._keep else b""
        self.kept += chunk
        if len(self.kept) > 2 * self._keep_bytes:  # trimmed now and then, not at every chunk
            del self.kept[:-self._keep_bytes]
        return self.found is not None

    def tail(self) -> bytes:
        return bytes(self.kept[-self._keep_bytes:])


# --- processes and signals ------------------------------------------------------------------------

class _StopRequest:
    """While active, SIGINT/SIGTERM are forwarded to the current job's process group and mark
    supervision as ending; `since` is when the first one came (the grace runs from then)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.since: float | None = None
        self.group: int | None = None  # the running job's process group
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_StopRequest":
        for signum in _STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, _frame) -> None:
        self.signal = signum  # handlers only set flags and signal the group: no locks taken here
        if self.since is None:
            self.since = time.monotonic()
        group = self.group
        if group is not None:
            signal_group(group, signum)

    def sleep(self, seconds: float) -> bool:
        """Back off; True if a stop signal arrived meanwhile."""
        deadline = time.monotonic() + seconds
        while self.signal is None and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
        return self.signal is not None


def _die_with_supervisor(signum: int) -> Callable[[], None] | None:
    """A preexec function that asks the kernel for `signum` when the supervisor dies (Linux; None elsewhere).

    SIGTERM while a guard will escalate (the trainer saves first), SIGKILL when none could be
    started (nothing else would end a child that ignores SIGTERM). Only the direct child gets it:
    the kernel does not pass it on to the child's own children (the guard ends those).
    Runs in the forked child before exec, while the supervisor has no other thread (the output
    pumps of the previous child are done, unless a process that left its group still writes to
    them; the function takes no lock they could hold), so it is safe there. A supervisor that died between
    fork and prctl would never send the signal: the child checks its parent and stops itself.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    supervisor = os.getpid()

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        if os.getppid() != supervisor:
            os.kill(os.getpid(), signum)

    return in_child


def _pump(source: BinaryIO, sink: BinaryIO | None, scanner: OomScanner) -> None:
    """Copy the child's output through as it comes (progress bars have no newline) while scanning it."""
    fd = source.fileno()
    while chunk := os.read(fd, 65536):
        scanner.feed(chunk)
        if sink is not None:
            try:
                sink.write(chunk)
                sink.flush()
            except OSError:  # our own output went away (a closed pipe): keep draining, or the child blocks
                sink = None
    source.close()


def _run_child(command: list[str], restarts: int, stop: _StopRequest, stdout: BinaryIO,
               stderr: BinaryIO, grace_seconds: float, guard: Guard | None) -> ChildOutcome:
    env = {**os.environ, RESTART_COUNT_ENV: str(restarts)}
    death_signal = signal.SIGTERM if guard is not None and guard.alive else signal.SIGKILL
    try:
        # Its own session and process group: a terminal's Ctrl-C reaches only us, and we forward it
        # exactly once, to the whole job.
        child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True, preexec_fn=_die_with_supervisor(death_signal))
    except OSError as exc:
        raise InputError(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None
    group = child.pid  # the leader of its own session and group
    if guard is not None and not guard.hold(group):
        log.warning("supervisor_guard_gone",
                    note="a SIGKILL to the supervisor now leaves the job's other processes running")
    stop.group = group
    if stop.signal is not None:  # a stop that landed between Popen and now
        signal_group(group, stop.signal)
    scanners = (OomScanner(), OomScanner())
    pumps = [threading.Thread(target=_pump, args=(pipe, sink, scanner), daemon=True)
             for pipe, sink, scanner in zip((child.stdout, child.stderr), (stdout, stderr), scanners)]
    for pump in pumps:
        pump.start()
    log.info("child_started", pid=child.pid, restarts_so_far=restarts, command=command)
    returncode = _wait(child, stop, grace_seconds)
    # what the child leaves behind (a shell's command, a worker) goes now, not with the next run
    leftover = end_group(group, grace_seconds, signalled_at=stop.since)
    if leftover is not None:
        log.warning("job_leftovers_ended", pgid=group, signal=leftover.name, grace_seconds=grace_seconds)
    stop.group = None
    if guard is not None:
        guard.release(group)
    for pump in pumps:
        pump.join(timeout=_DRAIN_SECONDS)  # bounded: a process that left the group may hold the pipe
        if pump.is_alive():
            log.warning("child_output_still_open", pid=child.pid,
                        note="a process outside the job's group holds its output; not waiting for it")
    marker = next((s.found for s in scanners if s.found), None)
    if marker:
        log.warning("child_out_of_memory_seen", pid=child.pid, marker=marker.decode())
    out, err = scanners
    return ChildOutcome(returncode, saw_oom=marker is not None, output_tail=err.tail() + out.tail())


def _wait(child: subprocess.Popen, stop: _StopRequest, grace_seconds: float) -> int:
    """The child's exit status; once a stop signal went to its group, SIGKILL to the group when the
    grace is over (a child that ignores SIGTERM must not keep the supervisor up for good)."""
    killed = False
    while True:
        try:
            return child.wait(timeout=_WAIT_POLL_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        if stop.since is not None and not killed and time.monotonic() >= stop.since + grace_seconds:
            log.warning("child_killed_after_grace", pid=child.pid, grace_seconds=grace_seconds,
                        signal=signal.Signals(stop.signal).name)
            signal_group(child.pid, signal.SIGKILL)
            killed = True


def check_options(max_restarts: int, backoff: float, max_backoff: float, grace_seconds: float = DEFAULT_GRACE_SECONDS
                  ) -> None:
    """InputError unless the budget is a count and the waits are finite seconds (a NaN wait is no wait)."""
    if max_restarts < 0:
        raise InputError(f"--max-restarts must be >= 0, got {max_restarts}")
    for flag, seconds in (("--backoff", backoff), ("--max-backoff", max_backoff), ("--grace-seconds", grace_seconds)):
        if not (math.isfinite(seconds) and seconds >= 0):
            raise InputError(f"{flag} must be a finite number of seconds >= 0, got {seconds}")


def supervise(command: Sequence[str], *, max_restarts: int = 3, backoff: float = 1.0,
              max_backoff: float = 60.0, grace_seconds: float = DEFAULT_GRACE_SECONDS,
              stdout: BinaryIO | None = None, stderr: BinaryIO | None = None,
              on_exit: Callable[[ChildOutcome, int], None] | None = None,
              restart_args: Sequence[str] = (), checkpoint: Path | None = None) -> int:
    """Run `command` until it finishes, restarting it as `decide` says; returns the supervisor's exit status.

    `on_exit(outcome, run)` is told of every exit of the child (run 0 is the first): the command
    line records it and prints a post-mortem of a crash. Must run on the main thread (it installs
    SIGINT/SIGTERM handlers for the duration).
    """
    command = list(command)
    if not command:
        raise InputError("no command to supervise: hbm-watchdog supervise [options] -- CMD ...")
    check_options(max_restarts, backoff, max_backoff, grace_seconds)
    stdout = stdout or sys.stdout.buffer
    stderr = stderr or sys.stderr.buffer
    guard = _start_guard(grace_seconds)
    try:
        return _supervise(command, max_restarts, backoff, max_backoff, grace_seconds, stdout, stderr, guard,
                          on_exit, Resume(list(restart_args), checkpoint))
    finally:
        if guard is not None:
            guard.close()


def _start_guard(grace_seconds: float) -> Guard | None:
    try:
        return start_guard(grace_seconds)
    except OSError as exc:
        log.warning("supervisor_guard_not_started", error=str(exc),
                    note="a SIGKILL to the supervisor would leave the job's other processes running")
        return None


def _supervise(command: list[str], max_restarts: int, backoff: float, max_backoff: float, grace_seconds: float,
               stdout: BinaryIO, stderr: BinaryIO, guard: Guard | None,
               on_exit: Callable[[ChildOutcome, int], None] | None = None, resume: "Resume | None" = None) -> int:
    restarts = 0
    resume = resume or Resume([], None)
    with _StopRequest() as stop:
        while True:
            outcome = _run_child(resume.command(command, restarts), restarts, stop, stdout, stderr, grace_seconds,
                                 guard)
            resume.exited(outcome.returncode)
            if on_exit is not None:
                try:
                    on_exit(outcome, restarts)
                except Exception:  # noqa: BLE001 - a post-mortem never changes what supervision does
                    log.error("child_exit_record_failed", exc_info=True)
            decision = decide(outcome, restarts, max_restarts, stopping=stop.signal is not None)
            if not decision.restart:
                _log_end(decision, outcome, restarts, max_restarts)
                return decision.exit_status
            delay = backoff_seconds(restarts, backoff, max_backoff)
            restarts += 1
            log.warning("child_restarting", reason=decision.reason, child_status=describe(outcome.returncode),
                        restart=restarts, max_restarts=max_restarts, delay_seconds=round(delay, 3),
                        added_args=resume.added(restarts))
            if stop.sleep(delay):
                log.info("supervision_stopped", signal=signal.Signals(stop.signal).name, during="backoff")
                return exit_status_of(outcome.returncode)


@dataclass
class Resume:
    """What a restart adds to the command (`--on-restart-args`), once a checkpoint exists: `checkpoint`
    is there (a file, or a folder with something in it), or, with none named, a run exited 42."""

    args: list[str]
    checkpoint: Path | None
    saved: bool = False  # a run of this job exited 42: it said it saved

    def exited(self, returncode: int) -> None:
        self.saved = self.saved or returncode == EXIT_RESTART_REQUESTED

    def added(self, restarts: int) -> list[str]:
        """The arguments run `restarts` (0: the first) gets on top of the command."""
        if not self.args or restarts == 0:
            return []
        return self.args if (checkpoint_exists(self.checkpoint) if self.checkpoint else self.saved) else []

    def command(self, command: list[str], restarts: int) -> list[str]:
        return command + self.added(restarts)


def checkpoint_exists(path: Path) -> bool:
    try:
        return path.is_file() or (path.is_dir() and any(path.iterdir()))
    except OSError:
        return False


def _log_end(decision: Decision, outcome: ChildOutcome, restarts: int, max_restarts: int) -> None:
    fields = dict(reason=decision.reason, child_status=describe(outcome.returncode), restarts=restarts,
                  exit_status=decision.exit_status)
    if decision.reason == "budget_exhausted":
        log.error("restart_budget_exhausted", message=f"giving up: restart budget of {max_restarts} spent",
                  **fields)
    elif decision.reason in ("finished", "stopped"):
        log.info("supervision_ended", **fields)
    else:
        log.error("child_failed_not_restarting", **fields)

