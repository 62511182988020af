"""The device check: the watchdog on a real CUDA GPU, in under 6 minutes on one H100 or H200.

Issue 41 made it; issue 65 added the cost table, the read costs and the readings fixture. It uses
the torch installed where it runs (2.11 on the lent machines, which have no network); the watchdog
comes from this checkout, its light dependencies as wheels (`tests/device/run.sh` says how). Each
case runs in a process of its own, under a real budget: the allocator's share of the GPU set with
`torch.cuda.set_per_process_memory_fraction`.

- leak: a training loop that keeps each step's gradient of its first layer, watched for 1,600
  steps: an action before a real `torch.OutOfMemoryError` in each of at least three cycles (the
  leak refills after every rebuild); the same loop unwatched does hit that error;
- clean: the loop without the leak, watched: no action, no leak, and the user's own
  `torch.cuda.max_memory_allocated()` is what it was (the watchdog never resets the peak);
- fragmentation: growing requests, every other one kept, so the allocator's blocks are split
  into holes too small for what comes next: the OOM comes at half the tensors' bytes. Watched,
  acted on before it; unwatched, its message names the fragmentation;
- cache: requests of changing sizes, all freed: the allocator's cache grows, no tensor does; no
  action and no leak;
- post-mortem: a sudden request above the budget, a real OOM, read back by `hbm-watchdog postmortem`
  with the flight record the OOM observer wrote;
- watch: `hbm-watchdog watch --gpu` stops an unmodified CUDA script (tests/jobs/leaky_script.py)
  from outside, while its unwatched twin runs to the OOM;
- reads: what each call the `cuda` source makes costs (and the calls it no longer makes every sample);
- cost: the step time with the watchdog off and on, at `sample_every` 1 and 10, at steps of 13, 40
  and 140 ms, in ABBA order, six pairs a cell: the mean difference and its 95% interval;
- every watched loop runs under `torch.cuda.set_sync_debug_mode("error")` (but its checkpoint
  save, which must read the device): the watchdog syncs nothing, or the case fails.

The watched leak, clean, fragmentation and cache cases read memory through `RecordingSource`: at
every reading the source makes, the allocator's whole breakdown and the device's free bytes of
that moment are recorded beside what the source made of them (`fixtures/readings.json`), so the
tests here replay every sample both ways.

    python tests/device/cuda_check.py --out OUT [--budget-gib 8] [--cases leak,clean,...]

It writes `OUT/README.md` (what it ran, and the report), `OUT/report.json` (every figure, the
cases' logs) and `OUT/fixtures/` (what the GPU said, for tests/data/cuda/): seven files, within
what the device tool brings back. Without a CUDA device it says so in one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MiB, GiB = 1 << 20, 1 << 30
WIDE, NARROW = 2048, 512  # the training model's width; the allocator cases' small model
LEAK_STEPS, CLEAN_STEPS, SPIKE_AT = 900, 600, 150
LEAK_CYCLES = 3  # the leak refills after every rebuild: an action before the OOM in each cycle
LEAK_CYCLE_STEPS = 1_600  # the unwatched leak reached its OOM in 495 steps on an H100: three cycles and room
CASE_SECONDS = 90  # one case at most (the cost case: COST_SECONDS)
TOTAL_SECONDS = 330  # all of them; run.sh's timeout is 350: the whole check stays under 6 minutes
COST_STEP_MS = (13, 40, 140)  # the steps the cost is measured beside
COST_SAMPLE_EVERY = (1, 10)
COST_PAIRS = 6  # watchdog off and on, per cell: three ABBA quartets
COST_BLOCK_SECONDS = 1.2  # one block's steps
COST_SECONDS = 150  # the cost case at most: 2 x 3 cells x 12 blocks x 1.2 s, calibration and warm-up
COST_GOAL = 0.005  # at most +0.5% at a 13 ms step with sample_every=1 (issue 65)
CASES = ("leak", "leak-unwatched", "clean", "fragmentation", "fragmentation-unwatched", "cache", "postmortem",
         "watch", "reads", "cost")
OFF, ON = "off", "on"


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments are one line and exit 2, as everywhere in the project."""

    def error(self, message: str):
        print(f"cuda_check: {message}", file=sys.stderr)
        raise SystemExit(2)


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="cuda-check", help="the folder for the README, the report and the fixtures")
    parser.add_argument("--budget-gib", type=float, default=8.0, help="each case's budget on the GPU")
    parser.add_argument("--cases", default=",".join(CASES), help="the cases to run, comma-separated (default: all)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # a child: one case
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=CASE_SECONDS, help=argparse.SUPPRESS)  # a child's time
    args = parser.parse_args(argv)
    if not (args.budget_gib > 0 and math.isfinite(args.budget_gib)):
        parser.error("--budget-gib must be positive")
    args.cases = [case for case in args.cases.split(",") if case]
    unknown = [case for case in args.cases if case not in CASES]
    if unknown or not args.cases:
        parser.error(f"unknown case {unknown[0]!r}: the cases are {', '.join(CASES)}" if unknown else "no case named")
    if args.case is not None and (args.case not in CASES or args.work is None):
        parser.error(f"a child needs a known --case and its --work folder")
    return args


# ---- the parent: runs each case in a child, then the report ------------------------------------------

