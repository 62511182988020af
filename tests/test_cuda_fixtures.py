"""What a real GPU said, replayed: the readings the device check recorded on an H100
(tests/device/cuda_check.py writes them; they are kept in tests/data/cuda/, whose README says where
they came from).

The cuda source reads the device's free bytes every sample and the allocator's breakdown only when
it is needed (readers/breakdown_plan.py). That its judgement is the one a breakdown at every sample
gave is shown three ways here: on the H100's own readings (`memory_stats.json`: the breakdown and
the device reading of the same moments); on the device check's cases replayed on a model of the
caching allocator (tests/cuda_allocator.py) that first gives the H100's own figures (`report.json`:
the steps of the OOMs and of the actions, the bytes at each); and on `readings.json`, every sample's
two readings side by side, once a device run has recorded it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from cuda_allocator import Case, OutOfMemory, run_watched

from watchdog.core.judge import Judge
from watchdog.core.oom_message import parse
from watchdog.core.sample import Sample
from watchdog.readers.outside import GpuProcessesReader, NvmlGpus
from watchdog.forensics.allocator_history import live_blocks
from watchdog.readers.breakdown_plan import BreakdownPlan
from watchdog.readers.sources import CudaSource, fresh_reading
from watchdog.station.station import Station
from watchdog.station.telemetry import Telemetry

RECORDED = Path(__file__).parent / "data" / "cuda"
MiB = 1 << 20


def recorded(name: str):
    return json.loads((RECORDED / name).read_text())


def check_script():
    spec = importlib.util.spec_from_file_location("cuda_check", Path(__file__).parent / "device" / "cuda_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def quiet():
    """A replay judges hundreds of samples: their lines are the station's, tested elsewhere."""
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


class Moment:
    """torch.cuda as the cuda source calls it, answering from one recorded moment (`now`): the
    device's free bytes and the allocator's breakdown, as `readings.json` records them."""

    def __init__(self, fraction: float, now: dict):
        self.fraction, self.now, self.breakdowns = fraction, now, 0

    def is_initialized(self) -> bool:
        return True

    def memory_stats_as_nested_dict(self, index: int) -> dict:
        self.breakdowns += 1
        now = self.now
        return {"allocated_bytes": {"all": {"current": now["allocated"], "peak": now["peak"]}},
                "reserved_bytes": {"all": {"current": now["reserved"]}},
                "inactive_split_bytes": {"all": {"current": now["split"]}}}

    def mem_get_info(self, index: int) -> tuple[int, int]:
        return self.now["free"], self.now["total"]

    def get_per_process_memory_fraction(self, index: int) -> float:
        return self.fraction


def as_recorded(readings: list[dict]) -> dict:
    """memory_stats.json's readings (the whole flat memory_stats() and mem_get_info of one moment,
    every 100 steps of the clean case) in readings.json's form."""
    records = [{"kind": "sample", "step": r["step"], "t": 1.7e9 + 0.005 * r["step"],
                "free": r["mem_get_info"][0], "total": r["mem_get_info"][1],
                "allocated": r["memory_stats"]["allocated_bytes.all.current"],
                "split": r["memory_stats"]["inactive_split_bytes.all.current"],
                "reserved": r["memory_stats"]["reserved_bytes.all.current"],
                "peak": r["memory_stats"]["allocated_bytes.all.peak"]} for r in readings]
    return {"fraction": readings[0]["fraction"], "records": records}


def replayed(case: dict, plan: BreakdownPlan) -> tuple[list, list]:
    """The recorded readings through the cuda source with `plan`, judged by a station as the
    sidecar's, each rebuild measured where it was: the readings, and (step, status, action) a sample."""
    records = case["records"]
    cuda = Moment(case["fraction"], records[0])
    source, station = CudaSource("cuda:0", cuda=cuda, plan=plan), Station(Judge(), Telemetry(device="cuda:0"))
    readings, judged = [], []
    for record in records:
        cuda.now = record
        if record["kind"] == "fresh":
            station.reinit_finished(float(fresh_reading(source).bytes_used))
            continue
        reading = source.read()
        verdict, action = station.observe(Sample(record["step"], record["t"], reading.bytes_used,
                                                 reading.bytes_limit, reading.peak_bytes_used))
        readings.append(reading)
        judged.append((record["step"], verdict.status, action))
    return readings, judged


def test_the_h100s_own_readings_read_alike_with_a_breakdown_only_when_needed():
    """The clean case's readings on the H100: where the plan reads the breakdown, the reading is the
    figures of that moment; where it carries the series, the device's free bytes had not moved and
    the series is the newest breakdown's. The verdicts are the same either way."""
    case = as_recorded(recorded("memory_stats.json"))
    every, planned = replayed(case, BreakdownPlan(every=1)), replayed(case, BreakdownPlan())
    newest = None
    for record, full, reading in zip(case["records"], every[0], planned[0]):
        assert full.bytes_used == record["allocated"] + record["split"]
        assert full.bytes_limit == min(record["free"] + record["reserved"], int(case["fraction"] * record["total"]))
        if reading.allocator is not None:
            assert reading == full
            newest = record
        else:
            assert reading.bytes_used == newest["allocated"] + newest["split"]
            assert abs((record["total"] - record["free"]) - (newest["total"] - newest["free"])) < 2 * MiB
    assert sum(r.allocator is None for r in planned[0]) >= 3, "the H100's steady readings were carried"
    assert planned[1] == every[1]


