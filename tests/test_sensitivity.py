"""`python -m watchdog.bench.sensitivity`: leak size vs steps to the leak report, on a few seeds."""

from __future__ import annotations

import json
import math
import struct

import numpy as np

import pytest

from watchdog.bench.sensitivity import STEPS, first_report, format_table, main, measure, render_png

ONSET = STEPS // 10


@pytest.fixture(scope="module")
def small():
    """Two sizes, one seed: three replays (the no-leak control included)."""
    return measure((0.20, 0.08), seeds=1)


def test_a_large_leak_is_reported_after_onset_and_the_same_job_without_it_is_not():
    first = first_report(0, 0.20)
    assert first is not None and ONSET <= first < STEPS
    assert first_report(0, 0.0) is None


def test_rows_are_sorted_and_their_fields_agree(small):
    assert [r.growth_share for r in small.rows] == [0.08, 0.20]
    assert small.steps == STEPS and small.onset_step == ONSET and small.seeds == 1 and small.noise == "normal"
    for row in small.rows:
        assert row.seeds == 1 and row.reported + row.early <= row.seeds
        assert row.life_steps == STEPS - ONSET
        assert row.rate_per_kstep == pytest.approx(row.growth_share * 1000 / (STEPS - ONSET))
        assert all(0 <= d < row.life_steps for d in row.delays)
        if row.delays:
            assert row.median_share_of_life == pytest.approx(row.median_delay / row.life_steps)
    low, high = small.rows
    assert low.rate_per_kstep < high.rate_per_kstep
    assert high.reported == 1 and high.early == 0 and high.detection_rate == 1.0
    assert low.median_delay is None or high.median_delay <= low.median_delay  # a faster leak is seen no later
    assert small.control.growth_share == 0 and small.control.early == 0 and small.control.reported == 0


def test_the_same_seeds_give_the_same_figures(small):
    again = measure((0.08, 0.20), seeds=1)
    assert again.rows == small.rows and again.control == small.control


def test_the_table_has_a_line_per_size_and_the_control(small):
    table = format_table(small)
    assert "8%" in table and "20%" in table and "1/1" in table
    assert "no leak (same seeds): 0/1 reported" in table


