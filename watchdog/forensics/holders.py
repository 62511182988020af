"""Who holds an object: the Python a person has to change to free it.

`Namer.holders_of(objects)` climbs the garbage collector's referrers from the objects to the
first things a person can name, and says the path in words:

- an attribute: `attribute 'tensors' of LeakSinks`
- a module global: `global 'CACHE' in module train`
- a local variable of a running function: `local variable 'total' of train_loop (train.py:55)`
- a closure variable or default argument, and the hook it belongs to:
  `closure variable 'acts' of save (forward hook on Sequential.0)`
- a module's hook table: `forward hook on TransformerLM.blocks.0`
- a functools cache: `cache of functools.lru_cache 'causal_mask' (60 entries)`
- containers on the way: `list of 300 (attribute 'kept' of Trainer)`

The climb is breadth first: one scan of the heap per level for all the objects asked about
together (`gc.get_referrers` walks every object, so per-object climbs would cost seconds), at most
`max_depth` levels. Modules are named by their path from the outermost module (`Sequential.0`).
A running function's locals are read through `frame.f_locals`; before Python 3.13 that leaves a
snapshot on the frame, which would keep this step's locals alive as long as the function runs,
so it is cleared again once read.
"""

from __future__ import annotations

import functools
import gc
import inspect
import os
import sys
import types
from collections import Counter, deque
from dataclasses import dataclass
from typing import Iterable

_SEQUENCES = (list, tuple, set, frozenset, deque)
MODULE_HOOKS = {  # nn.Module attribute -> words
    "_forward_hooks": "forward hook",
    "_forward_pre_hooks": "forward pre-hook",
    "_backward_hooks": "backward hook",
    "_backward_pre_hooks": "backward pre-hook",
    "_state_dict_hooks": "state-dict hook",
    "_load_state_dict_pre_hooks": "load-state-dict pre-hook",
}
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the forensics' own frames hold nothing
_MAX_FRONTIER = 256  # objects climbed from per level (gc.get_referrers is linear in them)
@dataclass(frozen=True)
class _Local:
    """A local variable of a running function, as a referrer."""

    name: str
    function: str
    where: str


