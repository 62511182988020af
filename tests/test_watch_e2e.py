"""`hbm-watchdog watch` end to end, every part real: a leaking job that knows nothing of
hbm-watchdog runs under `hbm-watchdog supervise`, the daemon runs beside it as its own process.

The jobs: a plain torch_xla script on PJRT CPU (tests/jobs/leaky_script.py), our own trainer with
`--no-watchdog`, and a Lightning `fit` on CPU (tests/jobs/leaky_lightning.py). Each checkpoints
on SIGTERM and exits 42; the supervisor restarts it; it resumes. The budget B is checked against
the job's memory as the kernel counts it (each process's `Pss_Anon + Pss_Shmem`), read by the test
itself every 10 ms (`JobPeak`), not against the daemon's samples. (The kernel's own high-water mark,
read once each job process was waited for, was the check while the judged series was the resident
set; the daemon now resets that mark at each reading, to see the peak between two readings.)
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import psutil

from tests.conftest import REPO, hbm_watchdog_env, json_lines, own_count
from watchdog.core.sample import load_trace

pytestmark = [pytest.mark.slow, pytest.mark.long]

MiB, GiB = 1 << 20, 1 << 30
JOBS = Path(__file__).resolve().parent / "jobs"
WATCH = [sys.executable, "-m", "watchdog", "--log-format", "json", "watch"]
SUPERVISE = [sys.executable, "-m", "watchdog", "--log-format", "json", "supervise", "--max-restarts", "6",
             "--backoff", "0.5", "--"]


@dataclass
class Run:
    job_status: int
    job_peak: int  # bytes: the job's memory at its highest, each page once, read every 10 ms by the test
    job_stdout: str
    job_stderr: str
    events: list[dict]  # the daemon's log
    daemon_status: int
    trace: list

    def named(self, event: str) -> list[dict]:
        return [e for e in self.events if e.get("event") == event]

    def story(self) -> str:
        """What a failed assertion should show: the supervisor's and the daemon's decisions."""
        told = [e for e in json_lines(self.job_stderr) if e.get("logger") == "watchdog.actions.supervisor"]
        told += [e for e in self.events if e["event"].startswith(("target_", "restart_", "signal", "watch_"))]
        lines = [f"job exit {self.job_status}, daemon exit {self.daemon_status}", self.job_stdout.strip()]
        lines += [" ".join(f"{k}={v}" for k, v in e.items() if k not in ("level", "logger"))[:300] for e in told]
        return "\n".join(lines + [self.job_stderr[-1500:]])


class JobPeak(threading.Thread):
    """The job's memory at its highest, as the kernel counts it: every 10 ms, every process below the
    supervisor whose command line names the job's own marker (a DataLoader worker carries its
    parent's), each page once (`own_count`: its smaps_rollup). Independent of the daemon's readers."""

    def __init__(self, supervisor: subprocess.Popen, marker: str):
        super().__init__(daemon=True)
        self.supervisor, self.marker, self.peak, self.done = supervisor, marker, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.01):
            try:
                below = psutil.Process(self.supervisor.pid).children(recursive=True)
            except psutil.Error:
                continue
            total = 0
            for process in below:
                try:
                    if self.marker in " ".join(process.cmdline()):
                        total += own_count(process.pid)
                except psutil.Error:
                    continue
            self.peak = max(self.peak, total)


def watch_supervised_job(tmp_path: Path, job: list[str], pattern: str, budget: int, *watch_args: str,
                         timeout: float = 900, torch_default_threads: bool = False) -> Run:
    env = hbm_watchdog_env()
    if torch_default_threads:  # the job's own process tree only; the daemon keeps the suite's setting
        job_env = {name: value for name, value in env.items() if name != "OMP_NUM_THREADS"}
    else:
        job_env = env
    out, err, log = (open(tmp_path / name, "w+") for name in ("job.out", "job.err", "watch.err"))
    trace = tmp_path / "watch.csv"
    supervisor = subprocess.Popen([*SUPERVISE, *job], stdout=out, stderr=err, cwd=REPO, env=job_env)
    peak = JobPeak(supervisor, pattern.replace("\\", ""))
    peak.start()
    daemon = subprocess.Popen([*WATCH, "--cmd-pattern", pattern, "--memory-limit", str(budget),
                               "--trace-file", str(trace), "--wait-seconds", "60", "--grace-seconds", "60",
                               *watch_args],
                              stdout=subprocess.DEVNULL, stderr=log, cwd=REPO, env=env)
    try:
        status = supervisor.wait(timeout)
    finally:
        peak.done.set()
        if supervisor.poll() is None:
            supervisor.kill()
        daemon.send_signal(signal.SIGTERM)
        daemon_status = daemon.wait(60)
    texts = []
    for handle in (out, err, log):
        handle.seek(0)
        texts.append(handle.read())
        handle.close()
    return Run(status, peak.peak, texts[0], texts[1], json_lines(texts[2]), daemon_status, load_trace(trace))


def segments(trace) -> int:
    return 1 + sum(1 for a, b in zip(trace, trace[1:]) if b.step < a.step)


def check_protected(run: Run, budget: int, job_pids: list[int], cycles: int = 1) -> None:
    """The done-when of the issue: signalled before B, saved, restarted, resumed, re-attached, never
    over B; in every one of at least `cycles` cycles (issue 49: the leak refills after each restart)."""
    assert run.job_status == 0, run.story()
    assert run.daemon_status == 0 and run.named("watch_stopped")
    signalled = run.named("target_signalled")
    assert len(signalled) >= cycles, run.story()
    assert {e["signal"] for e in signalled} == {"SIGTERM"} and not run.named("target_escalated"), run.story()
    assert {e["pid"] for e in signalled} <= set(job_pids), "only the job itself is signalled, never its supervisor"
    assert all(e["bytes_used"] < budget for e in signalled)
    reattached = [e for e in run.named("target_attached") if e["seconds_since_signal"] is not None]
    assert len(reattached) == len(signalled), "the daemon re-attaches to the restarted job after every signal"
    measured = [e for e in run.named("restart_measured") if e["after_signal"]]
    assert measured and all(e["recovered"] and e["recovered_bytes"] > 0 for e in measured)
    assert segments(run.trace) >= len(signalled) + 1  # a new trace segment per restart
    assert max(max(s.bytes_used, s.peak_bytes_used or 0) for s in run.trace) < budget
    assert run.job_peak < budget, f"the job reached {run.job_peak / MiB:.0f} MiB, over B"
    report_margins(run, budget)


def report_margins(run: Run, budget: int) -> None:
    """Print what the README quotes: detection time, lead before B, the process's own exit time."""
    attached = [e for e in run.named("target_attached")]
    for signal_event in run.named("target_signalled"):
        at = _time(signal_event)
        since = max((_time(e) for e in attached if _time(e) <= at), default=at)
        exited = min((_time(e) for e in run.named("target_exited") if _time(e) >= at), default=float("nan"))
        headroom = budget - signal_event["bytes_used"]
        print(f"\nsignal {at - since:.1f} s into the segment; {headroom / MiB:.0f} MiB below B, "
              f"{headroom / signal_event['slope_bytes_per_second']:.1f} s before B at the fitted rate; "
              f"projected OOM (pessimistic) in {signal_event['projected_oom_seconds_pessimistic']} s; "
              f"the job saved and exited {exited - at:.1f} s after the signal; "
              f"job peak {run.job_peak / MiB:.0f} MiB of B {budget / MiB:.0f} MiB")


