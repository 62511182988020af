"""Deliberate leaks, so the watchdog has something real to catch.

Each kind mimics a bug seen in real training code:

- `tensors:SIZE/step` - device tensors appended to a list the trainer state holds (metrics or
  activations "kept for later"). A reinit drops the state, so it frees them.
- `graph:N/step` - N losses kept together with their autograd graph (an eval loss summed without
  `no_grad`): every saved activation of that forward stays alive. Freed by a reinit.
- `global:SIZE/step` - tensors appended to a module-level list, outside the trainer's state: an
  in-process reinit cannot free them, so the policy must escalate to a restart.
- `recompile:K` - a tensor whose shape changes every K steps: a new XLA graph to compile, and
  one more executable in the compile cache, each time.
- `total:N/step` - N extra losses per step added to a running total with autograd on
  (`total += loss` without `.item()` or `no_grad`): the total keeps every step's graph and its
  saved activations. Freed by a reinit.
- `hook:SIZE/step` - a forward hook registered on the first block every step and never removed,
  each closing over a SIZE tensor it checks against. The model holds the hooks: freed by a reinit.
- `cache:SIZE/step` - SIZE tensors memoised by an unbounded `functools.lru_cache` keyed by the
  step: module-level, so only a restart frees them.
- `host:SIZE/step` - SIZE bytes of host memory (a bytearray) kept per step in a list the trainer
  state holds: a host leak beside the device's memory (encoded samples cached "for later").
- `checkpoint-ratchet:SIZE` - SIZE bytes of host memory kept at every checkpoint save by a
  module-level staging cache that is never emptied: the host RAM that ratchets up with each save
  until the kernel's OOM killer ends the run (orbax#2090, marin#6774).

Any spec may start late: `tensors:2MiB/step@100` leaks from step 100 on.
Parsing is pure (and torch-free: the CLI parses specs before torch is imported); injection
touches only the tensors it creates.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from watchdog.core.errors import InputError
from watchdog.core.numbers import parse_positive, parse_step
from watchdog.core.units import parse_size

if TYPE_CHECKING:
    import torch

KINDS = ("tensors", "graph", "global", "recompile", "total", "hook", "cache", "host", "checkpoint-ratchet")
SIZED = ("tensors", "global", "hook", "cache", "host", "checkpoint-ratchet")  # bytes; otherwise a count
PER_SAVE = ("recompile", "checkpoint-ratchet")  # written without /step: K steps, or bytes per save
FORMS = ("tensors:SIZE/step, graph:N/step, global:SIZE/step, recompile:K, total:N/step, hook:SIZE/step, "
         "cache:SIZE/step, host:SIZE/step or checkpoint-ratchet:SIZE")
_SPEC = re.compile(r"^(?P<kind>[a-z-]+):(?P<amount>[^/@]+)(?P<per>/step)?(?:@(?P<start>[^@]*))?$")
_FORMS = f"{FORMS}, optionally @START_STEP"

_GLOBAL_LEAK: list["torch.Tensor"] = []  # module level on purpose: what a reinit cannot reach


@dataclass(frozen=True)
class LeakSpec:
    kind: str
    amount: int  # bytes per step (SIZED kinds), graphs or losses per step (graph, total), or K steps (recompile)
    start_step: int = 0

    def active(self, step: int) -> bool:
        return step >= self.start_step


def parse_leak_spec(text: str) -> LeakSpec:
    """`tensors:4MiB/step@100` -> LeakSpec("tensors", 4194304, 100); bad text -> InputError."""
    match = _SPEC.match(text.strip())
    if not match:
        raise InputError(f"--inject-leak {text!r}: expected {_FORMS}")
    kind, amount, per_step, start = match["kind"], match["amount"], match["per"], match["start"]
    if kind not in KINDS:
        raise InputError(f"--inject-leak {text!r}: unknown kind {kind!r} (one of {', '.join(KINDS)})")
    if (kind in PER_SAVE) == bool(per_step):
        form = {"recompile": "recompile:K", "checkpoint-ratchet": "checkpoint-ratchet:SIZE"}.get(
            kind, f"{kind}:AMOUNT/step")
        raise InputError(f"--inject-leak {text!r}: write it as {form}")
    try:
        value = parse_size(amount) if kind in SIZED else parse_positive(amount)
        start_step = 0 if start is None else parse_step(start)
    except InputError as exc:
        raise InputError(f"--inject-leak {text!r}: {exc}") from None
    if value < 1:
        raise InputError(f"--inject-leak {text!r}: the amount must be positive")
    return LeakSpec(kind, value, start_step)


@dataclass
class LeakSinks:
    """Where the in-state leaks live: a field of the trainer state, dropped by a reinit."""

    tensors: list[torch.Tensor]
    graphs: list[torch.Tensor]
    shape_probe: torch.Tensor | None = None  # replaced, not accumulated: only its shape matters
    running_total: torch.Tensor | float = 0.0  # `total`: losses summed with their graphs
    host: list[bytearray] = field(default_factory=list)  # `host`: bytes kept in host memory


class CheckpointStaging:
    """The bug of `checkpoint-ratchet`: a save's host copy, staged and never let go."""

    def __init__(self):
        self.buffers: list[bytearray] = []


