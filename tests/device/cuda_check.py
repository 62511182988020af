"""Issue 41's device check: the watchdog on a real CUDA GPU, in at most 5 minutes on one H100.

It uses the torch installed where it runs (2.11 on the lent machine, which has no network); the
watchdog comes from this checkout, its light dependencies as wheels (`tests/device/run.sh` says
how). Each case runs in a process of its own, under a real budget: the allocator's share of the
GPU set with `torch.cuda.set_per_process_memory_fraction`. It prints one report, writes it to
`OUT/report.md` and `OUT/report.json`, and writes what the GPU really said as fixtures
(`OUT/fixtures/`) for tests/data/cuda/, so the tests here replay real numbers:

- leak: a training loop that keeps each step's gradient of its first layer, watched, acted on
  before a real `torch.OutOfMemoryError`; the same loop unwatched does hit that error;
- clean: the loop without the leak, watched: no action, no leak;
- fragmentation: growing requests, every other one kept, so the allocator's blocks are split
  into holes too small for what comes next: the OOM comes at half the tensors' bytes. Watched,
  acted on before it; unwatched, its message names the fragmentation;
- cache: requests of changing sizes, all freed: the allocator's cache grows, no tensor does; no
  action and no leak;
- post-mortem: a sudden request above the budget, a real OOM, read back by `hbm-watchdog postmortem`
  with the flight record the OOM observer wrote;
- watch: `hbm-watchdog watch --gpu` stops an unmodified CUDA script (tests/jobs/leaky_script.py)
  from outside, while its unwatched twin runs to the OOM;
- cost: `Watchdog.step()` beside a real CUDA step, steps per second with and without the
  watchdog, paired in one run;
- every watched loop runs under `torch.cuda.set_sync_debug_mode("error")` (but its checkpoint
  save, which must read the device): the watchdog syncs nothing, or the case fails.

    python tests/device/cuda_check.py --out OUT

Without a CUDA device it says so in one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
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
CASE_SECONDS = 90  # one case at most
TOTAL_SECONDS = 285  # all of them: what is left of 5 minutes is for the report


# ---- the parent: runs each case in a child, then the report ------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="cuda-check", help="the folder for the report and the fixtures")
    parser.add_argument("--budget-gib", type=float, default=8.0, help="each case's budget on the GPU")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # a child: one case
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.budget_gib <= 0:
        print("cuda_check: --budget-gib must be positive", file=sys.stderr)
        return 2
    budget = int(args.budget_gib * GiB)
    if args.case:
        return child(args.case, Path(args.work), budget)
    import torch

    if not torch.cuda.is_available():
        print("cuda_check: no CUDA device here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    out = Path(args.out)
    (out / "fixtures").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cuda-check-"))
    started = time.monotonic()
    results: dict[str, dict] = {"device": {"name": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                           "cuda": torch.version.cuda, "budget_bytes": budget}}
    for case in ("leak", "leak-unwatched", "clean", "fragmentation", "fragmentation-unwatched", "cache",
                 "postmortem", "cost", "watch"):
        left = started + TOTAL_SECONDS - time.monotonic()
        if left < 20:
            results[case] = {"passed": False, "error": "not run: the check's 5 minutes were spent"}
            continue
        print(f"cuda_check: {case} ({left:.0f} s left) ...", flush=True)
        if case == "watch":
            results[case] = watch_case(work / case, budget, min(120.0, left - 10))
            continue
        results[case] = run_child(case, work, budget, min(CASE_SECONDS, left - 5))
        if case == "postmortem":
            results[case].update(read_postmortem(work / case))
    results["seconds"] = round(time.monotonic() - started, 1)
    write_fixtures(work, out / "fixtures", results)
    report = render(results)
    (out / "report.md").write_text(report)
    (out / "report.json").write_text(json.dumps(results, indent=1, default=str))
    logs = "".join(f"==== {p.parent.name}/{p.name}\n{p.read_text(errors='replace')[-20000:]}\n"
                   for p in sorted(work.glob("*/*.log")))
    (out / "cases.log").write_text(logs)
    print(report)
    return 0 if all(r.get("passed") for k, r in results.items() if isinstance(r, dict) and "passed" in r) else 1


def run_child(case: str, work: Path, budget: int, seconds: float) -> dict:
    folder = work / case
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--case", case, "--work", str(folder),
               "--budget-gib", str(budget / GiB)]
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


def write_fixtures(work: Path, fixtures: Path, results: dict) -> None:
    """What the GPU said, for the tests here to replay: allocator stats, OOM messages, a snapshot,
    NVML's readings and the watch's trace."""
    stats = work / "clean" / "memory_stats.json"
    if stats.exists():
        (fixtures / "memory_stats.json").write_text(stats.read_text())
    messages = {case: results.get(case, {}).get("oom_text") for case in
                ("leak-unwatched", "fragmentation-unwatched", "postmortem")}
    (fixtures / "oom_messages.json").write_text(json.dumps({"torch": results["device"]["torch"], **messages},
                                                           indent=1))
    traces = sorted((work / "watch").glob("*.csv"))  # the daemon's trace, one per device
    for name, source in (("snapshot.json", work / "fragmentation-unwatched" / "snapshot.json"),
                         ("nvml.json", work / "watch" / "nvml.json"),
                         ("watch_trace.csv", traces[0] if traces else work / "watch" / "none")):
        if source.exists():
            (fixtures / name).write_text(source.read_text())


def render(results: dict) -> str:
    """The report, from the cases' figures (pure: tested on CPU with made-up results)."""
    device = results["device"]
    lines = [f"# cuda_check on {device['name']} (torch {device['torch']}, CUDA {device['cuda']}), "
             f"budget {device['budget_bytes'] / GiB:.1f} GiB a case, {results.get('seconds', '?')} s in all", ""]

    def row(name: str, words: str) -> None:
        result = results.get(name, {})
        mark = "pass" if result.get("passed") else "FAIL"
        lines.append(f"- {name}: {mark}: {words}")

    leak, bare = results.get("leak", {}), results.get("leak-unwatched", {})
    row("leak", f"{leak.get('actions')} actions in {leak.get('steps')} steps (at least {LEAK_CYCLES} owed), "
                f"first action {leak.get('first_action')} at step {leak.get('action_step')} "
                f"(memory {gib(leak.get('used_at_action'))} of {gib(leak.get('limit_at_action'))}), "
                f"OOM raised: {leak.get('oom_step') is not None}; unwatched, OutOfMemoryError at step "
                f"{bare.get('oom_step')}; suspects: {leak.get('suspects')}; sync errors: {leak.get('sync_error')}")
    row("leak-unwatched", f"OutOfMemoryError at step {bare.get('oom_step')}, message parsed: {bare.get('parsed')}")
    clean = results.get("clean", {})
    row("clean", f"{clean.get('steps')} steps, actions {clean.get('actions')}, leak reported {clean.get('leak')}, "
                 f"sync errors: {clean.get('sync_error')}")
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
    cost = results.get("cost", {})
    row("cost", f"step() median {cost.get('step_call_ns')} ns beside a CUDA step of {cost.get('step_ms')} ms; "
                f"steps/s without {cost.get('bare_steps_per_s')}, with {cost.get('watched_steps_per_s')} "
                f"(ratio {cost.get('ratio')}, blocks {cost.get('blocks')})")
    return "\n".join(lines) + "\n"


