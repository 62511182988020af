"""Where memory numbers come from, behind one small protocol.

Sources, most precise first:

- `xla`:  `xm.get_memory_info(device)`; per device, with limit and peak. Raises on PJRT CPU
          (UNIMPLEMENTED) and under SPMD, so it is probed, not assumed.
- `tpu`:  libtpu's runtime metrics (the in-process `libtpu.sdk.tpumonitoring`, else the gRPC
          endpoint tpu-info reads on localhost:8431): every local chip, so it works under SPMD,
          where one process drives all of them. The fullest chip drives the decision (an OOM
          happens there first); every chip is kept in the reading for the exporter. It is the
          only reading on TorchTPU (`torch.device("tpu")`, torch-tpu), which has no memory
          statistics of its own, and it needs nothing of torch_xla.
- `cuda`: the caching allocator: what it cannot give back (tensors and split blocks' remainders),
          against what it may still reserve; the device's free bytes every reading, the allocator's
          breakdown when it is needed (readers/breakdown_plan.py).
- `rss`:  the job's memory in host RAM (this process and its children, each page counted once):
          PJRT CPU keeps device buffers there. The limit comes from `--memory-limit`.
- `replay`: serves a recorded trace in order (demos, tests, dashboards without hardware).

`select_source` probes candidates in that order for the device and keeps the first that reads;
the choice is logged and exported (`hbmwatch_build_info{source}`). A source is read on the
sidecar thread every sample, and on the training thread twice: its first reading, when it is
chosen (`Watchdog.start()`), and after a rebuild (`Watchdog.reinit_finished`, `fresh_reading`),
between steps; never inside a step.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from watchdog.core.errors import InputError
from watchdog.core.readings import AllocatorMemory, DeviceMemory, MemoryReading, MemorySource
from watchdog.core.sample import read_trace
from watchdog.readers.breakdown_plan import BreakdownPlan
from watchdog.readers.host_memory import RssSource
from watchdog.logs import get_logger

log = get_logger(__name__)


def fullest(devices: list[DeviceMemory] | tuple[DeviceMemory, ...]) -> MemoryReading:
    """The reading of the chip closest to its limit (the most used when limits are unknown), with all chips.

    That chip runs out first, so it is the one the detector must watch: on a sharded job one
    chip can fill faster than the rest (uneven shards, a replicated leak on top of its shard).
    """
    if not devices:
        raise SourceUnavailable("no chips reported")
    if all(d.bytes_limit is not None for d in devices):
        chip = min(devices, key=lambda d: (d.bytes_limit - d.bytes_used, -d.bytes_used))
    else:
        chip = max(devices, key=lambda d: d.bytes_used)
    return MemoryReading(chip.bytes_used, chip.bytes_limit, devices=tuple(devices))


class SourceUnavailable(RuntimeError):
    """This source cannot read memory here (no such device, unsupported backend...)."""


class ChosenSourceUnavailable(SourceUnavailable, InputError):
    """The memory source a user named (not `auto`) cannot read this device: bad input, said in one
    line (exit 2 from the command line), and still a SourceUnavailable for code that falls back."""


def _first_int(info: dict, *keys: str) -> int | None:
    for key in keys:
        value = info.get(key)
        if value is not None:
            return int(value)
    return None


class XlaSource:
    """`xm.get_memory_info` for one device, whose name is captured on the training thread
    (the current XLA device is thread-local, so the sidecar must not ask for it)."""

    name = "xla"

    def __init__(self, device: str):
        self.device = device
        import torch_xla.core.xla_model as xm

        self._get_memory_info = xm.get_memory_info
        self._lifetime_peak = 0

    def read(self) -> MemoryReading:
        info = self._get_memory_info(self.device)
        used = _first_int(info, "bytes_used", "kb_total")  # "kb_*" were the keys before 2.5
        if used is None:
            raise SourceUnavailable(f"get_memory_info returned no usage: {sorted(info)}")
        lifetime_peak = _first_int(info, "peak_bytes_used")
        peak = None
        if lifetime_peak is not None:  # the runtime keeps a lifetime peak: the peak since the previous reading
            peak = peak_since(self._lifetime_peak, lifetime_peak, used)
            self._lifetime_peak = lifetime_peak
        return MemoryReading(bytes_used=used, bytes_limit=_first_int(info, "bytes_limit"), peak_bytes_used=peak)


class TpuRuntimeSource:
    """libtpu runtime metrics for every local chip: works under SPMD, where `get_memory_info` raises.

    Two readers of the same numbers: the in-process `libtpu.sdk` when libtpu ships it, else
    tpu-info's client for libtpu's gRPC metric service (`grpc_addr`, localhost:8431 by default).
    `chip_type` (a `tpu_info.device.TpuChip`) tells tpu-info how many devices a chip has; by
    default it is detected from the PCI bus, as tpu-info does.
    """

    name = "tpu"

    def __init__(self, grpc_addr: str | None = None, chip_type: object | None = None):
        reader = None if grpc_addr is not None else self._sdk_reader()
        self._read_chips = reader or self._grpc_reader(grpc_addr or "localhost:8431", chip_type)
        if self._read_chips is None:
            raise SourceUnavailable("neither libtpu.sdk nor tpu_info is installed")

    @staticmethod
    def _sdk_reader() -> Callable[[], list[DeviceMemory]] | None:
        try:
            from libtpu.sdk import tpumonitoring  # type: ignore[import-not-found]
        except ImportError:
            return None

        def read() -> list[DeviceMemory]:
            usage = [int(float(v)) for v in tpumonitoring.get_metric("hbm_capacity_usage").data()]
            total = [int(float(v)) for v in tpumonitoring.get_metric("hbm_capacity_total").data()]
            return [DeviceMemory(f"tpu:{chip}", used, total[chip] if chip < len(total) else None)
                    for chip, used in enumerate(usage)]

        return read

    @staticmethod
    def _grpc_reader(addr: str, chip_type: object | None) -> Callable[[], list[DeviceMemory]] | None:
        try:
            from tpu_info import device as tpu_device  # type: ignore[import-not-found]
            from tpu_info import metrics as tpu_metrics  # type: ignore[import-not-found]
        except ImportError:
            return None
        if chip_type is None:
            chip_type, _count = tpu_device.get_local_chips()
            if chip_type is None:
                raise SourceUnavailable("no local TPU chips on the PCI bus")

        def read() -> list[DeviceMemory]:
            return [DeviceMemory(f"tpu:{usage.device_id}", int(usage.memory_usage), int(usage.total_memory))
                    for usage in tpu_metrics.get_chip_usage(chip_type, addr=addr)]

        return read

    def read(self) -> MemoryReading:
        return fullest(self._read_chips())


class CudaSource:
    """PyTorch's CUDA caching allocator: the device's free bytes on every reading, the allocator's
    breakdown when it is needed (`BreakdownPlan`, readers/breakdown_plan.py, says when and why).
    Host-side figures only: no device sync, no new CUDA context.

    The series is what the allocator could not hand back if it had to: the bytes live tensors hold
    plus the free remainders of blocks split for them (`inactive_split_bytes`), which stay
    reserved while any part of their block is in use. Whole cached blocks are left out: on a
    failed cudaMalloc the allocator frees them and retries, so they never cause an OOM, and a
    cache that grows must not read as a leak. Fragmentation shows as that series rising while the
    tensors' own bytes do not. Only the breakdown tells these apart; a reading between breakdowns
    carries the floor the breakdowns saw (`BreakdownPlan.carried`: no allocator figures; the series
    stands in for the peak),
    while the device's free bytes, read every time, would have shown any segment reserved or handed
    back since.

    The limit is what this process's allocator may reserve: what it holds plus what the device
    has free (other processes' memory and this one's outside PyTorch, a CUDA context, cuBLAS's
    workspaces, NCCL's buffers, are already taken), capped by `set_per_process_memory_fraction`.

    The peak is the peak since the previous breakdown, as `RssSource`'s: the allocator keeps only a
    lifetime peak (`allocated_bytes.all.peak`, what `torch.cuda.max_memory_allocated()` returns),
    which after a reinit would keep the old high and read as an OOM about to happen. It can only be
    reset for every reader of the process (`reset_peak_memory_stats` resets every peak statistic,
    the user's own with it), so it is never reset: the source keeps its own running figure, the
    lifetime peak as last read, and a new high shows as that peak growing. A peak that needed memory
    from the device between breakdowns moved the device reading, so the next reading is a breakdown
    and reads it.

    Threads and the GIL. Every sample's reading runs on the sidecar thread: `mem_get_info` holds the
    GIL only to enter and leave PyTorch's binding (it releases it around the driver's
    `cudaMemGetInfo`); a breakdown, `memory_stats_as_nested_dict`, holds it the whole call (PyTorch
    builds the figures as Python dicts; the allocator's own lock is held only to copy its counters).
    The training thread reads twice: the first reading when the source is chosen (`start()`), and a
    breakdown after a rebuild (`Watchdog.reinit_finished`, through `fresh_reading`), between steps.
    """

    name = "cuda"

    def __init__(self, device: str, cuda: object | None = None, plan: BreakdownPlan | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if cuda is None:
            import torch

            if not torch.cuda.is_available():
                raise SourceUnavailable("CUDA is not available")
            cuda = torch.cuda
        if not cuda.is_initialized():  # mem_get_info would create a context, hundreds of MB of the device
            raise SourceUnavailable("this process has not used CUDA yet")
        self._cuda = cuda
        self.device = device if device.startswith("cuda") else "cuda"
        # An index, not a name: the calls parse no string. Taken here, on the training thread, whose
        # current device a bare "cuda" means.
        self._index = int(self.device.split(":", 1)[1]) if ":" in self.device else int(cuda.current_device())
        self.plan = plan if plan is not None else BreakdownPlan()
        self._clock = clock
        self._reserved = 0  # as the newest breakdown read it
        self._cap: int | None = None  # the allocator's share of the device, where it is given one
        self._lifetime_peak = _stat(cuda.memory_stats_as_nested_dict(self._index), "allocated_bytes", "peak")
        self._lock = threading.Lock()  # the sidecar's reading and the training thread's after a rebuild

    def read(self) -> MemoryReading:
        with self._lock:
            free, total = self._cuda.mem_get_info(self._index)
            if self.plan.due(total - free, self._limit(free), self._clock()):
                return self._breakdown()
            carried = self.plan.carried()
            return MemoryReading(carried, self._limit(free), carried)

    def read_fresh(self) -> MemoryReading:
        """A breakdown now, whatever the plan, and the plan started over: what a rebuild is measured by."""
        with self._lock:
            self.plan.restart()
            return self._breakdown()

    def _breakdown(self) -> MemoryReading:
        stats = self._cuda.memory_stats_as_nested_dict(self._index)
        allocated = _stat(stats, "allocated_bytes", "current")
        split = _stat(stats, "inactive_split_bytes", "current")
        reserved = _stat(stats, "reserved_bytes", "current")
        lifetime_peak = _stat(stats, "allocated_bytes", "peak") or allocated
        # After the figures: a segment reserved in between lowers the limit, never raises it.
        free, total = self._cuda.mem_get_info(self._index)
        fraction = getattr(self._cuda, "get_per_process_memory_fraction", None)  # torch 2.7 on
        self._cap = int(fraction(self._index) * int(total)) if fraction is not None else None
        used = allocated + split
        peak = peak_since(self._lifetime_peak, lifetime_peak, used)
        self._lifetime_peak, self._reserved = lifetime_peak, reserved
        self.plan.read(used, reserved, int(total) - int(free), self._clock())
        return MemoryReading(used, self._limit(free), peak, allocator=AllocatorMemory(allocated, split, reserved))

    def _limit(self, free: int) -> int:
        limit = int(free) + self._reserved
        return limit if self._cap is None else min(limit, self._cap)


def _stat(stats: dict, name: str, field: str) -> int:
    """One figure of the allocator's nested statistics, over all its pools (0 where the allocator
    keeps none: cudaMallocAsync reports several as zero)."""
    return int(stats.get(name, {}).get("all", {}).get(field, 0))


def fresh_reading(source: MemorySource) -> MemoryReading:
    """A reading that carries nothing from an earlier one: what a rebuild is measured by
    (`Watchdog.reinit_finished`). A source that carries figures between readings (`cuda`) reads
    them all now; every other source's readings are always fresh."""
    read_fresh = getattr(source, "read_fresh", None)
    return read_fresh() if read_fresh is not None else source.read()


def peak_since(previous_lifetime_peak: int, lifetime_peak: int, current: int) -> int:
    """The peak since the previous reading, where only a lifetime peak is kept (the kernel's
    `ru_maxrss`, the allocator's `allocated_bytes.all.peak`): a new high shows as that peak growing;
    otherwise the peak in between is unknown and the current value stands in."""
    return max(current, lifetime_peak) if lifetime_peak > previous_lifetime_peak else current


def release_host_memory() -> None:
    """Hand freed heap pages back to the OS (glibc), so an RSS reading after a rebuild sees what
    it freed (glibc keeps freed pages of large allocations for reuse otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class ReplaySource:
    """Serves a recorded trace, one sample per read; repeats the last one once exhausted."""

    name = "replay"

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._samples: Iterator = read_trace(self.path)
        self._last: MemoryReading | None = None
        self.read()  # fail now, on the caller's thread, if the trace is unreadable
        self._samples = read_trace(self.path)

    def read(self) -> MemoryReading:
        sample = next(self._samples, None)
        if sample is not None:
            self._last = MemoryReading(sample.bytes_used, sample.bytes_limit, sample.peak_bytes_used)
        if self._last is None:
            raise SourceUnavailable(f"{self.path} holds no samples")
        return self._last


def device_kind(device: str) -> str:
    return device.split(":", 1)[0].lower()


def current_device() -> str:
    """The device the training thread is using, judged from what the program already imported.

    Never imports torch itself: a CPU-only program must not pay for it. Never starts torch_xla's
    runtime either: before the program's first XLA tensor no device is current, and the one it
    will get is the default, `xla:0` (asking torch_xla would start a PJRT client here, and on a
    TPU VM claim the chips, for a program that only imported torch_xla through a library).
    """
    if "torch_xla" in sys.modules:
        import torch_xla

        if not torch_xla._XLAC._xla_runtime_is_initialized():
            return "xla:0"
        return str(torch_xla.device())
    torch = sys.modules.get("torch")
    if torch is None:
        return "cpu"
    tpu = getattr(torch, "tpu", None)  # TorchTPU registers `torch.tpu` when the program imports it
    if tpu is not None and tpu.is_available():
        return f"tpu:{tpu.current_device()}"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def candidates(kind: str, device: str, memory_limit_bytes: int | None,
               replay_trace: str | os.PathLike[str] | None = None) -> list[tuple[str, Callable[[], MemorySource]]]:
    """Constructors to try, in order, for a source kind (`auto` expands by device)."""
    build: dict[str, Callable[[], MemorySource]] = {
        "xla": lambda: XlaSource(device),
        "tpu": lambda: TpuRuntimeSource(),
        "cuda": lambda: CudaSource(device),
        "rss": lambda: RssSource(memory_limit_bytes),
        "replay": lambda: ReplaySource(replay_trace),  # type: ignore[arg-type]
    }
    if kind != "auto":
        return [(kind, build[kind])]
    order = {"xla": ["xla", "tpu", "rss"], "tpu": ["tpu", "rss"], "cuda": ["cuda", "rss"]}.get(device_kind(device),
                                                                                               ["rss"])
    return [(name, build[name]) for name in order]


def select_source(kind: str, device: str, memory_limit_bytes: int | None = None,
                  replay_trace: str | os.PathLike[str] | None = None) -> tuple[MemorySource, MemoryReading]:
    """Build and probe sources in order; return the first that reads, with its first reading.

    Each rejection is logged with its reason so a user sees why, say, `xla` fell back to `rss`.
    """
    reasons = []
    for name, make in candidates(kind, device, memory_limit_bytes, replay_trace):
        try:
            source = make()
            reading = source.read()
        except InputError:
            raise  # a bad trace path is the user's to fix, not a reason to fall back
        except Exception as exc:  # noqa: BLE001 - any failure means "try the next one"
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.info("memory_source_unavailable", source=name, device=device, reason=reason)
            reasons.append(f"{name} ({reason})")
            continue
        log.info("memory_source_selected", source=name, device=device,
                 bytes_used=reading.bytes_used, bytes_limit=reading.bytes_limit, chips=len(reading.devices) or None)
        if name == "rss" and device_kind(device) == "xla":
            # PJRT CPU (SPMD's virtual devices included): device buffers live in host memory, so the
            # process's RSS is the one honest number, for all devices together. Said once, loudly.
            log.warning("memory_source_stand_in", source=name, device=device,
                        note="no per-device memory on this backend: this process's resident memory "
                             "stands in for every XLA device, against --memory-limit")
        return source, reading
    if kind != "auto":
        raise ChosenSourceUnavailable(f"memory source {kind!r} cannot read device {device!r}: {reasons[0]}; "
                                      "choose one that can, or auto")
    raise SourceUnavailable(f"no memory source works for device {device!r}: " + "; ".join(reasons))
