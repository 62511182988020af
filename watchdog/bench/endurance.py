"""Endurance: a whole long job under `supervise`, with leaks that force actions and preemptions.

    hbm-watchdog bench --endurance [--endurance-steps 80000] [--preemptions 3] [--seed 0] [--json]

The instrumented trainer on plain CPU with a tiny model (one torch thread), as a user runs it:
`hbm-watchdog supervise --job-file ... -- hbm-watchdog train ...` with two leaks, one a reinit
frees (`tensors`) and one only a restart frees (`global`), sized so that the memory budget fills
several times over the run, and SIGTERM preemptions (the cluster's) sent to the trainer at
seeded random steps. The budget is the trainer's own resident floor, measured by a short run
first, plus `HEADROOM`: the same pressure on any machine.

It reports what the job's owner asks (also as `--json`): steps completed, lost and redone, the
actions by kind, restarts and preemptions, goodput and badput by cause (the job file, as
`hbm-watchdog goodput` reads it), the watchdog's own memory growth (the largest growth of what a
`Watchdog` keeps alive within one process, `runtime/footprint.py`), the peak memory against the
budget, and the wall time. It prints figures; it asserts nothing.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import psutil

from watchdog.core import goodput
from watchdog.core.errors import InputError
from watchdog.core.sample import load_trace

MiB = 1 << 20
HEADROOM = 160 * MiB  # above the trainer's floor: what the leaks fill, several times a run
LEAK_BYTES_PER_RUN = (640 * MiB, 160 * MiB)  # (tensors, global) over the whole run, whatever its length
MODEL = ["--device", "cpu", "--depth", "1", "--width", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "2",
         "--activation-checkpointing", "none"]


def train_command(steps: int, folder: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "watchdog", "--log-format", "json", "train", *MODEL, "--steps", str(steps),
            "--log-every", str(max(1, steps // 20)), "--checkpoint-dir", str(folder / "checkpoints"),
            "--trace-file", str(folder / "trace.csv"), *extra]


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HBMWATCH_")}  # a fresh job
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def measure_floor(folder: Path) -> int:
    """The trainer's resident memory with no leak: the highest sample of a short run."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(train_command(200, folder), check=True, capture_output=True, env=environment(), timeout=600)
    return max(s.bytes_used for s in load_trace(folder / "trace.csv"))


def leak_flags(steps: int, leak_bytes_per_run: tuple[int, int] = LEAK_BYTES_PER_RUN) -> list[str]:
    tensors, kept = (max(1, round(total / steps)) for total in leak_bytes_per_run)
    return ["--inject-leak", f"tensors:{tensors}B/step", "--inject-leak", f"global:{kept}B/step"]


