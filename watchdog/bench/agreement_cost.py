"""What agreeing on an action costs across processes: per decision, and per training step.

    python -m watchdog.bench.agreement_cost [--worlds 2 4] [--steps 4000] [--every 5 10] [--rounds 3]

Spawns real processes that join a gloo group over 127.0.0.1, as ranks of a multi-host job do,
and times in each of them, in the same run:

- one decision: `agree_on_action` (a one-element all_reduce(MAX) on the control group);
- a step's share, with no action pending (the common case): agreeing every step (the old loop)
  against `ActionCoordinator(every=N).agree`, which talks only on sampling steps, and an empty
  loop as the floor.

Figures are medians over rounds (fresh processes each) of the median over ranks of each rank's
mean; on a shared machine the processes also compete for the cores, so read the ratios measured
in one run rather than absolute times (the load average is printed with them).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

from watchdog.fileio import write_atomically


def _rank_main(rank: int, world: int, port: int, steps: int, everies: list[int], out_dir: str) -> None:
    import torch.distributed as dist

    from watchdog.actions.coordination import ActionCoordinator, agree_on_action

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # gloo prints its connection report on stdout, into the table
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for _ in range(200):  # warm up the connections
            agree_on_action(None)

        def timed(loop) -> float:
            dist.barrier()
            started = time.perf_counter()
            loop()
            return (time.perf_counter() - started) / steps

        def empty():
            for step in range(steps):
                pass

        def every_step():
            for step in range(steps):
                agree_on_action(None)

        result = {"empty": timed(empty), "every_step": timed(every_step)}
        for every in everies:
            coordinator = ActionCoordinator(every=every)

            def on_cadence():
                for step in range(steps):
                    coordinator.agree(None, step)

            result[f"every_{every}"] = timed(on_cadence)
        result["decision"] = result["every_step"] - result["empty"]
    finally:
        dist.destroy_process_group()
    write_atomically(Path(out_dir, f"rank{rank}.json"), json.dumps(result))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(world: int, steps: int, everies: list[int], rounds: int) -> dict[str, float]:
    """Seconds: median over rounds of the median over ranks of each rank's per-step (or per-decision) mean."""
    import torch.multiprocessing as mp

    results = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="agreement-cost-") as out_dir:
            mp.spawn(_rank_main, args=(world, _free_port(), steps, everies, out_dir), nprocs=world, join=True)
            ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
        results.append({key: statistics.median(rank[key] for rank in ranks) for key in ranks[0]})
    return {key: statistics.median(result[key] for result in results) for key in results[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--every", type=int, nargs="+", default=[5, 10])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    us = lambda seconds: f"{seconds * 1e6:.1f} µs"
    header = "| processes | one decision | per step, agreeing every step | " + " | ".join(
        f"per step, every {e} steps" for e in args.every) + " | empty loop |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for world in args.worlds:
        figures = measure(world, args.steps, args.every, args.rounds)
        cadence = " | ".join(f"{us(figures[f'every_{e}'])} ({figures['every_step'] / figures[f'every_{e}']:.1f}x less)"
                             for e in args.every)
        print(f"| {world} | {us(figures['decision'])} | {us(figures['every_step'])} | {cadence} | "
              f"{figures['empty'] * 1e9:.0f} ns |", flush=True)
    print(f"\n({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
