"""The host's memory end to end: the instrumented trainer on torch_xla (PJRT CPU), real processes.

The device's memory is a replayed flat trace (a TPU's HBM cannot exist here), so the host's series
and the device's differ and each judge is seen on its own; the host leaks for real (bytearrays
kept per step, or at every checkpoint save). The last test runs the trainer in a real memory
cgroup whose limit the kernel enforces with its OOM killer: there the device's source is this
process's resident memory, one memory, judged against the cgroup's limit.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ONE_BLOCK, REPO, hbm_watchdog_env, json_lines, logged, memory_cgroup

from watchdog.core.sample import Sample, labelled_trace_path, load_trace, write_trace

GiB, MiB = 1 << 30, 1 << 20
BUDGET = 2304 * MiB  # about 0.5 GiB of torch_xla's job memory (each page once) plus ~450 steps of 4 MiB/step
CGROUP_LIMIT = 2816 * MiB  # the group's usage counts the page cache its process faulted in: some room for it
TRAIN = ["train", *ONE_BLOCK, "--sample-every", "5", "--log-every", "50", "--host-memory-limit", str(BUDGET)]


@pytest.fixture
def flat_device(tmp_path) -> list[str]:
    trace = tmp_path / "device.csv"
    write_trace(trace, [Sample(i, 1e9 + i, 4 * GiB, 16 * GiB) for i in range(3)])
    return ["--memory-source", "replay", "--replay-trace", str(trace)]


def _host_action(records) -> dict:
    (acted,) = logged(records, "action_outcome")
    assert acted["memory"] == "host" and acted["action"] == "checkpoint_restart", acted
    assert "(host memory)" in acted["block"] and acted["outcome"] == "exit 42: restart requested"
    assert not [e for e in logged(records, "action_decided") if e["memory"] != "host"]  # the device stayed quiet
    return acted


@pytest.mark.slow
@pytest.mark.long
def test_a_host_leak_is_checkpointed_and_restarted_before_the_host_budget_and_the_device_stays_quiet(
        tmp_path, run_cli, flat_device):
    trace = tmp_path / "trace.csv"
    out = run_cli(*TRAIN, *flat_device, "--inject-leak", "host:4MiB/step", "--steps", "600",
                  "--trace-file", str(trace), "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert out.returncode == 42, out.stderr[-4000:]
    records = json_lines(out.stderr)
    acted = _host_action(records)
    assert acted["suspects"][0].startswith("+") and "bytearray[4194304] in host memory" in acted["suspects"][0]
    assert "attribute 'host' of LeakSinks" in acted["suspects"][0], acted["suspects"]
    assert acted["checkpoint"] and Path(acted["checkpoint"]).is_file()
    (watched,) = logged(records, "host_memory_watched")
    assert watched["domain"] == "budget" and watched["limit_bytes"] == BUDGET
    host = load_trace(labelled_trace_path(trace, "host"))
    assert max(s.bytes_used for s in host) < BUDGET and host[-1].bytes_limit == BUDGET
    assert {s.bytes_used for s in load_trace(trace)} == {4 * GiB}  # the device's series, replayed flat
    assert [e["memory"] for e in logged(records, "leak_detected")] == ["host"]


@pytest.mark.slow
@pytest.mark.long
def test_host_memory_kept_at_every_checkpoint_save_is_acted_on_and_its_holder_named(tmp_path, run_cli, flat_device):
    trace = tmp_path / "trace.csv"
    out = run_cli(*TRAIN, *flat_device, "--inject-leak", "checkpoint-ratchet:40MiB", "--checkpoint-every", "10",
                  "--steps", "600", "--trace-file", str(trace), "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert out.returncode == 42, out.stderr[-4000:]
    acted = _host_action(json_lines(out.stderr))
    assert "bytearray[41943040] in host memory" in acted["suspects"][0], acted["suspects"]
    assert "attribute 'buffers' of CheckpointStaging" in acted["suspects"][0], acted["suspects"]
    assert max(s.bytes_used for s in load_trace(labelled_trace_path(trace, "host"))) < BUDGET


@pytest.mark.slow
@pytest.mark.long
def test_a_clean_run_with_periodic_checkpoints_gets_no_host_action(tmp_path, run_cli, flat_device):
    trace = tmp_path / "trace.csv"
    out = run_cli(*TRAIN, *flat_device, "--checkpoint-every", "10", "--steps", "400",
                  "--trace-file", str(trace), "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert out.returncode == 0, out.stderr[-4000:]
    records = json_lines(out.stderr)
    assert not logged(records, "action_decided") and not logged(records, "leak_detected")
    assert "steps 400/400" in out.stdout
    assert len(load_trace(labelled_trace_path(trace, "host"))) >= 75  # it was watched all along


@pytest.mark.slow
@pytest.mark.long
def test_inside_a_memory_cgroup_the_leak_is_acted_on_before_the_kernels_oom_killer(tmp_path):
    trace = tmp_path / "trace.csv"
    with memory_cgroup(CGROUP_LIMIT) as procs:
        def join_the_group():
            procs.write_text(str(os.getpid()))

        out = subprocess.run(
            [sys.executable, "-m", "watchdog", "--log-format", "json", "train", *ONE_BLOCK, "--sample-every", "5",
             "--log-every", "50", "--inject-leak", "host:4MiB/step", "--steps", "600", "--trace-file", str(trace),
             "--checkpoint-dir", str(tmp_path / "ckpt")],
            capture_output=True, text=True, timeout=300, cwd=REPO, env=hbm_watchdog_env(), preexec_fn=join_the_group)
    # Finished, not -9: the kernel kills at the cgroup's limit, with no checkpoint and no traceback.
    assert out.returncode == 0, (out.returncode, out.stderr[-4000:])
    records = json_lines(out.stderr)
    (one,) = logged(records, "host_memory_is_device_memory")  # PJRT CPU: one memory, one series
    assert one["host_domain"] == "cgroup" and one["host_limit_bytes"] == CGROUP_LIMIT
    # The leak lives in the training state, so a reinit in process gives it back (measured), and
    # the device's policy, which this one series follows, tries that first.
    acted = logged(records, "action_outcome")
    assert acted and all(a["action"] == "checkpoint_reinit" for a in acted)
    assert "attribute 'host' of LeakSinks" in acted[0]["suspects"][0], acted[0]["suspects"]
    assert all(m["recovered_bytes"] > GiB // 2 for m in logged(records, "reinit_measured"))
    samples = load_trace(trace)
    assert samples[-1].bytes_limit == CGROUP_LIMIT and max(s.bytes_used for s in samples) < CGROUP_LIMIT
