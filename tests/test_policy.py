"""The action ladder: hysteresis, the action horizon, the quiet period while an action is carried out, escalation
to restart, the restart budget."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from watchdog.core.errors import ConfigError
from watchdog.core.policy import ActionPolicy, PolicyConfig
from watchdog.core.verdict import Action, Status, Verdict

GiB = 1 << 30


def verdict(step, status=Status.OOM_PROJECTED, projected_oom_steps=100.0, floor=10 * GiB, slope=1 << 20, window=1000.0):
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


def test_a_leak_reported_with_no_oom_projected_is_never_acted_on():
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, checkpoint_margin_steps=10, cooldown_steps=100))
    reported = [verdict(10 + i, Status.SUSPECT, projected_oom_steps=50.0)._replace(leak_detected=True)
                for i in range(150)]
    assert set(run(policy, reported)) == {Action.NONE}  # even with the OOM "50 steps" off: not the action path


def watched(policy, until, every=10):
    """Healthy verdicts every `every` steps up to `until`: what a sidecar sampling every 10 steps gives."""
    run(policy, [verdict(s, Status.HEALTHY) for s in range(0, until, every)])


def test_action_horizon_grows_with_the_steps_watched():
    config = PolicyConfig(confirm_verdicts=1, checkpoint_margin_steps=10, lead_factor=4, horizon_fraction=0.5)
    policy = ActionPolicy(config)
    watched(policy, 10_000)
    assert policy.action_horizon_steps(0) == 40 + 10  # four margins, and the gap between two verdicts
    assert policy.action_horizon_steps(10_000) == 5_000  # half the run watched so far
    assert policy.decide(verdict(10_000, projected_oom_steps=4_000.0, window=8_000)) is Action.CHECKPOINT_REINIT


# ---------------------------------------------------------- a first steep ramp is treated with caution

def test_a_first_steep_ramp_gets_a_warning_not_a_checkpoint_unless_imminent():
    # An evaluation that keeps its outputs climbs like a leak: seen over 300 steps, the OOM 1,000 ahead.
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, checkpoint_margin_steps=50, cooldown_steps=500))
    watched(policy, 10_000)
    ramp = [verdict(s, projected_oom_steps=1_000.0 - (s - 10_000), window=300.0) for s in range(10_000, 10_400, 10)]
    actions = run(policy, ramp)
    assert actions[0] is Action.WARN and not any(a.needs_checkpoint for a in actions)
    # Without the caution, the horizon (a quarter of 10,000 steps watched) would have taken it.
    assert policy.action_horizon_steps(10_000) == 2_500
    # Once it is imminent (four checkpoint margins, plus one gap between verdicts), it is acted on.
    assert policy.decide(verdict(10_400, projected_oom_steps=200.0, window=700.0)) is Action.CHECKPOINT_REINIT


def test_a_first_ramp_seen_for_twice_as_long_as_it_projects_is_acted_on():
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, checkpoint_margin_steps=50))
    watched(policy, 10_000)
    assert policy.decide(verdict(10_000, projected_oom_steps=2_000.0, window=3_000.0)) is Action.WARN
    assert policy.decide(verdict(10_010, projected_oom_steps=2_000.0, window=4_000.0)) is Action.CHECKPOINT_REINIT


def test_after_a_first_checkpoint_the_usual_horizon_applies_until_a_reinit_starts_a_new_baseline():
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, checkpoint_margin_steps=50, cooldown_steps=0))
    watched(policy, 10_000)
    assert policy.decide(verdict(10_000, projected_oom_steps=100.0, window=50.0)) is Action.CHECKPOINT_REINIT
    young = verdict(10_010, projected_oom_steps=2_000.0, window=300.0)  # the growth is known real now
    assert policy.decide(young) is Action.CHECKPOINT_REINIT
    policy.rearm()  # a reinit brought memory down: the detector starts over, and so does the caution
    assert policy.decide(young._replace(step=10_020)) is Action.WARN


def test_a_gap_between_verdicts_makes_an_oom_within_it_imminent():
    # Samples that arrive hours apart (missing data): an OOM that could fall between two is imminent.
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, checkpoint_margin_steps=10))
    run(policy, [verdict(0, Status.HEALTHY), verdict(3_000, Status.HEALTHY)])
    assert policy.decide(verdict(3_010, projected_oom_steps=2_500.0, window=100.0)) is Action.CHECKPOINT_REINIT


def test_pessimistic_projection_decides_not_the_central_one():
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, checkpoint_margin_steps=10))
    near = Verdict(step=5, timestamp=0.0, status=Status.OOM_PROJECTED, projected_oom_steps=1e6, projected_oom_steps_pessimistic=20.0)
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


def test_a_reinit_this_policy_did_not_ask_for_teaches_it_nothing():
    # Another rank's action, agreed across ranks: this rank rebuilt with nothing of its own to free.
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, cooldown_steps=0, max_restarts=3))
    assert policy.reinit_finished(floor_before_bytes=10 * GiB, floor_after_bytes=10 * GiB)
    assert policy.decide(verdict(2, projected_oom_steps=10.0)) is Action.CHECKPOINT_REINIT, "no escalation"
    # ... and its own next reinit is judged as usual
    assert not policy.reinit_finished(floor_before_bytes=10 * GiB, floor_after_bytes=10 * GiB)
    assert policy.decide(verdict(3, projected_oom_steps=10.0)) is Action.CHECKPOINT_RESTART


def test_reinit_that_freed_the_growth_keeps_reinit():
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, cooldown_steps=0))
    policy.decide(verdict(1, projected_oom_steps=10.0, slope=1 << 20, window=1000))  # ~1 GiB grown before the action
    assert policy.reinit_finished(floor_before_bytes=10 * GiB, floor_after_bytes=9 * GiB)
    assert policy.decide(verdict(2, projected_oom_steps=10.0)) is Action.CHECKPOINT_REINIT


def test_a_restart_is_asked_for_whatever_the_budget_and_the_policy_counts_none():
    """Past the budget a reinit could not help (a restart was wanted): the restart is asked for, and
    the hand-over stops the job instead (exit 45, tests/test_cycles.py). The budget is counted once,
    by `RunState` (tests/test_sidecar.py), never by the policy."""
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, cooldown_steps=0, prefer_restart=True, max_restarts=0))
    assert policy.decide(verdict(1, projected_oom_steps=10.0)) is Action.CHECKPOINT_RESTART
    assert policy.decide(verdict(2, projected_oom_steps=10.0)) is Action.CHECKPOINT_RESTART
    assert not any("restart" in name for name in vars(policy)), "a second restart counter"


def test_healthy_and_suspect_verdicts_never_act():
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1))
    for status in (Status.WARMING_UP, Status.HEALTHY, Status.SUSPECT):
        assert run(policy, [verdict(i, status, projected_oom_steps=0.0) for i in range(5)]) == [Action.NONE] * 5


@pytest.mark.parametrize("field, value", [("checkpoint_margin_steps", -1), ("max_restarts", -1),
                                          ("confirm_verdicts", 0), ("horizon_fraction", math.nan),
                                          ("min_recovery", 2.0), ("first_ramp_reach", -1.0), ("last_step", -1),
                                          ("restart_window_steps", -1)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"policy.{field}"):
        PolicyConfig(**{field: value})


def test_a_reinit_that_gave_nothing_back_is_followed_by_a_restart_without_waiting_out_the_cooldown():
    """Seen in `train --spmd --inject-leak global:4MiB/step`: the reinit at step 302 freed nothing,
    and the restart waited out the 150-step cooldown while the leak grew 600 MiB, to 3 MiB of B."""
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, checkpoint_margin_steps=10, cooldown_steps=150))
    watched(policy, 1_000)
    assert policy.decide(verdict(1_000, projected_oom_steps=30.0, window=500.0)) is Action.CHECKPOINT_REINIT
    assert not policy.reinit_finished(floor_before_bytes=2e9, floor_after_bytes=2e9)
    assert policy.decide(verdict(1_005, projected_oom_steps=25.0, window=500.0)) is Action.CHECKPOINT_RESTART


def test_with_the_restart_budget_spent_a_reinit_that_gave_nothing_back_is_never_followed_by_another():
    """Seen in `bench --endurance`: with the budget spent, a reinit that freed too little was followed
    by another every sample (15 steps apart), five in a row; then a cooldown held the next one back.
    Another reinit could not help: a restart is asked for at once, which the hand-over turns into a
    stop past the budget (exit 45)."""
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, checkpoint_margin_steps=10, cooldown_steps=150,
                                       max_restarts=3))
    watched(policy, 1_000)
    assert policy.decide(verdict(1_000, projected_oom_steps=30.0, window=500.0)) is Action.CHECKPOINT_REINIT
    assert not policy.reinit_finished(floor_before_bytes=2e9, floor_after_bytes=2e9)
    assert policy.decide(verdict(1_015, projected_oom_steps=25.0, window=500.0)) is Action.CHECKPOINT_RESTART


def test_a_reinit_that_leaves_more_behind_than_the_previous_one_escalates_to_a_restart():
    """Two leaks, one in the state and one outside it: each reinit frees the first, and what it
    leaves rises by the second. Seen in `bench --endurance` as nine reinits ratcheting toward the budget."""
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, checkpoint_margin_steps=10, cooldown_steps=150))
    watched(policy, 1_000)
    assert policy.decide(verdict(1_000, projected_oom_steps=30.0, window=500.0, slope=100_000)) is Action.CHECKPOINT_REINIT
    assert policy.reinit_finished(floor_before_bytes=1.1e9, floor_after_bytes=1.0e9)  # freed 100 MB
    assert policy.decide(verdict(2_000, projected_oom_steps=30.0, window=500.0, slope=100_000)) is Action.CHECKPOINT_REINIT
    assert not policy.reinit_finished(floor_before_bytes=1.07e9, floor_after_bytes=1.03e9)  # +30 MB left, 40 freed
    assert policy.decide(verdict(2_005, projected_oom_steps=25.0, window=500.0, slope=100_000)) is Action.CHECKPOINT_RESTART


def test_reinits_that_leave_the_same_behind_are_no_ratchet():
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, checkpoint_margin_steps=10, cooldown_steps=150))
    watched(policy, 1_000)
    for step, after in ((1_000, 1.0e9), (2_000, 1.005e9), (3_000, 1.004e9)):
        assert policy.decide(verdict(step, projected_oom_steps=30.0, window=500.0, slope=100_000)) is Action.CHECKPOINT_REINIT
        assert policy.reinit_finished(floor_before_bytes=after + 1e8, floor_after_bytes=after)


def test_an_oom_projected_past_the_runs_last_step_is_a_warning_not_a_checkpoint():
    """Seen in `bench --endurance`: a restart 133 steps before the end of an 80,000-step run,
    against an OOM projected 2,777 steps past it."""
    ends = PolicyConfig(confirm_verdicts=1, checkpoint_margin_steps=10, cooldown_steps=150, last_step=80_000)
    policy = ActionPolicy(ends)
    watched(policy, 79_800)
    assert policy.decide(verdict(79_867, projected_oom_steps=300.0, window=2_000.0)) is Action.WARN
    policy = ActionPolicy(ends)
    watched(policy, 79_500)
    assert policy.decide(verdict(79_600, projected_oom_steps=300.0, window=2_000.0)) is Action.CHECKPOINT_REINIT
    unknown = ActionPolicy(replace(ends, last_step=None))  # a host that does not know where the run ends
    watched(unknown, 79_800)
    assert unknown.decide(verdict(79_867, projected_oom_steps=300.0, window=2_000.0)) is Action.CHECKPOINT_REINIT


def test_memory_at_the_limit_is_acted_on_however_near_the_runs_end():
    policy = ActionPolicy(PolicyConfig(last_step=1_000))
    assert policy.limit_reached(verdict(999, projected_oom_steps=0.0)) is Action.CHECKPOINT_REINIT


def test_a_reinit_that_worked_ends_the_quiet_period_so_the_leak_growing_back_is_acted_on_again():
    """Seen on an H100: the leak, still in the code, refilled after the reinit at step 301 and hit a
    real OOM at step 797, four steps before a 500-step cooldown ended. Once the rebuild's effect is
    measured, the next projected OOM is acted on as the first one was."""
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, checkpoint_margin_steps=10, cooldown_steps=500))
    watched(policy, 1_000)
    assert policy.decide(verdict(1_000, projected_oom_steps=30.0, window=500.0)) is Action.CHECKPOINT_REINIT
    assert policy.carrying_out == 1_000
    assert policy.decide(verdict(1_005, projected_oom_steps=25.0, window=500.0)) is Action.NONE, "still being carried out"
    assert policy.reinit_finished(floor_before_bytes=2e9, floor_after_bytes=1e9)
    assert policy.carrying_out is None
    policy.observe(1_010)
    assert policy.decide(verdict(1_300, projected_oom_steps=30.0, window=250.0)) is Action.CHECKPOINT_REINIT, \
        "the second cycle waited out a cooldown"
    assert policy.limit_reached(verdict(1_301, projected_oom_steps=0.0)) is Action.NONE  # the second being carried out
    assert policy.reinit_finished(floor_before_bytes=2e9, floor_after_bytes=1e9)
    assert policy.limit_reached(verdict(1_302, projected_oom_steps=0.0)) is Action.CHECKPOINT_REINIT, "the limit rule waited"


def test_an_action_whose_effect_is_never_measured_holds_the_next_for_the_cooldown_only():
    """A loop that takes the action and never says it rebuilt (or a replayed trace): the cooldown is
    the bound, so the job is protected again once it has passed."""
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=1, cooldown_steps=100))
    assert policy.limit_reached(verdict(0, projected_oom_steps=0.0)) is Action.CHECKPOINT_REINIT
    assert policy.limit_reached(verdict(99, projected_oom_steps=0.0)) is Action.NONE
    assert policy.carrying_out == 0
    assert policy.limit_reached(verdict(100, projected_oom_steps=0.0)) is Action.CHECKPOINT_REINIT


def test_the_limit_rule_acts_at_once_then_keeps_the_cooldown_and_the_restart_budget():
    """`limit_reached`: memory at the limit is no projection to confirm or doubt (no confirmation, no
    horizon, no first-ramp caution), but it is one checkpoint action per cooldown, never a storm."""
    policy = ActionPolicy(PolicyConfig(confirm_verdicts=5, cooldown_steps=100, prefer_restart=True, max_restarts=1))
    at_limit = [verdict(step, projected_oom_steps=0.0, window=0.0) for step in range(250)]
    actions = [policy.limit_reached(v) for v in at_limit]
    acted = {step: action for step, action in enumerate(actions) if action is not Action.NONE}
    assert acted == {0: Action.CHECKPOINT_RESTART, 100: Action.CHECKPOINT_RESTART, 200: Action.CHECKPOINT_RESTART}
    # past the budget (RunState's count), each is handed over as a stop (exit 45)
