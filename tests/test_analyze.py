"""`hbm-watchdog analyze` end to end: exit codes, JSON fields, no torch (in a subprocess), and what it
says about memory over the budget and out-of-range steps (in process)."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
from conftest import run_python, watchdog_cli

from watchdog.commands.cli import main
from watchdog.core.sample import TRACE_HEADER, Sample, write_trace

MiB, GiB = 1 << 20, 1 << 30


def _cli(*args: str) -> subprocess.CompletedProcess:
    return watchdog_cli(*args, json_logs=False, timeout=120)


def _write(path: Path, steps: int, rate: int, limit: int | None = 16 * GiB) -> Path:
    rng = random.Random(2)
    write_trace(path, (Sample(s, 1e9 + 0.5 * s, int(8 * GiB + rate * s + 2 * GiB * rng.random()), limit)
                       for s in range(steps)))
    return path


@pytest.mark.slow
def test_json_one_object_per_trace_with_the_design_fields(tmp_path):
    leak = _write(tmp_path / "leak.csv", 5500, 1 * MiB)
    clean = _write(tmp_path / "clean.csv", 3000, 0)
    proc = _cli("analyze", str(leak), str(clean), "--json")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["trace"] for r in rows] == [str(leak), str(clean)]
    for row in rows:
        assert {"ended", "leak_reported", "first_leak_report_step", "first_action_step", "slope_bytes_per_step",
                "projected_oom_step", "trace"} <= row.keys()
    assert rows[0]["leak_reported"] is True and rows[0]["first_action_step"] is not None
    assert abs(rows[0]["slope_bytes_per_step"] - MiB) < 0.1 * MiB
    assert rows[1]["leak_reported"] is False and rows[1]["first_leak_report_step"] is None
    assert rows[1]["ended"] == "healthy" and rows[1]["leak_report_spans"] == []


@pytest.mark.slow
def test_human_output_and_memory_limit_budget(tmp_path):
    trace = _write(tmp_path / "nolimit.csv", 5000, 512 * 1024, limit=None)
    proc = _cli("analyze", str(trace), "--memory-limit", "14GiB")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{trace}: ended with an OOM projected")
    assert "14.0 GiB limit" in proc.stdout and "on the way: leak reported from step" in proc.stdout


@pytest.mark.slow
def test_bad_trace_exits_2_naming_file_and_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1,2.0,100,,\n2,2.5,lots,,\n")
    proc = _cli("analyze", str(bad))
    assert proc.returncode == 2
    assert f"{bad}:3:" in proc.stderr and "Traceback" not in proc.stderr
    missing = _cli("analyze", str(tmp_path / "missing.csv"))
    assert missing.returncode == 2 and "missing.csv" in missing.stderr
    size = _cli("analyze", str(bad), "--memory-limit", "lots")
    assert size.returncode == 2 and "--memory-limit" in size.stderr


@pytest.mark.slow
def test_analyze_never_imports_torch(tmp_path):
    trace = _write(tmp_path / "t.csv", 500, 0)
    code = ("import sys; from watchdog.commands.cli import main; rc = main(['analyze', sys.argv[1], '--json']); "
            "assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'; print('no torch')")
    assert run_python(code, str(trace), timeout=120, fresh=True).strip().endswith("no torch")


def test_memory_over_the_budget_from_the_first_sample_is_acted_on_at_step_0(tmp_path, capsys):
    """Issue 24, item 10: 120 samples from 2 GiB, rising, against a 1 GiB budget said "no leak,
    warming up". Over the budget needs no trend: acted on at the first sample, and said why."""
    trace = tmp_path / "over.csv"
    write_trace(trace, (Sample(s, 1e9 + s, 2 * GiB + s * 8 * MiB) for s in range(120)))
    assert main(["analyze", str(trace), "--memory-limit", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "ended with an OOM projected" in out and "checkpoint_reinit asked for at step 0" in out
    assert "at or over the 1.0 GiB limit" in out
    assert main(["analyze", str(trace), "--memory-limit", "1GiB", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["first_action_step"] == 0 and row["oom_projected"] and row["status"] == "oom_projected"


@pytest.mark.parametrize("step", [2**52, 2**60, 10**25])
def test_a_step_out_of_range_is_one_line_naming_file_and_line(tmp_path, capsys, step):
    """Issue 24, item 11: steps of 2**60 were a ZeroDivisionError in the trend fit (neighbouring
    steps one float), steps near 10**25 a TypeError inside matplotlib. Steps are below 2**52."""
    trace = tmp_path / "far.csv"
    trace.write_text(",".join(TRACE_HEADER) + f"\n0,1.0,{GiB},,\n{step},2.0,{GiB},,\n")
    assert main(["analyze", str(trace)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{trace}:3: step" in err[0] and "Traceback" not in err[0]
    trace.write_text(",".join(TRACE_HEADER) + f"\n0,1.0,{GiB},,\n{2**52 - 1},2.0,{GiB},,\n")
    assert main(["analyze", str(trace)]) == 0  # the largest step there is


def test_the_headline_says_how_the_run_ended_and_apart_what_happened_on_the_way(tmp_path, capsys):
    """A leak that stops: the report comes up and clears, and the run ends healthy. The headline
    must not read "LEAK" for it."""
    trace = tmp_path / "stopped.csv"
    rows = (Sample(s, 1e9 + s, 8 * GiB + min(s, 4000) * 256 * 1024 + (s % 8) * 64 * MiB, 16 * GiB)
            for s in range(12000))
    write_trace(trace, rows)
    assert main(["analyze", str(trace), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["ended"] == "healthy" and row["leak_reported"], row
    (up, cleared), *_ = row["leak_report_spans"]
    assert up < 4000 < cleared
    assert main(["analyze", str(trace)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{trace}: ended healthy") and "LEAK" not in out
    assert f"on the way: leak reported at steps {up:,}-{cleared:,}, cleared" in out
