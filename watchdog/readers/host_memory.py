"""The job's host memory as the kernel counts it: the RAM whose exhaustion ends a job with SIGKILL.

A TPU VM's host RAM holds data loading, the loop's Python objects and every checkpoint on its way
to disk; when it runs out, the kernel ends the job silently. The kernel decides on two things: the
pages the job holds, each counted once, and the highest point they reach. So that is what is read:

- **The job's memory** (`ProcessTree`): the process and its descendants (DataLoader workers, compile
  helpers), each one's proportional share of its anonymous and shared-memory pages (`Pss_Anon +
  Pss_Shmem` of `/proc/PID/smaps_rollup`). A page two workers share counts half to each, so the sum
  counts every page once, and pages the trainer no longer maps but its forked workers still share
  are counted too (the old sum, the trainer's resident memory plus each child's private memory,
  dropped them: 10% low with two workers). File-backed pages (`Pss_File`: the libraries, a memory-
  mapped dataset) are not counted: the kernel drops them before it kills, they are shared with
  other processes on the machine (so their share moves when an unrelated process maps the same
  library), and they are not what a job leaks. Anonymous pages the job shares with a process
  outside it (an interpreter it was forked from, which kept running) count in part too, and rise
  toward whole as the job writes to them or the others exit: a job forked so reads low at first.
- **Its peak since the previous reading**: the process's high-water mark (`VmHWM`), reset at each
  reading by writing `5` to `/proc/PID/clear_refs`, so a copy made and freed between two readings
  (an evaluation's end-of-pass concatenation) is seen. The reset is seen by anyone who reads the
  same mark (`ru_maxrss`, psutil's peak); where the write is refused (another user's process), a
  new high shows only as the lifetime mark growing.
- **Every limit it lives under** (`Bound`): a budget given (`--host-memory-limit`, and on the CPU the
  device's `--memory-limit`) on the job's memory; a memory cgroup with a limit below the machine's
  memory (a pod, a container, a systemd slice) on the group's working set (usage less the inactive
  file cache the kernel reclaims before it kills, as the kubelet counts it), the tightest of the
  group and its ancestors; `RLIMIT_AS` on the process's address space (`ulimit -v`) and
  `RLIMIT_DATA` on its data segment, where set; the machine's memory where no budget and no cgroup
  limit is. Every one is read at every reading, and the one with the least room left decides.

One series is judged, whichever limit binds: the room left under the tightest limit, measured down
from a reference fixed at the start (the lowest of the limits then). Where the budget binds (the
usual case) the series is the job's memory itself; where a pod's limit binds, it is the group's
working set; and when the binding limit changes mid-run the series does not jump, since the room
left moves continuously. Each reading names the limit that binds (`domain`).

The same code reads this process (the sidecar) or another one by PID (the `watch` daemon): it only
reads /proc and /sys, and writes only the process's `clear_refs`.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import psutil

from watchdog.core.readings import HostReading, MemoryReading
from watchdog.core.units import format_bytes

HOST_DEVICE = "host"  # the host series' `device` label, in metrics, logs and a trace's name
CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1
JUDGED = "the job's memory: its processes' anonymous and shared pages, each counted once (Pss_Anon + Pss_Shmem)"


@dataclass(frozen=True)
class MemoryCgroup:
    """One memory cgroup's files, v2 or v1: usage, limit, reclaimable cache, peak, OOM kills."""

    path: Path
    version: int

    def limit(self) -> int | None:
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        text = _read_text(self.path / name)
        if text is None or text in ("max", "-1"):  # v2's "no limit", and v1's where a kernel prints it so
            return None
        value = _whole(text)
        if value is None:
            raise ValueError(f"{self.path / name}: not a byte count")  # tightest_cgroup: unreadable, passed over
        return None if value >= _UNLIMITED else value

    def working_set(self) -> int:
        """Usage less the inactive file cache: what the kernel cannot take back before it kills."""
        return max(0, self._bytes("memory.current" if self.version == 2 else "memory.usage_in_bytes")
                   - self.inactive_file())

    def peak_usage(self) -> int | None:
        """The highest usage the kernel saw (v2 `memory.peak`, v1 `memory.max_usage_in_bytes`), None
        where it keeps none. Never reset here: the mark is the group's, shared with every reader."""
        text = _read_text(self.path / ("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"))
        return None if text is None else _whole(text)

    def oom_kills(self) -> int | None:
        keyed = _read_keyed(self.path / ("memory.events" if self.version == 2 else "memory.oom_control"))
        return keyed.get("oom_kill")

    def _bytes(self, name: str) -> int:
        text = _read_text(self.path / name)
        usage = 0 if text is None else _whole(text)
        if usage is None:
            raise ValueError(f"{self.path / name}: not a byte count")  # a failed reading, counted
        return usage

    def inactive_file(self) -> int:
        """The inactive file cache: what the kernel reclaims before it kills."""
        stat = _read_keyed(self.path / "memory.stat")
        return stat.get("inactive_file" if self.version == 2 else "total_inactive_file", stat.get("inactive_file", 0))


