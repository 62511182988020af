"""Phases of the training loop through the judge: a bounded phase (an evaluation) is judged against
the peak it reaches by its end, and a first evaluation ramp without phase information is met with
a warning, not a checkpoint."""

from __future__ import annotations

import random

import pytest

from watchdog.core.errors import ConfigError
from watchdog.core.judge import Judge
from watchdog.core.phase import PeakClimb, Phase, parse_label, phase_label
from watchdog.core.replay import replay
from watchdog.core.sample import Sample, load_trace, write_trace
from watchdog.core.verdict import Action, Status

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BASE = int(1.2 * GiB)  # a small model's process on PJRT CPU
KEPT = 185 * MiB  # the evaluation's outputs, kept on the device until it ends


def evaluations(*, length=200, first=1000, every=1800, kept=KEPT, spare_share=0.15, label="", steps=7000,
                sample_every=5, seed=0):
    """A training loop whose evaluations keep each batch's outputs until they end, then free them.

    The loop's counter keeps rising through an evaluation (its batches count); `label` is what
    the samples taken during one carry. The budget leaves `spare_share` of itself free at the
    evaluation's peak.
    """
    rng = random.Random(seed)
    limit = int((BASE + kept + 3 * MiB) / (1 - spare_share))
    samples = []
    for step in range(0, steps, sample_every):
        into = (step - first) % (every + length) if step >= first else -1
        evaluating = 0 <= into < length
        floor = BASE + (kept * (into + 1) / length if evaluating else 0)
        used = int(floor + 3 * MiB * rng.random() + rng.gauss(0, 0.3 * MiB))
        samples.append(Sample(step, 1.7e9 + 0.1 * step, used, None, None, label if evaluating else ""))
    return samples, limit


def judged(samples, limit):
    judge = Judge(memory_limit_bytes=limit)
    return [(s, *judge.judge(s)) for s in samples]


def checkpoints(outcomes):
    return [s.step for s, _, action in outcomes if action.needs_checkpoint]


def warnings(outcomes):
    return [s.step for s, _, action in outcomes if action is Action.WARN]


# ------------------------------------------------------------------------------------ labels

def test_a_label_carries_the_name_and_the_steps_the_loop_said():
    assert phase_label("eval", 300) == "eval/300" and parse_label("eval/300") == Phase("eval", 300)
    assert phase_label("eval") == "eval" and parse_label("eval") == Phase("eval", None)
    assert phase_label("train", 50) == "train"  # training is steady: its length changes nothing
    assert not parse_label("").bounded and not parse_label("train").bounded and parse_label("eval").bounded
    assert parse_label("odd/label/x") == Phase("odd/label/x", None)  # traces come from anywhere: lenient


@pytest.mark.parametrize("name, steps", [("", None), ("eval\n", None), ("eval,x", None), ("9eval", None), ("x" * 40, None),
                                         ("eval", 0), ("eval", -3), ("eval", 2.5), ("eval", True)])
def test_a_label_that_would_not_survive_a_csv_cell_is_refused(name, steps):
    with pytest.raises(ConfigError, match="phase"):
        phase_label(name, steps)


# ------------------------------------------------------------- the first evaluation ramp

RAMPS = [(0.10, 300, 1000), (0.10, 500, 2000), (0.15, 500, 2000)]  # (spare, length, first): each drew a checkpoint


@pytest.mark.parametrize("spare_share, length, first", RAMPS)
def test_a_first_evaluation_ramp_without_phase_information_gets_a_warning_not_a_checkpoint(spare_share, length, first):
    outcomes = judged(*evaluations(spare_share=spare_share, length=length, first=first))
    assert checkpoints(outcomes) == []  # a WARN at most


@pytest.mark.parametrize("spare_share, length, first", RAMPS + [(0.05, 200, 500), (0.05, 500, 2000)])
def test_with_the_phase_api_an_evaluation_is_judged_against_its_peak_at_its_end(spare_share, length, first):
    # Even 5% below the budget, where a first ramp without phase information is imminent and acted on.
    outcomes = judged(*evaluations(spare_share=spare_share, length=length, first=first, label=f"eval/{length}"))
    assert checkpoints(outcomes) == [] and warnings(outcomes) == []
    assert not any(v.status is Status.OOM_PROJECTED for _, v, _ in outcomes)
    # The evaluation's peak is a transient above the training floor: it counts in every projection.
    healthy = outcomes[-1][1]
    assert healthy.floor_bytes < BASE + 4 * MiB and healthy.excursion_bytes > 0.9 * KEPT


def test_an_evaluation_that_would_reach_the_limit_before_its_end_is_checkpointed_before_it_does():
    samples, limit = evaluations(kept=400 * MiB, label="eval/300", length=300, spare_share=0.0)
    limit = BASE + 300 * MiB  # the outputs would pass it three quarters of the way through
    outcomes = judged([s for s in samples if s.bytes_used < limit], limit)
    acted = checkpoints(outcomes)
    assert acted and 1000 < acted[0] < 1000 + 0.75 * 300
    verdict = next(v for s, v, _ in outcomes if s.step == acted[0])
    assert verdict.explanation.startswith("eval phase: memory rising") and "before it ends at step" in verdict.explanation


