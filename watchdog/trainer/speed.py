"""Steps per second of the instrumented trainer with and without the watchdog.

    python -m watchdog.trainer.speed [--steps 400] [--rounds 2] [-- extra train flags]

Each run is a fresh `hbm-watchdog train` process (an empty XLA compile cache each time), and the
modes alternate in ABBA order so that load from elsewhere on the machine hits both alike. The steady rate is
the mean of the progress lines' rates after the first interval (which includes compilation); the
final loss is printed too: the watchdog must not change training, so it must be identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from watchdog.commands.cli import OneLineParser
from watchdog.core.numbers import option, parse_positive

MODES = {"without watchdog": ["--no-watchdog"],
         "with watchdog": ["--memory-limit", "64GiB", "--sample-every", "5"]}


def measure(steps: int, log_every: int, flags: list[str], extra: list[str]) -> tuple[float, float | None]:
    command = [sys.executable, "-m", "watchdog", "--log-format", "json", "train", "--steps", str(steps),
               "--log-every", str(log_every), "--resume", "never", *flags, *extra]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    progress = [json.loads(line) for line in out.stderr.splitlines()
                if line.startswith("{") and '"train_progress"' in line]
    steady = [p["steps_per_second"] for p in progress if p["step"] >= 2 * log_every - 1]
    return statistics.mean(steady), progress[-1]["loss"] if progress else None


def parser() -> argparse.ArgumentParser:
    made = OneLineParser(prog="python -m watchdog.trainer.speed", description=__doc__.splitlines()[0])
    made.add_argument("--steps", type=option(parse_positive), default=400,
                      help="steps per run, more than twice --log-every (default 400)")
    made.add_argument("--log-every", type=option(parse_positive), default=50,
                      help="steps per progress line; the first interval (compiling) is left out (default 50)")
    made.add_argument("--rounds", type=option(parse_positive), default=2, help="runs per mode (default 2)")
    made.add_argument("extra", nargs=argparse.REMAINDER, help="-- more `train` flags (e.g. --device cpu)")
    return made


def main(argv: list[str] | None = None) -> int:
    made = parser()
    args = made.parse_args(argv)
    if args.steps <= 2 * args.log_every:  # the steady rate is read from the progress lines after the first interval
        made.error(f"--steps {args.steps} leaves no progress line after the first interval: give more than twice "
                   f"--log-every ({args.log_every})")
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        order = list(MODES.items())
        for mode, flags in order if round_index % 2 == 0 else order[::-1]:  # ABBA: neither always goes first
            rate, loss = measure(args.steps, args.log_every, flags, extra)
            rates[mode].append(rate)
            print(f"round {round_index + 1}: {mode:17s} {rate:6.1f} steps/s  final loss {loss}", flush=True)
    for mode, values in rates.items():
        print(f"{mode:17s} median {statistics.median(values):6.1f} steps/s over {len(values)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
