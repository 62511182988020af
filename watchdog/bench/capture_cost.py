"""What the creation-site capture costs a training step: while on, and while off.

    python -m watchdog.bench.capture_cost [--device cpu|xla] [--rounds 5] [--steps 30]

Trains the instrumented trainer's model (`TransformerLM`, default size) and times blocks of
steps in rounds, in one process, so the figures compare like with like on a shared machine:

- off: no capture was ever armed;
- on: a capture armed for exactly the block, noting every tensor the step creates;
- off again: the same `CreationSites` after its capture ended.

Block times are the fastest of the rounds (as timeit does: on a shared machine the slower ones
time the neighbours). The capture's cost is per torch call, so it is also timed on its own, on a
call that does almost nothing (`x + 1` on a 4-element tensor), off and on in the same process:
that cost times the calls a step makes is what a step pays while capturing. While off, nothing is
installed (the torch function mode stack is empty) and the trainer's only cost is
`between_steps()`, timed on its own too.
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch

from watchdog.commands.cli import OneLineParser
from watchdog.core.numbers import MAX_STEP, option, parse_positive, whole_in
from watchdog.forensics.creation_sites import CreationSites


def _training_step(device: torch.device):
    from watchdog.trainer.data import TokenSource
    from watchdog.trainer.model import ModelConfig, TransformerLM

    torch.manual_seed(0)
    config = ModelConfig()
    model = TransformerLM(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=device.type == "xla")
    batch = TokenSource(batch_size=8, seq_len=config.seq_len, vocab_size=config.vocab_size, seed=0).batch_at(0)
    tokens, targets = batch.tokens.to(device), batch.targets.to(device)
    sync = _sync(device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        sync()

    return step


def _sync(device: torch.device):
    if device.type == "xla":
        import torch_xla

        return torch_xla.sync
    return lambda: None


def _block(step, sites: CreationSites, steps: int) -> float:
    """Seconds per step over `steps` steps, calling between_steps() as the trainer does."""
    started = time.perf_counter()
    for _ in range(steps):
        sites.between_steps()
        step()
    return (time.perf_counter() - started) / steps


def _calls_per_step(step, steps: int = 3) -> int:
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        for _ in range(steps):
            step()
    return Count.calls // steps


def measure(device: torch.device, rounds: int, steps: int) -> dict:
    step = _training_step(device)
    for _ in range(10):  # warm-up: compilation, allocator, optimizer state
        step()
    off, on, after, noted = [], [], [], []
    for _ in range(rounds):
        never = CreationSites()
        off.append(_block(step, never, steps))
        sites = CreationSites(steps=steps)
        sites.arm()
        sites.between_steps()  # starts it: the block below runs captured, and it ends at its last step
        on.append(_block(step, sites, steps - 1))
        noted.append(len(sites._records))
        sites.between_steps()
        after.append(_block(step, sites, steps))
        assert torch._C._len_torch_function_stack() == 0
    idle = CreationSites()
    number = 1_000_000
    idle_ns = min(timeit.repeat(idle.between_steps, number=number, repeat=5)) / number * 1e9
    call_off, call_on = _per_call()
    return {"off": min(off), "on": min(on), "after": min(after), "idle_ns": idle_ns,
            "calls": _calls_per_step(step), "noted": statistics.median(noted),
            "call_off_us": call_off, "call_on_us": call_on,
            "modes_installed_while_off": torch._C._len_torch_function_stack()}


def _per_call(number: int = 20_000, repeat: int = 5) -> tuple[float, float]:
    """Microseconds per `x + 1` on a tiny tensor: off, then capturing (the note kept alive)."""
    x = torch.ones(4)
    kept = []

    def call():
        kept.append(x + 1)
        if len(kept) > 1000:
            kept.clear()

    off = min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6
    sites = CreationSites(steps=1, max_records=10_000)
    sites.arm()
    sites.between_steps()
    on = min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6
    sites.close()
    return off, on


def parser() -> argparse.ArgumentParser:
    made = OneLineParser(prog="python -m watchdog.bench.capture_cost", description=__doc__.splitlines()[0])
    made.add_argument("--device", choices=("cpu", "xla"), default="cpu")
    made.add_argument("--rounds", type=option(parse_positive), default=5, help="rounds, the fastest kept (default 5)")
    made.add_argument("--steps", type=option(whole_in(2, MAX_STEP - 1, "a number of steps")), default=30,
                      help="steps per round, from 2 (default 30)")
    made.add_argument("--threads", type=option(whole_in(1, 1024, "a number of threads")), default=1,
                      help="torch CPU threads, 1 to 1,024 (1: steadier on a shared machine)")
    return made


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.device == "xla":
        import torch_xla

        device = torch_xla.device()
    else:
        device = torch.device("cpu")
    r = measure(device, args.rounds, args.steps)
    ms = 1e3
    added = r["on"] - r["off"]
    per_call = r["call_on_us"] - r["call_off_us"]
    print(f"creation-site capture, TransformerLM (default size, batch 8) on {device}, "
          f"fastest of {args.rounds} rounds of {args.steps} steps:")
    print(f"  off, never armed      {r['off'] * ms:8.2f} ms/step")
    print(f"  on, capturing         {r['on'] * ms:8.2f} ms/step   {added * ms:+.2f} ms ({added / r['off']:+.1%}); "
          f"{r['calls']} torch calls/step, {r['noted']:.0f} tensors still noted at the end")
    print(f"  off again, after      {r['after'] * ms:8.2f} ms/step   {(r['after'] - r['off']) * ms:+.2f} ms")
    print(f"  per torch call: {r['call_off_us']:.2f} us off, {r['call_on_us']:.2f} us on: +{per_call:.2f} us, "
          f"x {r['calls']} calls = +{per_call * r['calls'] / 1e3:.2f} ms per captured step")
    print(f"  while off: between_steps() {r['idle_ns']:.0f} ns/call, "
          f"torch function modes installed: {r['modes_installed_while_off']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
