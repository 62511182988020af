"""XLA compilation counters, read from the sidecar (never from a scrape or a training step).

A steady rise of compilations after warm-up means a shape or a Python value changes every few
steps: each new graph costs compile time and HBM for its executable, a leak of its own kind.
"""

from __future__ import annotations

import sys


def compilations() -> int | None:
    """Graphs compiled so far in this process (`UncachedCompile`), or None without torch_xla.

    Only looks at torch_xla if the program already imported it.
    """
    if "torch_xla" not in sys.modules:
        return None
    import torch_xla.debug.metrics as met

    return int(met.counter_value("UncachedCompile") or 0)
