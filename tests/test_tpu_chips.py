"""Per-chip TPU memory through tpu-info's real client, against a real gRPC server on localhost.

The server (tests/libtpu_metrics_server.py) speaks libtpu's runtime-metrics protocol with the
stubs tpu-info ships and serves one trace per chip; nothing of ours is mocked. What stays
untested without a TPU: that libtpu itself serves these metrics under SPMD, the `libtpu.sdk`
reader, and PCI detection of the chip type.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("tpu_info")
from libtpu_metrics_server import LibtpuMetricsServer  # noqa: E402
from test_exporter import scrape, value  # noqa: E402
from tpu_info.device import TpuChip  # noqa: E402
from tpu_info.metrics import get_chip_usage  # noqa: E402

from watchdog.core.config import WatchdogConfig  # noqa: E402
from watchdog.core.sample import Sample  # noqa: E402
from watchdog.station.exporter import serve_metrics  # noqa: E402
from watchdog.runtime.sidecar import Watchdog  # noqa: E402
from watchdog.readers.sources import DeviceMemory, SourceUnavailable, TpuRuntimeSource, fullest  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
HBM = 16 * GiB  # a v5e chip
STEPS = 640
LEAKY_CHIP = 2


def chip_traces(steps: int = STEPS, leak_per_step: int = 8 * MiB) -> dict[int, list[Sample]]:
    """Four chips with the same sharded state and activation sawtooth; chip 2 also leaks."""
    traces = {}
    for chip in range(4):
        base = 6 * GiB + chip * 64 * MiB
        traces[chip] = [Sample(step, float(step), base + (step % 4) * 256 * MiB
                               + (leak_per_step * step if chip == LEAKY_CHIP else 0), HBM)
                        for step in range(steps)]
    return traces


def test_tpu_infos_own_client_reads_every_chip_from_the_server():
    traces = chip_traces()
    with LibtpuMetricsServer(traces) as server:
        first = get_chip_usage(TpuChip.V5E, addr=server.addr)
        second = get_chip_usage(TpuChip.V5E, addr=server.addr)
    assert [u.device_id for u in first] == [0, 1, 2, 3]
    assert [u.memory_usage for u in first] == [traces[c][0].bytes_used for c in range(4)]
    assert [u.memory_usage for u in second] == [traces[c][1].bytes_used for c in range(4)]
    assert {u.total_memory for u in first} == {HBM}


def test_the_tpu_source_reports_the_fullest_chip_and_keeps_every_chip():
    traces = chip_traces()
    with LibtpuMetricsServer(traces) as server:
        source = TpuRuntimeSource(grpc_addr=server.addr, chip_type=TpuChip.V5E)
        readings = [source.read() for _ in range(3)]
    for row, reading in enumerate(readings):
        assert [d.device for d in reading.devices] == ["tpu:0", "tpu:1", "tpu:2", "tpu:3"]
        assert [d.bytes_used for d in reading.devices] == [traces[c][row].bytes_used for c in range(4)]
        fullest_chip = max(range(4), key=lambda c: traces[c][row].bytes_used)
        assert (reading.bytes_used, reading.bytes_limit) == (traces[fullest_chip][row].bytes_used, HBM)


def test_fullest_means_least_headroom_when_chips_differ_in_size():
    small_but_full = DeviceMemory("tpu:0", 15 * GiB, 16 * GiB)
    big_and_roomy = DeviceMemory("tpu:1", 20 * GiB, 32 * GiB)
    assert fullest([big_and_roomy, small_but_full]).bytes_used == 15 * GiB
    assert fullest([DeviceMemory("tpu:0", 5), DeviceMemory("tpu:1", 9)]).bytes_used == 9  # no limits: most used
    with pytest.raises(SourceUnavailable):
        fullest([])


def test_nothing_listening_is_a_read_error_not_a_hang():
    source = TpuRuntimeSource(grpc_addr="localhost:1", chip_type=TpuChip.V5E)
    with pytest.raises(Exception) as raised:
        source.read()
    assert "UNAVAILABLE" in str(raised.value) or "failed to connect" in str(raised.value).lower()


def test_the_leaking_chip_drives_the_decision_and_every_chip_is_exported(tmp_path):
    """A watchdog on the gRPC source: chip 2 leaks while the others hold, so the detector (which
    sees only the fullest chip) calls the leak, and a real scrape shows all four chips."""
    traces = chip_traces()
    # The device as a TPU job names it: guessed, it would depend on whether torch_xla was imported first.
    config = WatchdogConfig(sample_every=1, device="xla:0", trace_file=tmp_path / "trace.csv", stall_after_seconds=600)
    with LibtpuMetricsServer(traces) as server:
        source = TpuRuntimeSource(grpc_addr=server.addr, chip_type=TpuChip.V5E)
        with Watchdog(config, source=source) as watchdog, serve_metrics(watchdog.telemetry, 0) as metrics:
            for step in range(STEPS):
                watchdog.step(step)
                assert watchdog.drain(timeout=10)  # one read per step, so server row == step
            samples = scrape(metrics)
    verdict = watchdog.verdict
    assert verdict.oom_projected and verdict.leak_detected, verdict.explanation
    assert math.isfinite(verdict.projected_oom_steps)
    last = STEPS - 1
    assert value(samples, "hbmwatch_memory_used_bytes", device="xla:0") == traces[LEAKY_CHIP][last].bytes_used
    for chip in range(4):
        assert value(samples, "hbmwatch_chip_memory_used_bytes", device=f"tpu:{chip}") == traces[chip][last].bytes_used
        assert value(samples, "hbmwatch_chip_memory_limit_bytes", device=f"tpu:{chip}") == HBM
    assert value(samples, "hbmwatch_build_info", source="tpu") == 1.0
    assert value(samples, "hbmwatch_memory_used_bytes", device="host") > 0  # the host, served beside the chips
