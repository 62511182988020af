"""What a real GPU said, replayed: the readings issue 41's device check recorded on a lent machine
(tests/device/cuda_check.py writes them; they are kept in tests/data/cuda/). Until a GPU has been
lent and the check has run, the folder does not exist and these tests are skipped, saying so."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from watchdog.core.oom_message import parse
from watchdog.daemon.readers import GpuProcessesReader, NvmlGpus
from watchdog.forensics.allocator_history import live_blocks
from watchdog.runtime.sources import CudaSource

RECORDED = Path(__file__).parent / "data" / "cuda"
pytestmark = pytest.mark.skipif(not RECORDED.is_dir(), reason="no GPU readings recorded yet (issue 41's device check)")


def recorded(name: str):
    path = RECORDED / name
    if not path.exists():
        pytest.skip(f"{name} was not recorded")
    return json.loads(path.read_text())


class Replayed:
    """torch.cuda as the cuda source calls it, answering with one recorded reading after another."""

    def __init__(self, readings: list[dict]):
        self.readings, self.calls = readings, 0

    def is_initialized(self) -> bool:
        return True

    def memory_stats(self, device) -> dict:
        self.calls += 1
        return self.readings[min(self.calls - 1, len(self.readings) - 1)]["memory_stats"]

    def mem_get_info(self, device):
        return tuple(self.readings[min(self.calls - 1, len(self.readings) - 1)]["mem_get_info"])

    def get_per_process_memory_fraction(self, device) -> float:
        return self.readings[0]["fraction"]


def test_the_cuda_source_reads_real_allocator_stats_as_tensors_and_split_remainders_against_the_budget():
    readings = recorded("memory_stats.json")
    source = CudaSource("cuda:0", cuda=Replayed(readings))
    for reading in readings[1:]:
        stats, (free, total) = reading["memory_stats"], reading["mem_get_info"]
        got = source.read()
        assert got.bytes_used == stats["allocated_bytes.all.current"] + stats["inactive_split_bytes.all.current"]
        assert got.bytes_limit == min(free + stats["reserved_bytes.all.current"], int(reading["fraction"] * total))
        assert got.bytes_used <= stats["reserved_bytes.all.current"] <= got.bytes_limit


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

    [got] = GpuProcessesReader(psutil.Process(), NvmlGpus(Nvml())).read()
    theirs = {p["pid"]: p["used"] or 0 for p in reading["processes"]}
    assert got.bytes_used == theirs.get(watched, 0)
    assert got.bytes_limit == reading["total"] - (sum(theirs.values()) - theirs.get(watched, 0))