def gib(value) -> str:
    return f"{value / GiB:.2f} GiB" if isinstance(value, (int, float)) else "?"


# ---- the children: one case each ----------------------------------------------------------------------

def child(case: str, work: Path, budget: int) -> int:
    import torch

    from watchdog.logs import configure_logging

    configure_logging("json")
    torch.cuda.set_per_process_memory_fraction(budget / torch.cuda.get_device_properties(0).total_memory, 0)
    cases = {"leak": lambda: leak_case(work, watched=True), "leak-unwatched": lambda: leak_case(work, watched=False),
             "clean": lambda: clean_case(work), "fragmentation": lambda: fragmentation_case(work, watched=True),
             "fragmentation-unwatched": lambda: fragmentation_case(work, watched=False),
             "cache": lambda: cache_case(work), "postmortem": lambda: postmortem_case(work, budget),
             "cost": lambda: cost_case(work)}
    result = cases[case]()
    (work / "result.json").write_text(json.dumps(result, default=str))
    return 0


class Loop:
    """A small model trained in a plain CUDA loop: no `.item()`, nothing that waits on the GPU."""

    def __init__(self, width: int, layers: int = 4, batch: int = 256):
        import torch

        torch.manual_seed(0)
        self.torch, self.batch, self.width = torch, batch, width
        blocks = []
        for _ in range(layers):
            blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*blocks).cuda()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.kept: list = []  # what a leak keeps

    def step(self, keep_grad: bool = False) -> None:
        torch = self.torch
        x = torch.randn(self.batch, self.width, device="cuda")
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