def _time(event: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def started_lines(stdout: str) -> list[tuple[int, int]]:
    return [(int(step), int(pid)) for step, pid in re.findall(r"started step=(\d+) pid=(\d+)", stdout)]


def check_resumed(run: Run, steps: int) -> list[int]:
    """Each restart began where the preempted run saved; returns the job's PIDs."""
    starts = started_lines(run.job_stdout)
    preempted = [int(s) for s in re.findall(r"preempted step=(\d+)", run.job_stdout)]
    assert len(starts) == len(preempted) + 1 and preempted, run.story()
    assert [s for s, _ in starts[1:]] == preempted, run.story()
    assert f"finished step={steps}" in run.job_stdout, run.story()
    return [pid for _, pid in starts]


def protect_script(tmp_path: Path, script: str, state_flag: str, steps: int, budget: int, step_seconds: float,
                   torch_default_threads: bool = False, cycles: int = 1) -> None:
    """A job script of tests/jobs (leaks 1 MiB per step, saves on SIGTERM, exits 42) under
    `supervise`, the daemon beside it; the pattern is the script's own state file, unique to the test."""
    state = tmp_path / "state"
    job = [sys.executable, str(JOBS / script), state_flag, str(state), "--steps", str(steps), "--leak-mib", "1",
           "--step-seconds", str(step_seconds)]
    run = watch_supervised_job(tmp_path, job, re.escape(str(state)), budget,
                               "--interval", "0.1", "--checkpoint-seconds", "3", "--warmup-seconds", "20",
                               torch_default_threads=torch_default_threads)
    check_protected(run, budget, check_resumed(run, steps), cycles)


def test_a_leaking_torch_xla_script_and_a_leaking_lightning_fit_are_both_preempted_before_their_budgets(tmp_path):
    """Done-when 1 and 2, side by side. Both jobs sleep in every step, so that their leak has a
    pace whatever the machine's speed, and a worker waiting for one after the other was idle for
    most of their 330 s (about 90 CPU-s between them, measured here). Each job, its supervisor
    and its daemon are their own, as before; only the waiting is shared."""
    scenarios = {"torch_xla": torch_xla_script, "lightning": lightning_fit}
    for name in scenarios:
        (tmp_path / name).mkdir()
    with ThreadPoolExecutor(len(scenarios)) as pool:
        running = {name: pool.submit(scenario, tmp_path / name) for name, scenario in scenarios.items()}
    failures = [f"{name}: {future.exception()}" for name, future in running.items() if future.exception()]
    assert not failures, "\n\n".join(failures)


def torch_xla_script(tmp_path: Path) -> None:
    """Done-when 1: a plain script with a SIGTERM handler, `supervise`, and the daemon beside it.

    The script's memory, each page once, sits at about 0.57 GiB once torch_xla is up (its resident
    set near 1 GiB counts the libraries' pages too) and leaks at most 12.5 MiB/s (0.08 s steps): B
    leaves it about 75 s, beyond the daemon's 20 s warm-up and 12.8 s to a first verdict. (Counted as
    resident memory, 1.5 GiB left a fresh clone's run 4 s before B, with no room for the save.)
    The leak is in the script, so it refills after every restart (issue 49): long enough for three
    cycles, each signalled before B."""
    protect_script(tmp_path, "leaky_script.py", "--state", steps=3000, budget=int(1.5 * GiB), step_seconds=0.08,
                   cycles=3)


def lightning_fit(tmp_path: Path) -> None:
    """Done-when 2: Lightning's own SIGTERM handling, turned into save-and-exit-42 by the script.

    The step's sleep bounds the leak's rate whatever the machine's speed (at most 20 MiB/s here):
    at 0.03 s a quiet machine leaked 28 MiB/s, filling B 37 s after the start, while the daemon
    judges nothing for the 20 s of warm-up and needs 16 buckets of 8 samples (12.8 s) after it.
    The first signal comes between steps 650 and 750. A run after it as long as the one before
    climbs back to the same memory and is signalled again as it ends: at 1,300 steps a run
    signalled first at step 653 was signalled again at its step 1,300, as Python shut the finished
    job down (a loaded machine, 2026-11-27). So the job stops 1,150 steps in: after a first signal
    at 653 the second run is about 150 steps (130 MiB) short of that point. And a finished job now
    exits at once too: in Python's shutdown a SIGTERM finds the default handler, and kills it.

    The job runs with torch's default thread count, as it was sized, not the suite's one thread
    (tests/conftest.py): with one thread its steps come nearer the 20 MiB/s bound, and the one
    fresh-clone run of it there was signalled 168 MiB below B (not the ~245 seen alone) and some
    job process's kernel peak reached 1,793 MiB, 1.4 MB over B, above every sample of the daemon
    (1,641 MiB at most). At 0.05 s steps it failed 2 of 4 whole-suite runs of 2026-11-27 (a job
    process at 1,846 MiB, a daemon sample at 1,812 MiB, against B = 1,792 MiB), both beside some
    other load: its steps are 0.07 s since, so the leak is at most 14 MiB/s and the daemon's
    seconds to a signal cost less memory. A run at 0.07 s beside three workers still reached
    1,797 MiB after a signal at 1,623 (samples at most 1,642): that last rise was Python's own
    shutdown of the saved job, +120 MiB in its last 20 ms (measured alone at 800 MiB held, the
    1.3 s exit included), so the job exits at once once saved (`gone`)."""
    protect_script(tmp_path, "leaky_lightning.py", "--checkpoint", steps=1150, budget=1331 * MiB,
                   step_seconds=0.07, torch_default_threads=True)  # the 1.75 GiB above, less the ~450 MB of libraries


def test_our_trainer_without_its_watchdog_is_preempted_before_its_budget_and_completes(tmp_path):
    """Done-when 2: `hbm-watchdog train --no-watchdog`; its SIGTERM handler saves a full checkpoint.

    The trainer has no step sleep, so its leak in seconds follows the machine's speed: 1 MiB a step
    is ~24 MiB/s on a quiet machine here (B ~55 s after the start), a few MiB/s under load. Under
    a loaded suite the first signal came at steps 836 and 1,029, 250-330 MB below B (the memory the
    leak grew from, the signal's reading less 1 MiB a step, was 1.0-1.3 GB): 1,400 steps reach the
    signal even from 0.75 GB, and the run after the restart outlives the daemon's warm-up (its
    start-up alone takes longer), so what the restart gave back is measured. (At 1,900 steps one of
    those two runs was signalled twice.)"""
    budget, steps = int(1.75 * GiB), 1400  # 2.25 GiB of resident memory, less the libraries' ~0.5 GB
    ckpt = tmp_path / "ckpt"
    job = [sys.executable, "-m", "watchdog", "--log-format", "json", "train", "--no-watchdog", "--steps", str(steps),
           "--inject-leak", "tensors:1MiB/step", "--checkpoint-dir", str(ckpt), "--resume", "auto",
           "--log-every", "10000"]
    run = watch_supervised_job(tmp_path, job, re.escape(str(ckpt)), budget,
                               "--interval", "0.05", "--checkpoint-seconds", "5", "--warmup-seconds", "15")
    runs = re.findall(rf"train: (.*?): steps (\d+)/{steps} \(this run from (\d+)\)", run.job_stdout)
    assert runs[-1][:2] == ("done", str(steps)) and len(runs) >= 2, run.story()
    assert [int(first) for _, _, first in runs[1:]] == [int(step) for _, step, _ in runs[:-1]], "each run resumed"
    pids = [e["pid"] for e in json_lines(run.job_stderr) if e.get("event") == "child_started"]
    check_protected(run, budget, pids)
