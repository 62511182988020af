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

Every object on the way is looked at through `peek` (its type by `type()`, its attributes and
slots through CPython's descriptors, a container's items through its builtin base): naming a
holder runs none of the program's code.
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

from watchdog.forensics import peek

_SEQUENCES = (list, tuple, set, frozenset, deque)
_PARTIAL_ARGS = functools.partial.args.__get__
_PARTIAL_FUNC = functools.partial.func.__get__
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

    def place_of(self, container) -> str:
        """A growing container and its owner in one phrase: "dict 'plans' of Planner", "deque
        'RECENT' in module train", else "list of 300" with its holder in brackets."""
        module = _module_name(container) if peek.container_base(type(container)) is dict else None
        if module is not None:
            return f"the globals of module {module}"
        kind = peek.short_name(type(container))
        holder = self.holder_of(container)
        for said in ("attribute ", "global "):  # this module's own words for an owner's name
            if holder is not None and holder.startswith(said):
                return f"{kind} {holder[len(said):]}"
        return f"{kind} of {peek.length(container):,}" + (f" ({holder})" if holder else "")

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
            for ref in self.referrers(frontier):
                for child in gc.get_referents(ref):
                    if id(child) in ids:
                        self._parents[id(child)].append(ref)
                if _anonymous(ref) and id(ref) not in self._parents:
                    climb.append(ref)
            for key, local in self._locals_holding(ids):  # last: a running function's locals go
                self._parents[key].append(local)          # when it returns; what else holds it stays
            self.ignore(climb)
            frontier = climb

    def referrers(self, objs: list) -> list:
        """What refers to `objs`, but for the forensics' own lists, frames and modules."""
        marker = object()  # ends the argument tuple gc.get_referrers gets, which refers to `objs` too
        arguments = (*objs, marker)
        self.ignore(objs, arguments)
        refs = [r for r in gc.get_referrers(*arguments)
                if id(r) not in self.ours and type(r) is not types.FrameType
                and not peek.derives(type(r), types.ModuleType)
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
        kind = type(ref)
        if kind is _Local:
            return f"local variable {ref.name!r} of {ref.function} ({ref.where})"
        if kind is types.CellType:
            return self._closure_words(ref, depth)
        if kind is functools._lru_cache_wrapper:
            return f"cache of functools.lru_cache {_qualname(ref)!r}"
        if kind is types.FunctionType:
            return None  # a function's code, defaults and closure are reached through their own objects
        base = peek.container_base(kind)
        if base is dict:
            return self._dict_words(ref, child, depth, keyed)
        if base is tuple:
            bound = self._bound_argument_words(ref, child, depth)
            if bound is not None:
                return bound
        if base is not None:
            outer = self._outer(ref, depth)
            return f"{peek.short_name(kind)} of {peek.length(ref)}" + (f" ({outer})" if outer else "")
        if not peek.derives(kind, type):  # an instance: its attributes (inline in 3.11+) and slots
            name = peek.attribute_holding(ref, child)
            if name is not None:
                return self._attribute(name, ref)
        return None

    def _dict_words(self, mapping: dict, child, depth: int, keyed: bool = True) -> str | None:
        key = next((k for k, v in peek.dict_items(mapping) if v is child), None)
        module = _module_name(mapping)
        if module is not None:
            return f"global {peek.key_words(key)} in module {module}" if peek.key_words(key) else None
        hook = self._hook_table(mapping)
        if hook is not None:
            return hook
        for owner in self._parents.get(id(mapping), []):
            if type(owner) is not _Local and peek.attributes(owner) is mapping:
                return self._attribute(key, owner) if type(key) is str else None
            if type(owner) is functools._lru_cache_wrapper:
                return f"cache of functools.lru_cache {_qualname(owner)!r} ({peek.length(mapping)} entries)"
        outer = self._outer(mapping, depth)
        entry = f"key {peek.key_words(key)} of " if keyed and peek.key_words(key) else ""
        return f"{entry}dict of {peek.length(mapping)}" + (f" ({outer})" if outer else "")

    def _hook_table(self, mapping: dict) -> str | None:
        """`forward hook on Sequential.0` when `mapping` is a module's hook table (held inline, or
        through the module's `__dict__`)."""
        for parent in self._parents.get(id(mapping), []):
            owners = [parent] + [o for o in self._parents.get(id(parent), [])
                                 if peek.container_base(type(parent)) is dict]
            for owner in owners:
                hook = _hook_kind(owner, mapping)
                if hook is not None:
                    return f"{hook} on {self.module_path(owner)}"
        return None

    def _attribute(self, name: str, owner) -> str:
        module = peek.module_global("torch.nn", "Module")
        is_module = module is not None and peek.derives(type(owner), module)
        return f"attribute {name!r} of {self.module_path(owner) if is_module else peek.short_name(type(owner))}"

    def _closure_words(self, cell, depth: int) -> str | None:
        for closure in self._parents.get(id(cell), []):
            for function in self._parents.get(id(closure), []):
                if type(function) is types.FunctionType and function.__closure__ is closure:
                    index = next(i for i, c in enumerate(closure) if c is cell)
                    variable = function.__code__.co_freevars[index]
                    where = self._outer(function, depth)
                    return (f"closure variable {variable!r} of {function.__qualname__}"
                            + (f" ({where})" if where else ""))
        return None

    def _bound_argument_words(self, arguments: tuple, child, depth: int) -> str | None:
        """A default argument (`lambda m, i, o, kept=kept: ...`), or one bound by functools.partial."""
        index = next((i for i, v in enumerate(peek.items(arguments)) if v is child), None)
        if index is None:
            return None
        for owner in self._parents.get(id(arguments), []):
            where = self._outer(owner, depth)
            held = f" ({where})" if where else ""
            if type(owner) is types.FunctionType and owner.__defaults__ is arguments:
                code = owner.__code__
                names = code.co_varnames[code.co_argcount - peek.length(arguments):code.co_argcount]
                return f"default argument {names[index]!r} of {owner.__qualname__}{held}"
            if type(owner) is not _Local and peek.derives(type(owner), functools.partial) and _PARTIAL_ARGS(owner) is arguments:
                function = _PARTIAL_FUNC(owner)
                name = function.__qualname__ if type(function) is types.FunctionType else peek.short_name(type(function))
                return f"argument {index} bound by functools.partial({name}){held}"
        return None


def _qualname(wrapper) -> str:
    """The `__qualname__` that `functools` copied into a cache wrapper's dict."""
    attrs = peek.attributes(wrapper)
    name = attrs.get("__qualname__") if attrs is not None else None
    return name if type(name) is str else "?"


def _module_name(mapping) -> str | None:
    """The module's name when `mapping` is a module's globals."""
    name = peek.dict_get(mapping, "__name__")
    return name if type(name) is str and name and dict.__contains__(mapping, "__builtins__") else None


def _anonymous(ref) -> bool:
    """Referrers that only say something through what holds them in turn."""
    kind = type(ref)
    base = peek.container_base(kind)
    if base is dict:
        return _module_name(ref) is None  # a module's globals are named
    return (base is not None or kind is types.CellType or kind is types.FunctionType
            or (kind is not _Local and peek.derives(kind, functools.partial)))


def _held(ref, ids: set[int]) -> int:
    """How many of `ids` a container holds directly (1 for anything else)."""
    if type(ref) is _Local:
        return 1
    return max(1, sum(id(v) in ids for v in peek.items(ref)))


def _hook_kind(owner, mapping: dict) -> str | None:
    attrs = peek.attributes(owner) if type(owner) is not _Local else None
    if attrs is None:
        return None
    for attribute, words in MODULE_HOOKS.items():
        if attrs.get(attribute) is mapping:
            return words
    return None


def live_modules() -> list:
    module = peek.module_global("torch.nn", "Module")
    if module is None:
        return []
    return [o for o in gc.get_objects() if peek.derives(type(o), module)]


def submodules(module) -> list[tuple[str, object]]:
    """(name, child) of a module's children, read from its `_modules` dict (an `nn.Module` whose
    `__init__` raised before `super().__init__()` has none: no children, not an error)."""
    return _named_entries(module, "_modules")


def _named_entries(module, table: str) -> list[tuple[str, object]]:
    attrs = peek.attributes(module)
    entries = attrs.get(table) if attrs is not None else None
    if entries is None or peek.container_base(type(entries)) is not dict:
        return []
    return [(name, value) for name, value in peek.dict_items(entries) if type(name) is str and value is not None]


def module_paths(modules: list | None = None) -> dict[int, str]:
    """id(module) -> `Root.child.grandchild` for every live nn.Module (or those given), named from
    the outermost modules, as `named_modules` names them (read from each module's `_modules`)."""
    if modules is None:
        modules = live_modules()
    children = {id(child) for module in modules for _, child in submodules(module)}
    paths: dict[int, str] = {}
    for root in modules:
        if id(root) in children:
            continue
        seen: set[int] = set()
        stack = [(peek.short_name(type(root)), root)]
        while stack:  # depth first, in order: as named_modules(remove_duplicate=True) yields them
            path, module = stack.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            paths.setdefault(id(module), path)
            stack.extend((f"{path}.{name}", child) for name, child in reversed(submodules(module)))
    return paths


def parameter_names(modules: list | None = None) -> dict[int, str]:
    """id(parameter) -> `Root.layer.weight` for the parameters of every live module (or those given)."""
    if modules is None:
        modules = live_modules()
    names: dict[int, str] = {}
    paths = module_paths(modules)
    for module in modules:
        prefix = paths.get(id(module), peek.short_name(type(module)))
        for name, parameter in _named_entries(module, "_parameters"):
            names.setdefault(id(parameter), f"{prefix}.{name}")
    return names
