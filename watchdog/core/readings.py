"""What a memory source reads, as plain values: one reading, each chip's share, an allocator's
figures, the host's; and the one protocol every source keeps.

They live in the core because every layer passes them on: a source makes them, in the training
process (the sidecar's) or beside it (the `watch` daemon's), and the station's telemetry and the
exporter show them. One protocol for both, so a reader of a kind of device is written once:

    class MemorySource(Protocol):
        name: str                     # exported as hbmwatch_build_info{source}
        def read(self) -> MemoryReading
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One chip's memory, as a source that sees several chips reports it (`device` is its label)."""

    device: str
    bytes_used: int
    bytes_limit: int | None = None
    peak_bytes_used: int | None = None  # its highest point since the previous reading, where the source knows it


@dataclass(frozen=True, slots=True)
class AllocatorMemory:
    """A caching allocator's own figures (PyTorch's on CUDA). What the series judges is the first
    two; the rest of what it reserved is cache it hands back before it raises an OOM."""

    allocated_bytes: int  # what live tensors hold
    split_bytes: int  # the free remainders of blocks split for them: usable only by requests that fit
    reserved_bytes: int  # all it holds from the device, cache included


@dataclass(frozen=True, slots=True)
class MemoryReading:
    bytes_used: int
    bytes_limit: int | None = None
    peak_bytes_used: int | None = None
    devices: tuple[DeviceMemory, ...] = ()  # every chip, when the source sees more than one
    allocator: AllocatorMemory | None = None  # the allocator's figures, where the source reads an allocator

    def each_device(self, label: str) -> tuple[DeviceMemory, ...]:
        """Every device this reading covers, each to be judged on its own (the `watch` daemon): its
        chips, or the reading itself as one device called `label`."""
        return self.devices or (DeviceMemory(label, self.bytes_used, self.bytes_limit, self.peak_bytes_used),)


class MemorySource(Protocol):
    """Where a series' memory comes from: a kind of device, or the job's host memory (the module
    docstring). `read` raises `psutil.NoSuchProcess` when the process it reads is gone."""

    name: str

    def read(self) -> MemoryReading: ...


@dataclass(frozen=True, slots=True)
class HostReading:
    bytes_used: int  # the series judged: the room left under the tightest limit, down from `bytes_limit`
    bytes_limit: int | None  # the series' reference: the lowest limit at the start (None: no limit known)
    domain: str  # the limit that binds now: "budget", "cgroup", "address_space", "data", "machine" (or "none")
    process_bytes: int  # the job's memory: its processes' anonymous and shared pages, each counted once
    available_bytes: int  # the machine's MemAvailable
    oom_kills: int | None = None  # the cgroup's OOM kills so far, where there is a cgroup
    peak_bytes_used: int | None = None  # the series' highest point since the previous reading
    age_seconds: float = 0.0  # how old the newest full count of the job's pages is (0: counted now)

    def fields(self) -> dict:
        return {"domain": self.domain, "bytes_used": self.bytes_used, "bytes_limit": self.bytes_limit,
                "process_bytes": self.process_bytes, "available_bytes": self.available_bytes,
                "oom_kills": self.oom_kills, "peak_bytes_used": self.peak_bytes_used,
                "age_seconds": round(self.age_seconds, 3)}
