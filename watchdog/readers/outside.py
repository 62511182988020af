"""The daemon's reading seam: a reader gives the memory of every device it sees, one reading each.

    class DeviceReader(Protocol):
        source: str                               # exported as hbmwatch_build_info{source}
        def read(self) -> Sequence[DeviceReading]  # one per device, the same devices every time

The daemon judges each device on its own (its own Judge, telemetry and trace) and signals the
watched process when any of them is about to run out. A reading may name the process holding
that memory (`pid`), where the source knows it.

Readers here:

- `ProcessTreeReader`: the job's memory, a process and its children, each page counted once (PJRT
  CPU and CPU jobs), against every limit over it (`watchdog.readers.host_memory`).
- `TpuChipsReader`: every TPU chip of this host (`device="tpu:N"`) through libtpu's runtime
  metrics, the same per-chip readings as the in-process `tpu` memory source
  (`watchdog.readers.sources.TpuRuntimeSource`); the watched process is whom to signal.
- `GpuProcessesReader`: every GPU of this host through NVML (`device="cuda:N"`): on each, the
  memory the target's process tree holds, against what the other processes leave it.
- `WithHost`: another reader's devices plus the target's host memory (`device="host"`), read as
  the in-process host watch reads it (`watchdog.readers.host_memory`). A process tree's
  memory already is the host's: there, one series, whose limit is the host's budget. When the
  other reader fails, the host's reading still comes (`PartialReading`), and the failure is counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import psutil

from watchdog.readers.host_memory import HOST_DEVICE, HostMemory, ProcessTree

PROCESS_DEVICE = "process"  # the device label of a process tree's memory (bounded: one value)


@dataclass(frozen=True, slots=True)
class DeviceReading:
    device: str
    bytes_used: int
    bytes_limit: int | None = None
    peak_bytes_used: int | None = None
    pid: int | None = None  # the process holding this memory, where the source knows it


class DeviceReader(Protocol):
    source: str

    def read(self) -> Sequence[DeviceReading]: ...


class PartialReading(Exception):
    """Some devices were read and some could not be: the readings there are, and what failed.
    The daemon judges the readings and counts the failure, so a device that cannot be read (a lost
    GPU, a TPU's metrics endpoint down) never blinds it to the others: the host's RAM above all."""

    def __init__(self, readings: Sequence[DeviceReading], error: BaseException):
        super().__init__(str(error))
        self.readings, self.error = list(readings), error


class ProcessTreeReader:
    """The job's memory: a process and all its descendants (data-loader workers, compile helpers),
    each page counted once, against every limit over it, with its peak since the previous reading
    (`HostMemory`, which the in-process host watch and the `rss` source read alike). The limit is
    the host's budget for the process: `host_limit_bytes` when given, and the kernel's (the
    tightest memory cgroup limit over it, RLIMIT_AS, RLIMIT_DATA), else the machine's memory.
    `psutil.NoSuchProcess` escapes when the process itself is gone; a child that exits mid-read is
    skipped.
    """

    source = "rss"

    def __init__(self, process: psutil.Process, host_limit_bytes: int | None = None):
        self.process = process
        self.memory = HostMemory(process.pid, host_limit_bytes)

    def read(self) -> list[DeviceReading]:
        host = self.memory.read()
        return [DeviceReading(PROCESS_DEVICE, host.bytes_used, host.bytes_limit, host.peak_bytes_used, self.process.pid)]


class TpuChipsReader:
    """Every TPU chip of this host, from libtpu's runtime metrics (tpu-info's gRPC endpoint).

    libtpu reports chips, not processes: the chips are judged one by one, and the process found
    by --pid / --cmd-pattern / --pidfile (the one holding the chips) is the one signalled. One
    `TpuRuntimeSource` serves every attachment, so a restart re-attaches without reconnecting.
    """

    source = "tpu"

    def __init__(self, process: psutil.Process, chips):
        self.process, self._chips = process, chips

    def read(self) -> list[DeviceReading]:
        if not self.process.is_running():
            raise psutil.NoSuchProcess(self.process.pid)
        return [DeviceReading(chip.device, chip.bytes_used, chip.bytes_limit, None, None)
                for chip in self._chips.read().devices]


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

    source = "nvml"

    def __init__(self, process: psutil.Process, gpus: NvmlGpus):
        self.process, self._gpus = process, gpus
        self._tree = ProcessTree(process)

    def read(self) -> list[DeviceReading]:
        if not self.process.is_running():
            raise psutil.NoSuchProcess(self.process.pid)
        ours = self._tree.pids()
        readings = []
        for index, total, held in self._gpus.read():
            used = sum(b for pid, b in held.items() if pid in ours)
            others = sum(b for pid, b in held.items() if pid not in ours)
            readings.append(DeviceReading(f"cuda:{index}", used, max(0, total - others), None, self.process.pid))
        return readings


class WithHost:
    """`inner`'s devices, and the target's host memory beside them as device "host": the RAM whose
    exhaustion the kernel ends with SIGKILL, judged like a chip and signalled for like one."""

    def __init__(self, inner: DeviceReader, process: psutil.Process, host_limit_bytes: int | None = None):
        self.inner, self.process = inner, process
        self.source = inner.source
        self._memory = HostMemory(process.pid, host_limit_bytes)

    def read(self) -> list[DeviceReading]:
        host = self._memory.read()  # raises NoSuchProcess once the target is gone
        reading = DeviceReading(HOST_DEVICE, host.bytes_used, host.bytes_limit, host.peak_bytes_used, self.process.pid)
        try:
            chips = self.inner.read()
        except psutil.NoSuchProcess:
            raise
        except Exception as exc:  # noqa: BLE001 - the chips' failure is counted; the host is still judged
            raise PartialReading([reading], exc) from exc
        return [*chips, reading]
