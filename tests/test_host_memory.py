"""The host's memory, watched beside the device's (issue: a host leak acted on before the kernel's
OOM killer ends the job).

In process, on this machine's real /proc: a fake device source (a flat replay trace: a TPU's HBM
numbers cannot exist here) so that the device's series and the host's differ, and a real host leak
(bytearrays kept per step). The cgroup v2 files cannot exist on this machine (its memory controller
is cgroup v1), so their parsing is read from files laid out as the kernel lays them out.
"""

import json
import os
import threading

import psutil
import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ThisProcess, kernel_count, settled_job_memory, tick_per_read_daemon
from watchdog.core.config import WatchdogConfig
from watchdog.core.errors import ConfigError, InputError
from watchdog.core.sample import Sample, labelled_trace_path, load_trace, write_trace
from watchdog.core.verdict import Action
from watchdog.daemon.loop import WatchConfig
from watchdog.core.readings import DeviceMemory, MemoryReading
from watchdog.readers.outside import WithHost
from watchdog.daemon.timeaxis import TimeAxis
from watchdog.forensics.census import census, explain_leak
from watchdog.station.exporter import build_registry
from watchdog.readers.host_memory import HostMemory, RssSource, cgroups_listed, tightest_cgroup
from watchdog.runtime.sidecar import Watchdog
from watchdog.trainer.leaks import parse_leak_spec

MiB, GiB = 1 << 20, 1 << 30


# -- where the host's budget comes from ----------------------------------------------------------

def _group(path, files: dict[str, str]):
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name).write_text(text)


def test_a_cgroup_v2_pod_limit_on_a_parent_is_the_budget_and_its_working_set_the_series(tmp_path):
    # A pod's limit on the parent group, none on the container's own: the tightest over the process.
    _group(tmp_path / "kubepods" / "pod1", {"memory.max": str(6 * GiB)})
    _group(tmp_path / "kubepods" / "pod1" / "ctr", {
        "memory.max": "max", "memory.current": str(5 * GiB),
        "memory.stat": f"anon {3 * GiB}\nfile {2 * GiB}\ninactive_file {GiB}\nactive_file {GiB}\n",
        "memory.events": "low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n"})
    groups = cgroups_listed("0::/kubepods/pod1/ctr\n", tmp_path)
    assert [g.path.name for g in groups] == ["ctr", "pod1"]  # innermost first; the root has no memory.max
    group, limit = tightest_cgroup(groups, machine_bytes=16 * GiB)
    assert group.path.name == "pod1" and limit == 6 * GiB
    ctr = groups[0]
    assert ctr.limit() is None
    assert ctr.working_set() == 4 * GiB  # the inactive file cache is reclaimed before a kill
    assert ctr.oom_kills() == 1


def test_a_cgroup_v1_memory_controller_is_read_and_no_limit_is_none(tmp_path):
    _group(tmp_path / "memory" / "job", {
        "memory.limit_in_bytes": str(2 * GiB), "memory.usage_in_bytes": str(1536 * MiB),
        "memory.stat": f"cache {512 * MiB}\ntotal_inactive_file {256 * MiB}\n",
        "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"})
    _group(tmp_path / "memory", {"memory.limit_in_bytes": "9223372036854771712"})
    groups = cgroups_listed("12:pids:/job\n4:memory:/job\n1:name=systemd:/\n", tmp_path)
    assert [g.version for g in groups] == [1, 1]
    assert groups[0].working_set() == 1280 * MiB and groups[0].oom_kills() == 3
    assert groups[1].limit() is None  # v1's "no limit" is 2**63 rounded to a page
    assert tightest_cgroup(groups, machine_bytes=16 * GiB)[1] == 2 * GiB
    assert tightest_cgroup(groups, machine_bytes=GiB) is None  # a limit above the machine's memory is none


def test_no_memory_cgroup_limit_means_the_process_tree_against_the_machine_and_a_budget_wins():
    machine = psutil.virtual_memory().total
    watched = HostMemory(limit_bytes=None)
    if watched.domain == "cgroup":
        pytest.skip("this process runs in a memory cgroup with a limit: the cgroup e2e test covers it")
    reading = watched.read()
    assert watched.domain == "machine" and reading.bytes_limit == machine
    assert reading.bytes_used == reading.process_bytes  # this process and its children (none here)
    assert reading.process_bytes == pytest.approx(kernel_count(), abs=16 * MiB)  # each page once, no file pages
    assert reading.process_bytes < psutil.Process().memory_info().rss  # the libraries' pages are not the job's
    assert 0 < reading.available_bytes <= machine
    given = HostMemory(limit_bytes=3 * GiB).read()
    assert (given.domain, given.bytes_limit) == ("budget", 3 * GiB)


