"""A loop that stopped stepping, bounded: where every thread is, and the exit a restarter acts on.

Across ranks a stalled rank hangs the job: the others wait in their next collective for as long as
the training's own timeout (30 minutes for gloo by default, NCCL's is similar), and a hung input
pipeline or a stuck file system read is enough. Past `WatchdogConfig.stall_exit_after_seconds`
without a `step()`, the watchdog's stall watch (a thread of its own: the training thread is the one
stuck) records every thread's Python stack in the flight record and the log, and ends the process
with status 43: nothing was saved, so the job restarts from its newest checkpoint. The other ranks
then fail their next collective when this process's connections close, or, waiting in one for it,
reach the same bound themselves (their record says they waited in a collective), and exit too; a
restarter (torchrun, `supervise`, JobSet) starts the group again. `postmortem` reads the stacks
back: "rank R stalled in FILE:LINE", or "rank R waited in a collective" for the ranks that waited.

`os._exit`, not `sys.exit`: the training thread cannot be interrupted where it is stuck (a C call, a
lock, a collective), and nothing that waits for it (atexit handlers, non-daemon threads) would
ever return.

The watch's thread needs the GIL, which a loop stuck in a C call that never releases it (a regex)
holds for good. So the watch also keeps a deadline in C (`runtime/hard_exit.py`), pushed back each
time it sees a step, `HARD_GRACE_SECONDS` (or two checks) past its own bound: if the watch's thread
could not end the process, faulthandler writes every thread's stack to stderr and the process
exits 43 all the same. That exit writes nothing of ours, so the flight record's `stall` is written
before, when the watch starts, as "armed" (the bound, and which thread is the training thread in
faulthandler's dump); the watch's own exit replaces it with the stacks it recorded.

A rank whose training thread waits for another rank in the watchdog's agreement is not stalled
itself: its record says so (`waiting`: the step and the ranks that have not made that offer).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import sysconfig
import threading
import time
import traceback
from typing import Callable

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

from watchdog.core.config import DEFAULT_STALL_EXIT_SECONDS
from watchdog.core.errors import EXIT_PEER_LOST
from watchdog.logs import exit_process, get_logger
from watchdog.runtime.hard_exit import HardExit

log = get_logger(__name__)

SCHEDULER_LOGGER = "watchdog.runtime.scheduler"
EXECUTOR = "hbm-watchdog"  # apscheduler logs a job's runs to "apscheduler.executors.<alias>"
MAX_THREADS = 64  # threads whose stacks are kept (a DataLoader with many workers has few Python threads)
MAX_FRAMES = 48  # frames kept per thread, the innermost ones
HARD_GRACE_SECONDS = 3.0  # past the watch's own bound, the deadline in C ends a process the watch could not


def thread_stacks(training_thread: int | None) -> list[dict]:
    """Every Python thread's stack, innermost frame last (as a traceback reads), the training
    thread's first: `{"name", "training", "frames": ["file:line in function", ...]}`."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    stacks = []
    for ident, frame in sys._current_frames().items():
        frames = [f"{entry.filename}:{entry.lineno} in {entry.name}"
                  for entry in traceback.extract_stack(frame)[-MAX_FRAMES:]]
        stacks.append({"name": names.get(ident, f"thread {ident}"), "training": ident == training_thread,
                       "frames": frames})
    stacks.sort(key=lambda stack: not stack["training"])
    return stacks[:MAX_THREADS]


