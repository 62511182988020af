"""The recompilation finding's decision: warm-up versus compilations that keep coming. Pure, fast."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from watchdog.core.errors import ConfigError
from watchdog.core.recompilation import RecompilationConfig, RecompilationDetector

CONFIG = RecompilationConfig(warmup_steps=100)


def run(compiles_at, steps, every=10, first_step=0, config=CONFIG):
    """Samples every `every` steps; `compiles_at(step)` is the counter at that step. All findings."""
    detector = RecompilationDetector(config)
    found = []
    for step in range(first_step, first_step + steps, every):
        finding = detector.observe(step, compiles_at(step))
        if finding is not None:
            found.append(finding)
    return detector, found


def test_a_loop_that_stops_compiling_after_warm_up_is_never_a_finding():
    detector, found = run(lambda s: min(s // 10, 6), 5000)  # six graphs in the first 60 steps, then cached
    assert found == []
    assert detector.active is None
    assert detector.steps_per_compile == math.inf


def test_a_new_graph_every_step_is_found_by_rate_within_a_few_samples():
    detector, found = run(lambda s: 4 + max(0, s - 100), 400)
    assert len(found) == 1
    finding = found[0]
    assert finding.trigger == "rate"
    assert 120 <= finding.step <= 130  # three intervals in a row after warm-up
    assert finding.warmup_compiles == 4
    assert finding.steps_per_compile == pytest.approx(1.0)
    assert finding.every == "every step"
    assert detector.active is finding


def test_a_shape_every_k_steps_is_found_by_count_once_past_the_warm_ups():
    # A new graph every 50 steps, sampled every 10: never three intervals in a row, but after warm-up
    # (3 graphs by step 100) more graphs come than warm-up had, spread over many intervals.
    detector, found = run(lambda s: 1 + s // 50, 1000)
    assert len(found) == 1
    assert found[0].trigger == "count"
    assert found[0].warmup_compiles == 3
    assert found[0].compiles_after_warmup == 4
    assert found[0].step == 300
    assert found[0].every == "every ~50 steps"


def test_a_burst_after_warm_up_such_as_a_first_eval_is_not_a_finding():
    # Ten eval graphs compiled at step 1000, then cached: more than warm-up's 3, but in one interval.
    detector, found = run(lambda s: 3 + (10 if s >= 1000 else 0), 5000)
    assert found == []


def test_bucketed_shapes_arriving_late_are_not_a_finding():
    # Eight buckets during warm-up, two rare ones later: fewer than warm-up, and far apart.
    late = {1500: 1, 4200: 1}
    detector, found = run(lambda s: 8 + sum(n for at, n in late.items() if s >= at), 6000)
    assert found == []


def test_warm_up_counts_from_the_first_step_this_process_saw():
    # A job resumed at step 5000 compiles all its graphs again: warm-up, not a finding.
    detector, found = run(lambda s: min(max(0, s - 5000) // 10, 8), 2000, first_step=5000)
    assert found == []


def test_counters_starting_over_mean_a_new_warm_up():
    detector = RecompilationDetector(CONFIG)
    for step in range(0, 200, 10):
        detector.observe(step, 5)
    assert detector.observe(200, 0) is None  # metrics cleared
    for step in range(210, 300, 10):  # compiling again right away: warm-up of the new baseline
        assert detector.observe(step, step // 10) is None


def test_the_finding_clears_when_compilations_stop_and_can_come_back():
    compiles = lambda s: 4 + max(0, min(s, 300) - 100) + max(0, s - 2000)  # noqa: E731
    detector, found = run(compiles, 2200)
    assert [f.step for f in found][0] <= 130
    assert len(found) == 2, "a second spell of recompilation is a second finding"
    assert found[1].step > 2000

    detector, _ = run(lambda s: 4 + max(0, min(s, 300) - 100), 1000)
    assert detector.active is None, "ten compile intervals without a compilation clear it"


@given(warmup=st.lists(st.integers(0, 20), min_size=1, max_size=10), every=st.integers(1, 50))
def test_no_compilation_after_warm_up_is_never_a_finding(warmup, every):
    """Whatever warm-up compiled, and however it is sampled, a loop that then stops is never found."""
    counts = [sum(warmup[: i + 1]) for i in range(len(warmup))]
    at = lambda s: counts[min(s * len(counts) // 100, len(counts) - 1)] if s < 100 else counts[-1]  # noqa: E731
    _, found = run(at, 3000, every=every)
    assert found == []


def test_rate_and_count_come_from_the_config():
    eager = RecompilationConfig(warmup_steps=10, consecutive=2, min_compiles=2)
    _, found = run(lambda s: s // 5, 100, every=5, config=eager)
    assert found and found[0].step == 20


@pytest.mark.parametrize("field, value", [("warmup_steps", -1), ("consecutive", 0), ("min_compiles", 0),
                                          ("quiet_factor", 0.5), ("capture_compiles", 0), ("capture_steps", True)])
def test_bad_configuration_names_the_field(field, value):
    with pytest.raises(ConfigError, match=f"recompilation.{field}"):
        RecompilationConfig(**{field: value})
