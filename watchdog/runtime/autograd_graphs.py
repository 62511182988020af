"""How much an autograd graph keeps alive, read from metadata only.

A tensor with a `grad_fn` keeps its whole backward graph alive, and with it every tensor the
forward pass saved for backward (activations, inputs, intermediate results). Those saved tensors
have no Python holder of their own, so a census of Python objects sees one small tensor where
the device holds a step's activations: `total_loss += loss` keeps every step's graph this way.

The walk follows `grad_fn.next_functions` and unpacks the `_saved_*` attributes of each node
(`saved_tensors` for custom Functions). Unpacking a saved tensor gives a tensor object sharing
its data: shape, dtype and device are metadata, so nothing is synchronised, compiled or copied
to the host. Saved tensors are counted once per buffer (an XLA tensor id, or a storage), so a
buffer saved by several nodes, or by several steps' graphs, counts once; parameters are left
out (they are the model, and live anyway). Tensors already freed by a backward pass raise when
unpacked and count as nothing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterable

_NO_SAVED: tuple[str, ...] = ()
_saved_names: dict[type, tuple[str, ...]] = {}  # per node type: its `_saved_*` attributes


@dataclass(frozen=True, slots=True)
class GraphSize:
    nodes: int = 0
    saved_tensors: int = 0
    saved_bytes: int = 0

    def __add__(self, other: GraphSize) -> GraphSize:
        return GraphSize(self.nodes + other.nodes, self.saved_tensors + other.saved_tensors,
                         self.saved_bytes + other.saved_bytes)

    def __sub__(self, other: GraphSize) -> GraphSize:
        return GraphSize(self.nodes - other.nodes, self.saved_tensors - other.saved_tensors,
                         self.saved_bytes - other.saved_bytes)


def buffer_key(tensor) -> tuple[object, int]:
    """(a key naming the buffer behind `tensor`, its size in bytes), from metadata only.

    XLA tensors have no storage: torch_xla's tensor id names the buffer (views and the unpacked
    copies of a saved tensor share it). Elsewhere the storage does.
    """
    if tensor.device.type == "xla":
        xla = sys.modules["torch_xla"]._XLAC
        return ("xla", xla._xla_get_tensor_id(tensor)), tensor.nelement() * tensor.element_size()
    try:
        storage = tensor.untyped_storage()
        return ("storage", tensor.device.type, storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses, meta tensors
        return ("object", id(tensor)), tensor.nelement() * tensor.element_size()


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
        return saver is not None and (key in self._shared or saver is not tensor.grad_fn)

    def walk(self, grad_fn, new_keys: list | None = None) -> GraphSize:
        """What this graph adds to the walks before it; `new_keys` collects its saved buffers' keys."""
        nodes = saved = saved_bytes = 0
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
            for tensor in _saved_tensors(node):
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
        return GraphSize(nodes, saved, saved_bytes)


def _saved_tensors(node) -> list:
    """The tensors a backward node saved, unpacked without reading a value."""
    import torch

    kind = type(node)
    names = _saved_names.get(kind)
    if names is None:
        names = tuple(n for n in dir(node) if n.startswith("_saved_"))
        if hasattr(node, "saved_tensors"):  # custom autograd.Function (and reentrant checkpoint)
            names += ("saved_tensors",)
        _saved_names[kind] = names or _NO_SAVED
    found = []
    for name in names:
        try:
            value = getattr(node, name)
        except Exception:  # noqa: BLE001 - freed by a backward pass, or not a tensor attribute
            continue
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found