def memory_cgroups(pid: int | str = "self", root: Path = CGROUP_ROOT) -> list[MemoryCgroup]:
    """The memory cgroups holding `pid`, innermost first, up to the root (each may carry a limit)."""
    return cgroups_listed(_read_text(Path(f"/proc/{pid}/cgroup")) or "", root)


def cgroups_listed(listing: str, root: Path = CGROUP_ROOT) -> list[MemoryCgroup]:
    """The memory cgroups a `/proc/PID/cgroup` listing names, innermost first, that exist under `root`."""
    found: list[MemoryCgroup] = []
    for line in listing.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, relative = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2: one unified tree
            base, version = root, 2
        elif "memory" in controllers.split(","):  # cgroup v1: the memory controller's own tree
            base, version = root / "memory", 1
        else:
            continue
        path = base / relative.lstrip("/")
        while True:
            if (path / ("memory.max" if version == 2 else "memory.limit_in_bytes")).exists():
                found.append(MemoryCgroup(path, version))
            if path == base or base not in path.parents:
                break
            path = path.parent
        if found:
            return found  # v1's memory controller, where mounted, is the one that limits
    return found


def tightest_cgroup(groups: list[MemoryCgroup], machine_bytes: int) -> tuple[MemoryCgroup, int] | None:
    """The group whose limit is lowest, if any is below the machine's memory."""
    best = None
    for group in groups:
        try:
            limit = group.limit()
        except (OSError, ValueError):
            continue
        if limit is not None and limit < machine_bytes and (best is None or limit < best[1]):
            best = (group, limit)
    return best


class Bound(NamedTuple):
    """One limit the job lives under, as read now: what it limits, how much of it is used, and the
    highest use since the previous reading."""

    domain: str  # "budget", "cgroup", "address_space", "data", "machine"
    used: int
    limit: int
    peak: int

    @property
    def room(self) -> int:
        return self.limit - self.used


DOMAINS = {
    "budget": "a budget given, on the job's memory",
    "cgroup": "the memory cgroup's limit, on the group's working set (usage less inactive file cache)",
    "address_space": "RLIMIT_AS (ulimit -v), on the process's address space (VmSize)",
    "data": "RLIMIT_DATA, on the process's data segment (VmData)",
    "machine": "the machine's memory, on the job's memory (no budget and no cgroup limit)",
}
_RLIMITS = {"address_space": b"Max address space", "data": b"Max data size"}