def watched_run(work: Path, loop: Loop, steps: int, body, *, sample_every: int = 5) -> dict:
    """`steps` of `body(step)` under a watchdog and the sync guard; actions carried out with the
    loop's own save and rebuild. Stops at a restart asked for, or at an OOM."""
    import torch

    from watchdog import Watchdog, WatchdogConfig

    guard = SyncGuard()
    config = WatchdogConfig(sample_every=sample_every, source="cuda", device="cuda:0",
                            trace_file=work / "trace.csv", host_memory=False)
    result = {"steps": 0, "actions": 0, "first_action": None, "action_step": None, "oom_step": None,
              "sync_error": None, "loop_syncs": guard.loop_syncs, "sync_mode": guard.mode, "restart": False}
    with Watchdog(config) as wd:
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
        return acted_before_the_oom(watched_run(work, loop, LEAK_CYCLE_STEPS, body), cycles=LEAK_CYCLES)
    result = unwatched_run(body, LEAK_STEPS * 2)
    result["passed"] = result["oom_step"] is not None and bool(result["parsed"])
    return result


def clean_case(work: Path) -> dict:
    import torch

    loop, recorded = Loop(WIDE), []

    def body(step: int) -> None:
        loop.step()
        time.sleep(0.003)
        if step % 100 == 0:  # the allocator's stats as the cuda source reads them: a fixture
            free, total = torch.cuda.mem_get_info(0)
            recorded.append({"step": step, "memory_stats": dict(torch.cuda.memory_stats(0)),
                             "mem_get_info": [free, total],
                             "fraction": torch.cuda.get_per_process_memory_fraction(0)})

    result = watched_run(work, loop, CLEAN_STEPS, body)
    (work / "memory_stats.json").write_text(json.dumps(recorded))
    result["passed"] = (result["actions"] == 0 and not result["leak"] and result["oom_step"] is None
                        and result["sync_error"] is None and result["steps"] == CLEAN_STEPS)
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
        return acted_before_the_oom(watched_run(work, loop, LEAK_STEPS, body))
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

    result = watched_run(work, loop, CLEAN_STEPS, body)
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


def cost_case(work: Path) -> dict:
    """Blocks of steps with and without the watchdog, in ABBA order, in one process."""
    import torch

    from watchdog import Watchdog, WatchdogConfig

    loop, block = Loop(WIDE), 200
    guard = SyncGuard()
    rates: dict[str, list[float]] = {"bare": [], "watched": []}
    call_ns: list[int] = []
    for _ in range(20):  # warm-up: kernels chosen, the allocator's cache filled
        loop.step()
    torch.cuda.synchronize()
    config = WatchdogConfig(sample_every=10, source="cuda", device="cuda:0", host_memory=False, forensics=False)
    with Watchdog(config) as wd:
        counter = 0
        for kind in ["bare", "watched", "watched", "bare"] * 3:
            started = time.perf_counter()
            with guard:
                for _ in range(block):
                    loop.step()
                    if kind == "watched":
                        before = time.perf_counter_ns()
                        wd.step(counter)
                        call_ns.append(time.perf_counter_ns() - before)
                    counter += 1
            torch.cuda.synchronize()
            rates[kind].append(block / (time.perf_counter() - started))
    bare, watched = statistics.median(rates["bare"]), statistics.median(rates["watched"])
    return {"bare_steps_per_s": round(bare, 1), "watched_steps_per_s": round(watched, 1),
            "ratio": round(watched / bare, 4), "step_call_ns": int(statistics.median(call_ns)),
            "step_ms": round(1000 / bare, 3), "blocks": len(rates["bare"]) + len(rates["watched"]),
            "sync_mode": guard.mode, "loop_syncs": guard.loop_syncs, "passed": True}


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