def test_host_settings_are_validated():
    with pytest.raises(ConfigError, match="host_memory_limit_bytes"):
        WatchdogConfig(host_memory_limit_bytes=0)
    with pytest.raises(ConfigError, match="host_sample_every"):
        WatchdogConfig(host_sample_every=0)


@pytest.mark.parametrize("text, kind, amount", [("host:4MiB/step", "host", 4 * MiB),
                                                ("checkpoint-ratchet:40MiB", "checkpoint-ratchet", 40 * MiB),
                                                ("checkpoint-ratchet:1GiB@300", "checkpoint-ratchet", GiB)])
def test_the_host_leaks_parse(text, kind, amount):
    spec = parse_leak_spec(text)
    assert (spec.kind, spec.amount) == (kind, amount)


@pytest.mark.parametrize("text, says", [("host:4MiB", "host:AMOUNT/step"),
                                        ("checkpoint-ratchet:40MiB/step", "checkpoint-ratchet:SIZE"),
                                        ("checkpoint-ratchet:0", "positive")])
def test_a_misspelt_host_leak_is_one_line(text, says):
    with pytest.raises(InputError, match=says):
        parse_leak_spec(text)


# -- the census names host buffers -------------------------------------------------------------

class StagingCache:
    def __init__(self):
        self.copies = []


def test_the_census_names_growing_python_buffers_and_numpy_arrays_with_their_holder():
    numpy = pytest.importorskip("numpy")
    cache, arrays = StagingCache(), StagingCache()
    baseline = census()
    for _ in range(12):
        cache.copies.append(bytearray(b"\x01") * MiB)
        arrays.copies.append(numpy.ones(32768, dtype=numpy.float64))  # 256 KiB each, owning its data
        arrays.copies.append(numpy.ones(32768, dtype=numpy.float64)[:10])  # a view: counted with its base only
    lines = explain_leak(baseline)
    assert lines[0] == ("+12 Python buffers bytearray[1048576] in host memory (+12.0 MiB); "
                        "held by list of 12 (attribute 'copies' of StagingCache)")
    assert any(line.startswith("+12 Python buffers numpy.float64[32768] in host memory (+3.0 MiB); held by list of 24")
               for line in lines), lines


def test_the_census_finds_buffers_in_a_dict_the_collector_does_not_track_and_names_its_holder():
    """A dict holding only numbers and buffers is untracked by CPython's collector: a cache of
    records keyed by step (issue 54's cache that keeps every record) was "no growing group found"."""
    import gc

    caches = {"records": {}}  # as a module's globals hold one (a list or a dict of them: the same)
    baseline = census()
    for step in range(20):
        caches["records"][step] = bytearray(b"\x01") * (256 << 10)
    assert not gc.is_tracked(caches["records"])
    lines = explain_leak(baseline)
    [line] = lines  # one holder, not one per key
    assert line.startswith("+20 Python buffers bytearray[262144] in host memory (+5.0 MiB); held by dict of 20 "
                           "(key 'records' of dict of 1 (local variable 'caches' of test_the_census_finds"), line


class DecodedImages:
    """A dataset that caches each decoded item under its index: `self.cache = {}` of arrays."""

    def __init__(self):
        self.cache = {}


def test_the_census_finds_an_untracked_dict_held_straight_as_an_objects_attribute():
    """The same cache held as an object's attribute (a Dataset's `self.cache`): in CPython 3.11+ an
    instance keeps its attributes inline, so the dict is no referent of any list, dict or deque;
    it was "no growing group" before."""
    import gc

    import numpy

    images = DecodedImages()
    baseline = census()
    for index in range(20):
        images.cache[index] = numpy.ones(65536, dtype=numpy.float32)  # 256 KiB each
    gc.collect()
    assert not gc.is_tracked(images.cache)
    [line] = explain_leak(baseline)
    assert line.startswith("+20 Python buffers numpy.float32[65536] in host memory (+5.0 MiB); held by dict of 20 "
                           "(attribute 'cache' of DecodedImages"), line


