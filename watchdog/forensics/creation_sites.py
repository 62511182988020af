"""Where leaked tensors were created: a short capture of the Python stack of new tensors.

The census says what grew and what holds it, not which line made it. When a leak is suspected,
`CreationSites` installs a `TorchFunctionMode` on the training thread for a few steps: every
torch function or tensor method that returns a new tensor notes the innermost frames of user
code (torch, torch_xla, the standard library and these forensics are skipped) against a weak
reference to the tensor. A tensor that dies takes its note with it, so what is left at the next
census is where the survivors, the leak among them, came from. Then the mode is removed again:
while off, nothing is installed and tensor operations pay nothing. On a process using CUDA the
window also turns on the allocator's own record of stacks (`AllocatorHistory`), which names the
blocks no torch function made from Python (a backward's gradients and saved tensors).

The capture only watches: each operation runs as it would, no tensor value is read, so the XLA
graph, its compilations and its transfers stay the same (tests/test_creation_sites.py proves it
with torch_xla's counters; `python -m watchdog.bench.capture_cost` measures the time).

    sites = CreationSites(steps=8)
    sites.arm()                    # any thread: a leak is suspected (reported, a WARN or an action)
    ...
    if sites.between_steps():      # the training thread, once per step: True when the window closes
        log(forensics.explain_leak(baseline, sites=sites))
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import weakref
from collections import Counter
from typing import Callable, Iterable, NamedTuple

from torch import Tensor
from torch.overrides import TorchFunctionMode

from watchdog.core.units import format_bytes
from watchdog.forensics import peek
from watchdog.forensics.allocator_history import AllocatorHistory, RawFrame
from watchdog.logs import get_logger

log = get_logger(__name__)

_IDLE, _ARMED, _CAPTURING, _DONE = "idle", "armed", "capturing", "done"


class Frame(NamedTuple):
    filename: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{os.path.basename(self.filename)}:{self.line} in {self.function}"


class Site(NamedTuple):
    """The innermost user frames when a tensor was created, innermost first."""

    frames: tuple[Frame, ...]

    def __str__(self) -> str:
        if not self.frames:
            return "unknown"
        inner, *callers = self.frames
        return str(inner) + (f" (called from {callers[0]})" if callers else "")


def _framework_prefixes() -> tuple[str, ...]:
    import torch

    packages = [torch, sys.modules.get("torch_xla")]
    prefixes = {os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in packages if getattr(m, "__file__", None)}
    prefixes.add(os.path.dirname(os.path.abspath(__file__)) + os.sep)  # these forensics
    paths = sysconfig.get_paths()
    site_packages = os.path.abspath(paths.get("purelib", "")) + os.sep
    for key in ("stdlib", "platstdlib"):  # in a venv, platstdlib holds site-packages: user code may live there
        path = os.path.abspath(paths.get(key) or "") + os.sep
        if len(path) > 1 and not site_packages.startswith(path):
            prefixes.add(path)
    return tuple(sorted(prefixes))


class _Note(weakref.ref):
    """A weak reference to a new tensor, with where it was made."""

    __slots__ = ("key", "site")


class _Recorder(TorchFunctionMode):
    def __init__(self, sites: CreationSites):
        super().__init__()
        self._note = sites._note

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **kwargs) if kwargs else func(*args)
        self._note(result, args)
        return result


class CreationSites:
    """Captures creation sites for `steps` steps once armed; see the module docstring."""

    def __init__(self, steps: int = 8, depth: int = 2, max_records: int = 200_000,
                 allocator: Callable[[], AllocatorHistory | None] = AllocatorHistory.of_this_process):
        if steps < 1 or depth < 1 or max_records < 1:
            raise ValueError("steps, depth and max_records must be positive")
        self.steps, self.depth, self.max_records = steps, depth, max_records
        self._allocator = allocator  # CUDA's history for the window, where CUDA is in use
        self._history: AllocatorHistory | None = None
        self._blocks: dict[int, Site] = {}  # a live CUDA block's address -> where it was allocated
        self._state = _IDLE
        self._pending = False  # armed or capturing: the one thing between_steps() reads when idle
        self._steps_left = 0
        self._mode: _Recorder | None = None
        self._thread: int | None = None
        self._records: dict[int, _Note] = {}
        self._interned: dict[tuple[Frame, ...], Site] = {}
        self._user_code: dict[object, bool] = {}
        self._prefixes: tuple[str, ...] = ()
        self.dropped = 0  # new tensors not noted because `max_records` was reached
        self.captured_steps = 0

    # ---- control ---------------------------------------------------------------------------

    @property
    def state(self) -> str:
        return self._state

    @property
    def capturing(self) -> bool:
        return self._state == _CAPTURING

    @property
    def done(self) -> bool:
        """A capture ran to its end: its notes name the sites of the tensors that survived it."""
        return self._state == _DONE

    def arm(self) -> bool:
        """Ask for a capture from the next step on (any thread). False if one was already asked for
        or done since the last `reset()`: one capture per suspected leak is enough."""
        if self._state != _IDLE:
            return False
        self._state, self._pending = _ARMED, True
        return True

    def between_steps(self) -> bool:
        """Call on the training thread between steps. Starts an armed capture, counts its steps,
        and ends it after `steps`: returns True exactly then (the census that reads the sites is due)."""
        if not self._pending:
            return False
        if self._state == _ARMED:
            self._start()
            return False
        self._steps_left -= 1
        self.captured_steps += 1
        if self._steps_left > 0:
            return False
        self._stop()
        return True

    def reset(self) -> None:
        """Forget the notes and allow a new capture (after a reinit, the old state is gone). A
        capture asked for and not started yet stays asked for: it will see the rebuilt state."""
        if self._state == _CAPTURING:
            self._stop()
        self._records.clear()
        self._blocks.clear()
        if self._state != _ARMED:
            self._state, self._pending = _IDLE, False
        self.dropped = self.captured_steps = 0

    def close(self) -> None:
        """Remove the mode if a capture is running and forget everything."""
        self.reset()
        self._state, self._pending = _IDLE, False

    def _start(self) -> None:
        if not self._prefixes:
            self._prefixes = _framework_prefixes()
        self._mode = _Recorder(self)
        self._mode.__enter__()
        self._thread = threading.get_ident()
        self._state, self._steps_left = _CAPTURING, self.steps
        self._history = self._allocator()
        if self._history is not None:
            try:
                self._history.start()
            except Exception as exc:  # noqa: BLE001 - the capture goes on with Python's sites alone
                log.warning("allocator_history_start_failed", error=f"{type(exc).__name__}: {exc}")
                self._history = None
        log.info("creation_capture_started", steps=self.steps, allocator_history=self._history is not None)

    def _stop(self) -> None:
        mode, self._mode = self._mode, None
        history, self._history = self._history, None
        self._state, self._pending = _DONE, False
        if mode is None:
            return
        try:
            mode.__exit__(None, None, None)
        except Exception as exc:  # noqa: BLE001 - another mode pushed after ours and still active
            log.warning("creation_capture_stop_failed", error=f"{type(exc).__name__}: {exc}")
        found = {}
        if history is not None:
            by_site: Counter = Counter()
            for block in history.stop():
                if block.frames:  # allocated while recording
                    site = self._blocks[block.address] = self._site_from(block.frames)
                    by_site[site] += block.size
            found = {"blocks_noted": len(self._blocks),
                     "block_sites": [f"{site} ({format_bytes(size)})" for site, size in by_site.most_common(3)]}
        log.info("creation_capture_stopped", steps=self.captured_steps, tensors_noted=len(self._records),
                 dropped=self.dropped, **found)

    # ---- reading ---------------------------------------------------------------------------

    def site_of(self, tensor) -> Site | None:
        note = self._records.get(id(tensor))
        if note is None:
            return self._block_site(tensor)
        noted = note()
        if noted is None:
            return None
        noted._fix_weakref()  # a tensor reached through a weak reference must be told (torch.utils.weak)
        return note.site if noted is tensor else None

    def _block_site(self, tensor) -> Site | None:
        """Where the allocator handed out a CUDA tensor's block (a storage is one block); a census's
        group of Python buffers (bytes, bytearrays, NumPy arrays) has none."""
        kind = type(tensor)
        if not self._blocks or kind is bytes or kind is bytearray or kind is peek.module_global("numpy", "ndarray"):
            return None
        if tensor.device.type != "cuda":
            return None
        return self._blocks.get(tensor.untyped_storage().data_ptr())

    def commonest_site(self, tensors: Iterable) -> tuple[Site, int] | None:
        """The site most of `tensors` were created at, and how many of them; None if none was noted."""
        found = Counter(site for site in map(self.site_of, tensors) if site is not None)
        return found.most_common(1)[0] if found else None

    # ---- the hot path while capturing ------------------------------------------------------

    def _note(self, result, args) -> None:
        if isinstance(result, Tensor):
            if not (args and result is args[0]):  # in place, or a no-op .to(): not a new tensor
                self._remember(result)
        elif isinstance(result, (tuple, list)):
            for item in result:
                if isinstance(item, Tensor):
                    self._remember(item)

    def _remember(self, tensor) -> None:
        records = self._records
        key = id(tensor)
        known = records.get(key)
        if known is not None and known() is not None:  # alive, so it is this very tensor
            return
        if len(records) >= self.max_records:
            self.dropped += 1
            return
        note = _Note(tensor, self._forget)
        note.key, note.site = key, self._site()
        records[key] = note

    def _forget(self, note: _Note) -> None:
        if self._records.get(note.key) is note:
            del self._records[note.key]

    def _site(self) -> Site:
        frames = []
        frame = sys._getframe(4)  # _site <- _remember <- _note <- __torch_function__ <- the caller
        user_code = self._user_code
        while frame is not None and len(frames) < self.depth:
            code = frame.f_code
            user = user_code.get(code)
            if user is None:
                user = user_code[code] = self._is_user(code.co_filename)
            if user:
                frames.append(Frame(code.co_filename, frame.f_lineno, code.co_name))
            frame = frame.f_back
        return self._interned_site(tuple(frames))

    def _site_from(self, raw: Iterable[RawFrame]) -> Site:
        """The site of a stack the allocator recorded (innermost first), by the same rule."""
        frames = []
        for filename, line, function in raw:
            user = self._user_code.get(filename)
            if user is None:
                user = self._user_code[filename] = self._is_user(filename)
            if user:
                frames.append(Frame(filename, line, function))
                if len(frames) == self.depth:
                    break
        return self._interned_site(tuple(frames))

    def _is_user(self, filename: str) -> bool:
        """User code: not torch, torch_xla, the standard library nor these forensics."""
        return not (filename.startswith(self._prefixes) or filename.startswith("<frozen"))

    def _interned_site(self, key: tuple[Frame, ...]) -> Site:
        site = self._interned.get(key)
        if site is None:
            site = self._interned[key] = Site(key)
        return site
