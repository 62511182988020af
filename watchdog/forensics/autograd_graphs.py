"""How much an autograd graph keeps alive, read from metadata only.

A tensor with a `grad_fn` keeps its whole backward graph alive, and with it every tensor the
forward pass saved for backward (activations, inputs, intermediate results). Those saved tensors
have no Python holder of their own, so a census of Python objects sees one small tensor where
the device holds a step's activations: `total_loss += loss` keeps every step's graph this way.

The walk follows `grad_fn.next_functions` and reads each node's `_saved_*` tensors: shape, dtype
and device are metadata, so nothing is synchronised, compiled or copied to the host. Reading a
saved tensor runs its unpack hook if one was packed under `saved_tensors_hooks`; under
non-reentrant checkpointing that hook would re-run the forward. The walk runs inside
`disable_saved_tensors_hooks`, so such a hook fails at once instead (it must install hooks to
recompute): those tensors are counted as `packed` and never unpacked. (An unpack hook that only
copies, like `save_on_cpu`'s, is not stopped by this: it copies back once per walk.)

Saved tensors are counted once per buffer (an XLA tensor id, or a storage), so a buffer saved by
several nodes, or by several steps' graphs, counts once; parameters are left out (they are the
model, and live anyway). Saved tensors already freed by a backward pass count as nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from watchdog.forensics import peek

_saved_names: dict[type, tuple[str, ...]] = {}  # per node type: its saved-tensor attributes
_GUARD = "hbm-watchdog reads saved tensors for their metadata only"


@dataclass(frozen=True, slots=True)
class GraphSize:
    nodes: int = 0
    saved_tensors: int = 0
    saved_bytes: int = 0
    packed: int = 0  # saved tensors packed by someone's saved-tensor hooks: not unpacked, not counted

    def __add__(self, other: GraphSize) -> GraphSize:
        return GraphSize(self.nodes + other.nodes, self.saved_tensors + other.saved_tensors,
                         self.saved_bytes + other.saved_bytes, self.packed + other.packed)

    def __sub__(self, other: GraphSize) -> GraphSize:
        return GraphSize(self.nodes - other.nodes, self.saved_tensors - other.saved_tensors,
                         self.saved_bytes - other.saved_bytes, self.packed - other.packed)


def buffer_key(tensor) -> tuple[object, int]:
    """(a key naming the buffer behind `tensor`, its size in bytes), from metadata only.

    XLA tensors have no storage: torch_xla's tensor id names the buffer (views and the unpacked
    copies of a saved tensor share it). Elsewhere the storage does. Read through `TensorBase`'s own
    descriptors (`peek.TensorReads`): a subclass's properties and methods never run.
    """
    reads = peek.tensor_reads()
    device = reads.device(tensor).type
    if device == "xla":
        xla = peek.module_global("torch_xla", "_XLAC")
        return ("xla", xla._xla_get_tensor_id(tensor)), reads.size(tensor)
    try:
        storage = reads.untyped_storage(tensor)
        return ("storage", device, storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses, meta tensors
        return ("object", id(tensor)), reads.size(tensor)


class GraphWalker:
    """Walks autograd graphs, counting each node and each saved buffer once across all walks.

    One walker per census: graphs that share nodes (every step's `total_loss` graph hangs off the
    previous one) are counted once, and `walk` returns only what this root adds to the walks
    before it, so the first root walked owns what it reaches. `max_nodes` bounds the work.
    """

    def __init__(self, excluded: Iterable[object] = (), max_nodes: int = 2_000_000):
        self._seen_nodes: set = set()
        self._seen_buffers: set = set(excluded)
        self._saved_by: dict[object, object] = {}  # buffer key -> the first node seen saving it
        self._shared: set = set()  # buffer keys saved by more than one node
        self._budget = max_nodes
        self.truncated = False

    def saved_by_another(self, tensor) -> bool:
        """Whether a node other than the tensor's own `grad_fn` saved it (walked so far): then the
        graph keeps it alive, whoever else does. A node may save its own output (tanh, relu, exp)."""
        key = buffer_key(tensor)[0]
        saver = self._saved_by.get(key)
        return saver is not None and (key in self._shared or saver is not peek.tensor_reads().grad_fn(tensor))

    def walk(self, grad_fn, new_keys: list | None = None) -> GraphSize:
        """What this graph adds to the walks before it; `new_keys` collects its saved buffers' keys."""
        from torch.autograd.graph import disable_saved_tensors_hooks

        with disable_saved_tensors_hooks(_GUARD):
            return self._walk(grad_fn, new_keys)

    def _walk(self, grad_fn, new_keys: list | None) -> GraphSize:
        nodes = saved = saved_bytes = packed = 0
        stack = [grad_fn]
        seen = self._seen_nodes
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            if len(seen) >= self._budget:
                self.truncated = True
                break
            seen.add(node)
            nodes += 1
            tensors, hooked = _saved_tensors(node)
            packed += hooked
            for tensor in tensors:
                try:
                    key, size = buffer_key(tensor)
                except Exception:  # noqa: BLE001 - exotic tensors without metadata are skipped
                    continue
                saver = self._saved_by.setdefault(key, node)
                if saver is not node:
                    self._shared.add(key)
                if key not in self._seen_buffers:
                    self._seen_buffers.add(key)
                    saved += 1
                    saved_bytes += size
                    if new_keys is not None:
                        new_keys.append(key)
            stack.extend(next_node for next_node, _ in node.next_functions)
        return GraphSize(nodes, saved, saved_bytes, packed)


def _saved_tensors(node) -> tuple[list, int]:
    """(the tensors a backward node saved, how many were packed by someone's saved-tensor hooks)."""
    tensor = peek.tensor_reads().tensor
    kind = type(node)
    names = _saved_names.get(kind)
    if names is None:  # `_raw_saved_x` marks a saved tensor `_saved_x` (not an int or a size)
        names = tuple("_" + n[len("_raw_"):] for n in dir(node) if n.startswith("_raw_saved_"))
        _saved_names[kind] = tuple("saved_tensors" if n == "_saved_tensors" else n  # custom Functions
                                   for n in names)
        names = _saved_names[kind]
    found, packed = [], 0
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError as exc:
            if _GUARD in str(exc):
                packed += 1  # someone's unpack hook wanted to run: checkpointing
            continue  # or freed by a backward pass
        except AttributeError:
            continue
        base = peek.container_base(type(value))
        if peek.derives(type(value), tensor):
            found.append(value)
        elif base is tuple or base is list:
            found.extend(v for v in peek.items(value) if peek.derives(type(v), tensor))
    return found, packed
