"""Looking at the program's objects without running any of the program's code.

A census looks at every object the garbage collector tracks, and the program decides what its
objects do when looked at: a class whose metaclass defines `__eq__` is unhashable, reading
`__class__` (which `isinstance` does) runs a lazily imported module's import, a `MagicMock(spec=
torch.Tensor)` says it is a tensor, a property or a `__getattr__` runs whatever it likes, an
`nn.Module` whose `__init__` raised before `super().__init__()` has no `_modules`. So the
forensics read objects through CPython's own descriptors and base types only, never through the
object's type's own Python:

- an object's type is `type(obj)` (the C field), never `obj.__class__` nor `isinstance`;
- what a type derives from is read from its MRO (`type.__mro__`'s descriptor, compared by
  identity), never `issubclass` (a metaclass's `__subclasscheck__`) nor `==` (its `__eq__`);
- types are keyed by `id` (a metaclass's `__hash__` may raise or run code), and kept alive
  beside the key;
- a type's name, flags and dict come from `type`'s own descriptors (a metaclass may define
  `__getattribute__`);
- an instance's attributes come from the `__dict__` and `__slots__` descriptors CPython made for
  its class (C code), found in the class dicts along the MRO; a class that defines its own
  `__dict__` property is not read;
- a container's length and items come from its builtin base's methods (`dict.values(d)`), so a
  subclass's `__len__`, `__iter__` or `items` never run;
- a tensor's metadata comes from `torch._C.TensorBase`'s descriptors inside
  `torch._C.DisableTorchFunction()` (`reading_tensors`): no subclass property and no
  `__torch_function__` (nor a TorchFunctionMode) runs;
- a module is used only when it is loaded (`loaded`): a `LazyLoader` module not yet imported is
  never touched.

tests/test_census_totality.py keeps objects that record every Python-level hook into them among
the census's objects and on the path to a leak's holder, and checks that none was called.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections import deque

_MRO = type.__dict__["__mro__"].__get__
_FLAGS = type.__dict__["__flags__"].__get__
_NAME = type.__dict__["__name__"].__get__
_QUALNAME = type.__dict__["__qualname__"].__get__
_DICTOFFSET = type.__dict__["__dictoffset__"].__get__
_MODULE = type.__dict__["__module__"].__get__
_TYPE_DICT = type.__dict__["__dict__"].__get__
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement, not a C type

# The builtin containers, each with its own length and iteration (a subclass's are never called).
_LENGTH = {id(dict): dict.__len__, id(list): list.__len__, id(tuple): tuple.__len__, id(deque): deque.__len__,
           id(set): set.__len__, id(frozenset): frozenset.__len__}
_ITEMS = {id(dict): dict.values, id(list): list.__iter__, id(tuple): tuple.__iter__, id(deque): deque.__iter__,
          id(set): set.__iter__, id(frozenset): frozenset.__iter__}


def mro(kind: type) -> tuple:
    return _MRO(kind)


def derives(kind: type, base: type) -> bool:
    """Whether `kind` is `base` or derives from it (identity along its MRO: no code of theirs runs)."""
    return any(c is base for c in _MRO(kind))


def is_heap_type(kind: type) -> bool:
    return bool(_FLAGS(kind) & _HEAP_TYPE)


def type_name(kind: type) -> str:
    """`module.Qualname` (`Qualname` alone for builtins)."""
    name = _QUALNAME(kind)
    module = _MODULE(kind)
    return f"{module}.{name}" if type(module) is str and module != "builtins" else name


def short_name(kind: type) -> str:
    """The class's own name (`__name__`)."""
    return _NAME(kind)


def container_base(kind: type) -> type | None:
    """The builtin container `kind` is or derives from (dict, list, tuple, deque, set, frozenset)."""
    for base in _MRO(kind):
        if id(base) in _LENGTH:
            return base
    return None


def length(container) -> int:
    """A builtin container's length, read by its builtin base (0 for anything else)."""
    base = container_base(type(container))
    return _LENGTH[id(base)](container) if base is not None else 0


def items(container):
    """What a builtin container holds (a dict's values), read by its builtin base; () otherwise."""
    base = container_base(type(container))
    return _ITEMS[id(base)](container) if base is not None else ()


def dict_items(mapping):
    return dict.items(mapping)


def dict_get(mapping, key: str):
    """`mapping[key]` for a str key, by dict's own lookup (a str key's hash and `==` are str's)."""
    return dict.get(mapping, key)


def _static(kind: type, name: str):
    """`name` as found along `kind`'s MRO in the class dicts, without any lookup hook; None if absent."""
    for cls in _MRO(kind):
        found = _TYPE_DICT(cls).get(name)
        if found is not None:
            return found
    return None