class HostMemory:
    """Reads one process's host memory (`pid`; this process by default) the way the kernel would:
    the job's memory and every limit over it (the module docstring).

    `limit_bytes`: a budget on the job's memory. `kernel_limits`: also the limits the kernel sets (a
    memory cgroup, `RLIMIT_AS`, `RLIMIT_DATA`) and, where neither a budget nor a cgroup limit is,
    the machine's memory; off, only the budget (the CPU's device series with the host unwatched).
    The limits are looked up once; which one binds is decided at every reading."""

    def __init__(self, pid: int | None = None, limit_bytes: int | None = None, *, kernel_limits: bool = True,
                 cgroup_root: Path = CGROUP_ROOT, tree: ProcessTree | None = None):
        self.process = psutil.Process(pid if pid is not None else os.getpid())
        self.tree = tree or ProcessTree(self.process)
        self.machine_bytes = psutil.virtual_memory().total
        self.budget = int(limit_bytes) if limit_bytes is not None else None
        self._cgroup: tuple[MemoryCgroup, int] | None = None
        self._rlimits: dict[str, int] = {}
        if kernel_limits:
            self._cgroup = tightest_cgroup(memory_cgroups(self.process.pid, cgroup_root), self.machine_bytes)
            self._rlimits = _rlimits(self.process.pid)
        self._machine = kernel_limits and self.budget is None and self._cgroup is None
        self._cgroup_peak: int | None = None
        self._reference: int | None = None  # the series' reference: the lowest limit at the first reading
        self.last: HostReading | None = None
        first = self.read()  # raises NoSuchProcess now when the process is gone
        self.domain = first.domain  # the limit that binds at the start, and the series' reference
        self.limit_bytes = first.bytes_limit

    def read(self) -> HostReading:
        """Raises psutil.NoSuchProcess when the process is gone; a child that exits mid-read is skipped."""
        tree = self.tree.read()
        bounds = self._bounds(tree)
        available = psutil.virtual_memory().available
        oom_kills = self._cgroup[0].oom_kills() if self._cgroup is not None else None
        if not bounds:  # no limit at all: the job's memory, unlimited
            reading = HostReading(tree.bytes_used, None, "none", tree.bytes_used, available, oom_kills,
                                  tree.peak_bytes, tree.age_seconds)
        else:
            if self._reference is None:
                self._reference = min(b.limit for b in bounds)
            reference = self._reference
            binding = min(bounds, key=lambda b: b.room)
            peak_room = min(b.limit - b.peak for b in bounds)
            reading = HostReading(reference - binding.room, reference, binding.domain, tree.bytes_used, available,
                                  oom_kills, reference - peak_room, tree.age_seconds)
        self.last = reading
        return reading

    def _bounds(self, tree: TreeReading) -> list[Bound]:
        bounds = []
        if self.budget is not None:
            bounds.append(Bound("budget", tree.bytes_used, self.budget, tree.peak_bytes))
        if self._cgroup is not None:
            group, limit = self._cgroup
            used = group.working_set()
            lifetime, self._cgroup_peak = self._cgroup_peak, group.peak_usage()
            peak = used
            if lifetime is not None and self._cgroup_peak is not None and self._cgroup_peak > lifetime:
                peak = max(used, self._cgroup_peak - group.inactive_file())  # a new high since the last reading
            bounds.append(Bound("cgroup", used, limit, peak))
        for domain, limit in self._rlimits.items():
            used = tree.address_space if domain == "address_space" else tree.data_segment
            bounds.append(Bound(domain, used, limit, used + tree.peak_bytes - tree.bytes_used))
        if self._machine:
            bounds.append(Bound("machine", tree.bytes_used, self.machine_bytes, tree.peak_bytes))
        return bounds

    def describe(self) -> dict:
        """What is judged and against what, for the one log line that says so at start: the number,
        every limit over it (name: bytes) and the one that binds now, and why."""
        limits = {}
        if self.budget is not None:
            limits["budget"] = self.budget
        if self._cgroup is not None:
            limits["cgroup"] = self._cgroup[1]
        limits.update(self._rlimits)
        if self._machine:
            limits["machine"] = self.machine_bytes
        return {"domain": self.domain, "limit_bytes": self.limit_bytes, "judged": JUDGED, "limits": limits,
                "why": DOMAINS.get(self.domain, "no limit is known"),
                "cgroup": str(self._cgroup[0].path) if self._cgroup is not None else None}


