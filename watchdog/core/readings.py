"""What a memory source reads, as plain values: one reading, each chip's share, an allocator's
figures, the host's.

They live in the core because every layer passes them on: a source (in process) or a reader (the
`watch` daemon) makes them, and the station's telemetry and the exporter show them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One chip's memory, as a source that sees several chips reports it (`device` is its label)."""

    device: str
    bytes_used: int
    bytes_limit: int | None = None


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
