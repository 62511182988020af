"""Every way out of a watched process but SIGKILL ends what the watchdog keeps on disk.

A loop may leave without `stop()`: `sys.exit(42)` after `carry_out` outside a `with` block, the
end of a script that never called it, an uncaught exception, or a signal left at its default
action (SIGTERM, SIGHUP: the process dies at once, with no `finally` and no atexit). The trace then
kept its newest rows in its buffer (written every 64), the flight record said `ended: null` as if
the process had been killed, and the job file had no `end`. `ExitWatch` sees each of these once
and calls `leave(how, clean)`, which ends them as `stop()` does:

- atexit, when the interpreter exits: `sys.exit(...)` and a script's end are clean ("exit": the
  status is not known here), an uncaught exception is not ("error": the interpreter printed it
  and left it in `sys.last_value` first), nor a `PeerLost` the watchdog raised (exit 43: `failed`),
  a KeyboardInterrupt is the loop's own way out ("interrupted");
- SIGTERM and SIGHUP, where the program left them at their default action, on the main thread
  (where Python runs handlers): the records end unclean ("killed"), the default action is put
  back and the signal sent again, so the process still dies by it (supervise sees the same status).

A signal the program handles itself (a SIGTERM that saves: Lightning's, the trainer's, the
README's line) stays the program's: nothing is installed over it, and its handler's `sys.exit`
reaches atexit. What no process can see (SIGKILL, an abort) leaves the records as last written.
A forked child (a DataLoader worker) inherits the hooks but never acts on them: the records are
its parent's. Where SIGTERM gets this handler, `/proc/PID/status` shows it caught: `watch`'s
check at attach (daemon/signalling.py) cannot tell it from a handler that saves.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Callable

DEFAULT_DEATHS = (signal.SIGTERM, signal.SIGHUP)  # signals whose default action ends a process at once


class ExitWatch:
    def __init__(self, leave: Callable[[str, bool], None]):
        """`leave(how, clean)`: end the records; `how` is the job file's word for the way out."""
        self._leave = leave
        self._pid = os.getpid()
        self._installed: list[signal.Signals] = []
        self._seen = False  # a way out was seen, or the loop stopped the watchdog itself
        self.failed = False  # the watchdog raised what ends the process in failure (PeerLost's exit 43)

    def arm(self) -> "ExitWatch":
        atexit.register(self._at_exit)
        if threading.current_thread() is threading.main_thread():
            for signum in DEFAULT_DEATHS:
                if signal.getsignal(signum) is signal.SIG_DFL:
                    signal.signal(signum, self._on_signal)
                    self._installed.append(signum)
        return self

    def fail(self) -> None:
        """The watchdog raised what ends the process in failure (`PeerLost`, exit 43): no clean end,
        whatever catches it."""
        self.failed = True

    def disarm(self) -> None:
        """Nothing left to see (the watchdog stopped). Idempotent; a handler the program installed
        since over this one stays. Called from `leave` too, inside atexit or the handler."""
        if not self._seen:  # atexit's own callback is never unregistered while it runs
            atexit.unregister(self._at_exit)
        self._seen = True
        installed, self._installed = self._installed, []
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal works only there; the handler, if it ever runs, leaves the records alone
        for signum in installed:
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, signal.SIG_DFL)

    def _first_way_out(self) -> bool:
        """Once, and only in the process that armed it (never in a fork of it)."""
        if self._seen or os.getpid() != self._pid:
            return False
        self._seen = True
        return True

    def _at_exit(self) -> None:
        if not self._first_way_out():
            return
        died = getattr(sys, "last_value", None)
        if isinstance(died, KeyboardInterrupt):
            self._leave("interrupted", True)
        elif died is not None or self.failed:
            self._leave("error", False)
        else:
            self._leave("exit", True)

    def _on_signal(self, signum: int, _frame) -> None:
        try:
            if self._first_way_out():
                self._leave("killed", False)
        finally:  # dies by the signal, as it would have without the watchdog
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
