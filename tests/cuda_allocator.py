"""PyTorch's CUDA caching allocator in miniature, and the device check's loops on it: the H100's
cases replayed here, with no GPU, at the level the `cuda` source reads.

The allocator keeps PyTorch's rules (c10/cuda/CUDACachingAllocator.cpp, default settings): sizes
rounded up to 512 bytes; requests of 1 MiB or less from a small pool of 2 MiB segments, larger ones
from 20 MiB segments below 10 MiB and from segments of their own size (rounded up to 2 MiB) above;
the smallest free block that fits, split when the rest is more than 512 bytes (small) or 1 MiB
(large); a freed block merged with its free neighbours; and, when a new segment would pass the
allowed bytes (`set_per_process_memory_fraction`), every whole free segment handed back and the
request tried again, else an OOM. It answers the calls the `cuda` source makes, as `torch.cuda` does.

The loops are `tests/device/cuda_check.py`'s, allocation by allocation (a step's forward, backward
and optimizer step), with the memory the H100's process held besides the model (cuBLAS's
workspaces, the check's own small loop) taken from what the H100 recorded. tests/test_cuda_fixtures.py
checks the model against the H100's own figures before it replays anything on it.
"""

from __future__ import annotations

import bisect
import itertools
import random

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MIN_BLOCK, SMALL_SIZE, SMALL_BUFFER = 512, 1 * MiB, 2 * MiB
LARGE_BUFFER, MIN_LARGE_ALLOC, ROUND_LARGE = 20 * MiB, 10 * MiB, 2 * MiB


class OutOfMemory(Exception):
    pass


class Block:
    __slots__ = ("size", "allocated", "prev", "next", "small", "key")

    def __init__(self, size: int, small: bool):
        self.size, self.small, self.allocated = size, small, False
        self.prev = self.next = None
        self.key = (0, 0)


