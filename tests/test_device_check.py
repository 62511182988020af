"""The device check (tests/device/cuda_check.py, issues 41 and 65), on a machine without a GPU: what
it does here for real (its arguments, one line and exit 2), its README from made-up figures, the
cost table's arithmetic, the fixtures it writes, and the unmodified job it stops from outside. The
check itself runs on a lent GPU machine (tests/device/run.sh)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

DEVICE = Path(__file__).parent / "device"
GiB = 1 << 30


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("cuda_check", DEVICE / "cuda_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(check, capsys, tmp_path):
    assert check.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device" in err
    assert not (tmp_path / "out").exists(), "nothing written"


@pytest.mark.parametrize("argv, said", [
    (["--budget-gib", "0"], "--budget-gib must be positive"),
    (["--budget-gib", "nan"], "--budget-gib must be positive"),
    (["--budget-gib", "lots"], "invalid float value"),
    (["--cases", "leak,bogus"], "unknown case 'bogus': the cases are leak, leak-unwatched"),
    (["--cases", ","], "no case named"),
    (["--case", "leak"], "a child needs a known --case and its --work folder"),
    (["--no-such-option"], "unrecognized arguments"),
])
def test_bad_arguments_are_one_line_and_exit_2_before_anything_runs(check, capsys, argv, said):
    assert check.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


def test_a_subset_of_cases_is_named_in_the_order_they_run(check):
    assert check.arguments(["--cases", "cost,reads,leak"]).cases == ["cost", "reads", "leak"]
    assert check.arguments([]).cases == list(check.CASES)


def test_the_cost_cells_are_abba_pairs_with_a_mean_and_its_95_percent_interval(check):
    assert check.abba(6) == ["off", "on", "on", "off"] * 3
    assert check.abba(5) == ["off", "on", "on", "off"] * 2 + ["off", "on"]
    with pytest.raises(ValueError):
        check.abba(0)
    schedule = check.abba(2)
    assert check.paired(schedule, [10.0, 11.0, 12.0, 9.0]) == [(10.0, 11.0), (9.0, 12.0)], "(off, on) whatever the order"
    with pytest.raises(ValueError):
        check.paired(["off", "off"], [1.0, 2.0])
    mean, half = check.mean_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert mean == 3.0 and half == pytest.approx(2.776 * statistics.stdev([1, 2, 3, 4, 5]) / 5 ** 0.5)
    with pytest.raises(ValueError):
        check.mean_interval([1.0])
    # six pairs: on costs 1% more than off in each, but the clock drifts 2% a block: ABBA cancels the drift
    drift = [1.0 + 0.02 * block for block in range(12)]
    seconds = [0.013 * d * (1.01 if kind == "on" else 1.0) for kind, d in zip(check.abba(6), drift)]
    cell = check.cell_figures(check.abba(6), seconds)
    assert cell["pairs"] == 6 and cell["low"] <= 0.01 <= cell["high"] and abs(cell["mean"] - 0.01) < 0.002
    assert cell["off_ms"] == pytest.approx(13 * statistics.fmean(drift), rel=0.01)


def test_the_cost_case_measures_every_cell_in_abba_blocks(check, monkeypatch):
    """The cost case's own path, on this CPU with the rss source (a GPU's step and its source cannot
    be had here): every cell measured, its pairs off and on, the samples the on blocks took."""

    class NoGuard:  # torch.cuda.set_sync_debug_mode needs CUDA
        loop_syncs, mode = None, "none"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(check, "SyncGuard", NoGuard)
    monkeypatch.setattr(check, "COST_STEP_MS", (3, 6))
    monkeypatch.setattr(check, "COST_PAIRS", 2)
    monkeypatch.setattr(check, "COST_BLOCK_SECONDS", 0.06)
    result = check.cost_case(seconds=30, device="cpu", width=64)
    cells = result["cells"]
    assert [(c["target_ms"], c["sample_every"]) for c in cells] == [(3, 1), (6, 1), (3, 10), (6, 10)]
    assert all(c["pairs"] == 2 and c["low"] <= c["mean"] <= c["high"] and c["off_ms"] > 0 for c in cells)
    assert all(c["samples"] >= 1 and c["sample_errors"] == 0 for c in cells)
    assert cells[0]["samples"] > cells[2]["samples"], "sample_every=1 samples more than sample_every=10"
    assert cells[1]["repeats"] >= cells[0]["repeats"], "a longer step: more of the loop's steps in it"
    assert result["goal_met"] == (cells[0]["mean"] <= check.COST_GOAL) and result["step_call_ns"] > 0


def test_the_readme_says_what_ran_and_has_a_line_a_case_with_its_figures(check):
    results = {"device": {"name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "cuda": "13.0", "budget_bytes": 8 * GiB,
                          "driver": "580.159.04", "commit": "abc123", "python": "3.12.3"},
               "command": "python tests/device/cuda_check.py --out /out", "seconds": 281.5,
               "leak": {"passed": True, "actions": 3, "steps": 1600, "first_action": "CHECKPOINT_REINIT", "action_step": 431,
                        "action_steps": [431, 900, 1400], "used_at_action": 7 * GiB, "limit_at_action": 8 * GiB,
                        "oom_step": None, "suspects": ["+400 tensors float32[2048x2048] on cuda:0"], "sync_error": None,
                        "breakdowns": 280, "samples": 320},
               "leak-unwatched": {"passed": True, "oom_step": 497, "parsed": {"kind": "allocation"}},
               "clean": {"passed": True, "steps": 600, "actions": 0, "leak": False, "sync_error": None,
                         "user_peak_kept": True, "breakdowns": 30, "samples": 120},
               "fragmentation": {"passed": False, "first_action": None},
               "reads": {"passed": True, "calls": {"mem_get_info": {"median_us": 7.1, "p10_us": 6.5, "p90_us": 8.7,
                                                                    "calls": 2000}}},
               "cost": {"passed": True, "goal_met": True, "step_call_ns": 180,
                        "cells": [{"target_ms": 13, "sample_every": 1, "pairs": 6, "off_ms": 13.02, "mean": 0.0021,
                                   "low": -0.0011, "high": 0.0053, "samples": 540, "breakdowns": 60}]},
               "files": ["fixtures/readings.json", "fixtures/oom_messages.json"]}
    readme = check.render(results)
    lines = readme.splitlines()
    assert lines[0].startswith("# cuda_check on NVIDIA H100 80GB HBM3 (torch 2.11.0, CUDA 13.0), budget 8.0 GiB")
    assert "Driver 580.159.04, Python 3.12.3, commit abc123." in readme
    ran = lines[lines.index("## What it ran") + 2:lines.index("## What it found") - 1]
    assert [line.split(":")[0] for line in ran] == ["- leak", "- leak-unwatched", "- clean", "- fragmentation",
                                                   "- reads", "- cost"], "the cases it ran, no other"
    found = [line.split(":")[0] for line in lines[lines.index("## What it found") + 2:] if line.startswith("- ")]
    assert found == ["- leak", "- leak-unwatched", "- clean", "- fragmentation", "- reads", "- cost"]
    assert ("- leak: pass: 3 actions in 1600 steps (at least 3 owed), at steps [431, 900, 1400], first action "
            "CHECKPOINT_REINIT at step 431 (memory 7.00 GiB of 8.00 GiB)") in readme
    assert "unwatched, OutOfMemoryError at step 497" in readme and "breakdowns 280 of 320 samples" in readme
    assert "user's peak kept: True" in readme and "- fragmentation: FAIL" in readme
    assert "| mem_get_info | 7.1 | 6.5-8.7 | 2000 |" in readme
    assert "| 13 ms | 1 | 6 | 13.020 | +0.21% | -0.11% to +0.53% | 540 (60) |" in readme
    assert "at most +0.5% at a 13 ms step with sample_every=1: met" in readme
    assert readme.rstrip().endswith("fixtures/readings.json, fixtures/oom_messages.json.")


def test_it_writes_seven_files_at_most_what_the_device_tool_brings_back(check, tmp_path):
    """The device tool brings back 8 files at most, two folders down: README.md, report.json and
    the fixtures, from every case's work folder."""
    work, fixtures = tmp_path / "work", tmp_path / "out" / "fixtures"
    for case in ("leak", "clean", "fragmentation", "cache"):
        (work / case).mkdir(parents=True)
        (work / case / "readings.json").write_text(json.dumps({"fraction": 0.1, "records": [{"kind": "sample"}]}))
    (work / "fragmentation-unwatched").mkdir()
    (work / "fragmentation-unwatched" / "snapshot.json").write_text("{}")
    (work / "watch").mkdir()
    (work / "watch" / "nvml.json").write_text("{}")
    (work / "watch" / "trace.csv").write_text("step\n")
    fixtures.mkdir(parents=True)
    results = {"device": {"name": "GPU", "torch": "2.11.0", "cuda": "13.0", "budget_bytes": 8 * GiB, "commit": "abc"},
               "leak-unwatched": {"oom_text": "CUDA out of memory."}}
    written = check.write_fixtures(work, fixtures, results)
    assert sorted(written) == ["fixtures/nvml.json", "fixtures/oom_messages.json", "fixtures/readings.json",
                               "fixtures/snapshot.json", "fixtures/watch_trace.csv"]
    assert len(written) + 2 <= 8
    readings = json.loads((fixtures / "readings.json").read_text())
    assert readings["version"] == 1 and readings["commit"] == "abc" and sorted(readings["cases"]) == [
        "cache", "clean", "fragmentation", "leak"]


