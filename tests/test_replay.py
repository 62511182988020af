"""Replay: the same detector + policy path as the sidecar, summed up per trace."""

from __future__ import annotations

import random

from watchdog.core.detector import DetectorConfig, LeakDetector
from watchdog.core.policy import ActionPolicy, PolicyConfig
from watchdog.core.replay import ReplayResult, replay, replay_steps
from watchdog.core.sample import Sample
from watchdog.core.verdict import Action, Status

MiB, GiB = 1 << 20, 1 << 30
LIMIT = 16 * GiB


def trace(steps, rate=0, seed=1):
    rng = random.Random(seed)
    return [Sample(s, 1e9 + s, int(8 * GiB + rate * s + 2 * GiB * rng.random()), LIMIT) for s in range(steps)]


def test_leaking_trace_alarms_then_acts_before_the_oom():
    rate = 1 * MiB
    true_oom = (LIMIT - 10 * GiB) // rate  # floor + 2 GiB transient reaches the limit
    result = replay(trace(int(true_oom * 0.95), rate), policy_config=PolicyConfig(checkpoint_margin_steps=50))
    assert result.leak and result.final_verdict.status is Status.LEAKING
    assert result.first_alarm_step is not None and result.first_action_step is not None
    assert result.first_alarm_step <= result.first_action_step <= true_oom - 50
    assert result.first_action is Action.CHECKPOINT_REINIT
    assert abs(result.slope_bytes_per_step - rate) < 0.1 * rate
    assert result.projected_oom_step_at_first_action is not None
    assert result.samples == int(true_oom * 0.95)


def test_clean_trace_has_no_alarm_and_no_projection():
    result = replay(trace(5000))
    assert not result.leak
    assert result.first_alarm_step is None and result.first_action_step is None and result.first_action is None
    assert result.projected_oom_step is None


def test_replay_steps_is_exactly_detector_then_policy_sample_by_sample():
    samples = trace(3000, rate=2 * MiB, seed=4)
    detector, policy = LeakDetector(DetectorConfig(), limit_bytes=LIMIT), ActionPolicy(PolicyConfig())
    expected = []
    for s in samples:
        v = detector.update(s)
        expected.append((v.status, v.projected_oom_step, policy.decide(v)))
    got = [(v.status, v.projected_oom_step, a) for _, v, a in replay_steps(iter(samples))]
    assert got == expected


def test_memory_limit_argument_is_a_budget_below_the_device():
    samples = trace(4000, rate=256 * 1024)
    device = replay(samples)
    budget = replay(samples, memory_limit_bytes=12 * GiB)
    assert budget.final_verdict.limit_bytes == 12 * GiB
    assert budget.first_alarm_step is not None
    assert device.projected_oom_step is None or budget.projected_oom_step < device.projected_oom_step


def test_to_json_carries_the_design_fields():
    row = replay(trace(2000)).to_json()
    for key in ("leak", "first_alarm_step", "first_action_step", "slope_bytes_per_step", "projected_oom_step"):
        assert key in row
    assert isinstance(row["leak"], bool) and isinstance(row["slope_bytes_per_step"], float)


def test_empty_trace_gives_an_empty_result():
    result = replay([])
    assert isinstance(result, ReplayResult) and result.samples == 0 and result.final_verdict is None