class Namer:
    """Names holders for one explanation; `ignore` the caller's own containers first."""

    def __init__(self, ours: Iterable[int] = (), modules: list | None = None, max_depth: int = 7):
        self.ours = set(ours)
        self.max_depth = max_depth
        self._modules = modules
        self._module_paths: dict[int, str] | None = None
        self._parents: dict[int, list] = {}

    def adopt(self, held_by: dict[int, object]) -> None:
        """Holders the collector's referrers cannot find (a dict it does not track), by the id of
        what they hold; where those holders are held is found as for any other."""
        if not held_by:
            return
        holders = list({id(holder): holder for holder in held_by.values()}.values())
        self.ignore(holders)
        for key, holder in held_by.items():
            parents = self._parents.setdefault(key, [])
            self.ours.add(id(parents))
            parents.append(holder)
        self._climb(holders)

    def ignore(self, *containers) -> None:
        """The caller's own containers of the objects asked about: never named as their holders."""
        self.ours.update(map(id, containers))

    def module_path(self, module) -> str:
        if self._module_paths is None:
            self._module_paths = module_paths(self._modules)
        return self._module_paths.get(id(module), type(module).__name__)

    # ---- asking --------------------------------------------------------------------------------

    def holders_of(self, members: list, probe: int = 16, limit: int = 2) -> tuple[str, ...]:
        """The holders of most of a group's newest members: a leak appends, so what holds a
        handful of them holds the rest. A container is credited with every member it holds."""
        if not members:
            return ()
        sample = members[-probe:]
        self.ignore(members, sample)
        self._climb(sample)
        ids = {id(m) for m in members}
        found: Counter[str] = Counter()
        for member in sample:
            for ref in self._parents.get(id(member), []):
                held = _held(ref, ids)
                words = self._words(ref, member, 0, keyed=held == 1)
                if words is not None:
                    found[words] += held
        ranked = found.most_common(limit)
        return tuple(words for words, count in ranked if count * 4 >= ranked[0][1])  # not a stray neighbour

    def holder_of(self, obj) -> str | None:
        named = self.holders_of([obj], limit=1)
        return named[0] if named else None

    # ---- climbing ------------------------------------------------------------------------------

    def _climb(self, start: list) -> None:
        """Record the referrers of `start` and, level by level, of the anonymous ones among them."""
        frontier = [o for o in start if id(o) not in self._parents]
        for _ in range(self.max_depth):
            if not frontier:
                return
            frontier = frontier[:_MAX_FRONTIER]
            ids = {id(o) for o in frontier}
            for o in frontier:
                self._parents[id(o)] = parents = []
                self.ours.add(id(parents))
            climb = []
            for ref in self._referrers(frontier):
                for child in gc.get_referents(ref):
                    if id(child) in ids:
                        self._parents[id(child)].append(ref)
                if _anonymous(ref) and id(ref) not in self._parents:
                    climb.append(ref)
            for key, local in self._locals_holding(ids):  # last: a running function's locals go
                self._parents[key].append(local)          # when it returns; what else holds it stays
            self.ignore(climb)
            frontier = climb

    def _referrers(self, objs: list) -> list:
        marker = object()  # ends the argument tuple gc.get_referrers gets, which refers to `objs` too
        arguments = (*objs, marker)
        self.ignore(objs, arguments)
        refs = [r for r in gc.get_referrers(*arguments)
                if id(r) not in self.ours and not isinstance(r, (types.FrameType, types.ModuleType))
                and not (type(r) is tuple and r and r[-1] is marker)]
        self.ignore(refs)
        return refs

    def _locals_holding(self, ids: set[int]) -> list[tuple[int, _Local]]:
        """(id, local) for the local variables of functions running on this thread that hold one of `ids`."""
        found = []
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if not code.co_filename.startswith(_HERE) and code.co_flags & inspect.CO_OPTIMIZED:
                snapshot = frame.f_locals
                try:
                    held = [(id(v), k) for k, v in snapshot.items() if id(v) in ids]
                finally:
                    if type(snapshot) is dict:  # a copy kept on the frame (< 3.13): let go of it
                        snapshot.clear()
                where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno}"
                found += [(key, _Local(name, code.co_name, where)) for key, name in held]
            frame = frame.f_back
        return found

    # ---- words ---------------------------------------------------------------------------------

    def _outer(self, obj, depth: int) -> str | None:
        """Words for whatever holds `obj` (a container or function met on the way up)."""
        if depth >= self.max_depth:
            return None
        for ref in self._parents.get(id(obj), []):
            words = self._words(ref, obj, depth + 1)
            if words is not None:
                return words
        return None

    def _words(self, ref, child, depth: int, keyed: bool = True) -> str | None:
        """Words for `ref`, which refers to `child`. `keyed`: name the key a dict holds `child`
        under; False where it holds many of a group, each under a key of its own: "dict of 266",
        one holder, not "key 251 of dict of 266", "key 252 of dict of 266", ..."""
        if isinstance(ref, _Local):
            return f"local variable {ref.name!r} of {ref.function} ({ref.where})"
        if isinstance(ref, types.CellType):
            return self._closure_words(ref, depth)
        if type(ref).__name__ == "_lru_cache_wrapper":
            return f"cache of functools.lru_cache {ref.__qualname__!r}"
        if isinstance(ref, types.FunctionType):
            return None  # a function's code, defaults and closure are reached through their own objects
        if isinstance(ref, dict):
            return self._dict_words(ref, child, depth, keyed)
        if isinstance(ref, tuple):
            bound = self._bound_argument_words(ref, child, depth)
            if bound is not None:
                return bound
        if isinstance(ref, _SEQUENCES):
            outer = self._outer(ref, depth)
            return f"{type(ref).__name__} of {len(ref)}" + (f" ({outer})" if outer else "")
        attrs = getattr(ref, "__dict__", None)  # an instance whose attributes live inline (3.11+)
        if isinstance(attrs, dict) and not isinstance(ref, type):
            name = next((k for k, v in attrs.items() if v is child), None)
            if name is not None:
                return self._attribute(name, ref)
        return None

    def _dict_words(self, mapping: dict, child, depth: int, keyed: bool = True) -> str | None:
        key = next((k for k, v in mapping.items() if v is child), None)
        if "__builtins__" in mapping and mapping.get("__name__"):
            return f"global {key!r} in module {mapping['__name__']}" if key is not None else None
        hook = self._hook_table(mapping)
        if hook is not None:
            return hook
        for owner in self._parents.get(id(mapping), []):
            if getattr(owner, "__dict__", None) is mapping:
                return self._attribute(key, owner) if key is not None else None
            if type(owner).__name__ == "_lru_cache_wrapper":
                return f"cache of functools.lru_cache {owner.__qualname__!r} ({len(mapping)} entries)"
        outer = self._outer(mapping, depth)
        entry = f"key {key!r} of " if keyed and isinstance(key, (str, int)) else ""
        return f"{entry}dict of {len(mapping)}" + (f" ({outer})" if outer else "")

    def _hook_table(self, mapping: dict) -> str | None:
        """`forward hook on Sequential.0` when `mapping` is a module's hook table (held inline, or
        through the module's `__dict__`)."""
        for parent in self._parents.get(id(mapping), []):
            owners = [parent] + [o for o in self._parents.get(id(parent), []) if isinstance(parent, dict)]
            for owner in owners:
                hook = _hook_kind(owner, mapping)
                if hook is not None:
                    return f"{hook} on {self.module_path(owner)}"
        return None

    def _attribute(self, name: str, owner) -> str:
        torch = sys.modules.get("torch")
        is_module = torch is not None and isinstance(owner, torch.nn.Module)
        return f"attribute {name!r} of {self.module_path(owner) if is_module else type(owner).__name__}"

    def _closure_words(self, cell, depth: int) -> str | None:
        for closure in self._parents.get(id(cell), []):
            for function in self._parents.get(id(closure), []):
                if isinstance(function, types.FunctionType) and function.__closure__ is closure:
                    variable = function.__code__.co_freevars[closure.index(cell)]
                    where = self._outer(function, depth)
                    return (f"closure variable {variable!r} of {function.__qualname__}"
                            + (f" ({where})" if where else ""))
        return None

    def _bound_argument_words(self, arguments: tuple, child, depth: int) -> str | None:
        """A default argument (`lambda m, i, o, kept=kept: ...`), or one bound by functools.partial."""
        index = next((i for i, v in enumerate(arguments) if v is child), None)
        if index is None:
            return None
        for owner in self._parents.get(id(arguments), []):
            where = self._outer(owner, depth)
            held = f" ({where})" if where else ""
            if isinstance(owner, types.FunctionType) and owner.__defaults__ is arguments:
                code = owner.__code__
                names = code.co_varnames[code.co_argcount - len(arguments):code.co_argcount]
                return f"default argument {names[index]!r} of {owner.__qualname__}{held}"
            if isinstance(owner, functools.partial) and owner.args is arguments:
                name = getattr(owner.func, "__qualname__", "a function")
                return f"argument {index} bound by functools.partial({name}){held}"
        return None


