"""The Prometheus exporter, scraped for real over HTTP and read with prometheus_client's parser."""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from watchdog import __version__
from watchdog.core import goodput
from watchdog.core.config import WatchdogConfig
from watchdog.core.readings import AllocatorMemory
from watchdog.core.errors import InputError
from watchdog.core.sample import Sample, write_trace
from watchdog.core.verdict import Action, Status, Verdict
from watchdog.station.exporter import serve_metrics
from watchdog.runtime.allocator_figures import AllocatorFigures
from watchdog.runtime.checkpoint_figures import CheckpointFigures
from watchdog.runtime.compile_watch import CompileFigures
from watchdog.readers.host_memory import HostReading
from watchdog.records.job_ledger import GoodputFigures
from watchdog.runtime.sidecar import Watchdog
from watchdog.station.telemetry import Telemetry

MiB, GiB = 1 << 20, 1 << 30
ALLOWED_LABELS = {"device", "rank", "action", "version", "source", "le", "cause"}


def scrape(server) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} from a real HTTP scrape of the endpoint."""
    with urllib.request.urlopen(server.url, timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    matches = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(matches) == 1, f"{name}{labels}: {len(matches)} series"
    return matches[0]


def names(samples: dict) -> set[str]:
    return {name for name, _ in samples}


def leaking_telemetry() -> Telemetry:
    t = Telemetry(device="xla:0", rank=3, source="xla")
    t.sample = Sample(step=1200, timestamp=1_700_000_000.5, bytes_used=900 * MiB, bytes_limit=1024 * MiB,
                      peak_bytes_used=950 * MiB)
    t.verdict = Verdict(step=1200, timestamp=1_700_000_000.5, status=Status.OOM_PROJECTED, floor_bytes=800 * MiB,
                        excursion_bytes=60 * MiB, limit_bytes=1000 * MiB, slope_bytes_per_step=65536.0,
                        slope_low_bytes_per_step=60000.0, slope_high_bytes_per_step=70000.0,
                        slope_bytes_per_second=131072.0, projected_oom_step=3360, projected_oom_steps=2160.0,
                        projected_oom_seconds=1080.0, projected_oom_steps_pessimistic=2000.0, window_steps=640.0,
                        leak_detected=True)
    t.training_step = 1210
    t.samples_total, t.sample_errors_total, t.restarts_total = 120, 2, 1
    compiles = t.part(CompileFigures)  # each component's own figures, served with the series
    compiles.compilations, compiles.detected, compiles.steps_per_recompilation = 7, True, 2.5
    t.count_action(Action.WARN)
    t.count_action(Action.CHECKPOINT_REINIT)
    t.count_action(Action.CHECKPOINT_REINIT)
    for seconds in (0.3, 4.0, 40.0):
        t.part(CheckpointFigures).observe_save(seconds)
    # a caching allocator's figures (the cuda source's; every name the exporter can serve is here)
    t.part(AllocatorFigures).observe(AllocatorMemory(700 * MiB, 100 * MiB, 950 * MiB))
    # one memory (the rss source's case): the host's own figures ride on the device's series
    t.host_reading = HostReading(900 * MiB, 1024 * MiB, "cgroup", 880 * MiB, 20 * 1024 * MiB, oom_kills=0)
    # the job's time so far: 10 s to start, 80 s of steps (5 s of them compiling), a 5 s save
    t.part(GoodputFigures).account = goodput.account([
        {"v": 1, "event": "process", "t": 10.0, "started": 0.0, "step": 0},
        {"v": 1, "event": "span", "t": 10.0, "cause": "startup", "seconds": 10.0},
        {"v": 1, "event": "steps", "t": 90.0, "first": 0, "last": 1200, "seconds": 80.0, "compile_seconds": 5.0},
        {"v": 1, "event": "span", "t": 95.0, "cause": "checkpoint_save", "seconds": 5.0, "step": 1200}])
    return t


def test_the_host_series_is_served_beside_the_devices_one_family_per_metric(served):
    device = leaking_telemetry()
    device.host_reading = None
    host = device.host_series = Telemetry(device="host", rank=3, source="host-cgroup")
    host.sample = Sample(step=1200, timestamp=1_700_000_000.5, bytes_used=30 * 1024 * MiB, bytes_limit=32 * 1024 * MiB)
    host.host_reading = HostReading(30 * 1024 * MiB, 32 * 1024 * MiB, "cgroup", 29 * 1024 * MiB, 3 * 1024 * MiB,
                                    oom_kills=2)
    host.count_action(Action.CHECKPOINT_RESTART)
    samples = scrape(served(device))
    assert value(samples, "hbmwatch_memory_used_bytes", device="host") == 30 * 1024 * MiB
    assert value(samples, "hbmwatch_memory_used_bytes", device="xla:0") == 900 * MiB
    assert value(samples, "hbmwatch_build_info", device="host", source="host-cgroup") == 1
    assert value(samples, "hbmwatch_actions_total", device="host", action="checkpoint_restart") == 1
    assert value(samples, "hbmwatch_host_process_resident_bytes", device="host") == 29 * 1024 * MiB
    assert value(samples, "hbmwatch_host_available_bytes", device="host") == 3 * 1024 * MiB
    assert value(samples, "hbmwatch_host_oom_kills_total", device="host") == 2
    with urllib.request.urlopen(served(device).url, timeout=5) as response:
        text = response.read().decode()
    assert text.count("# TYPE hbmwatch_memory_used_bytes gauge") == 1  # merged: one family, two series
    checkpointed = {dict(labels)["device"] for name, labels in samples if name == "hbmwatch_checkpoint_seconds_count"}
    assert checkpointed == {"xla:0"}, "a component's figures are served with the series that owns them, once"


def test_a_components_figures_are_made_once_per_series_and_labelled_when_scraped(served):
    t = Telemetry()
    figures = t.part(CheckpointFigures)
    assert t.part(CheckpointFigures) is figures, "whoever asks second gets the same figures"
    t.device, t.rank = "xla:1", 5  # the sidecar names its device at start, after the trainer asked
    samples = scrape(served(t))
    assert value(samples, "hbmwatch_checkpoint_seconds_count", device="xla:1", rank="5") == 0  # there before any save
    assert "hbmwatch_checkpoint_size_bytes" not in names(samples)  # unknown until the disk is read
    figures.observe_save(0.2)
    figures.observe_space(free_bytes=10 * MiB, checkpoint_bytes=2 * MiB)
    samples = scrape(served(t))
    assert value(samples, "hbmwatch_checkpoint_seconds_bucket", le="0.25") == 1
    assert value(samples, "hbmwatch_checkpoint_size_bytes") == 2 * MiB
    assert value(samples, "hbmwatch_checkpoint_disk_free_bytes") == 10 * MiB


@pytest.fixture
def served():
    servers = []

    def serve(telemetry: Telemetry, port: int = 0, **kwargs):
        server = serve_metrics(telemetry, port, addr="127.0.0.1", **kwargs)
        servers.append(server)
        return server

    yield serve
    for server in servers:
        server.close()


def test_every_design_metric_is_served_in_base_units_from_the_cache(served):
    samples = scrape(served(leaking_telemetry()))
    base = {"device": "xla:0", "rank": "3"}
    assert value(samples, "hbmwatch_memory_used_bytes", **base) == 900 * MiB
    assert value(samples, "hbmwatch_memory_peak_bytes") == 950 * MiB
    assert value(samples, "hbmwatch_memory_limit_bytes") == 1000 * MiB  # the effective (smaller) limit
    assert value(samples, "hbmwatch_memory_floor_bytes") == 800 * MiB
    assert value(samples, "hbmwatch_memory_excursion_bytes") == 60 * MiB
    assert value(samples, "hbmwatch_leak_slope_bytes_per_step") == 65536.0
    assert value(samples, "hbmwatch_leak_slope_low_bytes_per_step") == 60000.0
    assert value(samples, "hbmwatch_leak_slope_high_bytes_per_step") == 70000.0
    assert value(samples, "hbmwatch_leak_detected") == 1.0
    assert value(samples, "hbmwatch_oom_projected") == 1.0
    assert value(samples, "hbmwatch_projected_oom_steps") == 2160.0
    assert value(samples, "hbmwatch_projected_oom_steps_pessimistic") == 2000.0
    assert value(samples, "hbmwatch_projected_oom_seconds") == 1080.0
    assert value(samples, "hbmwatch_training_step") == 1210
    assert value(samples, "hbmwatch_last_sample_timestamp_seconds") == 1_700_000_000.5
    assert value(samples, "hbmwatch_actions_total", action="warn") == 1
    assert value(samples, "hbmwatch_actions_total", action="checkpoint_reinit") == 2
    assert value(samples, "hbmwatch_actions_total", action="checkpoint_restart") == 0
    assert value(samples, "hbmwatch_restarts_total") == 1
    assert value(samples, "hbmwatch_samples_total") == 120
    assert value(samples, "hbmwatch_sample_errors_total") == 2
    assert value(samples, "hbmwatch_xla_compilations_total") == 7
    assert value(samples, "hbmwatch_recompilation_detected") == 1
    assert value(samples, "hbmwatch_steps_per_recompilation") == 2.5
    assert value(samples, "hbmwatch_build_info", version=__version__, source="xla") == 1
    assert value(samples, "hbmwatch_training_stalled") == 0
    assert value(samples, "hbmwatch_seconds_since_last_step") >= 0
    # the histogram: cumulative buckets in seconds, +Inf equal to the count
    assert value(samples, "hbmwatch_checkpoint_seconds_bucket", le="0.5") == 1
    assert value(samples, "hbmwatch_checkpoint_seconds_bucket", le="5.0") == 2
    assert value(samples, "hbmwatch_checkpoint_seconds_bucket", le="+Inf") == 3
    assert value(samples, "hbmwatch_checkpoint_seconds_count") == 3
    assert value(samples, "hbmwatch_checkpoint_seconds_sum") == pytest.approx(44.3)
    assert value(samples, "hbmwatch_allocator_allocated_bytes") == 700 * MiB
    assert value(samples, "hbmwatch_allocator_split_bytes") == 100 * MiB
    assert value(samples, "hbmwatch_allocator_reserved_bytes") == 950 * MiB
    assert value(samples, "hbmwatch_allocator_breakdowns_total") == 1
    assert value(samples, "hbmwatch_elapsed_seconds_total") == 95.0
    assert value(samples, "hbmwatch_goodput_seconds_total") == 75.0
    assert value(samples, "hbmwatch_badput_seconds_total", cause="startup") == 15.0
    assert value(samples, "hbmwatch_badput_seconds_total", cause="checkpoint_save") == 5.0
    labels = {name for _, ls in samples for name, _ in ls}
    assert labels <= ALLOWED_LABELS
    assert all(dict(ls).get("device") == "xla:0" and dict(ls).get("rank") == "3" for _, ls in samples)


def test_before_any_verdict_nothing_is_made_up(served):
    samples = scrape(served(Telemetry(device="cpu", source="rss")))
    assert value(samples, "hbmwatch_projected_oom_steps") == math.inf  # "none in sight", not 0
    assert value(samples, "hbmwatch_projected_oom_seconds") == math.inf
    assert value(samples, "hbmwatch_leak_detected") == 0
    assert value(samples, "hbmwatch_oom_projected") == 0
    unknown = {"hbmwatch_memory_used_bytes", "hbmwatch_memory_floor_bytes", "hbmwatch_memory_limit_bytes",
               "hbmwatch_leak_slope_bytes_per_step", "hbmwatch_xla_compilations_total",
               "hbmwatch_recompilation_detected", "hbmwatch_steps_per_recompilation",
               "hbmwatch_allocator_allocated_bytes"}
    assert not names(samples) & unknown  # absent until known (compilations, recompilation: absent off XLA; the allocator's: absent off CUDA)


def test_port_is_base_plus_local_rank_and_zero_means_any_free_port(served):
    base = _free_port_pair()
    server = served(Telemetry(rank=1), base, local_rank=1)
    assert server.port == base + 1 and server.url == f"http://127.0.0.1:{base + 1}/metrics"
    any_port = served(Telemetry(rank=2), 0, local_rank=2)
    assert any_port.port not in (0, base + 1)
    # each endpoint has its own registry: each reports its own rank only
    assert {dict(ls)["rank"] for _, ls in scrape(server)} == {"1"}
    assert {dict(ls)["rank"] for _, ls in scrape(any_port)} == {"2"}


def test_a_busy_port_is_a_one_line_input_error(served):
    taken = served(Telemetry())
    with pytest.raises(InputError, match=rf"metrics port {taken.port} .* already in use"):
        serve_metrics(Telemetry(), taken.port, addr="127.0.0.1")
    with pytest.raises(InputError, match="above 65535"):
        serve_metrics(Telemetry(), 65535, local_rank=1, addr="127.0.0.1")
    with pytest.raises(InputError, match="non-negative"):
        serve_metrics(Telemetry(), -1, addr="127.0.0.1")


def test_close_frees_the_port(served):
    server = serve_metrics(Telemetry(), 0, addr="127.0.0.1")
    port = server.port
    server.close()
    again = served(Telemetry(), port)
    assert again.port == port


def test_a_real_watchdog_run_is_exported_as_the_sidecar_sees_it(tmp_path, served):
    """A real Watchdog (replay source, a leaking trace) fills the cache; scrapes agree with it."""
    trace = tmp_path / "leak.csv"
    write_trace(trace, [Sample(step, 1000.0 + step, 500 * MiB + step * 256 * 1024 + (step % 7) * MiB,
                               2048 * MiB) for step in range(600)])
    # The device's series alone: the host's, served beside it, is tests/test_host_memory.py's.
    config = WatchdogConfig(sample_every=1, source="replay", replay_trace=trace, device="cpu", host_memory=False)
    with Watchdog(config) as wd:
        server = served(wd.telemetry)
        for step in range(600):
            wd.step(step)
            assert wd.drain(5.0)
        samples = scrape(server)
        verdict = wd.verdict
    assert value(samples, "hbmwatch_samples_total") == wd.telemetry.samples_total >= 590
    assert value(samples, "hbmwatch_memory_used_bytes") == wd.telemetry.sample.bytes_used
    assert value(samples, "hbmwatch_memory_limit_bytes") == 2048 * MiB
    assert value(samples, "hbmwatch_build_info", source="replay") == 1
    assert verdict is not None and verdict.status is not Status.WARMING_UP
    assert value(samples, "hbmwatch_memory_floor_bytes") == pytest.approx(verdict.floor_bytes)
    assert value(samples, "hbmwatch_leak_slope_bytes_per_step") == pytest.approx(verdict.slope_bytes_per_step)
    assert value(samples, "hbmwatch_leak_slope_bytes_per_step") == pytest.approx(256 * 1024, rel=0.2)
    assert value(samples, "hbmwatch_leak_detected") == float(verdict.leak_detected)
    assert value(samples, "hbmwatch_oom_projected") == float(verdict.oom_projected)
    assert value(samples, "hbmwatch_projected_oom_steps") == verdict.projected_oom_steps


def test_a_cuda_sources_allocator_figures_are_served_beside_its_series(served):
    """The sidecar passes the allocator's figures of each reading on (a stand-in for torch.cuda: no GPU here)."""
    from test_sources import Allocator, state

    from watchdog.readers.sources import CudaSource

    source = CudaSource("cuda:0", cuda=Allocator(state(4, 6, split=0.5)))
    with Watchdog(WatchdogConfig(sample_every=1, device="cuda:0", host_memory=False, forensics=False),
                  source=source) as wd:
        server = served(wd.telemetry)
        wd.step(0)
        assert wd.drain(5.0)
        samples = scrape(server)
    assert value(samples, "hbmwatch_memory_used_bytes", device="cuda:0") == 4.5 * GiB
    assert value(samples, "hbmwatch_allocator_allocated_bytes", device="cuda:0") == 4 * GiB
    assert value(samples, "hbmwatch_allocator_split_bytes", device="cuda:0") == 0.5 * GiB
    assert value(samples, "hbmwatch_allocator_reserved_bytes", device="cuda:0") == 6 * GiB
    assert value(samples, "hbmwatch_allocator_breakdowns_total", device="cuda:0") == 1, "its first sample's"


@pytest.mark.slow
def test_serving_and_scraping_never_import_torch():
    """Scrapes read the cache only: the exporter must not even load torch or torch_xla."""
    code = (
        "import sys, urllib.request\n"
        "from watchdog.station.exporter import serve_metrics\n"
        "from watchdog.station.telemetry import Telemetry\n"
        "s = serve_metrics(Telemetry(device='xla:0'), 0, addr='127.0.0.1')\n"
        "body = urllib.request.urlopen(s.url).read().decode()\n"
        "s.close()\n"
        "assert 'hbmwatch_build_info' in body\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_xla')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _free_port_pair() -> int:
    """A base port whose successor is free too (base + local rank 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            if base >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
        return base
    raise RuntimeError("no free pair of ports")


def test_a_leak_reported_with_no_oom_in_sight_is_exported_as_one_signal_not_the_other(served):
    """The two signals never merge: a slow leak is reported while no OOM is projected to act on."""
    t = leaking_telemetry()
    t.verdict = t.verdict._replace(status=Status.SUSPECT, projected_oom_steps=90_000.0)
    samples = scrape(served(t))
    assert value(samples, "hbmwatch_leak_detected") == 1.0
    assert value(samples, "hbmwatch_oom_projected") == 0.0