def _rlimits(pid: int) -> dict[str, int]:
    """The process's soft `RLIMIT_AS` and `RLIMIT_DATA`, where set (`/proc/PID/limits`: any process)."""
    found = {}
    try:
        with open(f"/proc/{pid}/limits", "rb") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return found
    for domain, title in _RLIMITS.items():
        for line in lines:
            if line.startswith(title):
                soft = line[len(title):].split()[:1]
                if soft and soft[0].isdigit() and len(soft[0]) <= 20:
                    found[domain] = int(soft[0])
    return found


def job_memory(pid: int | None = None) -> int:
    """The job's memory now, counted in full: a process and its descendants, each page once (what
    `ProcessTree` reads), leaving the high-water mark alone. For a loop's own budget, and for tests."""
    return ProcessTree(psutil.Process(pid if pid is not None else os.getpid()), reset_high_water=False).read().bytes_used


class RssSource:
    """The job's memory as a memory source (`MemorySource`): on PJRT CPU and plain CPU, where device
    buffers live in host memory, in process; and for the `watch` daemon beside a CPU job, by PID.
    A process's and its children's (DataLoader workers) anonymous and shared pages, each counted
    once, with the peak since the previous reading (`HostMemory`, which reads the host's series the
    same way). A worker's cache is the job's memory as much as the trainer's own: the kernel kills
    the job when their sum runs out.

    In process the limit is `--memory-limit` (`kernel_limits` off); where the host is watched too,
    the host's memory is this same memory, and `merge_into_rss` gives it every limit the host has (a
    budget, a cgroup's, RLIMIT_AS). The daemon reads the target with the kernel's limits on.
    """

    name = "rss"

    def __init__(self, memory_limit_bytes: int | None = None, *, pid: int | None = None, kernel_limits: bool = False):
        self.memory = HostMemory(pid, memory_limit_bytes, kernel_limits=kernel_limits)

    @property
    def tree(self) -> ProcessTree:
        return self.memory.tree

    def read(self) -> MemoryReading:
        host = self.memory.read()
        return MemoryReading(host.bytes_used, host.bytes_limit, host.peak_bytes_used)


# -- the process tree ----------------------------------------------------------------------------

FULL_READ_SHARE = 0.05  # of one core, at most, spent on the page-table walks (smaps_rollup)
GROWN_SAID_BYTES = 16 << 20  # a child process that grew less than this is not named in an action's block


class TreeReading(NamedTuple):
    """The job's memory now (`bytes_used`), its peak since the previous reading, and how old the
    newest full count of its pages is (`age_seconds`: 0 when counted at this reading)."""

    bytes_used: int
    peak_bytes: int
    age_seconds: float
    address_space: int  # the process's own VmSize
    data_segment: int  # and VmData


class _Status(NamedTuple):
    """What `/proc/PID/status` says of a process's memory, in bytes (one read, microseconds)."""

    name: str
    resident: int  # anonymous + shared memory resident (RssAnon + RssShmem)
    rss: int  # VmRSS
    high_water: int  # VmHWM
    size: int  # VmSize
    data: int  # VmData


@dataclass(slots=True)
class _Member:
    """One process of the tree, as of the newest full count."""

    pid: int
    name: str
    since_start: bool  # found at the reading after it started (else: when the watch started)
    share: int  # its anonymous and shared pages' share (Pss_Anon + Pss_Shmem), at the newest full count
    resident_then: int  # its anonymous and shared resident memory then
    first: int | None = None  # its share when first counted