def _anonymous(ref) -> bool:
    """Referrers that only say something through what holds them in turn."""
    if isinstance(ref, dict):
        return not ("__builtins__" in ref and ref.get("__name__"))  # a module's globals are named
    return isinstance(ref, (*_SEQUENCES, types.CellType, types.FunctionType, functools.partial))


def _held(ref, ids: set[int]) -> int:
    """How many of `ids` a container holds directly (1 for anything else)."""
    if isinstance(ref, dict):
        return max(1, sum(id(v) in ids for v in ref.values()))
    if isinstance(ref, _SEQUENCES):
        return max(1, sum(id(v) in ids for v in ref))
    return 1


def _hook_kind(owner, mapping: dict) -> str | None:
    attrs = getattr(owner, "__dict__", None)
    if not isinstance(attrs, dict):
        return None
    for attribute, words in MODULE_HOOKS.items():
        if attrs.get(attribute) is mapping:
            return words
    return None


def live_modules() -> list:
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    return [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)]


def module_paths(modules: list | None = None) -> dict[int, str]:
    """id(module) -> `Root.child.grandchild` for every live nn.Module (or those given), named from
    the outermost modules."""
    if modules is None:
        modules = live_modules()
    children = {id(child) for module in modules for child in module.children()}
    paths: dict[int, str] = {}
    for root in modules:
        if id(root) in children:
            continue
        root_name = type(root).__name__
        for name, module in root.named_modules(remove_duplicate=True):
            paths.setdefault(id(module), f"{root_name}.{name}" if name else root_name)
    return paths


def parameter_names(modules: list | None = None) -> dict[int, str]:
    """id(parameter) -> `Root.layer.weight` for the parameters of every live module (or those given)."""
    if modules is None:
        modules = live_modules()
    names: dict[int, str] = {}
    paths = module_paths(modules)
    for module in modules:
        prefix = paths.get(id(module), type(module).__name__)
        for name, parameter in module.named_parameters(recurse=False):
            names.setdefault(id(parameter), f"{prefix}.{name}")
    return names
