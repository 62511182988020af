"""`python -m watchdog.bench.how_early`: docs/detection.md's "how early" table, from the one Judge."""

from watchdog.bench import how_early


def test_every_cycle_of_a_leak_taking_twenty_samples_or_more_is_acted_on_before_the_limit():
    rows = how_early.table(cycles=3)
    for row in rows:
        assert row.actions == 3, row
        if row.samples_to_fill >= 20:
            assert row.least_warning_steps > 0 and row.highest_share < 1.0, row
    fastest = [r for r in rows if r.samples_to_fill == 10]
    assert all(r.first_rule == "limit rule" for r in fastest), "too fast for any pace: the reading at the limit"


def test_the_table_prints(capsys):
    assert how_early.main(["--cycles", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n| ") == 1 + len(how_early.SAMPLE_EVERY) * len(how_early.SAMPLES_TO_FILL)
