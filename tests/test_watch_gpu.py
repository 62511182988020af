"""`watch --gpu`: every GPU of the host through NVML, from outside the job.

There is no GPU and no NVML driver here. The path without NVML runs for real: nvidia-ml-py is
installed and its library is not found. What a GPU would report comes from a stand-in for the
NVML calls the reader makes, with figures made up here; issue 41's device check is to record real
ones.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import psutil
import pytest

from watchdog.commands.cli import main
from watchdog.readers.outside import GpuProcessesReader, NvmlGpus, ReaderUnavailable

GiB = 1 << 30


class Nvml:
    """The five NVML calls `NvmlGpus` makes, over fixed devices: {index: (total, {pid: bytes})}."""

    class NVMLError(Exception):
        pass

    def __init__(self, devices: dict[int, tuple[int, dict[int, int | None]]]):
        self.devices = devices

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int):
        return SimpleNamespace(total=self.devices[handle][0], used=None, free=None)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.devices[handle][1].items()]


def test_each_gpu_reads_the_targets_memory_against_what_the_other_processes_leave():
    me, stranger = os.getpid(), 4_000_000  # a PID no process has (above the kernel's pid_max)
    nvml = Nvml({0: (80 * GiB, {me: 30 * GiB, stranger: 20 * GiB}), 1: (80 * GiB, {stranger: 5 * GiB}),
                 2: (80 * GiB, {me: None})})
    reader = GpuProcessesReader(psutil.Process(me), NvmlGpus(nvml))
    reading = reader.read()
    assert [(r.device, r.bytes_used, r.bytes_limit) for r in reading.each_device("process")] == [
        ("cuda:0", 30 * GiB, 60 * GiB), ("cuda:1", 0, 75 * GiB), ("cuda:2", 0, 80 * GiB)]
    assert (reading.bytes_used, reading.bytes_limit) == (30 * GiB, 60 * GiB), "the fullest GPU heads the reading"
    assert reader.name == "nvml"


def test_without_nvml_the_gpu_reader_is_unavailable_and_watch_gpu_is_one_line_and_exit_2(capsys):
    with pytest.raises(ReaderUnavailable, match="NVML cannot start"):
        NvmlGpus()  # this machine's real nvidia-ml-py, with no driver
    nvml = Nvml({})
    with pytest.raises(ReaderUnavailable, match="sees no GPU"):
        NvmlGpus(nvml)
    assert main(["watch", "--cmd-pattern", "no-such-job-anywhere", "--gpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--gpu: NVML cannot start" in err and "Traceback" not in err
    assert main(["watch", "--cmd-pattern", "no-such-job-anywhere", "--gpu", "--tpu"]) == 2
    assert "one accelerator per watch" in capsys.readouterr().err