# -- the sidecar: two series, two judges -----------------------------------------------------

@pytest.fixture
def flat_device(tmp_path):
    """A device that never moves (a replayed TPU at 4 of 16 GiB): only the host can leak here."""
    trace = tmp_path / "device.csv"
    write_trace(trace, [Sample(i, 1e9 + i, 4 * GiB, 16 * GiB) for i in range(3)])
    return trace


class LeakyLoader:
    """A data loader's cache that keeps every encoded batch: a host leak beside the device."""

    def __init__(self):
        self.encoded = []


def test_a_host_leak_beside_a_quiet_device_is_checkpointed_and_restarted_before_the_host_budget(
        tmp_path, flat_device, events):
    budget = settled_job_memory() + 320 * MiB
    trace = tmp_path / "trace.csv"
    config = WatchdogConfig(sample_every=1, source="replay", replay_trace=flat_device, device="cpu",
                            trace_file=trace, host_memory_limit_bytes=budget)
    loader = LeakyLoader()
    action, peak = None, 0
    with Watchdog(config) as wd:
        for step in range(600):
            loader.encoded.append(bytearray(b"\x02") * MiB)
            action = wd.step(step)
            wd.drain()
            peak = max(peak, kernel_count())
            if action is not None and action.needs_checkpoint:
                break
        host_telemetry = wd.telemetry.host_series
        assert wd.carry_out(action, save=lambda: tmp_path / "ckpt-1.pt") is False  # exit 42: a restart
        scrape = generate_latest(build_registry(wd.telemetry)).decode()
    assert action is Action.CHECKPOINT_RESTART and peak < budget  # before the host's budget, and a restart
    assert wd.last_action.memory == "host" and wd.last_action.verdict.limit_bytes == budget
    assert not any(wd.telemetry.actions_snapshot().values())  # the device's judge stayed quiet
    assert not wd.verdict.leak_detected
    assert host_telemetry.actions_snapshot()[Action.CHECKPOINT_RESTART] == 1
    assert wd.last_action.suspects[0].endswith("held by list of %d (attribute 'encoded' of LeakyLoader)"
                                               % len(loader.encoded))
    (acted,) = events.named("action_outcome")
    assert acted["memory"] == "host" and "(host memory)" in acted["block"] and "LeakyLoader" in acted["block"]
    (report,) = events.named("leak_detected")
    assert report["memory"] == "host"
    # the host series everywhere the device's goes: metrics, its own trace, the flight record
    series = {(s.name, s.labels["device"]): s.value
              for family in text_string_to_metric_families(scrape) for s in family.samples}
    assert series["hbmwatch_memory_limit_bytes", "host"] == budget
    assert series["hbmwatch_oom_projected", "host"] == 1 and series["hbmwatch_oom_projected", "cpu"] == 0
    assert series["hbmwatch_host_available_bytes", "host"] > 0
    assert series["hbmwatch_host_process_resident_bytes", "host"] == host_telemetry.sample.bytes_used
    host_trace = load_trace(labelled_trace_path(trace, "host"))
    assert len(host_trace) == host_telemetry.samples_total and host_trace[-1].bytes_limit == budget
    assert {s.bytes_used for s in load_trace(trace)} == {4 * GiB}
    flight = json.loads((tmp_path / "trace.csv.flight.json").read_text())
    assert flight["host"]["domain"] == "budget" and flight["host"]["oom_projected_at"] is not None
    assert flight["oom_projected_at"] is None


def test_a_host_watched_every_k_steps_reads_on_its_own_cadence(tmp_path, flat_device):
    config = WatchdogConfig(sample_every=2, source="replay", replay_trace=flat_device, device="cpu",
                            host_sample_every=10, forensics=False)
    with Watchdog(config) as wd:
        for step in range(100):
            wd.step(step)
            wd.drain()
    assert wd.telemetry.samples_total == 50 and wd.telemetry.host_series.samples_total == 10