_CHECKPOINT_STAGING = CheckpointStaging()  # module level, like a checkpointer's: only a restart frees it


def new_sinks() -> LeakSinks:
    return LeakSinks(tensors=[], graphs=[])


def after_save(specs: list[LeakSpec], step: int) -> None:
    """What a checkpoint save leaves behind in host memory (`checkpoint-ratchet`)."""
    for spec in specs:
        if spec.kind == "checkpoint-ratchet" and spec.active(step):
            _CHECKPOINT_STAGING.buffers.append(_host_bytes(spec.amount))


def global_leak_bytes() -> int:
    return sum(t.numel() * t.element_size() for t in _GLOBAL_LEAK)


def inject(specs: list[LeakSpec], step: int, sinks: LeakSinks, device: torch.device,
           forward_loss: Callable[[], torch.Tensor], model: torch.nn.Module | None = None,
           place: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Leak what the specs ask for at this step. `forward_loss` runs one more forward pass
    (with autograd recording) for the graph and total leaks; `model` takes the hooks. Call before
    the step's sync on XLA, so the new tensors are materialised with the step and not as a graph
    of their own.

    `place` lays out each leaked tensor (under SPMD: sharded on the data axis like the batch,
    so SIZE/step is what the whole job leaks, not SIZE on every device)."""
    import torch

    place = place or (lambda tensor: tensor)
    for spec in specs:
        if not spec.active(step):
            continue
        if spec.kind == "tensors":
            sinks.tensors.append(place(_filled(spec.amount, device)))
        elif spec.kind == "global":
            _GLOBAL_LEAK.append(place(_filled(spec.amount, device)))
        elif spec.kind == "graph":
            sinks.graphs.extend(forward_loss() for _ in range(spec.amount))
        elif spec.kind == "total":
            for _ in range(spec.amount):
                sinks.running_total = sinks.running_total + forward_loss()
        elif spec.kind == "hook":
            _register_shape_check(_first_block(model), _filled(spec.amount, device))
        elif spec.kind == "cache":
            _step_table(step, spec.amount, str(device))
        elif spec.kind == "host":
            sinks.host.append(_host_bytes(spec.amount))
        elif spec.kind == "recompile":
            length = 1 + (step - spec.start_step) // spec.amount
            sinks.shape_probe = torch.ones(length, device=device).sum()


def _first_block(model: torch.nn.Module | None) -> torch.nn.Module:
    if model is None:
        raise ValueError("the hook leak needs the model")
    blocks = getattr(model, "blocks", None)
    return blocks[0] if blocks else model


def _register_shape_check(module: torch.nn.Module, expected: torch.Tensor) -> None:
    """The bug: a hook registered inside the loop, never removed, each one keeping its tensor."""

    def check_shape(block, inputs, output):
        assert output.dim() == 3 and expected.numel() > 0  # metadata only: the XLA graph stays the same

    module.register_forward_hook(check_shape)


@functools.lru_cache(maxsize=None)
def _step_table(step: int, nbytes: int, device: str) -> torch.Tensor:
    """The bug: an unbounded cache keyed by something that changes every step."""
    import torch

    return _filled(nbytes, torch.device(device))


def _host_bytes(nbytes: int) -> bytearray:
    return bytearray(b"\x5a") * nbytes  # written, not calloc'ed: untouched pages are not resident


def _filled(nbytes: int, device: torch.device) -> torch.Tensor:
    import torch

    # Filled with ones, not empty: untouched pages would not count in resident memory. A fixed
    # value keeps the XLA graph the same every step (no recompilation from the leak itself).
    return torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
