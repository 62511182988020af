"""The watchdog's own memory: the bytes of the Python objects a `Watchdog` keeps alive.

A process's resident memory cannot say what the watchdog holds (the model, the optimizer and any
leak share it), so this walks the objects reachable from the watchdog and adds up their sizes
(`sys.getsizeof`, each object once). The walk does not cross into what the watchdog only points
at: modules, classes, functions and methods, threads and locks, loggers, and tensors and modules
of torch (the trainer's, never the watchdog's to keep). Read twice, early and late in a run, it
shows whether the watchdog itself grows: its detector windows, traces and censuses must stay
bounded however long the job. A few milliseconds; read at a run's ends only.
"""

from __future__ import annotations

import gc
import sys
import threading
import types
from logging import Logger
from typing import Any

_NOT_OURS = (types.ModuleType, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
             types.FrameType, types.CodeType, threading.Thread, Logger, type(threading.Lock()),
             type(threading.RLock()), threading.Event, threading.Condition)
MAX_OBJECTS = 1_000_000  # a bound on the walk, whatever it reaches


def retained_bytes(root: Any) -> int:
    """Bytes of the objects reachable from `root`, not crossing into code, threads or torch's objects."""
    torch_types = _torch_types()
    seen: set[int] = set()
    stack = [root]
    total = 0
    while stack and len(seen) < MAX_OBJECTS:
        obj = stack.pop()
        if id(obj) in seen or (obj is not root and isinstance(obj, _NOT_OURS + torch_types)):
            continue
        seen.add(id(obj))
        try:
            total += sys.getsizeof(obj)
        except TypeError:
            continue
        stack.extend(gc.get_referents(obj))
    return total


def _torch_types() -> tuple[type, ...]:
    torch = sys.modules.get("torch")
    return (torch.Tensor, torch.nn.Module, torch.device) if torch is not None else ()