def _library_prefixes() -> tuple[str, ...]:
    """Code that is not the user's: the standard library, site-packages, this package."""
    paths = sysconfig.get_paths()
    prefixes = {os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = paths.get(key)
        if path:
            prefixes.add(os.path.abspath(path) + os.sep)
    return tuple(sorted(prefixes))


def in_collective(frame: str | None) -> bool:
    """Whether a frame is inside torch.distributed: a rank waiting there waits for another rank."""
    return bool(frame) and f"{os.sep}torch{os.sep}distributed{os.sep}" in frame


def where(stacks: list[dict]) -> tuple[str | None, str | None]:
    """The training thread's innermost frame, and its innermost frame in the user's own code."""
    training = next((stack for stack in stacks if stack["training"]), None)
    if training is None or not training["frames"]:
        return None, None
    library = _library_prefixes()
    user = next((frame for frame in reversed(training["frames"])
                 if not os.path.abspath(frame.split(":", 1)[0]).startswith(library)
                 and not frame.startswith("<")), None)
    return training["frames"][-1], user


class StallWatch:
    """Reads the loop's step counter from a scheduler thread of its own: reports a loop that has not
    stepped for `report_after` seconds (`training_stalled`, `hbmwatch_training_stalled`) and its
    return (`training_resumed`); past `exit_after` (None: never), records every thread's stack and
    exits 43. Made and started on the training thread, whose stack says where the stall is."""

    def __init__(self, newest_step: Callable[[], int], telemetry, *, report_after: float, check_every: float,
                 exit_after: float | None, flight=None, rank: int = 0,
                 waiting: Callable[[], dict | None] | None = None):
        """`waiting`: what the training thread waits for in the watchdog's own agreement, if it does
        (`Agreement.waiting_for`: the step, and the ranks that have not made that offer)."""
        self._newest_step, self._telemetry, self._flight, self._rank = newest_step, telemetry, flight, rank
        self.report_after, self.exit_after = report_after, exit_after
        self._waiting = waiting
        self._interval = min(check_every, report_after / 4, exit_after / 4 if exit_after is not None else check_every)
        self._training_thread = threading.get_ident()
        self._seen_step, self._seen_at = newest_step(), time.monotonic()
        self._scheduler: BackgroundScheduler | None = None
        self._hard: HardExit | None = None
        self._hard_grace = max(HARD_GRACE_SECONDS, 2 * self._interval)

    def start(self) -> "StallWatch":
        if self.exit_after is not None:
            self._arm_hard_exit()
        scheduler = _quiet_scheduler()
        scheduler.add_job(self.check, "interval", seconds=self._interval, max_instances=1, coalesce=True,
                          misfire_grace_time=None, id="stall-watch", executor=EXECUTOR)
        scheduler.start()
        self._scheduler = scheduler
        return self

    def stop(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
            self._scheduler = None
        hard, self._hard = self._hard, None
        if hard is not None:
            atexit.unregister(self.stop)
            hard.release()
            if self._flight is not None:
                self._flight.stall_armed(None)

    def _arm_hard_exit(self) -> None:
        """The deadline in C, and the flight record's `stall` written before it can be needed."""
        self._hard = HardExit.acquire()
        if self._hard is None:
            log.info("stall_watch_armed", exit_from_c=False, note="another stall watch holds this process's "
                                                                   "deadline in C: this one ends the process from Python only")
            return
        bound = self.exit_after + self._hard_grace
        self._hard.arm(bound)
        # A process leaving in order (sys.exit, PeerLost's SystemExit(43)) runs its atexit handlers and
        # takes the armed record back: only the exit from C, which runs none, leaves it with status 43.
        atexit.register(self.stop)
        armed = {"armed": True, "rank": self._rank, "step": max(self._seen_step, 0), "seconds": round(bound, 1),
                 "exit_code": self._hard.exit_code, "training_thread": f"0x{self._training_thread:x}",
                 "stacks": "stderr"}
        if self._flight is not None:
            self._flight.stall_armed(armed)
        log.info("stall_watch_armed", exit_from_c=True, exit_code=self._hard.exit_code, seconds=round(bound, 1),
                 **({"fallback": self._hard.why} if self._hard.why else {}),
                 note="a loop that holds the GIL past this bound is ended from C: every thread's stack on stderr")

    def check(self) -> None:
        now, step = time.monotonic(), self._newest_step()
        telemetry = self._telemetry
        telemetry.training_step = max(step, 0)
        if step != self._seen_step:
            self._seen_step, self._seen_at = step, now
            telemetry.last_step_monotonic = now
            if self._hard is not None:  # the deadline in C moves with the loop
                self._hard.arm(self.exit_after + self._hard_grace)
            if telemetry.stalled:
                telemetry.stalled = False
                log.info("training_resumed", step=step)
            return
        idle = now - self._seen_at
        if idle >= self.report_after and not telemetry.stalled:
            telemetry.stalled = True
            log.error("training_stalled", step=step, seconds_without_step=round(idle, 1),
                      stall_after_seconds=self.report_after)
        if self.exit_after is not None and idle >= self.exit_after:
            self._exit(step, idle)

    def _exit(self, step: int, idle: float) -> None:
        """Every thread's stack into the flight record and the log, then exit 43 (the deadline in C
        pushed back for the time this takes, and no further)."""
        if self._hard is not None:
            self._hard.arm(self._hard_grace)
        stacks = thread_stacks(self._training_thread)
        innermost, user = where(stacks)
        waiting = self._waiting() if self._waiting is not None else None
        record = {"step": max(step, 0), "seconds": round(idle, 1), "rank": self._rank, "where": innermost,
                  "user": user, "collective": in_collective(innermost), "waiting": waiting, "threads": stacks}
        if self._flight is not None:
            self._flight.stalled(record)
        training = stacks[0]["frames"] if stacks and stacks[0]["training"] else []
        log.error("stall_exit", step=step, rank=self._rank, seconds_without_step=round(idle, 1), where=innermost,
                  user=user, exit_code=EXIT_PEER_LOST, stall_exit_after_seconds=self.exit_after,
                  waiting_in_agreement=waiting, training_thread=training,
                  note=(_waited(self._rank, waiting) + "; " if waiting is not None else "")
                  + "nothing saved: the job restarts from its newest checkpoint; every thread's stack is in the "
                    "flight record")
        exit_process(EXIT_PEER_LOST)


def start_stall_watch(config, newest_step: Callable[[], int], telemetry, flight, ranks, rank: int) -> "StallWatch":
    """The `Watchdog`'s stall watch, started on the training thread (whose stack says where a stall
    is). A stalled rank hangs every other rank: with several ranks (`ranks`, the agreement) a stall
    ends the process unless told otherwise."""
    exit_after = config.stall_exit_after_seconds
    if exit_after is None and ranks is not None:
        exit_after = DEFAULT_STALL_EXIT_SECONDS
    return StallWatch(newest_step, telemetry, report_after=config.stall_after_seconds,
                      check_every=config.stall_check_seconds, exit_after=exit_after, flight=flight,
                      rank=rank, waiting=ranks.waiting_for if ranks is not None else None).start()


def _waited(rank: int, waiting: dict) -> str:
    """A rank that waited in the agreement, in words: whom for, where known."""
    ranks = waiting.get("ranks")
    whom = (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else "another rank")
    return f"rank {rank} was not stalled itself: it waited in the watchdog's agreement for {whom} (step {waiting['step']})"


# ---- the scheduler: a quiet guest in the loop's log ------------------------------------------------

class _WarningsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def _quiet_scheduler() -> BackgroundScheduler:
    """A scheduler whose routine lines (a job added, run, executed: every stall check, at INFO)
    never reach the loop's log, while its warnings and errors (a missed run, a check that raised)
    do. It logs through loggers of its own, filtered there, so a user who runs apscheduler for
    their own jobs keeps all of its lines and nobody's levels are changed."""
    quiet = _WarningsOnly()
    for name in (SCHEDULER_LOGGER, f"apscheduler.executors.{EXECUTOR}"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _WarningsOnly) for f in logger.filters):
            logger.addFilter(quiet)
    return BackgroundScheduler(daemon=True, logger=logging.getLogger(SCHEDULER_LOGGER),
                               executors={EXECUTOR: ThreadPoolExecutor(1)})
