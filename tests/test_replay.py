"""Replay: the same detector + policy path as the sidecar, summed up per trace."""

from __future__ import annotations

import random
from dataclasses import replace

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
    assert result.leak_reported and result.final_verdict.status is Status.OOM_PROJECTED
    assert result.first_leak_report_step is not None and result.first_action_step is not None
    assert result.first_leak_report_step <= result.first_action_step <= true_oom - 50
    assert result.first_action is Action.CHECKPOINT_REINIT
    assert abs(result.slope_bytes_per_step - rate) < 0.1 * rate
    assert result.projected_oom_step_at_first_action is not None
    assert result.samples == int(true_oom * 0.95)


def test_clean_trace_has_no_alarm_and_no_projection():
    result = replay(trace(5000))
    assert not result.leak_reported
    assert result.first_leak_report_step is None and result.first_action_step is None and result.first_action is None
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
    assert budget.first_leak_report_step is not None
    assert device.projected_oom_step is None or budget.projected_oom_step < device.projected_oom_step


def test_to_json_carries_the_design_fields():
    row = replay(trace(2000)).to_json()
    for key in ("ended", "leak_reported", "first_leak_report_step", "leak_report_spans", "oom_projected",
                "first_oom_projected_step", "first_action_step", "slope_bytes_per_step", "projected_oom_step"):
        assert key in row
    assert isinstance(row["leak_reported"], bool) and isinstance(row["slope_bytes_per_step"], float)


def test_empty_trace_gives_an_empty_result():
    result = replay([])
    assert isinstance(result, ReplayResult) and result.samples == 0 and result.final_verdict is None


def _judged_both_ways(samples, **judge_args):
    """(judge's result, judge_quietly's result) for every sample, from two judges fed alike."""
    from watchdog.core.judge import Judge

    full, quiet = Judge(**judge_args), Judge(**judge_args)
    pairs = [(full.judge(s), quiet.judge_quietly(s)) for s in samples]
    assert full.latest == quiet.latest, "the verdict judge_quietly skipped is the one judge built"
    return pairs


def _check_quiet_is_judge(pairs) -> int:
    quiet = 0
    for (verdict, action), got in pairs:
        if got is None:
            quiet += 1
            assert verdict.status is not Status.OOM_PROJECTED and action is Action.NONE
        else:
            assert got == (verdict, action)
    return quiet


def test_judging_quietly_gives_every_verdict_and_action_judge_gives_on_the_bench_corpus(synthetic_corpus_0):
    """replay()'s hot loop builds no verdict while no alarm is up; nothing else may change."""
    import dataclasses

    traces = synthetic_corpus_0[::4]  # every family, leaks and hard negatives, phase labels included
    assert any(s.phase for t in traces for s in t.samples)
    quiet = total = 0
    for t in traces:
        policy = dataclasses.replace(PolicyConfig(), checkpoint_margin_steps=t.checkpoint_margin_steps)
        pairs = _judged_both_ways(t.samples, policy_config=policy, memory_limit_bytes=t.limit_bytes)
        quiet += _check_quiet_is_judge(pairs)
        total += len(pairs)
        result = replay(t.samples, memory_limit_bytes=t.limit_bytes, policy_config=policy)
        alarms = [v.step for (v, _), _ in pairs if v.status is Status.OOM_PROJECTED]
        reports = [v.step for (v, _), _ in pairs if v.leak_detected]
        actions = [(v.step, a) for (v, a), _ in pairs if a.needs_checkpoint]
        assert result.first_oom_projected_step == (alarms[0] if alarms else None)
        assert result.first_leak_report_step == (reports[0] if reports else None)  # the leak report's
        assert result.leak_reported == bool(reports) and result.oom_projected == bool(alarms)
        assert (result.first_action_step, result.first_action) == (actions[0] if actions else (None, None))
    assert 0.5 * total < quiet < total  # most samples are quiet, and some are not


def test_judging_quietly_follows_limit_changes_restarts_and_phases():
    samples = trace(3000, rate=2 * MiB, seed=5)
    limit_moves = [replace(s, bytes_limit=LIMIT - GiB) if s.step > 1500 else s for s in samples]
    restarted = samples[:2000] + trace(2500, rate=2 * MiB, seed=6)  # steps go back: a new process
    phased = [replace(s, phase="eval/200") if 1000 <= s.step < 1200 else s for s in samples]
    for case in (limit_moves, restarted, phased):
        pairs = _judged_both_ways(case, policy_config=PolicyConfig(checkpoint_margin_steps=50))
        assert 0 < _check_quiet_is_judge(pairs) < len(pairs)


# ---- every reader stays linear, whatever the input names (issue 64) -------------------------------

def _named(rows: int, name_of) -> list[Sample]:
    """A flat trace whose phase labels `name_of(row)` chooses; the bounded phases' runs climb."""
    return [Sample(s, 1e9 + s, int(4 * GiB + (s % 7) * MiB + (s // 8) * 64), LIMIT, None, name_of(s))
            for s in range(rows)]


NAMINGS = {
    "every other row a new phase": lambda s: f"p{s // 2}" if s % 2 else "train",
    "every row a new phase": lambda s: f"p{s}",
    "a new phase said to last 3 steps, every 4 rows": lambda s: f"p{s // 4}/3" if s % 4 else "train",
    "runs of many phases climbing in turn": lambda s: f"p{(s // 8) % 997}" if s % 2 else "train",
}


def _work(samples, read) -> int:
    """Python calls (and calls into C) `read(samples)` makes: a count, not a time, so it is the same
    on any machine and under any load."""
    import sys

    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        read(samples)
    finally:
        sys.setprofile(None)
    return calls


def _both_replays(samples) -> None:
    replay(samples)
    for _ in replay_steps(samples):
        pass


import pytest  # noqa: E402 - the section's own


@pytest.mark.parametrize("naming", NAMINGS, ids=list(NAMINGS))
def test_a_replay_s_work_grows_linearly_with_its_rows_whatever_the_rows_name(naming):
    """Issue 64: `analyze` of a trace whose every other row named a new phase took 2.0 s at 10^4 rows
    and 120 s at 10^5 (every phase change scanned every name seen). Four times the rows, whatever the
    names, is about four times the work (counted in calls, not timed), for `replay` (analyze, report,
    postmortem, bench) and `replay_steps`, the `Judge` the sidecar drives."""
    small, large = (_work(_named(rows, NAMINGS[naming]), _both_replays) for rows in (2_000, 8_000))
    assert large / small < 4 * 1.3, f"{naming}: {small:,} calls for 2,000 rows, {large:,} for 8,000"


def test_what_a_judge_remembers_of_phases_is_bounded_whatever_the_rows_name():
    """The judge's memory of phases, and so its work at a phase change, holds the newest MAX_PHASES
    names, however many a trace names: each name's length and runs' peaks, and which climb."""
    from watchdog.core.judge import Judge
    from watchdog.core.phase import MAX_PHASES

    judge = Judge()
    for sample in _named(20_000, NAMINGS["runs of many phases climbing in turn"]):
        judge.judge(sample)
    assert len(judge._phase_steps) <= MAX_PHASES and len(judge._climbs) <= MAX_PHASES
    assert len(judge.climbing_phases) <= MAX_PHASES
    eval_again = Judge()  # a phase run again within the newest names keeps its learned length
    for step, label in enumerate(["train", "eval", "eval", "train", *[f"p{n}" for n in range(MAX_PHASES - 2)],
                                  "train", "eval"]):
        eval_again.judge(Sample(step, 1e9 + step, 4 * GiB, LIMIT, None, label))
    assert eval_again._episode.expected_steps == 2
