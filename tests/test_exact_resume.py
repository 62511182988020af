"""A run interrupted by a reinit, a restart and a preemption ends where the same run without them ends.

Under `hbm-watchdog supervise`, as a user runs it: a reinit in process, a restart (exit 42, a new
process) and a SIGTERM from outside (the cluster preempting the job: it saves at the step boundary
and exits 42), against the same command with none of them. The data order, the RNG states, the
optimizer and the LR schedule must all come back for the final parameters, optimizer state and
every step's loss to be equal; on the CPU device the trainer is bit-for-bit reproducible, so
they are compared exactly.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
import torch

from conftest import REPO, hbm_watchdog_env, json_lines, python
from watchdog.actions.checkpoint import CheckpointManager
from watchdog.core import goodput

pytestmark = [pytest.mark.slow, pytest.mark.long]  # it starts the trainer and the supervisor as processes, for a minute or more

STEPS = 1200
# One thread per trainer, in both runs: a tiny model gains nothing from more, and two of them on a
# 2-core machine shared with other tests otherwise thrash (4x slower here).
ENV = hbm_watchdog_env(OMP_NUM_THREADS="1")
REINIT_AT, RESTART_AT, PREEMPT_AFTER = 300, 600, 900


def train_command(checkpoints, *extra: str) -> list[str]:
    return [sys.executable, "-m", "watchdog", "--log-format", "json", "train", "--device", "cpu",
            "--steps", str(STEPS), "--log-every", "1", "--no-watchdog",
            "--checkpoint-dir", str(checkpoints), "--depth", "1", "--width", "32", *extra]


def supervised(command: list[str], output, job_file) -> subprocess.Popen:
    """The supervisor and its children write to files: a pipe nobody reads while the test waits for a
    step would fill and stop the trainer."""
    return subprocess.Popen([sys.executable, "-m", "watchdog", "supervise", "--max-restarts", "3", "--backoff", "0",
                             "--job-file", str(job_file), "--", *command], stdout=output, stderr=subprocess.STDOUT, cwd=REPO, env=ENV)


def losses(log: str) -> dict[int, float]:
    """Every step's loss from the JSON progress lines; a step logged twice must log the same loss."""
    seen: dict[int, float] = {}
    for record in json_lines(log):
        if record.get("event") == "train_progress":
            step, loss = record["step"], record["loss"]
            assert seen.setdefault(step, loss) == loss, f"step {step} gave {loss} after {seen[step]}"
    return seen


def _is_trainer(process: psutil.Process) -> bool:
    try:
        return "train" in process.cmdline()
    except psutil.Error:  # exited (a zombie until the supervisor reaps it): not one to signal
        return False


def preempt_when_past(job: subprocess.Popen, checkpoints, step: int, timeout: float = 300) -> None:
    """SIGTERM to the trainer (the supervisor's child), as a cluster preempting it would send, once
    its checkpoints show it past `step`."""
    deadline = time.monotonic() + timeout
    supervisor = psutil.Process(job.pid)
    while time.monotonic() < deadline:
        if job.poll() is not None:
            raise AssertionError(f"the job ended (status {job.returncode}) before step {step}")
        latest = CheckpointManager(checkpoints).latest_step()
        trainers = [child for child in supervisor.children() if _is_trainer(child)]
        if trainers and latest is not None and latest >= step:
            trainers[0].terminate()
            return
        time.sleep(0.05)
    raise AssertionError(f"the trainer never passed step {step}")


def test_a_run_with_a_reinit_a_restart_and_a_preemption_ends_bit_for_bit_where_one_without_them_ends(tmp_path):
    straight = python(train_command(tmp_path / "straight")[1:], env=ENV, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]

    interrupted_dir = tmp_path / "interrupted"
    log_path = tmp_path / "interrupted.log"
    with open(log_path, "wb") as output:
        job = supervised(train_command(interrupted_dir, "--force-action", f"reinit@{REINIT_AT}",
                                       "--force-action", f"restart@{RESTART_AT}", "--checkpoint-every", "100"), output,
                         tmp_path / "job.jsonl")
        try:
            preempt_when_past(job, interrupted_dir, PREEMPT_AFTER)
            job.wait(timeout=600)
        finally:
            job.kill()
    stderr = log_path.read_text()
    assert job.returncode == 0, stderr[-3000:]

    records = json_lines(stderr)
    events = [r["event"] for r in records]
    assert events.count("reinitialised") >= 1 and events.count("preempted") == 1, events
    resumed = [r["step"] for r in records if r["event"] == "resumed"]
    assert len(resumed) == 2 and resumed[0] == RESTART_AT + 1 and resumed[1] > PREEMPT_AFTER, resumed

    a = CheckpointManager(tmp_path / "straight").load_latest()
    b = CheckpointManager(interrupted_dir).load_latest()
    assert a["step"] == b["step"] == STEPS and a["data_position"] == b["data_position"]
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for index, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["optimizer"]["state"][index][name])), (index, name)
    assert a["scheduler"] == b["scheduler"]
    # two restarts, one the watchdog's (forced) and one a preemption: the watchdog's budget counts one
    assert (b["watchdog"]["restarts_so_far"], b["watchdog"]["watchdog_restarts"]) == (2, 1)
    straight_losses, interrupted_losses = losses(straight.stderr), losses(stderr)
    assert len(straight_losses) == STEPS and interrupted_losses == straight_losses

    # Where the job's time went, across its three processes: every step kept once, none redone
    # (every interruption saved at its step boundary), and the time adds up.
    account = goodput.account(goodput.read(tmp_path / "job.jsonl"))
    assert (account.processes, account.reinits, account.steps_kept, account.steps_redone) == (3, 1, STEPS, 0)
    assert [a.kind for a in account.actions] == ["checkpoint_reinit", "checkpoint_restart"]
    assert account.ended == "done" and 0 < account.goodput < 1
    badput = account.badput_seconds
    assert badput["startup"] > 0 and badput["checkpoint_save"] > 0 and badput["checkpoint_restore"] > 0
    assert badput["reinit"] > 0 and badput["disruption"] > 0 and badput["redone"] == 0
    assert "goodput: " in stderr  # supervise printed it at the end