@dataclass(frozen=True, slots=True)
class Descendant:
    """One process of the tree below the trainer, and its own memory."""

    pid: int
    label: str  # "DataLoader worker 2", or the process's name
    own_bytes: int  # its share of the job's memory
    grown_bytes: int  # since it started (or since the watch began, for one already running then)
    since_start: bool = True

    def line(self) -> str:
        """For an action's block: which process grew, by how much of its own."""
        since = "since it started" if self.since_start else "since the watch began"
        return f"{self.label}, pid {self.pid}: +{format_bytes(self.grown_bytes)} of its own {since}"


class ProcessTree:
    """The memory of a process and its descendants, each page counted once (the module docstring).

    The tree's members are found in time linear in the tree: each member's threads list the
    children they started (`/proc/PID/task/TID/children`), so a worker started after the watch is
    in the next reading (where the kernel keeps no such lists, one pass over /proc finds them).
    Each member's `/proc/PID/status` gives its resident anonymous and shared memory (microseconds).

    A member's share of its pages comes from the kernel's walk of its page tables (`smaps_rollup`:
    3.4 ms for a torch_xla process mapping 900 MB here). So the shares are counted in full no more
    often than keeps the walks under `FULL_READ_SHARE` of a core; a member that comes or goes is
    counted at once, with the process itself (a fork moves shares between the two). In between,
    each member's count moves by what its resident anonymous and shared memory moved (the pages a
    process touches anew are its own). The process's own status is read at every reading; looking
    for the members and reading theirs is paced the same way by what it costs (a tree of hundreds
    of processes), and each reading says how old the oldest part of it is (`age_seconds`). A child
    that exits mid-read is skipped; one whose pages cannot be read (another user's) counts its
    resident anonymous and shared memory."""

    def __init__(self, process: psutil.Process, *, reset_high_water: bool = True):
        """`reset_high_water`: False for a reader beside the watchdog (a test's count), which must not
        take the peaks from the watchdog's readings."""
        self.process = process
        self._lock = threading.Lock()  # the sidecar's readings, and the training thread's after a rebuild
        self._members: dict[int, _Member] = {}
        self._ranks: dict[int, bool] = {}  # each descendant seen: another rank of the job (not counted)?
        self._statuses: dict[int, _Status] = {}  # the descendants' as of the newest look at the tree
        self._looked_at = self._counted_at = -math.inf
        self._look_seconds = self._count_seconds = 0.0
        self._first_reading = True
        self._resets = reset_high_water  # the high-water mark is reset (else: only a new lifetime high is seen)
        self._high_water = 0
        self.descendants: tuple[Descendant, ...] = ()  # as of the newest reading

    def read(self) -> TreeReading:
        """Raises psutil.NoSuchProcess when the process itself is gone."""
        with self._lock:
            return self._read()

    def _read(self) -> TreeReading:
        root = self.process.pid
        status = _status(root)
        if status is None:
            raise psutil.NoSuchProcess(root)
        now = time.monotonic()
        if now - self._looked_at >= self._look_seconds / FULL_READ_SHARE:
            started = time.perf_counter()
            self._statuses = {pid: found for pid in self._find() if (found := _status(pid)) is not None}
            self._looked_at, self._look_seconds = now, time.perf_counter() - started
        statuses = {root: status, **self._statuses}
        came_or_went = statuses.keys() ^ self._members.keys()
        if came_or_went and self._members:
            self._count(statuses, now, came_or_went | {root})
        elif came_or_went or now - self._counted_at >= self._count_seconds / FULL_READ_SHARE:
            self._count(statuses, now)
        total = 0
        for pid, member in self._members.items():
            total += max(0, member.share + statuses[pid].resident - member.resident_then)
        self._first_reading = False
        self.descendants = self._descendants(statuses)
        age = now - min(self._counted_at, self._looked_at if self._statuses else now)
        return TreeReading(total, total + self._excursion(status), age, status.size, status.data)

    def bytes_used(self) -> int:
        return self.read().bytes_used

    def pids(self) -> set[int]:
        """The process's and its descendants' PIDs (no memory read)."""
        with self._lock:
            return {self.process.pid, *self._find()}

    def grown(self, at_least: int = GROWN_SAID_BYTES) -> list[Descendant]:
        """The descendants whose own memory grew by `at_least` since they started, most first."""
        return sorted((d for d in self.descendants if d.grown_bytes >= at_least), key=lambda d: -d.grown_bytes)

    def _count(self, statuses: dict[int, _Status], now: float, only: set[int] | None = None) -> None:
        """The members' shares of their pages, counted now (the page-table walks): every member's,
        or `only` those that came (and the process itself), the rest kept."""
        started = time.perf_counter()
        members = {}
        for pid, status in statuses.items():
            known = self._members.get(pid)
            member = members[pid] = known or _Member(pid, status.name, not self._first_reading, 0, 0)
            if only is not None and known is not None and pid not in only:
                continue
            share = _share(pid)
            member.share = status.resident if share is None else share
            member.resident_then = status.resident
            if member.first is None:
                member.first = member.share
        self._members = members
        if only is None:
            self._counted_at, self._count_seconds = now, time.perf_counter() - started

    def _excursion(self, status: _Status) -> int:
        """How far the process's resident memory rose above now since the previous reading (its
        high-water mark, then reset), in the job's terms: what a copy made and freed in between held."""
        high_water, rss = status.high_water, status.rss
        if self._resets:
            try:
                with open(f"/proc/{self.process.pid}/clear_refs", "wb", buffering=0) as handle:
                    handle.write(b"5")
            except OSError:
                self._resets = False  # another user's process: only a new lifetime high is seen
            return max(0, high_water - rss)
        grew, self._high_water = high_water > self._high_water, high_water
        return max(0, high_water - rss) if grew else 0

    def _find(self) -> list[int]:
        """The descendants, less any that is another rank of the job (and what is below it): a
        rank started by this one (Lightning's own DDP launcher starts rank 1 from rank 0) has its
        own watchdog and budget, and counted here its whole memory landed on rank 0's series, which
        acted on a resumed leak that rank 0 alone never brought near its limit."""
        children = _children_of if _CHILDREN_LISTED else _scan_children()
        own = _rank_of(self.process)
        found: list[int] = []
        frontier = children(self.process.pid)
        seen = set()
        while frontier:
            pid = frontier.pop()
            if pid in seen:
                continue
            seen.add(pid)
            other = self._ranks.get(pid)
            if other is None:
                rank = _rank_of_pid(pid)
                other = self._ranks[pid] = rank is not None and rank != own
            if other:
                continue
            found.append(pid)
            frontier.extend(children(pid))
        self._ranks = {pid: self._ranks[pid] for pid in seen}  # only the living are remembered
        return found

    def _descendants(self, statuses: dict[int, _Status]) -> tuple[Descendant, ...]:
        root = self.process.pid
        mine = [(pid, m) for pid, m in self._members.items() if pid != root]
        workers = sorted(pid for pid, m in mine if m.name == DATALOADER_WORKER)
        read = []
        for pid, member in mine:
            own = max(0, member.share + statuses[pid].resident - member.resident_then)
            label = (f"DataLoader worker {workers.index(pid) + 1}" if member.name == DATALOADER_WORKER
                     else f"child process {member.name}")
            read.append(Descendant(pid, label, own, own - (member.first or 0), member.since_start))
        return tuple(read)