def preemption_steps(steps: int, count: int, seed: int) -> list[int]:
    """`count` seeded steps in the middle 80% of the run, at least a tenth of it apart."""
    rng = random.Random(seed)
    low, high = steps // 10, steps * 9 // 10
    return sorted(rng.sample(range(low, high, max(1, steps // 10)), min(count, 8)))


def newest_step(trace: Path) -> int | None:
    """The step of the trace's last whole row (read from its end: the file grows all run)."""
    try:
        with trace.open("rb") as handle:
            handle.seek(max(0, trace.stat().st_size - 4096))
            lines = handle.read().split(b"\n")
    except OSError:
        return None
    for line in reversed(lines[:-1]):  # the last element is after the final newline (or a torn row)
        head = line.split(b",", 1)[0]
        if head.isdigit():
            return int(head)
    return None


def _trainers(supervisor: psutil.Process) -> list[psutil.Process]:
    found = []
    for child in supervisor.children():
        try:
            if "train" in child.cmdline():
                found.append(child)
        except psutil.Error:
            continue
    return found


def run_job(steps: int, folder: Path, budget: int, preempt_at: list[int], leaks: list[str],
            progress: Callable[[int], None] = lambda step: None) -> tuple[int, list[int], float]:
    """The supervised job, SIGTERM to its trainer at each step in `preempt_at`; (exit status,
    steps it was preempted past, wall seconds)."""
    job_file = folder / "job.jsonl"
    command = [sys.executable, "-m", "watchdog", "--log-format", "json", "supervise", "--max-restarts", "100",
               "--backoff", "0", "--job-file", str(job_file), "--",
               *train_command(steps, folder, *leaks, "--memory-limit", f"{budget}B",
                              "--checkpoint-every", str(max(1, steps // 16)))]
    pending = list(preempt_at)
    preempted: list[int] = []
    started = time.perf_counter()
    with open(folder / "job.log", "wb") as output:
        job = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=environment())
        try:
            supervisor = psutil.Process(job.pid)
            while job.poll() is None:
                time.sleep(0.2)
                step = newest_step(folder / "trace.csv")
                if step is None:
                    continue
                progress(step)
                if pending and step >= pending[0]:
                    trainers = _trainers(supervisor)
                    if trainers:
                        trainers[0].send_signal(signal.SIGTERM)  # the cluster preempting the job
                        preempted.append(step)
                        pending.pop(0)
        finally:
            if job.poll() is None:
                job.kill()
            job.wait()
    return job.returncode, preempted, time.perf_counter() - started


def endurance(steps: int = 80_000, preemptions: int = 3, seed: int = 0, folder: Path | None = None,
              progress: Callable[[int], None] = lambda step: None,
              leak_bytes_per_run: tuple[int, int] = LEAK_BYTES_PER_RUN) -> dict[str, Any]:
    """The job and its figures. `leak_bytes_per_run`: what each leak (tensors, global) adds over
    the whole run; the default fills the budget several times at any length, and a short run gets
    a faster leak per step (a test's, at a gentler rate than that)."""
    with tempfile.TemporaryDirectory(prefix="hbm-watchdog-endurance-") as scratch:
        folder = folder or Path(scratch)
        floor = measure_floor(folder / "floor")
        budget = floor + HEADROOM
        status, preempted, wall = run_job(steps, folder, budget, preemption_steps(steps, preemptions, seed),
                                          leak_flags(steps, leak_bytes_per_run), progress)
        return summarise(folder, steps, budget, floor, status, preempted, wall)


def summarise(folder: Path, steps: int, budget: int, floor: int, status: int, preempted: list[int],
              wall: float) -> dict[str, Any]:
    account = goodput.account(goodput.read(folder / "job.jsonl"))
    events = _events((folder / "job.log").read_text(errors="replace"))
    samples = load_trace(folder / "trace.csv")
    peak = max((max(s.bytes_used, s.peak_bytes_used or 0) for s in samples), default=0)
    growth = [e["retained_bytes_at_end"] - e["retained_bytes_at_start"] for e in events
              if e.get("event") == "watchdog_footprint"]
    kinds: dict[str, int] = {}
    for action in account.actions:
        kinds[action.kind] = kinds.get(action.kind, 0) + 1
    completed = account.steps_kept
    return {
        "steps_planned": steps, "steps_completed": completed, "steps_lost": steps - completed,
        "steps_redone": account.steps_redone, "actions": kinds, "restarts": account.restarts,
        "preemptions": sum(1 for e in events if e.get("event") == "preempted"), "preempted_past_steps": preempted,
        "goodput": None if account.goodput is None else round(account.goodput, 4),
        "badput_seconds": {cause: round(s, 3) for cause, s in account.badput_seconds.items()},
        "watchdog_cost_seconds": round(account.watchdog_cost_seconds, 3),
        "watchdog_saved_seconds_estimate": round(account.watchdog_saved_seconds, 3),
        "watchdog_memory_growth_bytes": max(growth, default=None),
        "peak_bytes": peak, "budget_bytes": budget, "floor_bytes": floor,
        "actions_before_budget": peak < budget, "exit_status": status, "wall_seconds": round(wall, 1),
        "block": account.block(),
    }


def _events(text: str) -> list[dict]:
    events = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


def render(result: dict[str, Any]) -> str:
    actions = ", ".join(f"{kind} {count}" for kind, count in sorted(result["actions"].items())) or "none"
    growth = result["watchdog_memory_growth_bytes"]
    return "\n".join([
        f"endurance: {result['steps_completed']:,} of {result['steps_planned']:,} steps completed, "
        f"{result['steps_lost']} lost, {result['steps_redone']} redone, in {result['wall_seconds'] / 60:.1f} min "
        f"(supervise exit {result['exit_status']})",
        f"  actions: {actions}; restarts {result['restarts']}; preemptions {result['preemptions']} "
        f"(SIGTERM past steps {', '.join(map(str, result['preempted_past_steps'])) or '-'})",
        f"  peak memory {result['peak_bytes'] / MiB:.1f} MiB against a budget of {result['budget_bytes'] / MiB:.1f} MiB "
        f"(floor {result['floor_bytes'] / MiB:.1f} MiB): "
        f"{'every action before the budget' if result['actions_before_budget'] else 'THE BUDGET WAS REACHED'}",
        f"  the watchdog's own memory: {'n/a' if growth is None else f'{growth / 1024:+.1f} KiB'} at most "
        "within one process (what a Watchdog keeps alive, end against first step)",
        result["block"],
    ])


def run_from_cli(steps: int, preemptions: int, seed: int, as_json: bool, folder: Path | None = None) -> int:
    bar = None
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm

            bar = tqdm(total=steps, desc="endurance", unit="step", file=sys.stderr)
        except ImportError:
            bar = None
    reported = [0]

    def progress(step: int) -> None:
        if bar is not None:
            bar.update(max(0, step - bar.n))
        elif step >= reported[0] + steps // 10:  # a line every tenth, for logs
            reported[0] = step
            print(f"endurance: step {step:,} of {steps:,}", file=sys.stderr, flush=True)

    if folder is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"--endurance-dir {folder}: {exc.strerror or exc}") from None
        if any(folder.iterdir()):
            raise InputError(f"--endurance-dir {folder}: not empty (a job's files would mix with another's)")
    result = endurance(steps, preemptions, seed, folder=folder, progress=progress)
    if bar is not None:
        bar.close()
    print(json.dumps({k: v for k, v in result.items() if k != "block"}) if as_json else render(result))
    return 0
