"""When the cuda source reads the allocator's breakdown (readers/breakdown_plan.py): each rule alone.

Pure: the plan sees numbers only. The H100's cases replayed with it are tests/test_cuda_fixtures.py's.
"""

import pytest

from watchdog.readers.breakdown_plan import BreakdownPlan

MiB, GiB = 1 << 20, 1 << 30
LIMIT = 8 * GiB


def readings(plan: BreakdownPlan, n: int, *, series: int = 1 * GiB, reserved: int = 2 * GiB,
             device_used: int = 3 * GiB, limit: int = LIMIT, now: float = 0.0, apart: float = 0.001) -> list[bool]:
    """n readings of a steady allocator, `apart` seconds apart from `now`: which were breakdowns."""
    taken = []
    for at in range(n):
        due = plan.due(device_used, limit, now + at * apart)
        if due:
            plan.read(series, reserved, device_used, now + at * apart)
        else:
            plan.carried()
        taken.append(due)
    return taken


def test_the_first_reading_is_a_breakdown_then_one_in_every():
    assert readings(BreakdownPlan(every=4), 9) == [True, False, False, False, True, False, False, False, True]
    assert readings(BreakdownPlan(every=1), 3) == [True] * 3, "every=1: every reading, as before the plan"


def test_samples_far_apart_are_each_a_breakdown_at_least_every_seconds():
    assert readings(BreakdownPlan(every=10, seconds=0.1), 6, apart=0.06) == [True, False, True, False, True, False]
    assert readings(BreakdownPlan(every=10, seconds=0.1), 3, apart=0.2) == [True] * 3, "samples 200 ms apart"


def test_a_reading_between_breakdowns_carries_the_floor_the_breakdowns_saw():
    """The sidecar reads at a random moment of a step: a breakdown is the floor plus some of the
    step's activations. A carried reading is the lowest since the last climb, raised by what the
    device grew since (a leak's segment), never past the newest breakdown's."""
    plan = BreakdownPlan(every=3, seconds=10.0)
    for series in (160 * MiB, 100 * MiB, 110 * MiB):  # at a step's peak, near its start, a little after
        plan.due(3 * GiB, LIMIT, 0.0)
        plan.read(series, 2 * GiB, 3 * GiB, 0.0)
    assert plan.carried() == 100 * MiB
    plan.read(150 * MiB, 2 * GiB, 3 * GiB + 4 * MiB, 0.0)  # the device grew a segment: a leak's, perhaps
    assert plan.carried() == 104 * MiB
    plan.read(103 * MiB, 2 * GiB, 3 * GiB + 8 * MiB, 0.0)  # it grew again, but the breakdown read less
    assert plan.carried() == 103 * MiB, "never past what a breakdown read"
    plan.read(1 * GiB, 2 * GiB, 3 * GiB + 8 * MiB, 0.0)  # a climb: the high rose by 840 MiB, so may the floor
    assert plan.carried() == 103 * MiB + (1 * GiB - 160 * MiB)


def test_a_device_reading_that_moved_a_segment_either_way_asks_for_a_breakdown():
    plan = BreakdownPlan(every=100)
    readings(plan, 1)
    assert not plan.due(3 * GiB + 1 * MiB, LIMIT, 0.0), "less than the allocator's smallest segment: noise"
    assert plan.due(3 * GiB + 2 * MiB, LIMIT, 0.0), "a segment reserved (or another process's memory)"
    assert plan.due(3 * GiB - 2 * MiB, LIMIT, 0.0), "a segment handed back: an emptied cache, before an OOM too"


def test_a_climb_is_read_at_every_reading_until_every_breakdowns_in_a_row_found_no_new_high():
    plan = BreakdownPlan(every=3)
    readings(plan, 3)  # one breakdown, two carried
    plan.read(1 * GiB + 10 * MiB, 2 * GiB, 3 * GiB, 0.0)  # the third's breakdown: past the highest by a segment
    taken = [plan.due(3 * GiB, LIMIT, 0.0)]
    plan.read(1 * GiB + 5 * MiB, 2 * GiB, 3 * GiB, 0.0)  # lower: a reading below the step's activations
    taken.append(plan.due(3 * GiB, LIMIT, 0.0))
    plan.read(1 * GiB + 20 * MiB, 2 * GiB, 3 * GiB, 0.0)  # a new high again: the climb goes on
    taken += readings(plan, 6, series=1 * GiB + 20 * MiB)
    assert taken == [True, True, True, True, True, False, False, True]


def test_a_creep_below_a_segment_is_no_climb():
    plan = BreakdownPlan(every=5)
    readings(plan, 1)
    plan.read(1 * GiB + 1 * MiB, 2 * GiB, 3 * GiB, 0.0)
    assert not plan.due(3 * GiB, LIMIT, 0.0)


def test_near_the_limit_every_reading_is_a_breakdown():
    plan = BreakdownPlan(every=10, near_limit=0.9)
    assert readings(plan, 5, reserved=int(0.89 * LIMIT)) == [True] + [False] * 4
    grown = 3 * GiB + int(0.01 * LIMIT)  # the allocator reserved 1% more: the device reading moved
    assert readings(plan, 3, reserved=int(0.91 * LIMIT), device_used=grown) == [True, True, True], \
        "once a breakdown found more than 90% of the limit reserved"


def test_after_a_rebuild_the_next_reading_is_a_breakdown_and_the_refill_a_climb():
    plan = BreakdownPlan(every=10)
    readings(plan, 2, series=5 * GiB)
    plan.restart()
    assert plan.due(3 * GiB, LIMIT, 0.0), "what the rebuild gave back is measured"
    plan.read(1 * GiB, 2 * GiB, 3 * GiB, 0.0)
    assert readings(plan, 2, series=1 * GiB) == [False, False]
    plan.read(2 * GiB, 2 * GiB, 3 * GiB, 0.0)  # refilling, still below the old 5 GiB high: a climb all the same
    assert plan.due(3 * GiB, LIMIT, 0.0)


@pytest.mark.parametrize("settings", [{"every": 0}, {"moved_bytes": -1}, {"near_limit": 1.5}])
def test_settings_out_of_range_are_refused(settings):
    with pytest.raises(ValueError):
        BreakdownPlan(**settings)
