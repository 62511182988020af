"""Soak: threads, file descriptors and resident memory over a long run of the real trainer.

    python -m watchdog.bench.soak [--steps 100000] [--report-every 10000] [--checkpoint-every 10000]

`hbm-watchdog train`'s loop on plain CPU with a tiny model (one torch thread, so the figures are
the watchdog's and not a BLAS pool's), the watchdog sampling every step, appending every sample
to its trace, serving metrics (scraped once per report, as Prometheus would) and checkpointing
every `--checkpoint-every` steps. Every `--report-every` steps it prints one row: threads, open
file descriptors and resident memory. Something that leaks shows as a column that keeps growing;
the last line compares the first row with the last. It prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from watchdog.commands.cli import OneLineParser
from watchdog.core.inputs import folder_to_write
from watchdog.core.numbers import option, parse_positive

MiB = 1 << 20


@dataclass(frozen=True)
class Row:
    step: int
    seconds: float
    threads: int
    fds: int
    rss_bytes: int
    trace_bytes: int


def figures(step: int, started: float, trace: Path) -> Row:
    process = psutil.Process()
    return Row(step=step, seconds=time.perf_counter() - started, threads=process.num_threads(),
               fds=process.num_fds(), rss_bytes=process.memory_info().rss,
               trace_bytes=trace.stat().st_size if trace.exists() else 0)


def print_row(row: Row, previous: Row | None) -> None:
    if previous is None:
        print(f"{'step':>9} {'seconds':>8} {'steps/s':>8} {'threads':>7} {'fds':>5} {'RSS MiB':>8} {'trace KiB':>9}")
    rate = (row.step - previous.step) / (row.seconds - previous.seconds) if previous else row.step / row.seconds
    print(f"{row.step:>9,} {row.seconds:>8.1f} {rate:>8.1f} {row.threads:>7} {row.fds:>5} "
          f"{row.rss_bytes / MiB:>8.1f} {row.trace_bytes / 1024:>9.0f}", flush=True)


def soak(steps: int, report_every: int, checkpoint_every: int, directory: Path) -> list[Row]:
    import torch

    from watchdog.core.config import WatchdogConfig
    from watchdog.station.exporter import serve_metrics
    from watchdog.station.telemetry import Telemetry
    from watchdog.trainer.loop import TrainConfig, train
    from watchdog.trainer.model import ModelConfig

    torch.set_num_threads(1)
    trace = directory / "trace.csv"
    config = TrainConfig(
        steps=steps, batch_size=1, device="cpu", log_every=steps, progress_bar=False,
        model=ModelConfig(depth=1, width=16, heads=1, seq_len=8, activation_checkpointing="none"),
        checkpoint_dir=directory / "checkpoints", checkpoint_every=checkpoint_every,
        watchdog=WatchdogConfig(sample_every=1, memory_limit_bytes=64 << 30, trace_file=trace))
    telemetry = Telemetry()
    rows: list[Row] = []
    done = threading.Event()
    started = time.perf_counter()

    with serve_metrics(telemetry, 0) as server:
        next_step = report_every

        def report_if_due() -> None:
            nonlocal next_step
            sample = telemetry.sample
            if sample is None or sample.step + 1 < next_step:
                return
            step = sample.step + 1  # the step reached, which a fast run may have carried past the boundary
            urllib.request.urlopen(server.url, timeout=10).read()  # a scrape, as Prometheus would
            rows.append(figures(step, started, trace))
            print_row(rows[-1], rows[-2] if len(rows) > 1 else None)
            next_step = (step // report_every + 1) * report_every

        def report() -> None:  # a thread of its own: the training loop stays exactly the trainer's
            while not done.wait(0.02):
                report_if_due()
            report_if_due()  # the last boundary, which the run may have crossed after the last look

        reporter = threading.Thread(target=report, name="soak-report", daemon=True)
        reporter.start()
        result = train(config, telemetry=telemetry)
        done.set()
        reporter.join()
    after = figures(result.step, started, trace)
    print(f"after the run (sidecar and endpoint stopped): threads {after.threads}, fds {after.fds}, "
          f"RSS {after.rss_bytes / MiB:.1f} MiB")
    print(result.summary())
    return rows or [after]


def parser() -> argparse.ArgumentParser:
    made = OneLineParser(prog="python -m watchdog.bench.soak", description=__doc__.splitlines()[0])
    made.add_argument("--steps", type=option(parse_positive), default=100_000, help="training steps (default 100000)")
    made.add_argument("--report-every", type=option(parse_positive), default=10_000,
                      help="steps between two rows (default 10000)")
    made.add_argument("--checkpoint-every", type=option(parse_positive), default=10_000,
                      help="steps between two checkpoints (default 10000)")
    made.add_argument("--dir", type=option(folder_to_write),
                      help="where the trace and checkpoints go (default: a temporary directory)")
    return made


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from watchdog.logs import configure_logging

    configure_logging("json", level="WARNING")  # rows on stdout; only what goes wrong on stderr
    with tempfile.TemporaryDirectory(prefix="hbm-watchdog-soak-") as scratch:
        rows = soak(args.steps, args.report_every, args.checkpoint_every, Path(args.dir or scratch))
    first, last = rows[0], rows[-1]
    print(f"first row (step {first.step:,}) -> last row (step {last.step:,}): "
          f"RSS {first.rss_bytes / MiB:.1f} -> {last.rss_bytes / MiB:.1f} MiB "
          f"({(last.rss_bytes - first.rss_bytes) / MiB:+.1f}), threads {first.threads} -> {last.threads}, "
          f"fds {first.fds} -> {last.fds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
