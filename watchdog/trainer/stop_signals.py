"""SIGTERM (a preemption) and SIGINT (Ctrl-C), caught and acted on at the next step boundary.

Either asks for a checkpoint and a restart (the loop proposes it to its watchdog, so with several
ranks every rank saves at the same step); SIGINT then ends with 130, the shell's own status, and
a second Ctrl-C stops at once (a save in flight leaves no debris). Off the main thread nothing is
caught: Python delivers signals there only.
"""

from __future__ import annotations

import signal
import threading

from watchdog.core.errors import EXIT_INTERRUPTED
from watchdog.core.verdict import Action
from watchdog.logs import get_logger

log = get_logger(__name__)


class StopSignals:
    def __init__(self):
        self.caught: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._remember) for signum in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _remember(self, signum, _frame) -> None:
        if signum == signal.SIGINT and self.caught == signal.SIGINT:
            raise KeyboardInterrupt
        self.caught = signum  # acted on at the next step boundary, never mid-step

    def propose_to(self, watchdog) -> None:
        """A signal caught: ask for a checkpoint and a restart on the loop's own account."""
        if self.caught is not None:
            watchdog.propose(Action.CHECKPOINT_RESTART, "stop signal")

    def exit_code(self, code: int) -> int:
        """The status to end with after a restart saved for a signal: 130 for Ctrl-C."""
        return EXIT_INTERRUPTED if self.caught == signal.SIGINT else code

    def say(self, step: int) -> None:
        if self.caught is not None:
            log.warning("interrupted" if self.caught == signal.SIGINT else "preempted",
                        signal=signal.Signals(self.caught).name, step=step)
