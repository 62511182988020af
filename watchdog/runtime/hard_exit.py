"""The stall watch's last bound, where the GIL does not reach: exit 43 from C at a deadline.

A Python thread cannot run while another thread holds the GIL, and a C call that never releases it
(a regex stuck backtracking, a C extension's loop) holds it for good: the stall watch's own thread
was starved, and a loop stuck in a regex with `stall_exit_after_seconds=2` ran until it was killed
from outside at 15 s, with no stall record. So the watch also keeps a deadline in the kernel, which
it pushes back each time it sees the loop step:

- a POSIX timer (`timer_create`, CLOCK_MONOTONIC) sends this process signal 43 (a real-time signal
  whose number is the exit status a restarter acts on, `EXIT_PEER_LOST`) at the deadline;
- faulthandler's handler for it, in C, writes every thread's Python stack to stderr (it reads the
  frames without the GIL), then calls the handler under it: libc's `_exit`, which takes the signal's
  number as its status. The process exits 43 whatever holds the GIL.

Where that cannot be had (not Linux, no `timer_create`, signal 43 handled by someone else) the
deadline is faulthandler's own watchdog thread (`dump_traceback_later(exit=True)`, C as well),
which writes the same stacks and exits 1; `stall_watch_armed` says which. One deadline per process:
a second stall watch running at once keeps only its Python bound.
"""

from __future__ import annotations

import ctypes
import faulthandler
import signal
import sys
import threading

from watchdog.core.errors import EXIT_PEER_LOST

SIGNAL = EXIT_PEER_LOST  # the signal's number is the status `_exit` is handed
STDERR = 2  # where faulthandler writes the stacks: the process's stderr, which supervise and torchrun keep
_CLOCK_MONOTONIC, _SIGEV_SIGNAL = 1, 0
_lock = threading.Lock()
_held = False  # one deadline per process


class _Sigevent(ctypes.Structure):  # glibc's struct sigevent on 64-bit Linux: 64 bytes
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("pad", ctypes.c_int * 12)]


class _Timespec(ctypes.Structure):
    _fields_ = [("seconds", ctypes.c_long), ("nanoseconds", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("interval", _Timespec), ("value", _Timespec)]


class HardExit:
    """A deadline at which this process writes every thread's stack to stderr and exits, from C.
    `acquire()` it (None: another one holds the process's), `arm(seconds)` it from now, again and
    again, `release()` it. `exit_code` is what the process exits with (43, or 1 where it falls back)."""

    def __init__(self) -> None:
        self._timer: ctypes.c_void_p | None = None
        self._libc = None
        self._previous = None
        self.exit_code, self.why = 1, ""
        try:
            self._take_signal()
        except Exception as exc:  # noqa: BLE001 - no timer or no signal to take: faulthandler's own deadline
            self._give_back_signal()
            self.why = f"{type(exc).__name__}: {exc}"

    @classmethod
    def acquire(cls) -> "HardExit | None":
        global _held
        with _lock:
            if _held:
                return None
            _held = True
        return cls()

    def arm(self, seconds: float) -> None:
        """The process ends `seconds` from now, unless armed again (or released) before."""
        if self._timer is None:
            faulthandler.dump_traceback_later(seconds, exit=True, file=STDERR)
            return
        whole = int(seconds)
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(whole, int((seconds - whole) * 1e9) or (0 if whole else 1)))
        self._libc.timer_settime(self._timer, 0, ctypes.byref(spec), None)

    def release(self) -> None:
        """No deadline any more; signal 43 back to what it was."""
        global _held
        if self._timer is None:
            faulthandler.cancel_dump_traceback_later()
        self._give_back_signal()
        with _lock:
            _held = False

    def _take_signal(self) -> None:
        if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_long) != 8:
            raise OSError("a POSIX timer with a signal of our choosing needs 64-bit Linux")
        if not signal.SIGRTMIN <= SIGNAL <= signal.SIGRTMAX:
            raise OSError(f"signal {SIGNAL} is no real-time signal here")
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype, libc.signal.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_void_p]
        libc.timer_create.argtypes = [ctypes.c_int, ctypes.POINTER(_Sigevent), ctypes.POINTER(ctypes.c_void_p)]
        libc.timer_settime.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
        libc.timer_delete.argtypes = [ctypes.c_void_p]
        previous = libc.signal(SIGNAL, ctypes.cast(libc._exit, ctypes.c_void_p))  # _exit(signum): exit 43
        if previous:  # not SIG_DFL (0): someone's handler, SIG_IGN, or SIG_ERR
            libc.signal(SIGNAL, previous)
            raise OSError(f"signal {SIGNAL} already has a handler")
        self._libc, self._previous = libc, 0
        faulthandler.register(SIGNAL, file=STDERR, all_threads=True, chain=True)  # stacks, then _exit(43)
        event, timer = _Sigevent(signo=SIGNAL, notify=_SIGEV_SIGNAL), ctypes.c_void_p()
        if libc.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
            raise OSError(ctypes.get_errno(), "timer_create failed")
        self._timer, self.exit_code = timer, EXIT_PEER_LOST

    def _give_back_signal(self) -> None:
        libc, timer, self._timer = self._libc, self._timer, None
        if libc is None:
            return
        if timer is not None:
            libc.timer_delete(timer)
        faulthandler.unregister(SIGNAL)
        libc.signal(SIGNAL, self._previous or 0)
        self._libc = None
