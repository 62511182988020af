"""The daemon's readers: memory sources (`MemorySource`, `watchdog.core.readings`) that read a
process from outside it, by PID, and see every device it holds.

Each is a memory source like the sidecar's, and its reading lists every device it sees
(`MemoryReading.devices`); the daemon judges each device on its own (its own Judge, telemetry and
trace) and signals the watched process when any of them is about to run out. A reading of one
device, with no list (the job's memory), is judged as the device "process".

Sources here, beside `RssSource` (`watchdog.readers.host_memory`: the job's memory, a process and
its children, each page counted once, against every limit over it; PJRT CPU and CPU jobs):

- `TpuChipsReader`: every TPU chip of this host (`device="tpu:N"`) through libtpu's runtime
  metrics, the in-process `tpu` source itself (`watchdog.readers.sources.TpuRuntimeSource`); the
  watched process is whom to signal.
- `GpuProcessesReader`: every GPU of this host through NVML (`device="cuda:N"`): on each, the
  memory the target's process tree holds, against what the other processes leave it.
- `WithHost`: another source's devices plus the target's host memory (`device="host"`), read as
  the in-process host watch reads it (`watchdog.readers.host_memory`). A process tree's
  memory already is the host's: there, one series, whose limit is the host's budget. When the
  other source fails, the host's reading still comes (`PartialReading`), and the failure is counted.
"""

from __future__ import annotations

import psutil

from watchdog.core.readings import DeviceMemory, MemoryReading, MemorySource
from watchdog.readers.host_memory import HOST_DEVICE, HostMemory, ProcessTree
from watchdog.readers.sources import fullest

PROCESS_DEVICE = "process"  # the device label of a process tree's memory (bounded: one value)


class PartialReading(Exception):
    """Some devices were read and some could not be: the readings there are, and what failed.
    The daemon judges the readings and counts the failure, so a device that cannot be read (a lost
    GPU, a TPU's metrics endpoint down) never blinds it to the others: the host's RAM above all."""

    def __init__(self, reading: MemoryReading, error: BaseException):
        super().__init__(str(error))
        self.reading, self.error = reading, error


class TpuChipsReader:
    """Every TPU chip of this host, from libtpu's runtime metrics (tpu-info's gRPC endpoint).

    libtpu reports chips, not processes: the chips are judged one by one, and the process found
    by --pid / --cmd-pattern / --pidfile (the one holding the chips) is the one signalled. One
    `TpuRuntimeSource` serves every attachment, so a restart re-attaches without reconnecting.
    """

    name = "tpu"

    def __init__(self, process: psutil.Process, chips: MemorySource):
        self.process, self._chips = process, chips

    def read(self) -> MemoryReading:
        if not self.process.is_running():
            raise psutil.NoSuchProcess(self.process.pid)
        return self._chips.read()


class ReaderUnavailable(RuntimeError):
    """This reader cannot read here (no NVML, no GPU): the command says so at start, exit 2."""


class NvmlGpus:
    """This host's GPUs as NVML sees them (nvidia-ml-py): each one's total memory and the memory each
    process holds on it. NVML reads the driver's own accounting, so the daemon creates no CUDA
    context (`mem_get_info` would, several hundred MB on the GPU it watches). `ReaderUnavailable`
    when NVML is not installed, cannot start or sees no GPU."""

    def __init__(self, nvml=None):
        if nvml is None:
            try:
                import pynvml as nvml  # the nvidia-ml-py distribution
            except ImportError:
                raise ReaderUnavailable("nvidia-ml-py is not installed (hbm-watchdog[gpu])") from None
        try:
            nvml.nvmlInit()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        except nvml.NVMLError as exc:
            raise ReaderUnavailable(f"NVML cannot start: {exc}") from None
        if not self._handles:
            raise ReaderUnavailable("NVML sees no GPU")
        self._nvml = nvml

    def read(self) -> list[tuple[int, int, dict[int, int]]]:
        """(index, total bytes, {pid: bytes}) for every GPU; a process whose use NVML cannot tell
        (None: no permission, a MIG slice) counts 0."""
        gpus = []
        for index, handle in enumerate(self._handles):
            total = int(self._nvml.nvmlDeviceGetMemoryInfo(handle).total)
            held: dict[int, int] = {}
            for process in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                held[process.pid] = held.get(process.pid, 0) + int(process.usedGpuMemory or 0)
            gpus.append((index, total, held))
        return gpus


class GpuProcessesReader:
    """Every GPU of this host through NVML: on each, the memory the target and its descendants hold
    (NVML's per-process figures, CUDA context included: what the device really gives them), against
    what the other processes leave: the device's total less their memory. A GPU the job does not
    use reads 0. NVML names processes by the host's PIDs: in a container without the host's PID
    namespace the target's PID is not among them, and every GPU reads 0."""

    name = "nvml"

    def __init__(self, process: psutil.Process, gpus: NvmlGpus):
        self.process, self._gpus = process, gpus
        self._tree = ProcessTree(process)

    def read(self) -> MemoryReading:
        if not self.process.is_running():
            raise psutil.NoSuchProcess(self.process.pid)
        ours = self._tree.pids()
        gpus = []
        for index, total, held in self._gpus.read():
            used = sum(b for pid, b in held.items() if pid in ours)
            others = sum(b for pid, b in held.items() if pid not in ours)
            gpus.append(DeviceMemory(f"cuda:{index}", used, max(0, total - others)))
        return fullest(gpus)


class WithHost:
    """`inner`'s devices, and the target's host memory beside them as device "host": the RAM whose
    exhaustion the kernel ends with SIGKILL, judged like a chip and signalled for like one."""

    def __init__(self, inner: MemorySource, process: psutil.Process, host_limit_bytes: int | None = None):
        self.inner, self.process = inner, process
        self.name = inner.name
        self._memory = HostMemory(process.pid, host_limit_bytes)

    def read(self) -> MemoryReading:
        host = self._memory.read()  # raises NoSuchProcess once the target is gone
        reading = DeviceMemory(HOST_DEVICE, host.bytes_used, host.bytes_limit, host.peak_bytes_used)
        try:
            chips = self.inner.read()
        except psutil.NoSuchProcess:
            raise
        except Exception as exc:  # noqa: BLE001 - the chips' failure is counted; the host is still judged
            raise PartialReading(fullest([reading]), exc) from exc
        return fullest([*chips.each_device(PROCESS_DEVICE), reading])
