"""The judge: the one pipeline from a sample to a verdict and an action, with the limit rule and
the reinit feedback it owns."""

from __future__ import annotations

import random

import pytest

from watchdog.core.detector import DetectorConfig, LeakDetector
from watchdog.core.judge import Judge, effective_limit
from watchdog.core.policy import ActionPolicy, PolicyConfig
from watchdog.core.sample import Sample
from watchdog.core.verdict import Action, Status

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
LIMIT = 16 * GiB
BASE = 9 * GiB


def leaking(steps, rate=256 * KiB, limit=LIMIT, seed=0):
    rng = random.Random(seed)
    return [Sample(s, 1.7e9 + 0.5 * s, int(BASE + rate * s + 3 * GiB * rng.random()), limit) for s in range(steps)]


@pytest.mark.parametrize("device, budget, expected", [
    (100, 80, 80), (100, None, 100), (100, 0, 100), (None, 80, 80), (0, 80, 80), (None, None, None), (0, 0, None),
    (80, 100, 80),
])
def test_effective_limit_is_the_smaller_known_one(device, budget, expected):
    assert effective_limit(device, budget) == expected


def test_the_verdict_carries_the_effective_limit():
    budget = 12 * GiB
    assert Judge(memory_limit_bytes=budget).judge(Sample(1, 0.0, GiB, LIMIT))[0].limit_bytes == budget
    assert Judge(memory_limit_bytes=64 * GiB).judge(Sample(1, 0.0, GiB, LIMIT))[0].limit_bytes == LIMIT
    assert Judge(memory_limit_bytes=budget).judge(Sample(1, 0.0, GiB, None))[0].limit_bytes == budget
    assert Judge().judge(Sample(1, 0.0, GiB, None))[0].limit_bytes is None


def test_a_device_limit_that_changes_mid_run_moves_the_projection():
    """The limit is re-read from every sample: a smaller one brings the projected OOM forward at once."""
    samples = leaking(9000)
    judge = Judge()
    before = [judge.judge(s)[0] for s in samples][-1]
    step, t = samples[-1].step + 1, samples[-1].timestamp + 0.5
    after, _ = judge.judge(Sample(step, t, samples[-1].bytes_used, LIMIT - GiB))
    assert before.limit_bytes == LIMIT and after.limit_bytes == LIMIT - GiB
    assert judge.limit_bytes == LIMIT - GiB
    assert after.projected_oom_step == pytest.approx(before.projected_oom_step - GiB / (256 * KiB), abs=300)


def test_the_judge_is_the_detector_then_the_policy_sample_by_sample():
    samples = leaking(6000, rate=1 * MiB, seed=3)
    detector, policy = LeakDetector(DetectorConfig(), limit_bytes=LIMIT), ActionPolicy(PolicyConfig())
    expected = [(v, policy.decide(v)) for v in map(detector.update, samples)]
    judge = Judge()
    got = [judge.judge(s) for s in samples]
    assert got == expected
    assert any(action.needs_checkpoint for _, action in got)


def test_a_reinit_that_brought_memory_down_starts_a_new_baseline():
    judge = Judge(policy_config=PolicyConfig(cooldown_steps=0))
    for sample in leaking(6000, rate=1 * MiB):
        verdict, _ = judge.judge(sample)
    recovery = judge.reinit_finished(BASE)
    assert recovery is not None and recovery.recovered
    assert recovery.recovered_bytes == pytest.approx(verdict.floor_bytes - BASE)
    after, _ = judge.judge(Sample(6000, 1.7e9 + 3000, BASE, LIMIT))
    assert after.status is Status.WARMING_UP


def test_a_reinit_that_freed_nothing_keeps_the_history_and_escalates_to_a_restart():
    judge = Judge(policy_config=PolicyConfig(cooldown_steps=0, confirm_verdicts=1))
    samples = leaking(8000, rate=1 * MiB)
    actions = []
    for sample in samples[:5000]:
        actions.append(judge.judge(sample)[1])
    assert Action.CHECKPOINT_REINIT in actions
    recovery = judge.reinit_finished(samples[4999].bytes_used)
    assert recovery is not None and not recovery.recovered
    later = [judge.judge(s) for s in samples[5000:]]
    assert later[0][0].status is not Status.WARMING_UP  # history kept
    assert any(action is Action.CHECKPOINT_RESTART for _, action in later)
    assert 1 <= judge.restarts_so_far <= PolicyConfig().max_restarts


def test_no_floor_yet_means_no_recovery_to_measure():
    assert Judge().reinit_finished(GiB) is None


def test_a_restarted_process_starts_a_new_baseline_and_a_new_policy_clock():
    """Steps count again from the new process: a cooldown left from the old one must not silence it,
    while the restarts so far carry over."""
    judge = Judge(policy_config=PolicyConfig(cooldown_steps=5000, prefer_restart=True, max_restarts=10))
    samples = leaking(6000, rate=1 * MiB)
    judged = [judge.judge(s) for s in samples]
    actions = [a for _, a in judged]
    first = actions.index(Action.CHECKPOINT_RESTART)
    floor_before = judged[first][0].floor_bytes  # the floor the restart was asked at
    assert judge.restarts_so_far == 1

    judge.restarted()
    assert judge.latest is None and judge.restarts_so_far == 1
    again = [judge.judge(s) for s in samples[:first + 1]]  # the new process leaks the same way
    assert again[0][0].status is Status.WARMING_UP
    assert [a for _, a in again].count(Action.CHECKPOINT_RESTART) == 1, "the old cooldown was carried over"
    assert judge.restarts_so_far == 2

    recovery = judge.restart_settled(BASE)
    assert recovery == (floor_before, float(BASE), True)
    assert judge.restart_settled(BASE) is None, "measured once per restart"


def test_a_restart_before_any_floor_has_nothing_to_measure_and_one_that_freed_nothing_says_so():
    judge = Judge()
    judge.restarted()
    assert judge.restart_settled(GiB) is None
    for sample in leaking(3000):
        judge.judge(sample)
    floor = judge.latest.floor_bytes
    judge.restarted()
    recovery = judge.restart_settled(floor + MiB)
    assert recovery is not None and not recovery.recovered and recovery.recovered_bytes == -MiB


def test_a_restart_is_measured_against_the_floor_its_action_was_taken_at_not_the_teardown():
    """Between the signal and its exit a job stops growing and frees memory as it tears down; a
    verdict on those samples describes the teardown. Seen with Lightning under `watch`: the floor
    'before' read 0.86 GB for a job signalled at 1.6 GB, so its restart looked like a loss."""
    judge = Judge(policy_config=PolicyConfig(prefer_restart=True, max_restarts=10))
    samples = leaking(6000, rate=1 * MiB)
    for sample in samples:
        verdict, action = judge.judge(sample)
        if action is Action.CHECKPOINT_RESTART:
            break
    at_action = verdict.floor_bytes
    step, t = sample.step, sample.timestamp
    for k in range(1, 400):  # the job saves and tears down: memory falls far below that floor
        judge.judge(Sample(step + k, t + 0.5 * k, BASE // 2, LIMIT))
    assert judge.latest.floor_bytes < at_action - GiB
    judge.restarted()
    recovery = judge.restart_settled(BASE)
    assert recovery is not None and recovery.floor_before_bytes == at_action and recovery.recovered
