"""What a real GPU said, replayed: the readings issue 41's device check recorded on an H100
(tests/device/cuda_check.py writes them; they are kept in tests/data/cuda/, whose README says where
they came from)."""

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


def recorded(name: str):
    return json.loads((RECORDED / name).read_text())


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

    [got] = GpuProcessesReader(psutil.Process(), NvmlGpus(Nvml())).read()
    theirs = {p["pid"]: p["used"] or 0 for p in reading["processes"]}
    assert got.bytes_used == theirs.get(watched, 0)
    assert got.bytes_limit == reading["total"] - (sum(theirs.values()) - theirs.get(watched, 0))