class Allocator:
    """One device's caching allocator, with torch.cuda's face for the `cuda` source."""

    def __init__(self, total: int, allowed: int, outside: int):
        self.total, self.allowed, self.outside = total, allowed, outside  # outside: the context, other memory
        self._free: dict[bool, list] = {True: [], False: []}  # per pool, sorted by (size, serial)
        self._serial = itertools.count()
        self.allocated = self.reserved = self.peak = 0
        self.breakdowns = 0  # memory_stats_as_nested_dict calls

    # -- the allocator ---------------------------------------------------------------------------

    def malloc(self, size: int) -> Block:
        size = max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)
        small = size <= SMALL_SIZE
        block = self._best_fit(small, size)
        if block is None:
            segment = SMALL_BUFFER if small else LARGE_BUFFER if size < MIN_LARGE_ALLOC else \
                -(-size // ROUND_LARGE) * ROUND_LARGE
            if not self._fits(segment):
                self._release_cached()
                if not self._fits(segment):
                    raise OutOfMemory(f"{size} bytes asked, {self.reserved} reserved of {self.allowed} allowed")
            block = Block(segment, small)
            self.reserved += segment
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            remainder = Block(rest, small)
            remainder.prev, remainder.next = block, block.next
            if block.next is not None:
                block.next.prev = remainder
            block.next, block.size = remainder, size
            self._add_free(remainder)
        block.allocated = True
        self.allocated += block.size
        self.peak = max(self.peak, self.allocated)
        return block

    def free(self, block: Block) -> None:
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._remove_free(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._add_free(block)

    def split_bytes(self) -> int:
        """Free blocks that are part of a segment still in use: `inactive_split_bytes`."""
        return sum(b.size for pool in self._free.values() for _, b in pool if b.prev is not None or b.next is not None)

    def _fits(self, segment: int) -> bool:
        return self.reserved + segment <= min(self.allowed, self.total - self.outside)

    def _best_fit(self, small: bool, size: int) -> Block | None:
        pool = self._free[small]
        at = bisect.bisect_left(pool, (size, -1), key=lambda entry: entry[0])
        return pool.pop(at)[1] if at < len(pool) else None

    def _add_free(self, block: Block) -> None:
        block.key = (block.size, next(self._serial))
        bisect.insort(self._free[block.small], (block.key, block), key=lambda entry: entry[0])

    def _remove_free(self, block: Block) -> None:
        pool = self._free[block.small]
        at = bisect.bisect_left(pool, block.key, key=lambda entry: entry[0])
        assert pool[at][1] is block
        pool.pop(at)

    def _release_cached(self) -> None:
        for small, pool in self._free.items():
            kept = [(key, b) for key, b in pool if b.prev is not None or b.next is not None]
            self.reserved -= sum(b.size for _, b in pool) - sum(b.size for _, b in kept)
            self._free[small] = kept

    # -- torch.cuda, as the cuda source calls it ------------------------------------------------------

    def is_initialized(self) -> bool:
        return True

    def memory_stats_as_nested_dict(self, index: int) -> dict:
        self.breakdowns += 1
        return {"allocated_bytes": {"all": {"current": self.allocated, "peak": self.peak}},
                "reserved_bytes": {"all": {"current": self.reserved}},
                "inactive_split_bytes": {"all": {"current": self.split_bytes()}}}

    def mem_get_info(self, index: int) -> tuple[int, int]:
        return self.total - self.outside - self.reserved, self.total

    def get_per_process_memory_fraction(self, index: int) -> float:
        return self.allowed / self.total

    def figures(self) -> dict:
        split = self.split_bytes()
        return {"allocated": self.allocated, "split": split, "reserved": self.reserved, "series": self.allocated + split}


class Loop:
    """cuda_check.py's `Loop`: a stack of Linear+ReLU trained with SGD and momentum, float32, each
    step's allocations in the order PyTorch makes them. `probe`, when given, is called once, after
    one of the step's allocations or frees chosen at random: the sidecar reads while the loop runs."""

    def __init__(self, allocator: Allocator, width: int, layers: int, batch: int, besides: int):
        self.a, self.layers = allocator, layers
        self.act, self.weight, self.bias = batch * width * 4, width * width * 4, width * 4
        self.besides = allocator.malloc(besides)  # what the H100's process held besides the model
        self.params = [(allocator.malloc(self.weight), allocator.malloc(self.bias)) for _ in range(layers)]
        self.momentum: list | None = None
        self.kept: list[Block] = []

    def step(self, keep_grad: bool = False, probe=None, rng: random.Random | None = None) -> None:
        ops = self._ops(keep_grad)
        at = rng.randrange(len(ops)) if probe is not None else -1
        for n, op in enumerate(ops):
            op()
            if n == at:
                probe()

    def _ops(self, keep_grad: bool) -> list:
        """The step's allocations and frees, in order, as closures over the blocks they make."""
        a, live = self.a, {}

        def m(name, size):
            return lambda: live.__setitem__(name, a.malloc(size))

        def f(name):
            return lambda: a.free(live.pop(name))

        ops = [m("x", self.act)]
        for layer in range(self.layers):  # a Linear's output, its ReLU's (saved), the Linear's output freed
            ops += [m(f"h{layer}", self.act), m(f"r{layer}", self.act), f(f"h{layer}")]
        ops += [m("loss_t", self.act), m("loss", MIN_BLOCK), f("loss_t"), m("g", self.act)]
        for layer in reversed(range(self.layers)):  # ReLU's backward, then the Linear's: its weight's and bias's grads
            ops += [m("gh", self.act), f("g"), m(f"gw{layer}", self.weight), m(f"gb{layer}", self.bias)]
            ops += [m("g", self.act), f("gh")] if layer else [f("gh")]
            ops += [f(f"r{layer}")]
        ops += [f("loss"), self._momentum_op(live), self._zero_grad_op(live, keep_grad), f("x")]
        return ops

    def _momentum_op(self, live: dict):
        def op():
            if self.momentum is None:  # SGD's momentum buffers, made at its first step
                self.momentum = [(self.a.malloc(self.weight), self.a.malloc(self.bias)) for _ in range(self.layers)]
        return op

    def _zero_grad_op(self, live: dict, keep_grad: bool):
        def op():
            for layer in range(self.layers):
                weight_grad = live.pop(f"gw{layer}")
                if keep_grad and layer == 0:
                    self.kept.append(weight_grad)  # the leak: the first layer's gradient, every step
                else:
                    self.a.free(weight_grad)
                self.a.free(live.pop(f"gb{layer}"))
        return op

    def rebuild(self) -> None:
        """cuda_check.py's `Loop.rebuild`: the leak dropped, the checkpoint loaded onto the device
        (a copy of every parameter and buffer), copied in, and freed."""
        for block in self.kept:
            self.a.free(block)
        self.kept.clear()
        loaded = [self.a.malloc(size) for _ in range(2 * self.layers) for size in (self.weight, self.bias)]
        for block in loaded:
            self.a.free(block)


# ---- the check's cases, watched through the sidecar's own path ------------------------------------

H100_STEP_SECONDS = 0.005  # a leak case's step on the H100: the model's ~1.5 ms and 3 ms of "data loading"


class Case:
    """One of cuda_check.py's cases on a fresh allocator: the loop, and what its body does a step."""

    def __init__(self, name: str, recorded: dict):
        """`recorded`: the H100's first clean reading (tests/data/cuda/memory_stats.json[0])."""
        stats, (free, total) = recorded["memory_stats"], recorded["mem_get_info"]
        outside = total - free - stats["reserved_bytes.all.current"]  # the CUDA context, and the like
        self.allocator = Allocator(total, int(recorded["fraction"] * total), outside)
        wide = name in ("leak", "clean")
        width, layers, batch = (2048, 4, 256) if wide else (512, 2, 64)
        model = 2 * 4 * (2048 * 2048 * 4 + 2048 * 4)  # the wide model's parameters and momentum, as recorded
        self.loop = Loop(self.allocator, width, layers, batch, besides=stats["allocated_bytes.all.current"] - model)
        self.name = name
        self.time = 0.0  # the case's clock, in seconds: `run_watched` moves it a step at a time

    def clock(self) -> float:
        """The case's time, for the source's `clock`: the H100's step time a step."""
        return self.time

    def step(self, step: int, probe=None, rng: random.Random | None = None) -> None:
        name, a, loop = self.name, self.allocator, self.loop
        if name in ("leak", "clean"):
            loop.step(keep_grad=name == "leak", probe=probe, rng=rng)
            return
        loop.step()  # the sidecar's reading lands in what the body does besides the small loop
        if name == "fragmentation":
            size = min(2 * MiB + step * 8 * KiB, 9 * MiB + MiB // 2)
            ops = [lambda: self._hold("first", a.malloc(size)), lambda: loop.kept.append(a.malloc(size)),
                   lambda: a.free(self._held.pop("first"))]
        else:  # cache
            ops = [lambda: self._hold("scratch", a.malloc(12 * MiB + (step % 100) * 2 * MiB)),
                   lambda: a.free(self._held.pop("scratch"))]
        at = rng.randrange(len(ops)) if probe is not None else -1
        for n, op in enumerate(ops):
            op()
            if n == at:
                probe()

    _held: dict = {}

    def _hold(self, name: str, block: Block) -> None:
        self._held = {**self._held, name: block}


def run_watched(case: Case, source, steps: int, *, sample_every: int = 5, seed: int = 0, station=None) -> dict:
    """cuda_check.py's `watched_run` on the model: a sample every `sample_every` steps, read by
    `source` while the next step runs (at one of its allocations, at random), judged by a Station
    as the sidecar's; an action handed to the loop after that step and carried out as
    `Watchdog.carry_out` does (save, rebuild, the rebuild measured by a fresh reading). Stops at an
    OOM or at a restart asked for."""
    from watchdog.core.judge import Judge
    from watchdog.core.sample import Sample
    from watchdog.readers.sources import fresh_reading
    from watchdog.station.station import Station
    from watchdog.station.telemetry import Telemetry

    rng = random.Random(seed)
    station = station or Station(Judge(), Telemetry(device="cuda:0"))
    result = {"actions": [], "oom_step": None, "restart": False, "samples": [], "leak_steps": [], "history": []}
    requested, decided = None, None

    def probe() -> None:
        nonlocal decided
        reading = source.read()
        sample = Sample(requested, 1.7e9 + case.time, reading.bytes_used, reading.bytes_limit,
                        reading.peak_bytes_used)
        verdict, action = station.observe(sample)
        result["history"].append(sample)
        result["samples"].append((requested, reading.bytes_used, reading.allocator is not None, verdict.status))
        if verdict.leak_detected:
            result["leak_steps"].append(requested)
        if action.needs_checkpoint and decided is None:
            decided = action

    for step in range(steps):
        case.time = step * H100_STEP_SECONDS
        try:
            case.step(step, probe if requested is not None else None, rng)
        except OutOfMemory:
            result["oom_step"] = step
            return result
        requested = None
        if decided is not None:  # handed over at this step(): carried out at once
            result["actions"].append(step)
            if decided.name == "CHECKPOINT_RESTART":
                result["restart"] = True
                return result
            case.loop.rebuild()
            station.reinit_finished(float(fresh_reading(source).bytes_used))
            decided = None
        if step % sample_every == 0:
            requested = step
    return result


# ---- what the breakdown plan gives up: a slow leak inside the cache -----------------------------------

class SlowLeak(Case):
    """The clean case's loop keeping `size` bytes more every step: a leak slow beside the step's
    activations (70 MiB), that the allocator serves from its cache as long as it can."""

    def __init__(self, recorded: dict, size: int):
        super().__init__("clean", recorded)
        self.size, self.kept = size, []

    def step(self, step: int, probe=None, rng: random.Random | None = None) -> None:
        super().step(step, probe, rng)
        self.kept.append(self.allocator.malloc(self.size))


def slow_leak_table(recorded: dict, seeds: int = 8) -> list[tuple]:
    """(leak bytes a step, sample_every, median step of the leak report with a breakdown every
    sample, the same with the source's plan), over `seeds` runs each: docs/gpus.md's figures."""
    import statistics

    from watchdog.readers.breakdown_plan import BreakdownPlan
    from watchdog.readers.sources import CudaSource

    rows = []
    for size, steps in ((1 * MiB + 4 * KiB, 2000), (256 * KiB, 3000)):
        for sample_every in (1, 2, 5, 10):
            medians = []
            for plan in (lambda: BreakdownPlan(every=1), BreakdownPlan):
                reported = []
                for seed in range(seeds):
                    case = SlowLeak(recorded, size)
                    source = CudaSource("cuda:0", cuda=case.allocator, plan=plan(), clock=case.clock)
                    run = run_watched(case, source, steps, sample_every=sample_every, seed=seed)
                    reported.append(run["leak_steps"][0] if run["leak_steps"] else steps)
                medians.append(statistics.median(reported))
            rows.append((size, sample_every, *medians))
    return rows


if __name__ == "__main__":  # python tests/cuda_allocator.py: the slow leak's table, from the H100's first reading
    import json
    import logging
    from pathlib import Path

    logging.disable(logging.CRITICAL)
    first = json.loads((Path(__file__).parent / "data" / "cuda" / "memory_stats.json").read_text())[0]
    print("leak a step | sample every (5 ms steps) | leak reported at (median step): every sample a breakdown | the plan")
    for size, sample_every, full, planned in slow_leak_table(first):
        print(f"{size // KiB} KiB | {sample_every} | {full:g} | {planned:g}")