def test_the_allocator_model_gives_the_h100s_own_figures():
    """Before anything is replayed on it: the model, started from the H100's first clean reading,
    runs the check's unwatched cases into their OOMs at the H100's steps, with its bytes."""
    h100, first = recorded("report.json"), recorded("memory_stats.json")[0]

    def unwatched(name: str) -> tuple[int, dict]:
        case = Case(name, first)
        for step in range(2000):
            try:
                case.step(step)
            except OutOfMemory:
                return step, case.allocator.figures()
        raise AssertionError(f"{name}: no OOM")

    leak_step, leak = unwatched("leak")
    assert abs(leak_step - h100["leak-unwatched"]["oom_step"]) <= 2
    assert leak["allocated"] == pytest.approx(h100["leak-unwatched"]["at_oom"]["allocated"], rel=0.01)
    frag_step, frag = unwatched("fragmentation")
    bare = h100["fragmentation-unwatched"]
    assert abs(frag_step - bare["oom_step"]) <= 5
    assert frag["allocated"] == pytest.approx(bare["at_oom"]["allocated"], rel=0.02)
    assert frag["split"] == pytest.approx(bare["at_oom"]["split"], rel=0.05), "the holes the H100's allocator left"
    case = Case("cache", first)
    reserved = series = 0
    for step in range(600):
        case.step(step)
        figures = case.allocator.figures()
        reserved, series = max(reserved, figures["reserved"]), max(series, figures["series"])
    assert reserved == pytest.approx(h100["cache"]["reserved_max"], rel=0.02)
    assert series < 2 * h100["cache"]["series_max"]
    clean = Case("clean", first)
    for step in range(100):
        clean.step(step)
    stats = first["memory_stats"]
    assert clean.allocator.peak - clean.allocator.allocated == pytest.approx(
        stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"], rel=0.05), "a step's activations"


CHECK_STEPS = {"leak": 1600, "clean": 600, "fragmentation": 900, "cache": 600}  # cuda_check.py's
# Where the code judges differently from the code the H100's run was judged by, the model's first
# action moved, and says why. Issue 62: the fragmentation case keeps a block a step that grows by 8 KiB
# each step (it accelerates), and the projection's upper edge now follows the tail that rises faster
# than the window (`trend.faster_evidence`): acted on at step 856, 35 steps before the H100's 891.
FIRST_ACTION_SINCE = {"fragmentation": 856}


@pytest.mark.parametrize("sample_every", [1, 5, 10])
@pytest.mark.parametrize("name", sorted(CHECK_STEPS))
def test_the_checks_cases_watched_are_judged_as_with_a_breakdown_every_sample(name, sample_every):
    """Each case of the device check watched on the model, the source reading a breakdown at every
    sample (as before) and when its plan says: the same actions at the same steps, the leak reported
    at the same step, no OOM; and at sample_every=5 (the check's), the H100's own first actions.
    Steps of 5 ms, the H100's leak case's (twice as many steps at sample_every=10: its OOMs come later)."""
    first, h100 = recorded("memory_stats.json")[0], recorded("report.json")
    runs = {}
    for every in (1, None):
        case = Case(name, first)
        plan = BreakdownPlan(every=every) if every else BreakdownPlan()
        runs[every] = run_watched(case, CudaSource("cuda:0", cuda=case.allocator, plan=plan, clock=case.clock),
                                  CHECK_STEPS[name] * (2 if sample_every == 10 else 1), sample_every=sample_every)
    full, planned = runs[1], runs[None]
    assert (planned["actions"], planned["leak_steps"][:1], planned["oom_step"], planned["restart"]) == (
        full["actions"], full["leak_steps"][:1], full["oom_step"], full["restart"])
    assert planned["oom_step"] is None
    if name == "leak":
        assert len(planned["actions"]) >= 3, "an action in each of three cycles"
    elif name == "fragmentation":
        assert planned["actions"]
    else:
        assert not planned["actions"] and not planned["leak_steps"], "a clean loop, a growing cache: no leak"
    if sample_every == 5 and planned["actions"]:
        assert planned["actions"][0] == FIRST_ACTION_SINCE.get(name, h100[name]["action_step"]), \
            "the H100 acted at this step"
    breakdowns = sum(taken for _, _, taken, _ in planned["samples"])
    if name in ("clean", "cache") and sample_every < 10:  # samples 5 and 25 ms apart (ten: 50 ms, every other)
        assert breakdowns < len(planned["samples"]) / 2, "a steady job is carried at most samples"


def model_recordings() -> dict:
    """readings.json's cases as the device check records them (its own `RecordingSource`), on the model."""
    check, first, cases = check_script(), recorded("memory_stats.json")[0], {}
    for name, steps in CHECK_STEPS.items():
        case = Case(name, first)
        source = check.RecordingSource(CudaSource("cuda:0", cuda=case.allocator, clock=case.clock), case.allocator)
        run = run_watched(case, source, steps)
        cases[name] = {"fraction": first["fraction"], "records": source.stepped(run["history"])}
    return cases


def recordings() -> list:
    """Every recording there is: the model's, and each device run's readings.json under tests/data/cuda/."""
    found = [pytest.param(case, id=f"model-{name}") for name, case in model_recordings().items()]
    for path in sorted(RECORDED.glob("**/readings.json")):  # a device run's, in a folder of its own
        gpu = json.loads(path.read_text())
        found += [pytest.param(case, id=f"{path.parent.name}-{name}") for name, case in gpu["cases"].items()]
    return found


@pytest.mark.parametrize("case", recordings())
def test_every_sample_recorded_both_ways_is_judged_alike(case):
    """A recording holds, at every reading the source made, its breakdown and its device reading side
    by side: replayed with a breakdown at every sample and with the source's plan, the same verdict
    and action at every sample."""
    assert all("step" in r for r in case["records"] if r["kind"] == "sample"), "every sample has its step"
    full, planned = replayed(case, BreakdownPlan(every=1)), replayed(case, BreakdownPlan())
    assert planned[1] == full[1]
    assert any(r.allocator is None for r in planned[0]), "some samples carried the series"


def test_real_cuda_oom_messages_are_parsed_and_fragmentation_named():
    messages = recorded("oom_messages.json")
    for case, text in messages.items():
        if case == "torch" or not text:
            continue
        message = parse(text)
        assert message is not None and (message.kind, message.memory_space) == ("allocation", "device"), case
        assert message.requested_bytes and message.capacity_bytes and message.free_bytes is not None, case
    if messages.get("fragmentation-unwatched"):
        assert parse(messages["fragmentation-unwatched"]).fragmented


def test_the_limit_torch_2_11_prints_is_the_allocators_share_not_the_devices_capacity():
    """torch 2.11 on an H100 under an 8 GiB `set_per_process_memory_fraction`: "... this process has
    8.71 GiB memory in use. 8.00 GiB allowed; ...". The capacity is the device's 79.18 GiB; the
    limit that ran out is the 8 GiB share, and `postmortem` says so with no flight record at all."""
    from watchdog.core.postmortem import _allocator_limit

    text = recorded("oom_messages.json")["leak-unwatched"]
    message = parse(text)
    assert message.limit_bytes == 8 << 30 and message.to_json()["limit_bytes"] == 8 << 30
    assert message.capacity_bytes > 79 << 30 and message.process_bytes > message.limit_bytes
    said = _allocator_limit(None, message)
    assert "the allocator's limit was 8.0 GiB, its share of the device's 79.2 GiB" in said, said
    older = text.replace(" 8.00 GiB allowed;", "")  # torch 2.1 to 2.10: computed, not printed
    assert parse(older).limit_bytes is None and _allocator_limit(None, parse(older)) == ""


def test_a_real_snapshot_gives_live_blocks_with_the_checks_own_lines():
    blocks = live_blocks(recorded("snapshot.json"))
    assert blocks and all(b.size > 0 for b in blocks)
    assert any(any(frame[0].endswith("cuda_check.py") for frame in b.frames) for b in blocks)


def test_nvml_readings_of_a_real_gpu_give_the_watched_process_its_memory():
    nvml = recorded("nvml.json")
    reading = next(r for r in nvml["readings"] if r.get("processes"))
    watched = nvml["pids"]["watched"]

    class Nvml:
        NVMLError = RuntimeError

        def nvmlInit(self): pass
        def nvmlDeviceGetCount(self): return 1
        def nvmlDeviceGetHandleByIndex(self, index): return index
        def nvmlDeviceGetMemoryInfo(self, handle): return SimpleNamespace(total=reading["total"])

        def nvmlDeviceGetComputeRunningProcesses(self, handle):
            mine = {watched: os.getpid()}  # the recorded job's PID stands for this process here
            return [SimpleNamespace(pid=mine.get(p["pid"], p["pid"] + 4_000_000), usedGpuMemory=p["used"])
                    for p in reading["processes"]]

    [got] = GpuProcessesReader(psutil.Process(), NvmlGpus(Nvml())).read().devices
    theirs = {p["pid"]: p["used"] or 0 for p in reading["processes"]}
    assert got.bytes_used == theirs.get(watched, 0)
    assert got.bytes_limit == reading["total"] - (sum(theirs.values()) - theirs.get(watched, 0))
