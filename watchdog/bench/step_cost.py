"""What `Watchdog.step()` costs the training thread, beside an empty Python call, in one run.

Both are timed the same way: a tight loop of calls, per-call time = loop time / calls, median
over repeats. The sidecar runs for real (RSS source, trace off) so `step()` pays for waking it.
Target (issue 2): at most 5x the empty call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from watchdog.commands.cli import OneLineParser
from watchdog.core.config import WatchdogConfig
from watchdog.runtime.sidecar import Watchdog


def _noop(step: int) -> None:
    return None


def _per_call_ns(fn, calls: int, repeats: int) -> float:
    timings = []
    for r in range(repeats):
        start = time.perf_counter_ns()
        for i in range(r * calls, (r + 1) * calls):
            fn(i)
        timings.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(timings)


def measure(sample_every: int = 10, calls: int = 100_000, repeats: int = 15) -> dict:
    config = WatchdogConfig(sample_every=sample_every, source="rss", memory_limit_bytes=1 << 40,
                            stall_after_seconds=3600)
    with Watchdog(config) as watchdog:
        _per_call_ns(watchdog.step, calls, 2)  # warm-up
        _per_call_ns(_noop, calls, 2)
        noop_ns, step_ns = [], []
        for _ in range(repeats):  # interleave, so machine noise hits both alike
            noop_ns.append(_per_call_ns(_noop, calls, 1))
            step_ns.append(_per_call_ns(watchdog.step, calls, 1))
        watchdog.drain()
        samples = watchdog.telemetry.samples_total
    empty, step = statistics.median(noop_ns), statistics.median(step_ns)
    return {"sample_every": sample_every, "empty_call_ns": round(empty, 1), "step_ns": round(step, 1),
            "ratio": round(step / empty, 2), "calls": calls * repeats, "sidecar_samples": samples}


def parser() -> argparse.ArgumentParser:
    made = OneLineParser(prog="python -m watchdog.bench.step_cost", description=__doc__.splitlines()[0])
    made.add_argument("--json", action="store_true", help="print one JSON list instead of the table")
    return made


def main(argv: list[str] | None = None) -> int:
    as_json = parser().parse_args(argv).json
    rows = [measure(sample_every) for sample_every in (10, 1)]
    if as_json:
        print(json.dumps(rows))
        return 0
    print("Watchdog.step() cost on the training thread (median per call, same run)")
    print(f"{'sample_every':>12} {'empty call':>12} {'step()':>10} {'ratio':>7}  target <= 5x")
    for row in rows:
        print(f"{row['sample_every']:>12} {row['empty_call_ns']:>9.1f} ns {row['step_ns']:>7.1f} ns "
              f"{row['ratio']:>6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
