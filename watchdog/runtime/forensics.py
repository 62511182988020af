"""What is leaking: a census of live tensors, diffed against a baseline.

A leak of small tensors shows up as one group (device, dtype, shape, whether it holds an
autograd graph) whose count keeps growing. The census walks the garbage collector's objects,
so it costs milliseconds to seconds: it runs on the training thread between steps, at start
and when the watchdog asks for an action, never in the step. Reading `.nbytes`, `.shape`
and `.device` touches metadata only: no device sync, no transfer.

For the fastest-growing group, `holders` names the containers that keep those tensors alive
(a list held by an attribute, a module-level global) so the log line points at Python code.
"""

from __future__ import annotations

import gc
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field

from watchdog.core.units import format_bytes


@dataclass(frozen=True, slots=True, order=True)
class TensorGroup:
    device: str
    dtype: str
    shape: tuple[int, ...]
    has_graph: bool  # a tensor with grad_fn keeps its whole autograd graph alive


@dataclass
class Census:
    count: Counter = field(default_factory=Counter)
    nbytes: Counter = field(default_factory=Counter)

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes.values())


@dataclass(frozen=True)
class Growth:
    group: TensorGroup
    added_tensors: int
    added_bytes: int
    holders: tuple[str, ...] = ()

    def describe(self) -> str:
        g = self.group
        shape = "x".join(map(str, g.shape)) or "scalar"
        graph = " with autograd graph" if g.has_graph else ""
        held = f"; held by {', '.join(self.holders)}" if self.holders else ""
        return (f"+{self.added_tensors} tensors {g.dtype}[{shape}] on {g.device}{graph} "
                f"(+{format_bytes(self.added_bytes)}){held}")


def _live_tensors():
    torch = sys.modules.get("torch")
    if torch is None:
        return
    tensor_type, parameter_type = torch.Tensor, torch.nn.Parameter
    with warnings.catch_warnings():  # isinstance() wakes deprecation shims among gc's objects
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, tensor_type) and not isinstance(o, parameter_type)]
    return tensors


def group_of(tensor) -> TensorGroup:
    return TensorGroup(str(tensor.device), str(tensor.dtype).replace("torch.", ""),
                       tuple(tensor.shape), tensor.grad_fn is not None)


def census() -> Census:
    """Count live tensors by group. Parameters are left out: they are the model, not a leak."""
    result = Census()
    for tensor in _live_tensors():
        try:
            group = group_of(tensor)
            size = tensor.nelement() * tensor.element_size()
        except Exception:  # noqa: BLE001 - exotic subclasses without metadata are skipped
            continue
        result.count[group] += 1
        result.nbytes[group] += size
    return result


def growth(before: Census, after: Census, top: int = 3, min_tensors: int = 2) -> list[Growth]:
    """Groups that grew most in bytes between two censuses (pure: no gc walk)."""
    grown = []
    for group, count in after.count.items():
        added = count - before.count.get(group, 0)
        if added >= min_tensors:
            grown.append(Growth(group, added, after.nbytes[group] - before.nbytes.get(group, 0)))
    grown.sort(key=lambda g: (-g.added_bytes, g.group))
    return grown[:top]


def holders(group: TensorGroup, limit: int = 2, probe: int = 16) -> tuple[str, ...]:
    """Name the containers holding tensors of `group`: `list of 120 (attribute 'bucket' of
    TrainerState)` or `list of 120 (global 'CACHE' in module leaks)`.

    One walk of the heap for a handful of the group's newest tensors (a leak appends, and the
    container that holds one of them holds the rest): asking per tensor would walk it once each.
    """
    tensors = _live_tensors()
    members = []
    for tensor in tensors:
        try:
            if group_of(tensor) == group:
                members.append(tensor)
        except Exception:  # noqa: BLE001 - exotic subclasses without metadata are skipped
            continue
    del tensors
    if not members:
        return ()
    member_ids = {id(t) for t in members}
    ours = {id(members)}
    held: list[tuple[int, object]] = []
    for ref in gc.get_referrers(*members[-probe:]):
        if isinstance(ref, (list, dict, set, tuple)) and id(ref) not in ours:
            values = ref.values() if isinstance(ref, dict) else ref
            held.append((sum(id(v) in member_ids for v in values), ref))
    held.sort(key=lambda item: -item[0])
    ours.add(id(held))
    return tuple(f"{type(ref).__name__} of {n} ({_owner(ref, ours)})" for n, ref in held[:limit] if n >= 2)


def _owner(container, ours: set[int]) -> str:
    for ref in gc.get_referrers(container):
        if id(ref) in ours:
            continue
        attrs = getattr(ref, "__dict__", None)
        if isinstance(attrs, dict) and not isinstance(ref, type):  # 3.11+ inline attributes
            name = next((k for k, v in attrs.items() if v is container), None)
            if name is not None:
                return f"attribute {name!r} of {type(ref).__name__}"
        if isinstance(ref, dict):
            name = next((k for k, v in ref.items() if v is container), None)
            if name is None:
                continue
            if "__builtins__" in ref and ref.get("__name__"):
                return f"global {name!r} in module {ref['__name__']}"
            owner = next((o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref), None)
            if owner is not None:
                return f"attribute {name!r} of {type(owner).__name__}"
            return f"key {name!r} of a dict"
    return "unnamed container"


def explain_leak(baseline: Census, top: int = 3) -> list[str]:
    """Census now, compare with the baseline, name the holders of each top grower: log-ready lines.

    Tensors saved by a kept autograd graph grow too but have no Python holder; the line for the
    kept outputs (`with autograd graph`) names the list that keeps the whole graph alive.
    """
    grown = growth(baseline, census(), top=top)
    return [Growth(g.group, g.added_tensors, g.added_bytes, holders(g.group)).describe() for g in grown]