def test_the_picture_is_a_png_of_about_900_by_500(small, tmp_path):
    path = render_png(small, tmp_path / "sub" / "curve.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (900, 500)


@pytest.mark.parametrize("bad", [(), (0.0,), (0.5,)])
def test_measure_rejects_sizes_it_cannot_measure(bad):
    with pytest.raises(ValueError):
        measure(bad, seeds=1)


def test_measure_rejects_no_seeds():
    with pytest.raises(ValueError):
        measure((0.2,), seeds=0)


@pytest.mark.parametrize("seeds", ["0", "-3", "two", "1.5"])
def test_bad_seeds_is_a_one_line_error_with_status_2(seeds, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--seeds", seeds])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seeds" in err and "positive" in err


def test_the_command_prints_json_and_writes_the_picture(tmp_path, capsys):
    out = tmp_path / "s.png"
    assert main(["--seeds", "1", "--json", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["seeds"] == 1 and report["steps"] == STEPS and len(report["rows"]) == 8
    assert report["control"] == {"seeds": 1, "false_reports": 0, "others_false_reports": {
        "oracle": 0, "cache_aware_oracle": 0, "predict_linear_1h": 0, "gpulse_leak_rule": 0}}
    cache = report["cache_control"]  # a cache that fills and stops: the oracle, which only knows ramps, reports it
    assert cache["false_reports"] == 0 and cache["others_false_reports"]["oracle"] == 1
    assert cache["others_false_reports"]["cache_aware_oracle"] == 0  # told the caches' shape, it does not
    largest = report["rows"][-1]
    assert set(largest["ours_vs"]) == {"oracle", "cache_aware_oracle"}
    assert largest["ours_vs"]["oracle"] == largest["median_delay_steps"] / largest["others"]["oracle"]["median_delay_steps"]
    assert out.read_bytes()[:4] == b"\x89PNG"


# -- the oracle and the baselines on the same jobs -------------------------------------------------

def test_every_detector_is_measured_on_the_same_jobs_and_the_comparison_is_printed(small):
    names = [name for name, _ in small.control.others]
    assert names == ["oracle", "cache_aware_oracle", "predict_linear_1h", "gpulse_leak_rule"]
    assert all(reports.early == 0 for _, reports in small.control.others)  # no false report on the control
    oracle = small.rows[-1].of("oracle")
    assert oracle.reported == 1 and oracle.median_delay < small.rows[-1].median_delay  # it sees a 20% leak sooner
    table = format_table(small)
    assert "ours/oracle" in table and "ours/cache_aware_oracle" in table
    assert "false reports on the same jobs without a leak: hbm-watchdog 0/1, oracle 0/1, cache_aware_oracle 0/1" in table
    assert json.loads(json.dumps(small.to_json()))["rows"][-1]["others"]["oracle"]["reported"] == 1


@pytest.fixture(scope="module")
def calibration():
    """Three leak-free draws and three with the second control's cache, apart from the measured seeds."""
    from watchdog.bench.sensitivity import CACHE_SHARE, draw

    leak_free = [draw(seed, 0.0)[:2] for seed in (100, 101, 102)]
    caches = [draw(seed, CACHE_SHARE, cache=True)[:2] for seed in (103, 104, 105)]
    return leak_free, caches


def test_the_oracles_threshold_lies_above_every_leak_free_draw_it_was_set_on(calibration):
    from watchdog.bench.oracle import Oracle, calibrate
    from watchdog.bench.sensitivity import draw

    leak_free, _ = calibration
    threshold = calibrate(leak_free, Oracle(ONSET, math.inf))
    highest = max(Oracle(ONSET, threshold).statistic(samples, model)[1].max() for samples, model in leak_free)
    assert highest < threshold
    assert all(Oracle(ONSET, threshold).first_report(samples, model) is None for samples, model in leak_free)
    samples, model, _ = draw(100, 0.20)  # the same job with a leak: reported, after the onset
    first = Oracle(ONSET, threshold).first_report(samples, model)
    assert first is not None and ONSET <= first < STEPS


def test_the_cache_aware_oracle_reports_the_leak_and_neither_the_caches_nor_the_leak_free_jobs_it_was_set_on(calibration):
    from watchdog.bench.oracle import CacheAwareOracle, Oracle, cache_time_constants, calibrate
    from watchdog.bench.sensitivity import CACHE_TAU_FRACTION, draw

    leak_free, caches = calibration
    taus = cache_time_constants(CACHE_TAU_FRACTION * STEPS)
    assert len(taus) == 16 and taus[-1] == pytest.approx(CACHE_TAU_FRACTION * STEPS) and taus[0] < taus[-1] / 60
    aware = CacheAwareOracle(ONSET, calibrate(leak_free + caches, CacheAwareOracle(ONSET, math.inf, taus)), taus)
    assert all(aware.first_report(samples, model) is None for samples, model in leak_free + caches)
    ramp_only = Oracle(ONSET, calibrate(leak_free, Oracle(ONSET, math.inf)))
    assert any(ramp_only.first_report(samples, model) is not None for samples, model in caches)  # it knows only ramps
    samples, model, _ = draw(100, 0.20)
    first = aware.first_report(samples, model)
    assert first is not None and ramp_only.first_report(samples, model) <= first < STEPS  # telling a cache apart costs time


def test_with_no_caches_to_rule_out_the_cache_aware_statistic_is_the_ramp_oracles_z_squared(calibration):
    """D is the ramp's gain over the best cache, in units of sigma^2; with no cache it is max(z, 0)^2,
    and with caches it can only be lower."""
    from watchdog.bench.oracle import CacheAwareOracle, Oracle, cache_time_constants
    from watchdog.bench.sensitivity import draw

    samples, model, _ = draw(100, 0.05)
    steps, z = Oracle(ONSET, math.inf).statistic(samples, model)
    bare_steps, bare = CacheAwareOracle(ONSET, math.inf, ()).statistic(samples, model)
    assert (bare_steps == steps).all() and bare == pytest.approx(np.maximum(z, 0.0) ** 2, rel=1e-9, abs=1e-9)
    _, aware = CacheAwareOracle(ONSET, math.inf, cache_time_constants(2_000)).statistic(samples, model)
    assert (aware <= bare + 1e-9).all() and (aware < bare - 1.0).any()
