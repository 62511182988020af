"""What the lazy-tensor runtime has done so far, from torch_xla's debug counters: syncs, traced
IR nodes, compilations, and whether a tensor is still a pending graph. Reading them is no sync."""

from __future__ import annotations

from dataclasses import dataclass

from watchdog.forensics import peek


@dataclass(frozen=True)
class XlaActivity:
    """What the lazy-tensor runtime has done so far, from its debug counters (reading them is no sync).

    `traced_ir_nodes` sums the `xla::<op>` counters: one per IR node traced. A loop that syncs
    moves `syncs` (`MarkStep`) every step; one that never does keeps tracing onto one pending
    graph, whose nodes and the device data they reference stay on the host until something syncs.
    """

    syncs: int
    traced_ir_nodes: int
    compilations: int
    ops: tuple[tuple[str, int], ...] = ()  # (op, nodes traced) per op, to say which ops pile up


def activity() -> XlaActivity | None:
    """The counters, read from torch_xla's C extension where the program imported torch_xla (no import here)."""
    xla = peek.module_global("torch_xla", "_XLAC")
    if xla is None:
        return None
    value = xla._xla_counter_value
    ops = {name: int(value(name) or 0) for name in xla._xla_counter_names() if name.startswith("xla::")}
    return XlaActivity(syncs=int(value("MarkStep") or 0), traced_ir_nodes=sum(ops.values()),
                       compilations=int(value("UncachedCompile") or 0), ops=tuple(sorted(ops.items())))


def has_pending_graph(tensor) -> bool:
    """An XLA tensor whose value is still an IR graph waiting for a sync (no device data yet)."""
    info = peek.module_global("torch_xla", "_XLAC")._get_xla_tensor_debug_info(tensor)
    return "\nIR: None" not in info and "\nXLAData: None" in info