def test_where_the_device_is_this_process_there_is_one_series_against_the_tighter_budget(events):
    host_budget = settled_job_memory() + 2 * GiB
    for memory_limit, tighter in ((None, host_budget), (host_budget + GiB, host_budget),
                                  (host_budget - GiB, host_budget - GiB)):
        config = WatchdogConfig(sample_every=1, source="rss", device="cpu", memory_limit_bytes=memory_limit,
                                host_memory_limit_bytes=host_budget, forensics=False)
        with Watchdog(config) as wd:
            wd.step(0)
            wd.drain()
        assert wd.telemetry.host_series is None and wd.host_verdict is None
        assert wd.telemetry.host_reading.bytes_limit == tighter  # the same reading, on the device's telemetry
        assert wd.telemetry.sample.bytes_limit == tighter and wd.judge.limit_bytes == tighter
    said = events.named("host_memory_is_device_memory")
    assert len(said) == 3 and said[0]["host_limit_bytes"] == host_budget
    assert said[0]["judged"].startswith("the job's memory") and said[0]["limits"]["budget"] == host_budget
    assert said[2]["limits"]["budget"] == host_budget - GiB  # the tighter of --memory-limit and the host's budget


def test_with_the_host_watch_off_only_the_device_is_read(flat_device, events):
    config = WatchdogConfig(sample_every=1, source="replay", replay_trace=flat_device, device="cpu",
                            host_memory=False, forensics=False)
    with Watchdog(config) as wd:
        wd.step(0)
        wd.drain()
    assert wd.telemetry.host_series is None
    assert not events.named("host_memory_watched") and not events.named("host_memory_is_device_memory")


# -- the daemon: the target's host memory beside its chips ------------------------------------

class FlatChipLeakingHost:
    """One chip that never moves, read from a process (this one) whose host memory grows by `size`
    every `every` reads (1 MiB a read: a host leak; 16 MiB every 16: a checkpoint's ratchet), as a
    target's would until it gets the signal; then it saves and exits (the daemon stops)."""

    name = "scripted"

    def __init__(self, stop: threading.Event, size: int, every: int):
        self.stop, self.size, self.every, self.kept, self.reads = stop, size, every, [], 0
        self.signalled = lambda: False

    def read(self):
        self.reads += 1
        if self.signalled():
            self.stop.set()
        elif self.reads % self.every == 0:
            self.kept.append(bytearray(b"\x03") * self.size)
        return MemoryReading(4 * GiB, 16 * GiB, devices=(DeviceMemory("tpu:0", 4 * GiB, 16 * GiB),))


TickPerRead = tick_per_read_daemon()


@pytest.mark.parametrize("size, every", [(MiB, 1), (16 * MiB, 16)], ids=["per step", "ratchet"])
def test_the_watch_daemon_judges_the_targets_host_memory_beside_its_chips(tmp_path, size, every, events):
    axis = TimeAxis(interval_seconds=0.001, checkpoint_seconds=0.05, warmup_seconds=0.0, grace_seconds=0.1)
    config = WatchConfig(axis=axis, act=False, wait_seconds=1.0, trace_file=tmp_path / "trace.csv")
    stop = threading.Event()
    chips = FlatChipLeakingHost(stop, size, every)
    budget = settled_job_memory() + 480 * MiB
    daemon = TickPerRead(config, ThisProcess(), lambda process: WithHost(chips, process, budget), stop=stop)
    chips.signalled = lambda: bool(events.named("would_signal"))
    assert daemon.run() == 0
    assert set(daemon.devices) == {"tpu:0", "host"}
    host, chip = daemon.telemetry["host"], daemon.telemetry["tpu:0"]
    assert host.verdict.limit_bytes == budget and host.actions_snapshot()[Action.CHECKPOINT_RESTART] >= 1
    assert not any(chip.actions_snapshot().values()) and not chip.verdict.leak_detected
    first = events.named("would_signal")[0]  # --no-act: the signal that would have gone out
    assert first["device"] == "host" and first["signal"] == "SIGTERM"
    assert max(s.bytes_used for s in load_trace(labelled_trace_path(tmp_path / "trace.csv", "host"))) < budget


class LostChips(FlatChipLeakingHost):
    """The chips cannot be read at all (NVML's "GPU is lost", a TPU metrics endpoint down), while the
    target's host memory leaks."""

    def read(self):
        super().read()
        raise RuntimeError("GPU is lost")


