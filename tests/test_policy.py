"""The action ladder: hysteresis, the action horizon, cooldown, escalation to restart, the restart budget."""

from __future__ import annotations

import math

import pytest

from watchdog.core.errors import ConfigError
from watchdog.core.policy import ActionPolicy, PolicyConfig
from watchdog.core.verdict import Action, Status, Verdict

GiB = 1 << 30


def verdict(step, status=Status.LEAKING, projected_oom_steps=100.0, floor=10 * GiB, slope=1 << 20, window=1000.0):
    return Verdict(step=step, timestamp=float(step), status=status, floor_bytes=floor, slope_bytes_per_step=slope,
                   projected_oom_steps=projected_oom_steps, projected_oom_steps_pessimistic=projected_oom_steps, window_steps=window)


def run(policy, verdicts):
    return [policy.decide(v) for v in verdicts]


def leaking_from(step, count, **kw):
    return [verdict(step + i, **kw) for i in range(count)]


def test_one_noisy_verdict_never_acts():
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=3))
    actions = run(policy, [verdict(1), verdict(2), verdict(3, Status.HEALTHY), verdict(4), verdict(5)])
    assert actions == [Action.NONE] * 5  # the healthy verdict restarts the count


def test_confirmed_leak_near_oom_asks_for_a_checkpoint_and_reinit():
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=3, checkpoint_margin_steps=50))
    actions = run(policy, leaking_from(10, 3, projected_oom_steps=150.0))
    assert actions == [Action.NONE, Action.NONE, Action.CHECKPOINT_REINIT]


def test_leak_with_oom_far_away_only_warns_once_per_cooldown():
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, checkpoint_margin_steps=10, cooldown_steps=100))
    actions = run(policy, leaking_from(10, 150, projected_oom_steps=1e6))
    assert actions.count(Action.WARN) == 2  # at step 10 and again at step 110
    assert actions[0] is Action.WARN and actions[100] is Action.WARN
    assert not any(a.needs_checkpoint for a in actions)


def test_action_horizon_grows_with_the_steps_watched():
    config = PolicyConfig(confirm_verdicts=1, checkpoint_margin_steps=10, lead_factor=4, horizon_fraction=0.5)
    policy = ActionPolicy(config)
    assert policy.decide(verdict(0, Status.HEALTHY)) is Action.NONE
    assert policy.action_horizon_steps(0) == 40  # four margins
    assert policy.action_horizon_steps(10_000) == 5_000  # half the run watched so far
    assert policy.decide(verdict(10_000, projected_oom_steps=4_000.0)) is Action.CHECKPOINT_REINIT


def test_pessimistic_projection_decides_not_the_central_one():
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, checkpoint_margin_steps=10))
    near = Verdict(step=5, timestamp=0.0, status=Status.LEAKING, projected_oom_steps=1e6, projected_oom_steps_pessimistic=20.0)
    assert policy.decide(near) is Action.CHECKPOINT_REINIT


def test_cooldown_after_an_action():
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, cooldown_steps=200))
    actions = run(policy, leaking_from(0, 400, projected_oom_steps=10.0))
    acted = [i for i, a in enumerate(actions) if a.needs_checkpoint]
    assert acted == [0, 200]


def test_reinit_that_did_not_bring_the_floor_down_escalates_to_restart():
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, cooldown_steps=0, max_restarts=3))
    assert policy.decide(verdict(1, projected_oom_steps=10.0)) is Action.CHECKPOINT_REINIT
    assert not policy.reinit_finished(floor_before_bytes=10 * GiB, floor_after_bytes=10 * GiB)  # leak survived
    assert policy.decide(verdict(2, projected_oom_steps=10.0)) is Action.CHECKPOINT_RESTART
    assert policy.restarts_so_far == 1


def test_reinit_that_freed_the_growth_keeps_reinit():
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, cooldown_steps=0))
    policy.decide(verdict(1, projected_oom_steps=10.0, slope=1 << 20, window=1000))  # ~1 GiB grown before the action
    assert policy.reinit_finished(floor_before_bytes=10 * GiB, floor_after_bytes=9 * GiB)
    assert policy.decide(verdict(2, projected_oom_steps=10.0)) is Action.CHECKPOINT_REINIT


def test_restart_budget_counts_earlier_restarts_and_falls_back_to_reinit():
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, cooldown_steps=0, prefer_restart=True, max_restarts=2),
                          restarts_so_far=1)
    assert policy.decide(verdict(1, projected_oom_steps=10.0)) is Action.CHECKPOINT_RESTART
    assert policy.decide(verdict(2, projected_oom_steps=10.0)) is Action.CHECKPOINT_REINIT  # budget spent: still save
    assert policy.restarts_so_far == 2


def test_healthy_and_suspect_verdicts_never_act():
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1))
    for status in (Status.WARMING_UP, Status.HEALTHY, Status.SUSPECT):
        assert run(policy, [verdict(i, status, projected_oom_steps=0.0) for i in range(5)]) == [Action.NONE] * 5


@pytest.mark.parametrize("field, value", [("checkpoint_margin_steps", -1), ("max_restarts", -1),
                                          ("confirm_verdicts", 0), ("horizon_fraction", math.nan),
                                          ("min_recovery", 2.0)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"policy.{field}"):
        PolicyConfig(**{field: value})
