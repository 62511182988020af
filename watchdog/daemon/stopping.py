"""The daemon's stop flag, safe to set from a signal handler.

`threading.Event.set()` takes the event's lock. A Python signal handler runs in the main thread
between two bytecodes, and when those two are inside `Event.wait()` while it holds that very lock,
`set()` waits for a lock its own thread holds: the daemon never stops (a loaded CI saw `watch`
ignore SIGTERM for over a minute). Here `set()` takes no lock: it sets a bool and writes a byte
to a pipe that `wait()` selects on, so a signal that lands anywhere ends the wait at once.
"""

from __future__ import annotations

import os
import select


class StopFlag:
    """`is_set()`, `set()` and `wait(timeout)` as on `threading.Event`; `set()` may run in a handler."""

    def __init__(self) -> None:
        self._set = False
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)

    def set(self) -> None:
        self._set = True
        try:
            os.write(self._wake_write, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full of earlier wake-ups (or closed): the flag is what counts

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Until set or `timeout` seconds; True if set. A signal handler that calls set() ends it."""
        if not self._set:
            select.select([self._wake_read], [], [], timeout)
        return self._set

    def close(self) -> None:
        for fd in (self._wake_read, self._wake_write):
            try:
                os.close(fd)
            except OSError:
                pass