def attributes(obj) -> dict | None:
    """The instance's `__dict__` through the descriptor CPython made for its class; None when it has
    none, or when its class defines `__dict__` itself (a property: code of the program's)."""
    descriptor = _static(type(obj), "__dict__")
    if type(descriptor) is not types.GetSetDescriptorType and type(descriptor) is not types.MemberDescriptorType:
        return None
    try:
        found = descriptor.__get__(obj, type(obj))
    except Exception:  # noqa: BLE001 - a C getter that refuses (no dict) says nothing
        return None
    return found if type(found) is dict else None


def has_attributes(kind: type) -> bool:
    """Whether instances of `kind` have a `__dict__` or slots of a Python class."""
    return _DICTOFFSET(kind) != 0 or bool(slot_names(kind))


def slot_names(kind: type) -> tuple[tuple[str, object], ...]:
    """(name, descriptor) of the `__slots__` of `kind`'s Python classes."""
    found = []
    for cls in _MRO(kind):
        if not is_heap_type(cls):
            continue
        for name, value in _TYPE_DICT(cls).items():
            if type(value) is types.MemberDescriptorType and type(name) is str:
                found.append((name, value))
    return tuple(found)


def slot_values(obj):
    """(name, value) of each filled slot of `obj` (C reads; an empty slot is skipped)."""
    for name, descriptor in slot_names(type(obj)):
        try:
            yield name, descriptor.__get__(obj, type(obj))
        except AttributeError:
            continue


def attribute_holding(obj, child) -> str | None:
    """The name of the attribute (in `__dict__` or a slot) under which `obj` holds `child`."""
    attrs = attributes(obj)
    if attrs is not None:
        for name, value in attrs.items():
            if value is child and type(name) is str:
                return name
    for name, value in slot_values(obj):
        if value is child:
            return name
    return None


def shallow_size(obj) -> int:
    """`sys.getsizeof`, unless the object's class defines `__sizeof__` in Python: then the size its
    C layout takes (object.__sizeof__)."""
    kind = type(obj)
    for cls in _MRO(kind):
        if "__sizeof__" in _TYPE_DICT(cls):
            if is_heap_type(cls):
                return object.__sizeof__(obj)
            break
    try:
        return sys.getsizeof(obj)
    except Exception:  # noqa: BLE001 - a C __sizeof__ that refuses
        return object.__sizeof__(obj)


def key_words(key) -> str | None:
    """A dict key as it is written, for a str or an int key only (another key's repr is the program's code)."""
    if type(key) is str or type(key) is int:
        return repr(key)
    return None


def loaded(name: str) -> types.ModuleType | None:
    """The module `name` when it is imported and a plain module: a `LazyLoader` module not yet
    loaded (and any module of a class of its own, whose attribute reads may run code) is None."""
    module = sys.modules.get(name)
    return module if type(module) is types.ModuleType else None


def module_global(name: str, attribute: str):
    """A loaded module's global, read from its dict (a module's `__getattr__` never runs)."""
    module = loaded(name)
    return dict.get(module.__dict__, attribute) if module is not None else None


class TensorReads:
    """A tensor's metadata through `TensorBase`'s own descriptors (a subclass's properties never run);
    use inside `reading_tensors()`, where no `__torch_function__` runs either."""

    def __init__(self, torch):
        base = torch._C.TensorBase
        self.tensor = torch.Tensor
        self.parameter = torch.nn.Parameter
        self.module = torch.nn.Module
        self.grad_fn = base.grad_fn.__get__
        self.grad = base.grad.__get__
        self.shape = base.shape.__get__
        self.device = base.device.__get__
        self.dtype = base.dtype.__get__
        self.nelement = base.nelement
        self.element_size = base.element_size
        self.untyped_storage = base.untyped_storage

    def size(self, tensor) -> int:
        return self.nelement(tensor) * self.element_size(tensor)

    def is_parameter(self, tensor) -> bool:
        """An nn.Parameter, or a tensor marked as one (`_is_param`: a parameter of a tensor subclass,
        as FSDP2's DTensor parameters are), read from its dict."""
        if derives(type(tensor), self.parameter):
            return True
        attrs = attributes(tensor) if type(tensor) is not self.tensor else None
        return attrs is not None and attrs.get("_is_param") is True


_tensor_reads: dict[int, TensorReads] = {}


def tensor_reads() -> TensorReads | None:
    """The reads for the loaded torch; None when torch is not imported (nothing is a tensor then)."""
    torch = loaded("torch")
    if torch is None:
        return None
    reads = _tensor_reads.get(id(torch))
    if reads is None:
        reads = _tensor_reads[id(torch)] = TensorReads(torch)
    return reads


def reading_tensors():
    """A context in which reading a tensor runs no `__torch_function__` (a subclass's or a mode's)."""
    torch = loaded("torch")
    return torch._C.DisableTorchFunction() if torch is not None else contextlib.nullcontext()
