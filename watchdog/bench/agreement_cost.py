"""What many ranks' one decision costs the training thread: per sampling step, and on the other steps.

    python -m watchdog.bench.agreement_cost [--worlds 2 4 8] [--every 10] [--calls 20000]
                                            [--samples 100] [--period-ms 100] [--rounds 3]

Spawns real processes that join a gloo group over 127.0.0.1, as the ranks of a job do, and times
in each of them, in the same run, with a running `Watchdog` (RSS source, its sidecar thread live):

- a sampling step: `Watchdog.step(n)` on steps that sample, where the ranks agree (the offer goes
  to the agreement's thread; the answer to the previous one is read), with `--period-ms` of
  training (a busy loop holding the GIL, as Python dispatching work does) between two;
- the baseline, in the same processes and with the same gaps: a decision waited for on the
  training thread, `Agreement.decide` (one all_gather of one integer per rank), as every sampling
  step did before the agreement moved off the critical path;
- a step that does not sample: `Watchdog.step(n)` on the others, beside an empty Python call (the
  `step()` goal: at most 3x the empty call), and the same for a watchdog with agreement off.

Figures are medians over rounds (fresh processes each) of the median over ranks of each rank's
mean. On a shared machine the processes compete for the cores (this one has 2: eight ranks wait for
a core at every agreement), so read ratios measured in one run rather than absolute times; the
load average is printed with them.
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

from watchdog.commands.cli import OneLineParser
from watchdog.core.numbers import MAX_STEP, decimal_in, option, parse_positive, whole_in
from watchdog.fileio import write_atomically


def _noop(step: int) -> None:
    return None


def _per_call(fn, steps) -> float:
    started = time.perf_counter()
    for step in steps:
        fn(step)
    return (time.perf_counter() - started) / len(steps)


def _with_gaps(fn, steps, gap_seconds: float) -> float:
    """Mean seconds inside `fn`, with `gap_seconds` of training before each call: a busy loop, as a
    training thread dispatching work is (after a sleep, the first microseconds of any call run on a
    cold core: 15 µs for a Future's result that takes 1.8 µs warm)."""
    inside = 0.0
    for step in steps:
        until = time.perf_counter() + gap_seconds
        while time.perf_counter() < until:
            pass
        started = time.perf_counter()
        fn(step)
        inside += time.perf_counter() - started
    return inside / len(steps)


def _rank_main(rank: int, world: int, port: int, every: int, calls: int, samples: int, gap: float,
               out_dir: str) -> None:
    import torch.distributed as dist

    from watchdog.core.config import WatchdogConfig
    from watchdog.actions.agreement import Agreement
    from watchdog.runtime.sidecar import Watchdog

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # gloo prints its connection report on stdout, into the table
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    config = WatchdogConfig(sample_every=every, source="rss", device="cpu", memory_limit_bytes=1 << 40,
                            host_memory=False, forensics=False, stall_after_seconds=3600)
    try:
        agreement = Agreement()
        for step in range(200):  # warm up the connections
            agreement.decide(step, None)
        dist.barrier()
        result = {"decision": _with_gaps(lambda step: agreement.decide(step, None), range(samples), gap)}
        agreement.close()
        sampling = range(0, samples * every, every)
        off = [step for step in range(calls) if step % every]
        for name, agree in (("agreeing", True), ("alone", False)):
            dist.barrier()
            with Watchdog(WatchdogConfig(**{**config.__dict__, "agree_across_ranks": agree})) as watchdog:
                result[f"off_step_{name}"] = _per_call(watchdog.step, off)
                result[f"empty_{name}"] = _per_call(_noop, off)
                dist.barrier()
                result[f"sampling_step_{name}"] = _with_gaps(watchdog.step, sampling, gap)
    finally:
        dist.destroy_process_group()
    write_atomically(Path(out_dir, f"rank{rank}.json"), json.dumps(result))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(world: int, every: int, calls: int, rounds: int, samples: int = 100,
            period_ms: float = 100.0) -> dict[str, float]:
    """Seconds per call: median over rounds of the median over ranks of each rank's mean."""
    import torch.multiprocessing as mp

    results = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="agreement-cost-") as out_dir:
            mp.spawn(_rank_main, args=(world, _free_port(), every, calls, samples, period_ms / 1000, out_dir),
                     nprocs=world, join=True)
            ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
        results.append({key: statistics.median(rank[key] for rank in ranks) for key in ranks[0]})
    return {key: statistics.median(result[key] for result in results) for key in results[0]}


MAX_WORLD = 64  # ranks spawned on this machine at once
MIN_CALLS = 1000  # steps timed per kind: fewer, and an empty call's mean can read 0 s


def parser() -> argparse.ArgumentParser:
    made = OneLineParser(prog="python -m watchdog.bench.agreement_cost", description=__doc__.split("\n\n")[0])
    made.add_argument("--worlds", type=option(whole_in(2, MAX_WORLD, "a number of ranks")), nargs="+",
                      default=[2, 4, 8], help=f"ranks of each job measured, 2 to {MAX_WORLD} (default 2 4 8)")
    made.add_argument("--every", type=option(whole_in(2, MAX_STEP - 1, "a sampling period in steps")), default=10,
                      help="sample_every: from 2, so that some steps do not sample (default 10)")
    made.add_argument("--calls", type=option(whole_in(MIN_CALLS, MAX_STEP - 1, "a number of steps")), default=20000,
                      help=f"steps timed that do not sample, from {MIN_CALLS:,} (default 20000)")
    made.add_argument("--samples", type=option(parse_positive), default=100,
                      help="sampling steps timed, each after a period (default 100)")
    made.add_argument("--period-ms", type=option(decimal_in(0, 60_000, "milliseconds")), default=100.0,
                      help="training between two sampling steps, 0 to 60,000 ms (default 100)")
    made.add_argument("--rounds", type=option(parse_positive), default=3, help="fresh processes per world (default 3)")
    made.add_argument("--json", action="store_true")
    return made


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    rows = []
    for world in args.worlds:
        figures = measure(world, args.every, args.calls, args.rounds, args.samples, args.period_ms)
        rows.append({"ranks": world, "every": args.every, **figures,
                     "off_step_ratio": figures["off_step_agreeing"] / figures["empty_agreeing"],
                     "off_step_ratio_alone": figures["off_step_alone"] / figures["empty_alone"]})
        if not args.json:
            if len(rows) == 1:
                print(f"sample_every={args.every}; medians of {args.rounds} rounds of {args.calls:,} steps, "
                      f"{args.samples} sampling steps {args.period_ms:g} ms apart")
                print("| ranks | decision waited for (before) | sampling step, agreeing | sampling step, alone | "
                      "other step, agreeing | other step, alone | empty call |")
                print("|---|---|---|---|---|---|---|")
            row = rows[-1]
            print(f"| {world} | {row['decision'] * 1e6:.1f} µs | {row['sampling_step_agreeing'] * 1e6:.1f} µs | "
                  f"{row['sampling_step_alone'] * 1e6:.1f} µs | {row['off_step_agreeing'] * 1e9:.0f} ns "
                  f"({row['off_step_ratio']:.1f}x) | {row['off_step_alone'] * 1e9:.0f} ns "
                  f"({row['off_step_ratio_alone']:.1f}x) | {row['empty_agreeing'] * 1e9:.0f} ns |", flush=True)
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"\n({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
