"""`watch --tpu`: every chip of the host through libtpu's runtime metrics, from outside the job.

The chips are served by a real gRPC server speaking libtpu's protocol with tpu-info's own stubs
(tests/libtpu_metrics_server.py), replaying one trace per chip; the daemon reads them with
tpu-info's real client, in a process of its own. One chip leaks, three stay flat: the daemon must
name the leaking chip and signal the job before that chip's trace reaches its capacity. What stays
untested without a TPU: that libtpu serves these numbers for a live job, and which process holds
which chip (libtpu reports chips, not processes; the job to signal is given by --pid).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("tpu_info")
from conftest import REPO, hbm_watchdog_env, json_lines  # noqa: E402
from libtpu_metrics_server import LibtpuMetricsServer  # noqa: E402

from watchdog.core.sample import Sample  # noqa: E402

pytestmark = pytest.mark.slow

MiB, GiB = 1 << 20, 1 << 30
HBM = 16 * GiB
LEAK_PER_READ = 24 * MiB
LEAKY_CHIP = 2
READS = 2000


def chip_traces() -> dict[int, list[Sample]]:
    traces = {}
    for chip in range(4):
        base = 6 * GiB + chip * 64 * MiB
        traces[chip] = [Sample(i, float(i), min(HBM, base + (i % 4) * 192 * MiB
                                                 + (LEAK_PER_READ * i if chip == LEAKY_CHIP else 0)), HBM)
                        for i in range(READS)]
    return traces


def first_full_read(traces) -> int:
    return next(i for i, s in enumerate(traces[LEAKY_CHIP]) if s.bytes_used >= HBM)


def test_the_leaking_chip_is_named_and_the_job_signalled_before_it_fills():
    traces = chip_traces()
    job = subprocess.Popen([sys.executable, str(REPO / "tests" / "jobs" / "hog.py"), "--tag", "tpu-chips"],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline().startswith("ready")
        with LibtpuMetricsServer(traces) as server:
            daemon = subprocess.run(
                [sys.executable, "-m", "watchdog", "--log-format", "json", "watch", "--pid", str(job.pid),
                 "--tpu", "--tpu-address", server.addr, "--tpu-chip", "v5e", "--interval", "0.05",
                 "--checkpoint-seconds", "1", "--warmup-seconds", "0", "--wait-seconds", "0"],
                capture_output=True, text=True, timeout=240, cwd=REPO, env=hbm_watchdog_env())
            reads_at_exit = server.service.usage_requests
        job.wait(timeout=30)
    finally:
        job.kill()
    events = json_lines(daemon.stderr)
    signalled = [e for e in events if e["event"] == "target_signalled"]
    assert daemon.returncode == 0, daemon.stderr[-3000:]
    assert len(signalled) == 1, [e["event"] for e in events]
    assert signalled[0]["device"] == f"tpu:{LEAKY_CHIP}" and signalled[0]["pid"] == job.pid
    assert job.returncode == -15  # SIGTERM reached the job
    # The signal went out before the leaking chip's trace reached its capacity, with room for the checkpoint.
    assert reads_at_exit < first_full_read(traces)
    chips = {e.get("device") for e in events if e["event"] == "action_decided"} | {signalled[0]["device"]}
    assert chips == {f"tpu:{LEAKY_CHIP}"}  # the flat chips never asked for anything


def test_no_chips_and_no_chip_type_is_one_line_and_exit_2():
    out = subprocess.run([sys.executable, "-m", "watchdog", "watch", "--pid", str(os.getpid()), "--tpu"],
                         capture_output=True, text=True, timeout=60, cwd=REPO, env=hbm_watchdog_env())
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "--tpu:" in out.stderr and "Traceback" not in out.stderr
