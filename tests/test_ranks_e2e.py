"""Many ranks, one decision: the three hosts a user runs, as two real ranks under torchrun.

Each host (a bare DDP loop with the README's lines, Lightning with `strategy="ddp"`, the Hugging
Face `Trainer`) runs twice, as a user would write it (tests/jobs/ddp_*.py), with DDP over gloo on the
CPU and `torchrun --max-restarts 2`:

- with a leak on rank 0 only (a rank-0-only table of samples): before the agreement, rank 0 acted
  alone and waited in a collective rank 1 never joined, and the job hung with both processes alive;
- as a clean twin: no leak anywhere.

Lightning also runs under its own launcher (`strategy="ddp"` starts rank 1 from rank 0's script),
restarted by `hbm-watchdog supervise`. Each run is started once per suite (`once_per_suite`) and
every test reads its records, logs and exit.
A run still going after its bound is killed and fails the test: a hang never stalls the suite.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import hbm_watchdog_env, once_per_suite, rank_logs, torchrun

pytestmark = pytest.mark.slow

JOBS = Path(__file__).parent / "jobs"
HOSTS = {"bare": "ddp_bare.py", "lightning": "ddp_lightning.py", "huggingface": "ddp_hf.py"}
STEPS = 300  # the leak (4 MiB a step) reaches the budget in about 200 steps: one action, then the run's end
CLEAN_STEPS = 120


class Run:
    def __init__(self, out: Path, outcome: dict):
        self.out, self.returncode, self.output = out, outcome["returncode"], outcome["output"]

    def records(self, rank: int) -> list[dict]:
        import json

        return [json.loads(line) for line in (self.out / f"rank{rank}.jsonl").read_text().splitlines()]

    def actions(self, rank: int) -> list[dict]:
        return [r for r in self.records(rank) if "action" in r]


def steps_done(record: dict) -> int:
    """How far a run got: the bare loop says `finished`, the callbacks' jobs their trainer's step."""
    return record["finished"] if "finished" in record else record["step"]


def _run(tmp_path_factory, name: str, host: str, *args: str) -> Run:
    """A torchrun job, once per suite: a module fixture runs again on every xdist worker that takes
    one of its tests (seen: Lightning's leaky job twice in one run, 40 s each)."""
    def run(out: Path) -> dict:
        completed = torchrun(JOBS / HOSTS[host], out, *args, timeout=300)
        return {"returncode": completed.returncode, "output": completed.stdout}

    return Run(*once_per_suite(tmp_path_factory, f"ranks-{name}-{host}", run))


@pytest.fixture(scope="module", params=sorted(HOSTS))
def leaky(request, tmp_path_factory) -> tuple[str, Run]:
    return request.param, _run(tmp_path_factory, "leaky", request.param, "--leak-rank", "0", "--steps", str(STEPS))


@pytest.fixture(scope="module")
def lightning_launched(tmp_path_factory) -> Run:
    """Lightning's own launcher under `supervise`, with the leak on rank 0."""
    def run(out: Path) -> dict:
        command = [sys.executable, "-m", "watchdog", "--log-format", "json", "supervise", "--max-restarts", "2", "--",
                   sys.executable, str(JOBS / HOSTS["lightning"]), str(out), "--leak-rank", "0", "--steps", str(STEPS)]
        try:
            completed = subprocess.run(command, cwd=out, env=hbm_watchdog_env(USE_TORCH_XLA="0"), capture_output=True,
                                       text=True, timeout=300)
        except subprocess.TimeoutExpired as exc:  # supervise's guard ends the job's group when it is killed
            pytest.fail(f"Lightning's launcher under supervise still running after 300 s: {str(exc.stderr)[-2000:]}")
        return {"returncode": completed.returncode, "output": completed.stderr}  # supervise's own log

    return Run(*once_per_suite(tmp_path_factory, "ranks-lightning-launcher", run))


@pytest.fixture(scope="module", params=sorted(HOSTS))
def clean(request, tmp_path_factory) -> tuple[str, Run]:
    return request.param, _run(tmp_path_factory, "clean", request.param, "--steps", str(CLEAN_STEPS))


def test_every_rank_takes_the_one_action_at_the_same_step_and_the_job_finishes(leaky):
    host, run = leaky
    assert run.returncode == 0, f"{host}: {run.output[-3000:]}"
    (first,), (second,) = run.actions(0), run.actions(1)
    assert first["attempt"] == second["attempt"] == 0
    assert first["step"] == second["step"] and first["action"] == second["action"]
    assert first["action"] in ("checkpoint_reinit", "checkpoint_restart")
    assert first["origin"] == second["origin"] == "asked by rank 0, agreed by all 2 ranks", "rank 1 was told why"
    for rank in (0, 1):
        exits = [r for r in run.records(rank) if "exit" in r or "finished" in r]
        assert [r["attempt"] for r in exits] == [0, 1], "one restart by torchrun, then the run's end"
        assert exits[0].get("exit") == 42 and exits[0]["step"] in (first["step"], first["step"] + 1)
        ended = exits[1]
        assert ended.get("exit", 0) == 0 and steps_done(ended) == STEPS
        assert ended["start"] != 0, "the restart resumed from the checkpoint"


def test_the_leaking_rank_stays_under_its_budget_in_every_attempt(leaky):
    host, run = leaky
    for record in run.records(0):
        if "peak" in record:
            assert record["peak"] < record["limit"], (host, record)


def test_the_rank_that_did_not_ask_logs_the_block_saying_who_did(leaky):
    host, run = leaky
    (acted,) = [r for r in rank_logs(run.out, 1, attempt=0) if r["event"] == "action_outcome"]
    assert acted["origin"] == "asked by rank 0, agreed by all 2 ranks"
    assert "decided" in acted["block"] and "asked by rank 0" in acted["block"]
    joined = [r for r in rank_logs(run.out, 1, attempt=0) if r["event"] == "agreement_joined"]
    assert [(r["rank"], r["ranks"]) for r in joined] == [(1, 2)]


def test_the_run_s_end_reaches_the_policy_so_the_resumed_leak_only_warns(leaky):
    # After the restart the leak starts again from nothing and would fill the budget only past the
    # run's last step (`ending_at` / the callbacks' max_steps): no second action.
    host, run = leaky
    assert [r["attempt"] for r in run.actions(0)] == [0], host


def test_a_clean_twin_is_left_untouched(clean):
    host, run = clean
    assert run.returncode == 0, f"{host}: {run.output[-3000:]}"
    for rank in (0, 1):
        records = run.records(rank)
        assert not [r for r in records if "action" in r], (host, records)
        (ended,) = records
        assert ended["attempt"] == 0 and ended.get("exit", 0) == 0
        assert steps_done(ended) == CLEAN_STEPS


def test_lightning_s_own_launcher_agrees_too_and_supervise_restarts_it(lightning_launched):
    run = lightning_launched
    assert run.returncode == 0, run.output[-3000:]
    (first,), (second,) = run.actions(0), run.actions(1)
    assert first["step"] == second["step"] and first["attempt"] == second["attempt"] == 0
    assert first["origin"] == second["origin"] == "asked by rank 0, agreed by all 2 ranks"
    for rank in (0, 1):
        exits = [r for r in run.records(rank) if "exit" in r]
        assert [(r["attempt"], r["exit"]) for r in exits] == [(0, 42), (1, 0)], "supervise restarted the job once"
        assert exits[1]["step"] == STEPS and exits[1]["start"] == "resumed"
    assert all(r["peak"] < r["limit"] for r in run.records(0) if "peak" in r)
