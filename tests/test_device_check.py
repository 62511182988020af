"""Issue 41's device check (tests/device/cuda_check.py), on a machine without a GPU: what it does
here for real (one line and exit 2), its report from made-up figures, and the unmodified job it
stops from outside. The check itself runs on a lent GPU machine (tests/device/run.sh)."""

from __future__ import annotations

import importlib.util
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
    assert check.main(["--budget-gib", "0"]) == 2 and "must be positive" in capsys.readouterr().err


def test_the_report_has_a_line_a_case_with_its_figures(check):
    results = {"device": {"name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "cuda": "13.0", "budget_bytes": 8 * GiB},
               "seconds": 181.5,
               "leak": {"passed": True, "actions": 3, "steps": 1600, "first_action": "CHECKPOINT_REINIT", "action_step": 431,
                        "used_at_action": 7 * GiB, "limit_at_action": 8 * GiB, "oom_step": None,
                        "suspects": ["+400 tensors float32[2048x2048] on cuda:0"], "sync_error": None},
               "leak-unwatched": {"passed": True, "oom_step": 497, "parsed": {"kind": "allocation"}},
               "clean": {"passed": True, "steps": 600, "actions": 0, "leak": False, "sync_error": None},
               "fragmentation": {"passed": False, "first_action": None},
               "cost": {"passed": True, "step_call_ns": 180, "step_ms": 1.2, "bare_steps_per_s": 830.0,
                        "watched_steps_per_s": 828.1, "ratio": 0.9977, "blocks": 12}}
    report = check.render(results)
    lines = report.splitlines()
    assert lines[0].startswith("# cuda_check on NVIDIA H100 80GB HBM3 (torch 2.11.0, CUDA 13.0), budget 8.0 GiB")
    cases = [line.split(":")[0] for line in lines[2:]]
    assert cases == ["- leak", "- leak-unwatched", "- clean", "- fragmentation", "- fragmentation-unwatched",
                     "- cache", "- postmortem", "- watch", "- cost"]
    assert ("- leak: pass: 3 actions in 1600 steps (at least 3 owed), first action CHECKPOINT_REINIT at step 431 "
            "(memory 7.00 GiB of 8.00 GiB)") in report
    assert "unwatched, OutOfMemoryError at step 497" in report
    assert "- fragmentation: FAIL" in report and "- watch: FAIL" in report, "a case that did not run fails"
    assert "steps/s without 830.0, with 828.1 (ratio 0.9977, blocks 12)" in report


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
