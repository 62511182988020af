"""What reading the job's memory costs, by how many processes the job has (docs/host-memory.md's table).

    python -m watchdog.bench.tree_cost [--descendants N ...] [--json]     (default: 1, 8, 64 and 256)

This process holds 200 MiB, then forks N workers that each hold 4 MiB of their own (DataLoader
workers, as a loop's). For each N it times, median over repeats: finding the tree's members (the
kernel's lists of each thread's children), reading every member's status, counting every member's
share of its pages (the page-table walks, `smaps_rollup`), a `ProcessTree` reading as paced (what
the sidecar pays at each sample), and, beside them, finding the members as main at 4ee56fa did
(each member's `psutil.Process.children()`, a scan of every process on the machine) and psutil's
recursive listing (one scan).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

import psutil

from watchdog.commands.cli import OneLineParser
from watchdog.core.numbers import option, whole_in
from watchdog.readers.host_memory import ProcessTree, _share, _status

MiB = 1 << 20
MAX_DESCENDANTS = 1024


def _median_seconds(fn, repeats: int) -> float:
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def _scan_per_member() -> None:
    frontier, found = psutil.Process().children(), []
    while frontier:
        child = frontier.pop()
        found.append(child)
        try:
            frontier.extend(child.children())
        except psutil.Error:
            continue


def measure(count: int) -> dict:
    workers = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:  # a worker: its own 4 MiB, written, then nothing until it is killed
            own = bytearray(4 * MiB)
            own[::4096] = b"w" * len(own[::4096])
            signal.pause()
            os._exit(0)
        workers.append(pid)
    try:
        time.sleep(1.0 + count / 100)  # every worker has written its pages
        members = [os.getpid(), *workers]
        tree = ProcessTree(psutil.Process(), reset_high_water=False)
        tree.read()
        return {"descendants": count,
                "find_ms": 1e3 * _median_seconds(tree._find, 20),
                "status_ms": 1e3 * _median_seconds(lambda: [_status(pid) for pid in members], 20),
                "count_ms": 1e3 * _median_seconds(lambda: [_share(pid) for pid in members], 5),
                "reading_ms": 1e3 * _median_seconds(tree.read, 50),
                "find_per_member_ms": 1e3 * _median_seconds(_scan_per_member, 3),
                "psutil_recursive_ms": 1e3 * _median_seconds(lambda: psutil.Process().children(recursive=True), 5)}
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        for pid in workers:
            os.waitpid(pid, 0)


def parser() -> argparse.ArgumentParser:
    made = OneLineParser(prog="python -m watchdog.bench.tree_cost", description=__doc__.splitlines()[0])
    made.add_argument("--descendants", type=option(whole_in(1, MAX_DESCENDANTS, "a count of processes")),
                      action="append", help=f"workers to fork, 1 to {MAX_DESCENDANTS}; repeat for several rows "
                                            "(default 1, 8, 64 and 256)")
    made.add_argument("--json", action="store_true", help="one JSON list of rows")
    return made


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    held = bytearray(200 * MiB)  # the parent's memory, shared with every worker it forks
    held[::4096] = b"p" * len(held[::4096])
    rows = []
    for count in args.descendants or [1, 8, 64, 256]:
        rows.append(measure(count))
        if not args.json:
            print(f"measured {count} descendants", file=sys.stderr)
    if args.json:
        print(json.dumps(rows))
        return 0
    print("| descendants | finding them | every status | counting every share (smaps_rollup) | a reading, "
          "paced | finding them, main at 4ee56fa | psutil's recursive listing |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['descendants']} | {row['find_ms']:.2f} ms | {row['status_ms']:.2f} ms | {row['count_ms']:.1f} ms "
              f"| {row['reading_ms']:.2f} ms | {row['find_per_member_ms']:.1f} ms | {row['psutil_recursive_ms']:.1f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
