"""The endurance benchmark's short version: the same job and the same assertions as
`hbm-watchdog bench --endurance` (80,000 steps, minutes), on 6,000 steps.

A supervised trainer with a leak a reinit frees and one only a restart frees, and a SIGTERM
preemption at a seeded step: every step completes, none is lost, the watchdog acts before the
budget every time, the preemption restarts the job, and the job file accounts for the time.
"""

from __future__ import annotations

import pytest

from watchdog.bench import endurance
from watchdog.core import goodput

MiB = 1 << 20
STEPS = 6000


@pytest.mark.slow
@pytest.mark.long  # the supervisor and three trainers as processes, about a minute
def test_a_supervised_job_with_leaks_and_a_preemption_completes_every_step_acting_before_the_budget(tmp_path):
    # 50 KiB a step in all: the budget's headroom fills about twice (the 80k run leaks 10 KiB a step)
    result = endurance.endurance(STEPS, preemptions=1, seed=0, folder=tmp_path,
                                 leak_bytes_per_run=(240 * MiB, 60 * MiB))
    assert result["exit_status"] == 0, (tmp_path / "job.log").read_text()[-3000:]
    assert result["steps_completed"] == STEPS and result["steps_lost"] == 0 and result["steps_redone"] == 0
    assert result["actions"].get("checkpoint_reinit", 0) >= 1, result["actions"]
    assert result["preemptions"] == 1 and result["restarts"] >= 1
    assert result["actions_before_budget"] and result["peak_bytes"] < result["budget_bytes"]
    assert 0 < result["goodput"] < 1 and set(result["badput_seconds"]) == set(goodput.CAUSES)
    assert result["badput_seconds"]["reinit"] > 0 and result["badput_seconds"]["checkpoint_restore"] > 0
    assert result["watchdog_memory_growth_bytes"] is not None
    text = endurance.render(result)
    assert f"{STEPS:,} of {STEPS:,} steps completed, 0 lost" in text and "every action before the budget" in text


def test_preemptions_fall_in_the_middle_of_the_run_apart_and_the_same_for_a_seed():
    steps = endurance.preemption_steps(80_000, 3, seed=0)
    assert steps == endurance.preemption_steps(80_000, 3, seed=0) != endurance.preemption_steps(80_000, 3, seed=1)
    assert len(steps) == 3 and all(8_000 <= s < 72_000 for s in steps)
    assert all(b - a >= 8_000 for a, b in zip(steps, steps[1:]))


def test_the_newest_step_is_read_from_the_traces_last_whole_row(tmp_path):
    trace = tmp_path / "trace.csv"
    assert endurance.newest_step(trace) is None
    trace.write_text("step,timestamp,bytes_used,bytes_limit,peak_bytes_used,phase\n0,1.0,5,,,\n15,2.0,5,,,\n20,3")
    assert endurance.newest_step(trace) == 15  # the torn row is still being written