def _status(pid: int) -> _Status | None:
    """None where the process is gone, or a zombie (no memory left to it)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as handle:
            text = handle.read()
    except OSError:
        return None
    name, kib = "", {}
    for line in text.split(b"\n"):
        key, _, value = line.partition(b":")
        if key == b"Name":
            name = value.strip().decode("ascii", "replace")
        elif key in _STATUS_KIB:
            number = value.split()[:1]
            if number and number[0].isdigit():
                kib[key] = int(number[0])
    if b"VmRSS" not in kib:
        return None
    return _Status(name, (kib.get(b"RssAnon", kib[b"VmRSS"]) + kib.get(b"RssShmem", 0)) << 10, kib[b"VmRSS"] << 10,
                   kib.get(b"VmHWM", kib[b"VmRSS"]) << 10, kib.get(b"VmSize", 0) << 10, kib.get(b"VmData", 0) << 10)


_STATUS_KIB = frozenset((b"RssAnon", b"RssShmem", b"VmRSS", b"VmHWM", b"VmSize", b"VmData"))


def _share(pid: int) -> int | None:
    """The process's share of its anonymous and shared-memory pages (`Pss_Anon + Pss_Shmem`; the
    whole `Pss` less `Pss_File` on kernels before 5.9, `Pss` alone before that); None where its page
    tables cannot be read (another user's process, or it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as handle:
            text = handle.read()
    except OSError:
        return None
    kib = {}
    for line in text.split(b"\n"):
        key, _, value = line.partition(b":")
        if key in (b"Pss", b"Pss_Anon", b"Pss_Shmem", b"Pss_File"):
            number = value.split()[:1]
            if number and number[0].isdigit():
                kib[key] = int(number[0])
    if b"Pss_Anon" in kib:
        return (kib[b"Pss_Anon"] + kib.get(b"Pss_Shmem", 0)) << 10
    if b"Pss" in kib:
        return (kib[b"Pss"] - kib.get(b"Pss_File", 0)) << 10
    return None


_CHILDREN_LISTED = os.path.exists(f"/proc/self/task/{os.getpid()}/children")  # CONFIG_PROC_CHILDREN


def _children_of(pid: int) -> list[int]:
    """The children `pid`'s threads started, from the kernel's own lists: no scan of the machine."""
    found: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as handle:
                found.extend(int(child) for child in handle.read().split())
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
    return found


def _scan_children():
    """Where the kernel keeps no children lists: every process's parent, read once per reading."""
    by_parent: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                parent = int(handle.read().rpartition(b")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        by_parent.setdefault(parent, []).append(int(entry))
    return lambda pid: list(by_parent.get(pid, ()))


def _rank_of_pid(pid: int) -> tuple[str | None, str | None] | None:
    try:
        return _rank_of(psutil.Process(pid))
    except psutil.Error:
        return None


def _rank_of(process: psutil.Process) -> tuple[str | None, str | None] | None:
    """The rank a process was started as (`RANK`, `LOCAL_RANK`), None where neither is set. This
    process's own from its environment now (a launcher may set them after it started); another's
    from the environment it was started with (a forked worker's is its parent's)."""
    if process.pid == os.getpid():
        environ = os.environ
    else:
        try:
            environ = process.environ()
        except psutil.Error:
            return None
    rank = (environ.get("RANK"), environ.get("LOCAL_RANK"))
    return None if rank == (None, None) else rank


DATALOADER_WORKER = "pt_data_worker"  # the name torch's DataLoader gives each worker process's main thread


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _whole(text: str) -> int | None:
    """A kernel's byte count or counter: the digits 0-9 only, at most 20 of them (2**64 has 20), else
    None. `int()` would read "+5", "1_000", " 5" and "١٢٣" (Arabic-Indic digits) as numbers."""
    return int(text) if 0 < len(text) <= 20 and text.isascii() and text.isdigit() else None


def _read_keyed(path: Path) -> dict[str, int]:
    """`key value` lines (memory.stat, memory.events, memory.oom_control) as numbers; a value that
    is not one (`_whole`) is left out."""
    found = {}
    for line in (_read_text(path) or "").splitlines():
        key, _, value = line.partition(" ")
        number = _whole(value.strip())
        if number is not None:
            found[key] = number
    return found