def test_chips_that_cannot_be_read_never_blind_the_daemon_to_the_hosts_memory(tmp_path, events):
    """Issue 52: one failed chip read dropped the host's reading too, so `watch --gpu` or `--tpu` never
    acted on host RAM while the chips were unreadable. The failure is counted and said once; the host
    is judged, and acted on, all the same."""
    axis = TimeAxis(interval_seconds=0.001, checkpoint_seconds=0.05, warmup_seconds=0.0, grace_seconds=0.1)
    config = WatchConfig(axis=axis, act=False, wait_seconds=10.0, trace_file=tmp_path / "trace.csv")
    stop = threading.Event()
    chips = LostChips(stop, MiB, 1)
    budget = settled_job_memory() + 480 * MiB
    daemon = TickPerRead(config, ThisProcess(), lambda process: WithHost(chips, process, budget), stop=stop)
    chips.signalled = lambda: bool(events.named("would_signal"))
    assert daemon.run() == 0
    assert set(daemon.devices) == {"host"}
    assert daemon.telemetry["host"].actions_snapshot()[Action.CHECKPOINT_RESTART] >= 1
    assert events.named("would_signal")[0]["device"] == "host"
    failed = events.named("watch_error")
    assert len(failed) == 1 and "GPU is lost" in failed[0]["error"], "said once, however many reads failed"
    assert labelled_trace_path(tmp_path / "trace.csv", "host").exists(), "the host's trace keeps its name"


def test_chips_that_never_answer_end_the_daemon_in_one_line_after_the_wait(tmp_path, events):
    """Issue 53: `watch --tpu --tpu-chip X` with no metrics endpoint ran on forever after one warning.
    Chips with no reading for --wait-seconds while the target runs are bad input: InputError, exit 2."""
    from watchdog.core.errors import InputError

    axis = TimeAxis(interval_seconds=0.01, checkpoint_seconds=0.05, warmup_seconds=0.0, grace_seconds=0.1)
    config = WatchConfig(axis=axis, act=False, wait_seconds=0.3, trace_file=tmp_path / "trace.csv")
    stop = threading.Event()
    chips = LostChips(stop, 0, 1_000_000)  # the host flat: nothing to act on, only chips that never answer
    daemon = TickPerRead(config, ThisProcess(), lambda process: WithHost(chips, process, 64 * GiB), stop=stop)
    with pytest.raises(InputError, match=r"no reading of the devices for 0.3 s \(--wait-seconds\).*GPU is lost"):
        daemon.run()
    assert chips.reads >= 10, chips.reads  # it read on while waiting, the host judged all along


def test_a_process_trees_limit_is_the_hosts_budget():
    """The daemon's reader of a CPU job is the sidecar's `rss` source, by PID, with the kernel's limits."""
    (process,) = RssSource(3 * GiB, pid=os.getpid(), kernel_limits=True).read().each_device("process")
    assert (process.device, process.bytes_limit) == ("process", 3 * GiB)
    machine_or_cgroup = HostMemory().limit_bytes
    assert RssSource(pid=os.getpid(), kernel_limits=True).read().bytes_limit == machine_or_cgroup


# -- the post-mortem of a job the kernel killed -------------------------------------------------

def _flat(n=40):
    return [Sample(i, 1e9 + i, 4 * GiB, 16 * GiB) for i in range(n)]


def test_a_host_at_its_budget_in_the_flight_record_is_the_post_mortems_diagnosis():
    from watchdog.core.postmortem import diagnose

    host = {"domain": "cgroup", "bytes_used": 31 * GiB, "bytes_limit": 32 * GiB, "oom_kills": 1,
            "oom_projected_at": 3900}
    post = diagnose(_flat(), record={"last_step": 4000, "host": host})
    assert post.diagnosis == "host_memory"
    assert post.explanation.startswith("the host's memory ran out: 31.0 GiB of its 32.0 GiB budget (cgroup)")
    assert "projected the host's OOM at step 3,900" in post.explanation and "killed 1 process" in post.explanation


def test_a_host_far_from_its_budget_or_an_xla_message_is_not_a_host_diagnosis():
    from watchdog.core.oom_message import parse
    from watchdog.core.postmortem import diagnose

    roomy = {"domain": "machine", "bytes_used": 8 * GiB, "bytes_limit": 32 * GiB, "oom_kills": None,
             "oom_projected_at": None}
    assert diagnose(_flat(), record={"host": roomy}).diagnosis == "unknown"
    full = dict(roomy, bytes_used=31 * GiB)
    message = parse("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 1.00G. "
                    "That was not possible. There are 512.00M free.")
    assert message is not None
    assert diagnose(_flat(), record={"host": full}, oom=message).diagnosis != "host_memory"