def test_a_phase_of_unsaid_length_is_cautious_the_first_time_and_judged_by_its_last_length_after():
    outcomes = judged(*evaluations(label="eval", spare_share=0.15))
    assert checkpoints(outcomes) == []
    # The first evaluation may warn (its end unknown); the later ones end where the first did.
    assert all(step < 1000 + 200 for step in warnings(outcomes))
    second = [v for s, v, _ in outcomes if 3000 <= s.step < 3200]
    assert second and not any(v.status is Status.OOM_PROJECTED for v in second)


def test_analyze_replays_the_phase_from_the_trace_as_the_sidecar_decided(tmp_path):
    samples, limit = evaluations(label="eval/200", spare_share=0.05)
    path = tmp_path / "trace.csv"
    write_trace(path, samples)
    assert load_trace(path) == samples  # the phase column round-trips
    live = judged(samples, limit)
    again = replay(load_trace(path), memory_limit_bytes=limit)
    assert again.first_action_step is None and again.final_verdict == live[-1][1]


def test_steps_going_back_are_a_new_process_whose_first_ramp_is_cautious_again():
    # The first process acted on a leak (so its policy dropped the caution); the restarted one,
    # appending to the same trace, starts over as its sidecar did.
    rng = random.Random(3)
    limit = BASE + 600 * MiB
    first = [Sample(s, 1.7e9 + 0.1 * s, int(BASE + 400 * KiB * s + 3 * MiB * rng.random()), limit) for s in range(0, 1500, 5)]
    judge = Judge()
    assert any(judge.judge(s)[1].needs_checkpoint for s in first)
    assert not judge.policy._cautious
    judge.judge(Sample(1000, 1.8e9, BASE, limit))
    assert judge.policy._cautious


def climbing_evaluations(climb, *, runs=9, every=400, length=60, base=GiB, kept=100 * MiB, seed=0):
    """Evaluations every `every` steps, each keeping `kept + climb * run` by its end and freeing it
    after; the floor between them flat: (samples, the first step of each run)."""
    rng = random.Random(seed)
    samples, starts = [], []
    for step in range(0, runs * every, 5):
        run, into = divmod(step, every)
        label = phase_label("eval", length) if into >= every - length else ""
        if label and (not starts or starts[-1] < run * every):
            starts.append(step)
        share = (into - (every - length) + 5) / length if label else 0.0
        used = base + share * (kept + climb * run) + rng.random() * 4 * MiB
        samples.append(Sample(step, step * 0.1, int(used), None, None, label))
    return samples, starts


@pytest.mark.parametrize("seed", range(3))
def test_evaluations_that_peak_higher_each_run_are_acted_on_between_runs_before_the_one_that_would_cross(seed):
    """Issue 54: an evaluation that keeps more every time it runs leaks peaks (metatrain#1014,
    karpathy/nanochat#295): the floor stays flat, each run ends below the limit, and the run that
    crosses comes anyway. The action comes between runs, before that one: a checkpoint before eval."""
    limit = GiB + 330 * MiB  # run 7 peaks at 100 + 7 * 33 = 331 MiB above the floor: the first to cross
    samples, starts = climbing_evaluations(33 * MiB, seed=seed)
    sample, verdict, _ = next(outcome for outcome in judged(samples, limit) if outcome[2].needs_checkpoint)
    assert starts[6] < sample.step < starts[7], (sample.step, starts)
    assert sample.phase == "", "between runs, not inside one"
    assert "eval runs peak higher each time" in verdict.explanation and f"step {starts[7]:,}" in verdict.explanation


@pytest.mark.parametrize("seed", range(3))
def test_evaluations_that_peak_alike_or_jump_once_are_left_alone(seed):
    limit = GiB + 160 * MiB  # each run peaks 100-104 MiB above the floor
    assert not checkpoints(judged(climbing_evaluations(0, seed=seed)[0], limit))
    jumped = [Sample(s.step, s.timestamp, s.bytes_used + (40 * MiB if s.phase and s.step > 2000 else 0), None, None,
                     s.phase) for s in climbing_evaluations(0, seed=seed)[0]]  # one run kept 40 MiB more, and the rest
    assert not checkpoints(judged(jumped, limit))


def test_a_phase_whose_runs_peak_higher_three_times_running_is_said_to_climb_until_one_peaks_lower():
    """What asks the watchdog to count what a run holds at its end (`LeakFollower.phase_ended`), a run
    before a climb is acted on; a run that peaks lower ends the climb."""
    climbing = Judge(memory_limit_bytes=GiB + 4 * GiB)
    seen = []
    for sample in climbing_evaluations(33 * MiB)[0]:
        climbing.judge(sample)
        seen.append(climbing.climbing_phases)
    assert frozenset({"eval"}) in seen and seen[-1] == frozenset({"eval"})
    climb = PeakClimb()
    for start, peak in ((0, 10), (100, 20), (200, 30)):
        climb.add(start, peak)
    assert climb.climbing
    climb.add(300, 25)
    assert not climb.climbing