def main(argv: list[str] | None = None) -> int:
    try:
        args = arguments(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    budget = int(args.budget_gib * GiB)
    if args.case:
        return child(args.case, Path(args.work), budget, args.seconds)
    import torch

    if not torch.cuda.is_available():
        print("cuda_check: no CUDA device here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    out = Path(args.out)
    (out / "fixtures").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cuda-check-"))
    started = time.monotonic()
    results: dict[str, dict] = {"device": device_facts(budget), "command": command_line(argv)}
    for case in CASES:
        if case not in args.cases:
            continue
        left = started + TOTAL_SECONDS - time.monotonic()
        if left < 20:
            results[case] = {"passed": False, "error": "not run: the check's time was spent"}
            continue
        print(f"cuda_check: {case} ({left:.0f} s left) ...", flush=True)
        if case == "watch":
            results[case] = watch_case(work / case, budget, min(120.0, left - 10))
            continue
        results[case] = run_child(case, work, budget, min(COST_SECONDS if case == "cost" else CASE_SECONDS, left - 5))
        if case == "postmortem":
            results[case].update(read_postmortem(work / case))
    results["seconds"] = round(time.monotonic() - started, 1)
    results["files"] = write_fixtures(work, out / "fixtures", results)
    readme = render(results)
    (out / "README.md").write_text(readme)
    results["cases_log"] = "".join(f"==== {p.parent.name}/{p.name}\n{p.read_text(errors='replace')[-20000:]}\n"
                                   for p in sorted(work.glob("*/*.log")))
    (out / "report.json").write_text(json.dumps(results, indent=1, default=str))
    print(readme)
    return 0 if all(r.get("passed") for k, r in results.items() if isinstance(r, dict) and "passed" in r) else 1


def device_facts(budget: int) -> dict:
    """The device, the versions and the commit, for the README and the fixtures' provenance."""
    import torch

    driver = None
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
    except Exception:  # noqa: BLE001 - a fact the report can go without
        pass
    return {"name": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "driver": driver, "budget_bytes": budget, "commit": commit(), "python": sys.version.split()[0]}


def commit() -> str | None:
    """The checkout's commit: HBMWATCH_COMMIT where the tree travelled without its .git (the device tool's copy)."""
    said = os.environ.get("HBMWATCH_COMMIT")
    if said:
        return said
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=REPO)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def command_line(argv: list[str] | None) -> str:
    return " ".join(["python", "tests/device/cuda_check.py", *(sys.argv[1:] if argv is None else argv)])


def run_child(case: str, work: Path, budget: int, seconds: float) -> dict:
    folder = work / case
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--case", case, "--work", str(folder),
               "--budget-gib", str(budget / GiB), "--seconds", f"{seconds:.1f}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    with open(folder / "stdout.log", "w") as stdout, open(folder / "stderr.log", "w") as stderr:
        try:
            status = subprocess.run(command, stdout=stdout, stderr=stderr, env=env, timeout=seconds).returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
    result_file = folder / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    result.update(exit=status, wall_seconds=round(time.monotonic() - started, 1))
    if not result_file.exists():
        result["passed"] = False
        result["error"] = (folder / "stderr.log").read_text(errors="replace")[-2000:]
    return result


def read_postmortem(folder: Path) -> dict:
    """`hbm-watchdog postmortem` over the case's trace, flight record and output, as a user would."""
    command = [sys.executable, "-m", "watchdog", "postmortem", str(folder), "--log", str(folder / "stderr.log"),
               "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO)
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        return {"passed": False, "postmortem_error": (done.stdout + done.stderr)[-2000:]}
    message = answer.get("oom_message") or {}
    flight = next(iter(sorted(folder.glob("*flight*"))), None)
    record = json.loads(flight.read_text()) if flight is not None else {}
    device_oom = record.get("device_oom")
    passed = (message.get("kind") == "allocation" and message.get("memory_space") == "device"
              and device_oom is not None and device_oom.get("requested_bytes") == message.get("requested_bytes")
              and device_oom.get("limit_bytes") is not None)
    told = {k: answer.get(k) for k in ("ended", "last_step", "diagnosis", "explanation")}
    return {"passed": passed, "postmortem": told,
            "oom_message": {k: message.get(k) for k in ("kind", "memory_space", "requested_bytes", "capacity_bytes",
                                                         "free_bytes", "allocated_bytes", "reserved_unallocated_bytes",
                                                         "process_bytes", "processes")},
            "device_oom": device_oom}


def watch_case(folder: Path, budget: int, seconds: float) -> dict:
    """An unmodified CUDA script under `watch --gpu`, and its unwatched twin beside it."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    fraction = budget / torch.cuda.get_device_properties(0).total_memory
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def job(name: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(REPO / "tests/jobs/leaky_script.py"), "--device", "cuda",
                                 "--memory-fraction", f"{fraction:.6f}", "--state", str(folder / f"{name}.state"),
                                 "--steps", "1000000", "--leak-mib", "4", "--step-seconds", "0.01"],
                                stdout=open(folder / f"{name}.stdout.log", "w"),
                                stderr=open(folder / f"{name}.stderr.log", "w"), env=env)

    daemon = subprocess.Popen([sys.executable, "-m", "watchdog", "--log-format", "json", "watch", "--gpu",
                               "--cmd-pattern", r"leaky_script\.py .*watched\.state", "--memory-limit", str(budget),
                               "--interval", "0.05", "--checkpoint-seconds", "1", "--warmup-seconds", "4",
                               "--wait-seconds", "60", "--trace-file", str(folder / "trace.csv")],
                              stdout=open(folder / "daemon.stdout.log", "w"),
                              stderr=open(folder / "daemon.stderr.log", "w"), cwd=REPO, env=env)
    started = time.monotonic()
    watched, twin = job("watched"), job("twin")
    nvml, ended = [], {}
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception as exc:  # noqa: BLE001 - the readings are a fixture, the case goes on
        handle, nvml = None, [{"error": f"{type(exc).__name__}: {exc}"}]
    while time.monotonic() - started < seconds and len(ended) < 2:
        for name, process in (("watched", watched), ("twin", twin)):
            if name not in ended and process.poll() is not None:
                ended[name] = {"exit": process.returncode, "seconds": round(time.monotonic() - started, 1)}
        if handle is not None and len(nvml) < 400:
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            nvml.append({"t": round(time.monotonic() - started, 2), "total": int(info.total), "used": int(info.used),
                         "processes": [{"pid": p.pid, "used": p.usedGpuMemory}
                                       for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]})
        time.sleep(0.25)
    for process in (watched, twin):
        if process.poll() is None:
            process.kill()
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon_exit = daemon.wait(timeout=20)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon_exit = "killed"
    (folder / "nvml.json").write_text(json.dumps({"pids": {"watched": watched.pid, "twin": twin.pid},
                                                  "readings": nvml}))
    events = [json.loads(line) for line in (folder / "daemon.stderr.log").read_text().splitlines()
              if line.startswith("{")]
    signalled = [e for e in events if e.get("event") == "target_signalled"]
    watched_out = (folder / "watched.stdout.log").read_text()
    twin_err = (folder / "twin.stderr.log").read_text(errors="replace")
    twin_oom = "OutOfMemoryError" in twin_err
    preempted = "preempted step=" in watched_out
    result = {"ended": ended, "daemon_exit": daemon_exit, "signals": len(signalled),
              "signalled": {k: signalled[0].get(k)
                            for k in ("bytes_used", "limit_bytes", "device", "projected_oom_seconds")}
              if signalled else None,
              "watched_stdout": watched_out.strip().splitlines()[-2:], "twin_oom": twin_oom}
    result["passed"] = bool(signalled and preempted and ended.get("watched", {}).get("exit") == 42 and twin_oom
                            and "OutOfMemoryError" not in (folder / "watched.stderr.log").read_text(errors="replace"))
    return result


RECORDED_CASES = ("leak", "clean", "fragmentation", "cache")  # their readings.json entries


def write_fixtures(work: Path, fixtures: Path, results: dict) -> list[str]:
    """What the GPU said, for the tests here to replay: every sample's readings side by side, the
    OOM messages, a snapshot, NVML's readings and the watch's trace. Returns the files written."""
    written = []

    def write(name: str, text: str) -> None:
        (fixtures / name).write_text(text)
        written.append(f"fixtures/{name}")

    device = results["device"]
    readings = {}
    for case in RECORDED_CASES:
        path = work / case / "readings.json"
        if path.exists():
            readings[case] = json.loads(path.read_text())
    if readings:
        provenance = {k: device.get(k) for k in ("name", "torch", "cuda", "driver", "commit", "budget_bytes")}
        write("readings.json", json.dumps({"version": 1, **provenance, "cases": readings}))
    messages = {case: results.get(case, {}).get("oom_text") for case in
                ("leak-unwatched", "fragmentation-unwatched", "postmortem")}
    write("oom_messages.json", json.dumps({"torch": device["torch"], **messages}, indent=1))
    traces = sorted((work / "watch").glob("*.csv"))  # the daemon's trace, one per device
    for name, source in (("snapshot.json", work / "fragmentation-unwatched" / "snapshot.json"),
                         ("nvml.json", work / "watch" / "nvml.json"),
                         ("watch_trace.csv", traces[0] if traces else work / "watch" / "none")):
        if source.exists():
            write(name, source.read_text())
    return written


WHAT = {  # what each case runs, for the README
    "leak": f"a loop that keeps each step's gradient (16 MiB), watched for {LEAK_CYCLE_STEPS:,} steps: an action "
            f"before a real OutOfMemoryError in each of at least {LEAK_CYCLES} cycles, carried out with the loop's "
            "own save and rebuild",
    "leak-unwatched": "the same loop unwatched, to its real OutOfMemoryError",
    "clean": f"the loop without the leak, watched for {CLEAN_STEPS} steps: no action, no leak, and the user's "
             "torch.cuda.max_memory_allocated() untouched",
    "fragmentation": "growing requests, every other one kept: watched, acted on before the OOM the holes bring",
    "fragmentation-unwatched": "the same, unwatched: the OOM's message names fragmentation",
    "cache": "requests of changing sizes, all freed: the cache grows, no tensor does; no action, no leak",
    "postmortem": "a request above the budget: `postmortem` reads the message and the flight record's device_oom",
    "watch": "`watch --gpu` stops an unmodified CUDA script by its preemption signal; its unwatched twin hits the OOM",
    "reads": "each call the cuda source makes (and the ones it makes only for a breakdown), timed per call",
    "cost": f"step time with the watchdog off and on, sample_every {' and '.join(map(str, COST_SAMPLE_EVERY))}, "
            f"steps of {', '.join(map(str, COST_STEP_MS))} ms; ABBA order, {COST_PAIRS} pairs a cell",
}


def render(results: dict) -> str:
    """The README: what ran, where, and each case's figures (pure: tested on CPU with made-up results)."""
    device = results["device"]
    lines = [f"# cuda_check on {device['name']} (torch {device['torch']}, CUDA {device['cuda']}), "
             f"budget {device['budget_bytes'] / GiB:.1f} GiB a case, {results.get('seconds', '?')} s in all", "",
             f"Driver {device.get('driver') or '?'}, Python {device.get('python') or '?'}, commit "
             f"{device.get('commit') or '?'}. Command: `{results.get('command', '?')}`.", "",
             "## What it ran", ""]
    lines += [f"- {case}: {WHAT[case]}" for case in CASES if case in results]
    lines += ["", "## What it found", ""]

    def row(name: str, words: str) -> None:
        result = results.get(name)
        if result is None:
            return
        mark = "pass" if result.get("passed") else "FAIL"
        lines.append(f"- {name}: {mark}: {words}")

    leak, bare = results.get("leak", {}), results.get("leak-unwatched", {})
    row("leak", f"{leak.get('actions')} actions in {leak.get('steps')} steps (at least {LEAK_CYCLES} owed), "
                f"at steps {leak.get('action_steps')}, first action {leak.get('first_action')} at step "
                f"{leak.get('action_step')} (memory {gib(leak.get('used_at_action'))} of "
                f"{gib(leak.get('limit_at_action'))}), OOM raised: {leak.get('oom_step') is not None}; unwatched, "
                f"OutOfMemoryError at step {bare.get('oom_step')}; suspects: {leak.get('suspects')}; "
                f"breakdowns {leak.get('breakdowns')} of {leak.get('samples')} samples; "
                f"sync errors: {leak.get('sync_error')}")
    row("leak-unwatched", f"OutOfMemoryError at step {bare.get('oom_step')}, message parsed: {bare.get('parsed')}")
    clean = results.get("clean", {})
    row("clean", f"{clean.get('steps')} steps, actions {clean.get('actions')}, leak reported {clean.get('leak')}, "
                 f"user's peak kept: {clean.get('user_peak_kept')}, breakdowns {clean.get('breakdowns')} of "
                 f"{clean.get('samples')} samples, sync errors: {clean.get('sync_error')}")
    frag, frag_bare = results.get("fragmentation", {}), results.get("fragmentation-unwatched", {})
    row("fragmentation", f"first action {frag.get('first_action')} at step {frag.get('action_step')}, "
                         f"OOM raised: {frag.get('oom_step') is not None}; at the action tensors "
                         f"{gib(frag.get('allocated_at_action'))}, split remainders "
                         f"{gib(frag.get('split_at_action'))}, reserved {gib(frag.get('reserved_at_action'))}")
    row("fragmentation-unwatched", f"OutOfMemoryError at step {frag_bare.get('oom_step')}, tensors "
                                   f"{gib(frag_bare.get('allocated_at_oom'))} of reserved "
                                   f"{gib(frag_bare.get('reserved_at_oom'))}; message: fragmented "
                                   f"{frag_bare.get('fragmented')}, parsed {frag_bare.get('parsed')}")
    cache = results.get("cache", {})
    row("cache", f"{cache.get('steps')} steps, reserved up to {gib(cache.get('reserved_max'))}, the series up to "
                 f"{gib(cache.get('series_max'))}, actions {cache.get('actions')}, leak reported {cache.get('leak')}")
    post = results.get("postmortem", {})
    row("postmortem", f"diagnosis {(post.get('postmortem') or {}).get('diagnosis')!r}, message "
                      f"{post.get('oom_message')}, flight record's device_oom {post.get('device_oom')}")
    watch = results.get("watch", {})
    row("watch", f"signalled {watch.get('signalled')}, ended {watch.get('ended')}, twin OOM {watch.get('twin_oom')}")
    reads = results.get("reads", {})
    row("reads", "per call, median (10th-90th percentile) in microseconds, below")
    cost = results.get("cost", {})
    row("cost", f"the goal, at most +{COST_GOAL:.1%} at a 13 ms step with sample_every=1: "
                f"{'met' if cost.get('goal_met') else 'not met'}; step() median {cost.get('step_call_ns')} ns; below")
    if reads.get("calls"):
        lines += ["", "### Read costs", "", "| call | median us | 10th-90th us | calls |", "|---|---|---|---|"]
        lines += [f"| {name} | {c['median_us']:.1f} | {c['p10_us']:.1f}-{c['p90_us']:.1f} | {c['calls']} |"
                  for name, c in reads["calls"].items()]
    if cost.get("cells"):
        lines += ["", "### Cost (watchdog on less off, per step)", "",
                  "| step | sample_every | pairs | off, ms | on - off | 95% interval | samples (breakdowns) |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {c['target_ms']} ms | {c['sample_every']} | {c['pairs']} | {c['off_ms']:.3f} | "
                  f"{c['mean']:+.2%} | {c['low']:+.2%} to {c['high']:+.2%} | {c['samples']} ({c['breakdowns']}) |"
                  for c in cost["cells"]]
    if results.get("files"):
        lines += ["", "Files: README.md, report.json (every figure above and each case's log), "
                  + ", ".join(results["files"]) + "."]
    return "\n".join(lines) + "\n"


def gib(value) -> str:
    return f"{value / GiB:.2f} GiB" if isinstance(value, (int, float)) else "?"


# ---- the cost table's arithmetic (pure: tested on CPU) --------------------------------------------------

def abba(pairs: int) -> list[str]:
    """Blocks for `pairs` pairs of off and on, in ABBA order (off on on off, again): a drift in time
    (clocks, temperature, the allocator's cache) weighs on both sides of every quartet alike."""
    if pairs < 1:
        raise ValueError(f"pairs {pairs}: at least one")
    return ([OFF, ON, ON, OFF] * (-(-pairs // 2)))[:2 * pairs]


def paired(schedule: list[str], values: list[float]) -> list[tuple[float, float]]:
    """(off, on) for each pair of neighbouring blocks: blocks 0 and 1, 2 and 3, ..."""
    if len(schedule) != len(values) or len(values) % 2:
        raise ValueError("one value a block, and whole pairs")
    pairs = []
    for at in range(0, len(values), 2):
        first, second = (schedule[at], values[at]), (schedule[at + 1], values[at + 1])
        if {first[0], second[0]} != {OFF, ON}:
            raise ValueError(f"blocks {at} and {at + 1} are not one off and one on")
        pairs.append((first[1], second[1]) if first[0] == OFF else (second[1], first[1]))
    return pairs


T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def mean_interval(differences: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its 95% interval (Student's t, n - 1 degrees of freedom; past
    30 the value at 30, a little wide)."""
    n = len(differences)
    if n < 2:
        raise ValueError("an interval needs two differences or more")
    return statistics.fmean(differences), T_975[min(n - 1, 30) - 1] * statistics.stdev(differences) / math.sqrt(n)


def cell_figures(schedule: list[str], seconds: list[float]) -> dict:
    """A cell's pairs as relative differences (on less off, over off): their mean and 95% interval."""
    pairs = paired(schedule, seconds)
    differences = [(on - off) / off for off, on in pairs]
    mean, half = mean_interval(differences)
    return {"pairs": len(pairs), "off_ms": 1000 * statistics.fmean(off for off, _ in pairs),
            "on_ms": 1000 * statistics.fmean(on for _, on in pairs), "mean": mean, "low": mean - half,
            "high": mean + half, "differences": differences}


# ---- the children: one case each ----------------------------------------------------------------------

def child(case: str, work: Path, budget: int, seconds: float) -> int:
    import torch

    from watchdog.logs import configure_logging

    configure_logging("json")
    torch.cuda.set_per_process_memory_fraction(budget / torch.cuda.get_device_properties(0).total_memory, 0)
    cases = {"leak": lambda: leak_case(work, watched=True), "leak-unwatched": lambda: leak_case(work, watched=False),
             "clean": lambda: clean_case(work), "fragmentation": lambda: fragmentation_case(work, watched=True),
             "fragmentation-unwatched": lambda: fragmentation_case(work, watched=False),
             "cache": lambda: cache_case(work), "postmortem": lambda: postmortem_case(work, budget),
             "reads": lambda: reads_case(), "cost": lambda: cost_case(seconds)}
    result = cases[case]()
    (work / "result.json").write_text(json.dumps(result, default=str))
    return 0


class Loop:
    """A small model trained in a plain CUDA loop: no `.item()`, nothing that waits on the GPU.
    (`device`: "cpu" where the tests here run the cost case's arithmetic without a GPU.)"""

    def __init__(self, width: int, layers: int = 4, batch: int = 256, device: str = "cuda"):
        import torch

        torch.manual_seed(0)
        self.torch, self.batch, self.width, self.device = torch, batch, width, device
        blocks = []
        for _ in range(layers):
            blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*blocks).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.kept: list = []  # what a leak keeps

    def step(self, keep_grad: bool = False) -> None:
        torch = self.torch
        x = torch.randn(self.batch, self.width, device=self.device)
        loss = torch.nn.functional.mse_loss(self.model(x), x)
        loss.backward()
        if keep_grad:
            self.kept.append(self.model[0].weight.grad)  # the leak: a gradient per step, 16 MiB at width 2048
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def save(self, path: Path) -> str:
        self.torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, path)
        return str(path)

    def rebuild(self, path: Path) -> None:
        """Drop the training state, the leak with it, and load the checkpoint back."""
        self.kept.clear()
        state = self.torch.load(path, map_location="cuda")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def cuda_figures() -> dict:
    import torch

    stats = torch.cuda.memory_stats(0)
    allocated = stats.get("allocated_bytes.all.current", 0)
    split = stats.get("inactive_split_bytes.all.current", 0)
    return {"allocated": allocated, "split": split, "reserved": stats.get("reserved_bytes.all.current", 0),
            "series": allocated + split}


class SyncGuard:
    """`set_sync_debug_mode("error")` while the loop and the watchdog run; off for a checkpoint."""

    def __init__(self):
        import torch

        self.torch = torch
        self.mode = "error"
        loop = Loop(64, layers=1, batch=8)  # made first: copying a model to the device waits on it
        try:  # the loop alone must not sync, or nothing can be said about the watchdog
            torch.cuda.set_sync_debug_mode("error")
            for _ in range(3):
                loop.step()
            self.loop_syncs = None
        except RuntimeError as exc:
            self.loop_syncs, self.mode = str(exc).splitlines()[0], "default"
        torch.cuda.set_sync_debug_mode(self.mode)

    def __enter__(self):
        self.torch.cuda.set_sync_debug_mode(self.mode)

    def __exit__(self, *exc):
        self.torch.cuda.set_sync_debug_mode("default")


class RecordingSource:
    """The `cuda` source, recorded: at every reading it makes, the allocator's whole breakdown and the
    device's free bytes of that moment, beside what the source made of them (a breakdown or a
    carried series). The tests replay these readings through the source both ways
    (tests/test_cuda_fixtures.py): every reading a breakdown, and the source's own plan."""

    name = "cuda"

    def __init__(self, source, cuda):
        self.source, self.cuda, self.records = source, cuda, []

    def read(self):
        return self._recorded("sample", self.source.read)

    def read_fresh(self):
        return self._recorded("fresh", self.source.read_fresh)

    def _recorded(self, kind: str, read):
        stats = self.cuda.memory_stats_as_nested_dict(0)
        free, total = self.cuda.mem_get_info(0)
        reading = read()
        figure = lambda name, field="current": int(stats.get(name, {}).get("all", {}).get(field, 0))  # noqa: E731
        self.records.append({"kind": kind, "free": int(free), "total": int(total),
                             "allocated": figure("allocated_bytes"), "split": figure("inactive_split_bytes"),
                             "reserved": figure("reserved_bytes"), "peak": figure("allocated_bytes", "peak"),
                             "read": {"bytes_used": reading.bytes_used, "bytes_limit": reading.bytes_limit,
                                      "peak_bytes_used": reading.peak_bytes_used,
                                      "breakdown": reading.allocator is not None}})
        return reading

    def stepped(self, history) -> list[dict]:
        """The records, each sample's with the step and time the watchdog gave it (its history holds
        the samples in the order they were read)."""
        samples = [r for r in self.records if r["kind"] == "sample"]
        if len(samples) == len(history) and all(r["read"]["bytes_used"] == h.bytes_used
                                                for r, h in zip(samples, history)):
            for record, sample in zip(samples, history):
                record["step"], record["t"] = sample.step, sample.timestamp
        return self.records


def watched_run(work: Path, loop: Loop, steps: int, body, *, sample_every: int = 5, record: bool = False) -> dict:
    """`steps` of `body(step)` under a watchdog and the sync guard; actions carried out with the
    loop's own save and rebuild. Stops at a restart asked for, or at an OOM. `record`: the source's
    readings are written to `work/readings.json` (`RecordingSource`)."""
    import torch

    from watchdog import Watchdog, WatchdogConfig
    from watchdog.runtime.allocator_figures import AllocatorFigures
    from watchdog.readers.sources import CudaSource

    guard = SyncGuard()
    config = WatchdogConfig(sample_every=sample_every, source="cuda", device="cuda:0",
                            trace_file=work / "trace.csv", host_memory=False)
    source = RecordingSource(CudaSource("cuda:0"), torch.cuda) if record else None
    result = {"steps": 0, "actions": 0, "action_steps": [], "first_action": None, "action_step": None,
              "oom_step": None, "sync_error": None, "loop_syncs": guard.loop_syncs, "sync_mode": guard.mode,
              "restart": False}
    with Watchdog(config, source=source) as wd:
        for step in range(steps):
            try:
                with guard:
                    body(step)
                    action = wd.step(step)
            except torch.OutOfMemoryError as exc:
                result.update(oom_step=step, oom_text=str(exc), at_oom=cuda_figures())
                break
            except RuntimeError as exc:
                if "synchroniz" not in str(exc):
                    raise
                result["sync_error"] = str(exc).splitlines()[0]
                break
            result["steps"] = step + 1
            if action is not None and action.needs_checkpoint:
                figures, verdict = cuda_figures(), wd.verdict
                result["actions"] += 1
                result["action_steps"].append(step)
                if result["first_action"] is None:
                    result.update(first_action=action.name, action_step=step,
                                  used_at_action=figures["series"], projected_oom_step=verdict and
                                  verdict.projected_oom_step, limit_at_action=wd.limit_bytes,
                                  allocated_at_action=figures["allocated"],
                                  split_at_action=figures["split"], reserved_at_action=figures["reserved"])
                path = work / "checkpoint.pt"
                if not wd.carry_out(action, save=lambda: loop.save(path), rebuild=lambda: loop.rebuild(path)):
                    result["restart"] = True
                    break
        wd.drain()
        suspects = wd.suspects
        result["suspects"] = suspects.lines if suspects is not None else None
        result["leak"] = bool(wd.leak_suspected)
        # the sidecar counts what raised on its thread, a sync under "error" mode too
        result["sample_errors"] = wd.telemetry.sample_errors_total
        result["samples"] = wd.telemetry.samples_total
        result["breakdowns"] = wd.telemetry.part(AllocatorFigures).breakdowns
        if source is not None:
            (work / "readings.json").write_text(json.dumps(
                {"fraction": torch.cuda.get_per_process_memory_fraction(0), "sample_every": sample_every,
                 "records": source.stepped(list(wd.history))}))
    if result["sample_errors"]:
        result["sync_error"] = result["sync_error"] or f"{result['sample_errors']} failed readings on the sidecar"
    return result


def unwatched_run(body, steps: int, at_oom=None) -> dict:
    """`body(step)` with no watchdog until a real OutOfMemoryError (or `steps`); `at_oom()` runs
    while the allocator still holds what failed."""
    import torch

    for step in range(steps):
        try:
            body(step)
        except torch.OutOfMemoryError as exc:
            if at_oom is not None:
                at_oom()
            return {"oom_step": step, "oom_text": str(exc), "at_oom": cuda_figures(), "parsed": parsed(str(exc))}
    return {"oom_step": None, "parsed": None}


def acted_before_the_oom(result: dict, cycles: int = 1) -> dict:
    result["passed"] = result["actions"] >= cycles and result["oom_step"] is None and result["sync_error"] is None
    return result


def leak_case(work: Path, watched: bool) -> dict:
    loop = Loop(WIDE)

    def body(step: int) -> None:
        loop.step(keep_grad=True)
        time.sleep(0.003)  # the data loader's share of a step

    if watched:
        return acted_before_the_oom(watched_run(work, loop, LEAK_CYCLE_STEPS, body, record=True), cycles=LEAK_CYCLES)
    result = unwatched_run(body, LEAK_STEPS * 2)
    result["passed"] = result["oom_step"] is not None and bool(result["parsed"])
    return result


def clean_case(work: Path) -> dict:
    """The loop without the leak. Before it, the user's own peak: a tensor of 1 GiB made and freed;
    `torch.cuda.max_memory_allocated()` must still say so after the watched run (the watchdog keeps
    a running figure of its own and never resets the allocator's peak)."""
    import torch

    loop = Loop(WIDE)
    big = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    del big
    users_peak = torch.cuda.max_memory_allocated(0)

    def body(step: int) -> None:
        loop.step()
        time.sleep(0.003)

    result = watched_run(work, loop, CLEAN_STEPS, body, record=True)
    result["user_peak_kept"] = torch.cuda.max_memory_allocated(0) >= users_peak >= GiB
    result["passed"] = (result["actions"] == 0 and not result["leak"] and result["oom_step"] is None
                        and result["sync_error"] is None and result["steps"] == CLEAN_STEPS
                        and result["user_peak_kept"])
    return result


def fragmentation_case(work: Path, watched: bool) -> dict:
    """Requests that grow a little every step (a curriculum of longer sequences), two a step, the
    second kept: each kept one pins the part of a 20 MiB block it sits in, and the holes left
    are all smaller than the next request. Reserved grows twice as fast as the tensors."""
    import torch

    loop = Loop(NARROW, layers=2, batch=64)  # its own tensors stay in the small pool

    def body(step: int) -> None:
        loop.step()
        size = min(2 * MiB + step * 8 * 1024, 9 * MiB + MiB // 2)
        first = torch.empty(size, dtype=torch.uint8, device="cuda")
        loop.kept.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        del first
        time.sleep(0.003)

    if watched:
        return acted_before_the_oom(watched_run(work, loop, LEAK_STEPS, body, record=True))
    torch.cuda.memory._record_memory_history(enabled="state", context="state", stacks="python", max_entries=100_000)

    def snapshot() -> None:  # the fragmented allocator, a fixture
        (work / "snapshot.json").write_text(json.dumps(trimmed(torch.cuda.memory._snapshot())))

    result = unwatched_run(body, LEAK_STEPS * 2, at_oom=snapshot)
    figures, message = result.get("at_oom") or {}, result["parsed"]
    result.update(fragmented=bool(message and message.get("fragmented")),
                  allocated_at_oom=figures.get("allocated"), reserved_at_oom=figures.get("reserved"))
    result["passed"] = result["oom_step"] is not None and result["fragmented"]
    return result


def cache_case(work: Path) -> dict:
    """Requests of 12 to 210 MiB, a new size each step, each freed at once: the cache grows until
    the budget makes the allocator empty it; no tensor is kept."""
    import torch

    loop = Loop(NARROW, layers=2, batch=64)
    series_max = reserved_max = 0

    def body(step: int) -> None:
        nonlocal series_max, reserved_max
        loop.step()
        scratch = torch.empty(12 * MiB + (step % 100) * 2 * MiB, dtype=torch.uint8, device="cuda")
        del scratch
        figures = cuda_figures()
        series_max, reserved_max = max(series_max, figures["series"]), max(reserved_max, figures["reserved"])
        time.sleep(0.003)

    result = watched_run(work, loop, CLEAN_STEPS, body, record=True)
    result.update(series_max=series_max, reserved_max=reserved_max)
    result["passed"] = (result["actions"] == 0 and not result["leak"] and result["oom_step"] is None
                        and result["sync_error"] is None)
    return result


def postmortem_case(work: Path, budget: int) -> dict:
    """A watched loop that asks for more than the budget at once: a real OOM, not caught; the
    process dies with torch's message on its stderr, and the flight record keeps the observer's."""
    import torch

    from watchdog import Watchdog, WatchdogConfig

    loop = Loop(WIDE)
    config = WatchdogConfig(sample_every=5, source="cuda", device="cuda:0", trace_file=work / "trace.csv",
                            host_memory=False)
    requested = 2 * budget
    (work / "result.json").write_text(json.dumps({"requested_bytes": requested, "oom_step": SPIKE_AT}))
    with Watchdog(config) as wd:
        for step in range(SPIKE_AT + 1):
            loop.step()
            wd.step(step)
            time.sleep(0.003)
        wd.drain()
        try:
            torch.empty(requested, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as exc:
            result = {"requested_bytes": requested, "oom_step": SPIKE_AT, "oom_text": str(exc)}
            (work / "result.json").write_text(json.dumps(result))
            raise
    return {"passed": False, "error": "no OOM"}


def timed_calls(call, calls: int) -> dict:
    """Per call, in microseconds: median, 10th and 90th percentiles of `calls` calls."""
    times = []
    for _ in range(calls):
        started = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - started)
    deciles = statistics.quantiles(times, n=10)
    return {"median_us": statistics.median(times) / 1000, "p10_us": deciles[0] / 1000, "p90_us": deciles[-1] / 1000,
            "calls": calls}


def reads_case() -> dict:
    """What each call the cuda source makes costs, beside a populated allocator: the device reading
    (every sample), the breakdown (when due), the fraction (with a breakdown), and, for comparison,
    the flat `memory_stats()` the source read every sample before, `memory_allocated()` (the same
    dict inside), and NVML's readings. Then the source's own read, carried and breakdown apart."""
    import torch

    from watchdog.readers.breakdown_plan import BreakdownPlan
    from watchdog.readers.sources import CudaSource

    loop = Loop(WIDE)
    for _ in range(20):
        loop.step()
    torch.cuda.synchronize()
    calls = {"mem_get_info": lambda: torch.cuda.mem_get_info(0),
             "memory_stats_as_nested_dict": lambda: torch.cuda.memory_stats_as_nested_dict(0),
             "get_per_process_memory_fraction": lambda: torch.cuda.get_per_process_memory_fraction(0),
             "memory_stats": lambda: torch.cuda.memory_stats(0),
             "memory_allocated": lambda: torch.cuda.memory_allocated(0)}
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        calls["nvml_memory_info"] = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle)
        calls["nvml_running_processes"] = lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception as exc:  # noqa: BLE001 - the other figures stand without NVML's
        nvml_error = f"{type(exc).__name__}: {exc}"
    else:
        nvml_error = None
    for call in calls.values():  # warm: lazy initialisation out of the figures
        call()
    figures = {name: timed_calls(call, 2000) for name, call in calls.items()}
    for plan, name in ((BreakdownPlan(every=1), "source_read_breakdown"),
                       (BreakdownPlan(every=10**9, seconds=math.inf), "source_read_carried")):
        source = CudaSource("cuda:0", plan=plan)
        source.read()
        figures[name] = timed_calls(source.read, 2000)
    return {"calls": figures, "nvml_error": nvml_error, "passed": True}


def cost_case(seconds: float = COST_SECONDS, device: str = "cuda:0", width: int = WIDE) -> dict:
    """The step time with the watchdog off and on, per cell (sample_every x step length), in ABBA
    blocks of about `COST_BLOCK_SECONDS` (less when the case has less than `COST_SECONDS`: all of it
    fits in `seconds`, 20 of them for the start and the calibration). A step is the wide loop's step
    repeated to the length asked: host-bound (the host dispatches, the GPU keeps up, nothing waits
    on the GPU), so every microsecond the sidecar holds the GIL is one the training thread may wait
    for: the case that costs most. Off: the watchdog is running but `step()` is not called, so its sidecar sleeps.
    (`device` "cpu", a narrower `width`: the tests here, with the rss source, and no GPU.)"""
    import itertools

    import torch

    from watchdog import Watchdog, WatchdogConfig
    from watchdog.runtime.allocator_figures import AllocatorFigures

    on_gpu = device.startswith("cuda")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    loop, guard = Loop(width, device="cuda" if on_gpu else "cpu"), SyncGuard()
    for _ in range(20):  # warm-up: kernels chosen, the allocator's cache filled
        loop.step()
    sync()
    started = time.perf_counter()
    for _ in range(40):
        loop.step()
    sync()
    base = (time.perf_counter() - started) / 40  # one loop step, host-bound
    blocks = len(COST_SAMPLE_EVERY) * len(COST_STEP_MS) * 2 * COST_PAIRS
    block_seconds = min(COST_BLOCK_SECONDS, max(0.2, (seconds - 20) / blocks))
    cells, call_ns = [], []

    def block(wd, steps: int, repeats: int, counter) -> float:
        sync()
        began = time.perf_counter()
        with guard:
            for _ in range(steps):
                for _ in range(repeats):
                    loop.step()
                if wd is not None:
                    before = time.perf_counter_ns()
                    wd.step(next(counter))
                    call_ns.append(time.perf_counter_ns() - before)
        sync()
        return (time.perf_counter() - began) / steps

    for sample_every in COST_SAMPLE_EVERY:
        config = WatchdogConfig(sample_every=sample_every, source="cuda" if on_gpu else "rss", device=device,
                                host_memory=False, forensics=False)
        with Watchdog(config) as wd:
            counter, figures = itertools.count(), wd.telemetry.part(AllocatorFigures)
            for target_ms in COST_STEP_MS:
                repeats = max(1, round(target_ms / 1000 / base))
                steps = max(3, round(block_seconds / (repeats * base)))
                schedule, seconds = abba(COST_PAIRS), []
                samples, breakdowns = wd.telemetry.samples_total, figures.breakdowns
                for kind in schedule:
                    seconds.append(block(wd if kind == ON else None, steps, repeats, counter))
                    wd.drain()  # the sidecar's last sample done before the next block starts
                cells.append({"target_ms": target_ms, "sample_every": sample_every, "repeats": repeats,
                              "steps_a_block": steps, **cell_figures(schedule, seconds),
                              "samples": wd.telemetry.samples_total - samples,
                              "breakdowns": figures.breakdowns - breakdowns,
                              "sample_errors": wd.telemetry.sample_errors_total})
    goal = next(c for c in cells if c["target_ms"] == COST_STEP_MS[0] and c["sample_every"] == 1)
    return {"cells": cells, "loop_step_ms": round(1000 * base, 3), "block_seconds": round(block_seconds, 3),
            "step_call_ns": int(statistics.median(call_ns)),
            "sync_mode": guard.mode, "loop_syncs": guard.loop_syncs, "goal_met": goal["mean"] <= COST_GOAL,
            "passed": goal["mean"] <= COST_GOAL and not any(c["sample_errors"] for c in cells)}


def parsed(text: str | None) -> dict | None:
    if not text:
        return None
    from watchdog.core.oom_message import parse

    message = parse(text)
    if message is None:
        return None
    return {**{k: v for k, v in message.to_json().items() if k not in ("allocations", "python_sites")},
            "fragmented": message.fragmented}


def trimmed(snapshot: dict, frames: int = 6) -> dict:
    """A snapshot small enough for a fixture: segments and blocks, each stack cut to its innermost frames."""
    segments = []
    for segment in snapshot.get("segments", []):
        blocks = [{k: b.get(k) for k in ("address", "size", "requested_size", "state")}
                  | {"frames": [{k: f.get(k) for k in ("filename", "line", "name")}
                                for f in b.get("frames", [])[:frames]]}
                  for b in segment.get("blocks", [])]
        segments.append({k: segment.get(k) for k in ("address", "total_size", "allocated_size", "active_size",
                                                      "segment_type")} | {"blocks": blocks})
    return {"segments": segments}


if __name__ == "__main__":
    sys.exit(main())