@pytest.mark.slow
def test_the_job_it_stops_is_the_plain_script_of_the_watch_tests_on_cuda():
    """leaky_script.py --device cuda needs a GPU: here it fails as any CUDA script does, at its first
    tensor, after it started (its argument parsing and device choice ran)."""
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "jobs" / "leaky_script.py"), "--device", "cuda",
                           "--state", "/nonexistent/state", "--steps", "1"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and "started step=0" in done.stdout
    assert "RuntimeError" in done.stderr or "AssertionError" in done.stderr


def test_what_it_keeps_of_a_snapshot_and_of_an_oom_message_reads_back(check):
    """The fixtures it writes are read by the same code the watchdog uses (stand-in inputs, as
    torch documents them)."""
    from test_creation_sites import SNAPSHOT
    from test_oom_message import CUDA_2_1

    from watchdog.forensics.allocator_history import live_blocks

    deep = {"segments": [dict(SNAPSHOT["segments"][0], blocks=[
        dict(SNAPSHOT["segments"][0]["blocks"][0], frames=[{"filename": f"f{i}.py", "line": i, "name": "g"}
                                                           for i in range(20)])])]}
    [block] = live_blocks(check.trimmed(deep))
    assert [frame[0] for frame in block.frames] == [f"f{i}.py" for i in range(6)], "the innermost six"
    message = check.parsed(CUDA_2_1)
    assert message["fragmented"] and message["requested_bytes"] == 256 << 20 and "allocations" not in message
    assert check.parsed("no message here") is None and check.parsed(None) is None
