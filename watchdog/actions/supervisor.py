"""The restart half of checkpoint-and-restart (`hbm-watchdog supervise`, in commands/supervise.py).

A leak that survives an in-process reinit (memory held outside the trainer's state) can only be
freed by a new process. The trainer saves a checkpoint and exits 42; this loop starts it again
(with `--resume auto` it picks up the checkpoint). It also restarts a child that crashed out of
memory anyway (RESOURCE_EXHAUSTED / CUDA OOM in its output) or died by a signal (the kernel's
OOM killer sends SIGKILL), within a budget and with capped exponential backoff.

Exit status of the supervisor:
- 0 when the child finishes;
- the child's own status when it fails for any other reason (128+N for death by signal N);
- 1 when a restart was due but the budget (`--max-restarts`) was spent: not 42, so an outer
  restarter (JobSet, torchelastic) does not loop on a job that keeps running out of memory;
- SIGINT/SIGTERM to the supervisor are forwarded to the child and end supervision: the exit
  status is then the child's (42 when it saved on SIGTERM, which tells a cluster to reschedule).

The child sees `HBMWATCH_RESTART_COUNT` = restarts so far (0 for the first run).

The child's life is tied to the supervisor's: on Linux it is started with PR_SET_PDEATHSIG, so
if the supervisor dies, even by SIGKILL, the kernel sends the child SIGTERM (the trainer saves a
checkpoint and exits) instead of leaving it running unsupervised under PID 1.
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
from typing import BinaryIO, Callable, Sequence

from watchdog.core.errors import EXIT_RESTART_REQUESTED, InputError
from watchdog.logs import get_logger

log = get_logger(__name__)

RESTART_COUNT_ENV = "HBMWATCH_RESTART_COUNT"
EXIT_BUDGET_EXHAUSTED = 1
OOM_MARKERS = (b"RESOURCE_EXHAUSTED", b"CUDA out of memory", b"OutOfMemoryError")
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


# --- pure decisions -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ChildOutcome:
    returncode: int  # subprocess convention: -N means killed by signal N
    saw_oom: bool = False  # an out-of-memory marker appeared in its output


@dataclass(frozen=True, slots=True)
class Decision:
    restart: bool
    reason: str  # finished | restart_requested | out_of_memory | killed_by_signal | failed | budget_exhausted | stopped
    exit_status: int | None = None  # what the supervisor exits with, when not restarting


def decide(outcome: ChildOutcome, restarts_so_far: int, max_restarts: int, stopping: bool = False) -> Decision:
    """Restart or stop, given how the child ended, what it printed, and the budget left."""
    code = outcome.returncode
    if stopping:
        return Decision(False, "stopped", exit_status_of(code))
    if code == 0:
        return Decision(False, "finished", 0)
    if code == EXIT_RESTART_REQUESTED:
        reason = "restart_requested"
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
    """Finds the OOM markers in a byte stream fed in arbitrary chunks (a marker may straddle two)."""

    def __init__(self, markers: Sequence[bytes] = OOM_MARKERS):
        self.markers = tuple(markers)
        self._keep = max(len(m) for m in self.markers) - 1
        self._tail = b""
        self.found: bytes | None = None

    def feed(self, chunk: bytes) -> bool:
        if self.found is None:
            window = self._tail + chunk
            self.found = next((m for m in self.markers if m in window), None)
            self._tail = window[-self._keep:] if self._keep else b""
        return self.found is not None


# --- processes and signals ------------------------------------------------------------------------

class _StopRequest:
    """While active, SIGINT/SIGTERM are forwarded to the current child and mark supervision as ending."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.child: subprocess.Popen | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_StopRequest":
        for signum in _STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, _frame) -> None:
        self.signal = signum  # handlers only set a flag and signal the child: no locks taken here
        child = self.child
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    def sleep(self, seconds: float) -> bool:
        """Back off; True if a stop signal arrived meanwhile."""
        deadline = time.monotonic() + seconds
        while self.signal is None and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
        return self.signal is not None


def _die_with_supervisor() -> Callable[[], None] | None:
    """A preexec function that asks the kernel for SIGTERM when the supervisor dies (Linux; None elsewhere).

    Runs in the forked child before exec, while the supervisor has no other thread (the output
    pumps of the previous child are joined), so it is safe there. A supervisor that died between
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
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != supervisor:
            os.kill(os.getpid(), signal.SIGTERM)

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
               stderr: BinaryIO) -> ChildOutcome:
    env = {**os.environ, RESTART_COUNT_ENV: str(restarts)}
    try:
        # Its own session: a terminal's Ctrl-C reaches only us, and we forward it exactly once.
        child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True, preexec_fn=_die_with_supervisor())
    except OSError as exc:
        raise InputError(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None
    stop.child = child
    if stop.signal is not None:  # a stop that landed between Popen and now
        child.send_signal(stop.signal)
    scanners = (OomScanner(), OomScanner())
    pumps = [threading.Thread(target=_pump, args=(pipe, sink, scanner), daemon=True)
             for pipe, sink, scanner in zip((child.stdout, child.stderr), (stdout, stderr), scanners)]
    for pump in pumps:
        pump.start()
    log.info("child_started", pid=child.pid, restarts_so_far=restarts, command=command)
    returncode = child.wait()
    for pump in pumps:
        pump.join()
    stop.child = None
    marker = next((s.found for s in scanners if s.found), None)
    if marker:
        log.warning("child_out_of_memory_seen", pid=child.pid, marker=marker.decode())
    return ChildOutcome(returncode, saw_oom=marker is not None)


def check_options(max_restarts: int, backoff: float, max_backoff: float) -> None:
    """InputError unless the budget is a count and the waits are finite seconds (a NaN wait is no wait)."""
    if max_restarts < 0:
        raise InputError(f"--max-restarts must be >= 0, got {max_restarts}")
    for flag, seconds in (("--backoff", backoff), ("--max-backoff", max_backoff)):
        if not (math.isfinite(seconds) and seconds >= 0):
            raise InputError(f"{flag} must be a finite number of seconds >= 0, got {seconds}")


def supervise(command: Sequence[str], *, max_restarts: int = 3, backoff: float = 1.0,
              max_backoff: float = 60.0, stdout: BinaryIO | None = None, stderr: BinaryIO | None = None) -> int:
    """Run `command` until it finishes, restarting it as `decide` says; returns the supervisor's exit status.

    Must run on the main thread (it installs SIGINT/SIGTERM handlers for the duration).
    """
    command = list(command)
    if not command:
        raise InputError("no command to supervise: hbm-watchdog supervise [options] -- CMD ...")
    check_options(max_restarts, backoff, max_backoff)
    stdout = stdout or sys.stdout.buffer
    stderr = stderr or sys.stderr.buffer
    restarts = 0
    with _StopRequest() as stop:
        while True:
            outcome = _run_child(command, restarts, stop, stdout, stderr)
            decision = decide(outcome, restarts, max_restarts, stopping=stop.signal is not None)
            if not decision.restart:
                _log_end(decision, outcome, restarts, max_restarts)
                return decision.exit_status
            delay = backoff_seconds(restarts, backoff, max_backoff)
            restarts += 1
            log.warning("child_restarting", reason=decision.reason, child_status=describe(outcome.returncode),
                        restart=restarts, max_restarts=max_restarts, delay_seconds=round(delay, 3))
            if stop.sleep(delay):
                log.info("supervision_stopped", signal=signal.Signals(stop.signal).name, during="backoff")
                return exit_status_of(outcome.returncode)


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
