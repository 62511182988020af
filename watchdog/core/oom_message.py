"""XLA's and PyTorch CUDA's out-of-memory messages, parsed: which kind, how much, and which Python
lines asked. Pure.

When an OOM happens anyway, XLA's message already holds the map back to the program, in one of a
few layouts (OpenXLA's error pages `docs/errors/error_1000.md`, `error_0100.md`, `error_0101.md`,
and what public reports show in older and newer wordings):

- **compile** (a program too large for the memory space, found while compiling):
  "Ran out of memory in memory space hbm. Used 63.80G of 30.75G hbm. Exceeded hbm capacity by
  33.05G." then a breakdown and "Largest program allocations in hbm:", a numbered list whose
  items carry `Size:`, `Operator: op_name="..." source_file="..." source_line=N`, `Shape:` and
  `Allocation type:`;
- **runtime** (a program that cannot be loaded): "Attempting to reserve 6.14G at the bottom of
  memory. That was not possible. There are 1.92G free, ..." with an "HBM capacity 8.00G:" table
  whose rows print the byte count in parentheses;
- **allocation** (a buffer that cannot be allocated): "Error allocating device buffer: Attempting
  to allocate 196.00M. That was not possible. There are 134.44M free.; (1x0x0_HBM0)"; on GPU
  "Out of memory while trying to allocate 6291456 bytes." with "Peak buffers:" (`Buffer N:`
  items, the same fields, or `Entry Parameter Subshape:` for an argument), or the allocator's
  "Failed to allocate request for 176.00MiB (184549376B) on device ordinal 0".

PyTorch's CUDA caching allocator says "CUDA out of memory. Tried to allocate N" (kind allocation,
memory space `device`), with its figures in one of three wordings:
- 1.0 to 1.3: "(GPU 0; T total capacity; A already allocated; F free; C cached)", where "cached" is
  what the allocator holds but no tensor uses (reserved but unallocated);
- 1.4 to 2.0: the same with "R reserved in total by PyTorch" instead of "cached" (so R - A);
- 2.1 on: "GPU 0 has a total capac(i)ty of T of which F is free.", one "Process P has M memory in
  use." per other process, "Including non-PyTorch memory, this process has M memory in use." (where
  NVML answered) and "Of the allocated memory A is allocated by PyTorch, and U is reserved by
  PyTorch but unallocated."; 2.11 adds "L allowed;" after this process's use: the allocator's
  limit, its share of the device under `set_per_process_memory_fraction` (`limit_bytes`; the
  capacity stays the device's).
Its sizes are printed as "512 bytes", "12.50 KiB", "1.72 GiB". The oldest form, "CUDA error: out of
memory" (or "cuda runtime error (2) : out of memory"), has no figures at all.

Sizes with K/M/G/T suffixes are binary; a byte count in parentheses, where printed, wins. With
several messages in one log the last one is parsed: it is the one that ended the job. A
`RESOURCE_EXHAUSTED` about anything else (a quota, a file system) is not an out-of-memory
message, and `parse` returns None for it.

What a log holds is read totally: ANSI colour codes and launcher prefixes (torchrun's `[rank0]:`)
are dropped first; a size is 0 to 2**63 - 1 bytes (`MAX_SIZE`, its digits counted before any
arithmetic), and one out of that range is unknown (None), a listed allocation with one is left
out and counted (`unreadable_sizes`); every pattern runs in time linear in its line, and `parse`
reads each line of the log a bounded number of times, however often a message repeats.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
MAX_SIZE = 2**63 - 1  # sizes read are 0 to this (numbers.MAX_SIZE - 1): a signed 64-bit byte count
# Possessive quantifiers (`*+`, `++`) everywhere a run of spaces or digits could be split two ways:
# a line of 5,000 spaces after "Size: 5" took 387 s to refuse with plain ones.
# A size is a whole number with one fraction at most: "1.5.5 GiB" is no size (it was read as 2 bytes).
_SIZE = r"(?<![0-9.])[0-9]++(?:\.[0-9]++)?+(?![.0-9])\s*+(?:[KMGTP]i?B?|B)?"
_EXACT = r"\(\s*+([0-9][0-9,]*+)\s*+(?:B|bytes)\)"  # "(184549376B)", "(     554,696,704 bytes)"

# What a launcher or a terminal puts before or inside a line, dropped before anything is read: ANSI
# colour and cursor codes; torchrun's rank prefixes ("[rank0]:", "[default3]:", --tee and
# local_ranks_filter); then the line's own log prefix: glog ("E1103 18:23:55.102 ... cc:73] "),
# absl ("2022-04-04 00:27:49.642380: E tensorflow/.../xla_util.cc:88] ").
# An OSC sequence (ESC ], a title or a clipboard write) ends at BEL, ESC \\ or, unfinished, at its line's
# end: two stray bytes 100 lines before PyTorch's message used to swallow it whole.
_ANSI = re.compile(r"\x1b(?:\[[0-?]*+[ -/]*+[@-~]|\][^\x07\x1b\n]*+(?:\x07|\x1b\\)?|[@-Z\\-_])")
_RANK_PREFIX = re.compile(r"^(?:\s*+\[[A-Za-z_]*+[0-9]++\]:)++ ?")
_LOG_PREFIX = re.compile(r"^(?:[EWIF]\d{4} [0-9:.]++\s++\d++ \S+?\] |\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d++: [EWIF] \S+?\] )")

_COMPILE = re.compile(r"Ran out of memory in memory space (?P<space>\w++)")
_RESERVE = re.compile(rf"Attempting to reserve (?P<size>{_SIZE}) at the bottom of memory\. That was not possible")
_ALLOCATE = re.compile(rf"Attempting to allocate (?P<size>{_SIZE})\. That was not possible")
_GPU_ALLOCATE = re.compile(r"Out of memory while trying to allocate (?P<size>[0-9]++) bytes")
_GPU_REQUEST = re.compile(rf"Failed to allocate request for (?P<size>{_SIZE})\s*+(?:{_EXACT})? on device")
_CUDA_SIZE = rf"{_SIZE}(?:\s*+bytes)?"  # PyTorch prints "512 bytes" below a KiB
_TORCH_CUDA = re.compile(rf"CUDA out of memory\.\s++Tried to allocate (?:(?P<size>{_CUDA_SIZE})|\S++)")
_TORCH_CUDA_BARE = re.compile(r"CUDA error: out of memory|cuda runtime error \(2\) : out of memory")
_STARTS = (_COMPILE, _RESERVE, _ALLOCATE, _GPU_ALLOCATE, _GPU_REQUEST, _TORCH_CUDA, _TORCH_CUDA_BARE)
_CUDA_FIGURES = 2000  # characters of a CUDA message after its headline that hold its figures

# The CUDA message's figures; `\s++` between words, as a long message is often wrapped.
_CUDA_TOTAL = re.compile(rf"(?P<size>{_CUDA_SIZE})\s++total\s++capacity")
_CUDA_ALREADY = re.compile(rf"(?P<size>{_CUDA_SIZE})\s++already\s++allocated")
_CUDA_FREE = re.compile(rf";\s*+(?P<size>{_CUDA_SIZE})\s++free")
_CUDA_CACHED = re.compile(rf"(?P<size>{_CUDA_SIZE})\s++cached\)")
_CUDA_RESERVED = re.compile(rf"(?P<size>{_CUDA_SIZE})\s++reserved\s++in\s++total\s++by\s++PyTorch")
_CUDA_CAPACITY = re.compile(rf"has\s++a\s++total\s++capaci?ty\s++of\s++(?P<size>{_CUDA_SIZE})\s++of\s++which\s++"
                            rf"(?P<free>{_CUDA_SIZE})\s++is\s++free")
_CUDA_PROCESS = re.compile(rf"Process\s++(?P<pid>[0-9]{{1,10}})\s++has\s++(?P<size>{_CUDA_SIZE})\s++memory\s++in\s++use")
_CUDA_ALLOWED = re.compile(rf"(?P<size>{_CUDA_SIZE})\s++allowed\s*+;")  # 2.11: the allocator's limit
_CUDA_THIS_PROCESS = re.compile(rf"this\s++process\s++has\s++(?P<size>{_CUDA_SIZE})\s++memory\s++in\s++use")
_CUDA_BY_PYTORCH = re.compile(rf"Of\s++the\s++allocated\s++memory\s++(?P<size>{_CUDA_SIZE})\s++is\s++allocated\s++by\s++"
                              rf"PyTorch,?\s++and\s++(?P<unallocated>{_CUDA_SIZE})\s++is\s++reserved\s++by\s++PyTorch"
                              rf"\s++but\s++unallocated")

_USED = re.compile(rf"Used (?P<used>{_SIZE}) of (?P<capacity>{_SIZE}) (?P<space>\w++)")
_EXCEEDED = re.compile(rf"Exceeded \w++ capacity by (?P<size>{_SIZE})")
_CAPACITY = re.compile(rf"(?<![A-Za-z])(?P<space>[A-Za-z]++) capacity (?P<size>{_SIZE}):")
_ALLOCATED = re.compile(rf"Currently allocated:\s*+(?P<size>{_SIZE})\s*+(?:{_EXACT})?")
_FREE = re.compile(rf"There are (?P<size>{_SIZE}) free")
_SPACE_TAG = re.compile(r"_(?P<space>HBM|VMEM|SMEM|CMEM)[0-9]*+\)", re.I)  # "(1x0x0_HBM0)"

_ITEM = re.compile(rf"^\s*+(?:[0-9]++\.\s++)?Size:\s*+(?P<size>{_SIZE})\s*+(?:{_EXACT})?\s*+$")
_FIELD = re.compile(r"^\s*+(?P<name>Operator|Shape|Entry Parameter Subshape|Allocation type|Unpadded size|"
                    r"Extra memory due to padding|XLA [Ll]abel|Buffer [0-9]++|=++)\s*+:?")
_QUOTED = r'"((?:[^"\\]++|\\.)*+)"'  # possessive: an unclosed quote over 20 MB took 2.75 GB to refuse
_OP_NAME, _OP_TYPE, _SOURCE_FILE = (re.compile(rf"{name}={_QUOTED}") for name in ("op_name", "op_type", "source_file"))
_SOURCE_LINE = re.compile(r"source_line=([0-9]{1,9})")
_EXACT_RE = re.compile(_EXACT)
_EXACT_AFTER = re.compile(rf"\s*+{_EXACT}")
_SIZE_TEXT = re.compile(r"\s*+([0-9]++)(?:\.([0-9]++))?+\s*+(?:([KMGTP]?)i?B?|bytes)\s*+")


@dataclass
class Allocation:
    size_bytes: int
    op_name: str | None = None
    source_file: str | None = None
    source_line: int | None = None
    shape: str | None = None
    allocation_type: str | None = None


@dataclass
class PythonSite:
    file: str
    line: int
    bytes: int
    allocations: int


@dataclass
class OomMessage:
    kind: str  # compile, runtime or allocation
    memory_space: str  # hbm, vmem, ...; device for a GPU allocator's message
    used_bytes: int | None = None
    capacity_bytes: int | None = None
    exceeded_bytes: int | None = None
    requested_bytes: int | None = None
    free_bytes: int | None = None  # free on the device, as the message says
    allocated_bytes: int | None = None  # PyTorch's allocator: what live tensors hold
    reserved_unallocated_bytes: int | None = None  # held by PyTorch's allocator, in no tensor
    process_bytes: int | None = None  # this process's whole use of the device (NVML), PyTorch's or not
    limit_bytes: int | None = None  # PyTorch's allocator: its limit ("L allowed;", torch 2.11 on)
    processes: list[dict] = field(default_factory=list)  # the other processes on the device: {pid, bytes}
    allocations: list[Allocation] = field(default_factory=list)
    unreadable_sizes: int = 0  # listed allocations left out: a size out of range (0 to MAX_SIZE)

    @property
    def fragmented(self) -> bool:
        """The allocator held more than was asked for, yet in no block that could take it."""
        return (self.reserved_unallocated_bytes is not None and self.requested_bytes is not None
                and self.reserved_unallocated_bytes >= self.requested_bytes)

    @property
    def python_sites(self) -> list[PythonSite]:
        """The allocations grouped by the Python line that made them, biggest first."""
        sites: dict[tuple[str, int], list[int]] = defaultdict(list)
        for allocation in self.allocations:
            if allocation.source_file and allocation.source_line is not None:
                sites[(allocation.source_file, allocation.source_line)].append(allocation.size_bytes)
        grouped = [PythonSite(file, line, sum(sizes), len(sizes)) for (file, line), sizes in sites.items()]
        return sorted(grouped, key=lambda site: (-site.bytes, site.file, site.line))

    def to_json(self) -> dict:
        return {"oom": True, "kind": self.kind, "memory_space": self.memory_space,
                "used_bytes": self.used_bytes, "capacity_bytes": self.capacity_bytes,
                "exceeded_bytes": self.exceeded_bytes, "requested_bytes": self.requested_bytes,
                "free_bytes": self.free_bytes, "allocated_bytes": self.allocated_bytes,
                "reserved_unallocated_bytes": self.reserved_unallocated_bytes, "process_bytes": self.process_bytes,
                "processes": [dict(p) for p in self.processes], "limit_bytes": self.limit_bytes,
                "allocations": [vars(a).copy() for a in self.allocations],
                "python_sites": [vars(s).copy() for s in self.python_sites]}


def size_bytes(text: str) -> int:
    """`63.80G`, `6.00MiB`, `384.0KiB`, `0B`, `4.0K`, `176.00MiB (184549376B)`: binary units; the
    byte count in parentheses wins where one is printed. ValueError for anything else, a size
    beyond MAX_SIZE included (its digits are counted before any arithmetic)."""
    exact = _EXACT_RE.search(text)
    if exact:
        return _exact(exact.group(1), text)
    match = _SIZE_TEXT.fullmatch(text)
    if match is None:
        raise ValueError(f"not a size: {text[:40]!r}")
    whole, fraction, unit = match.groups()
    unit = unit or ""
    if len(whole.lstrip("0")) > 19:  # beyond any 64-bit count, whatever the unit: no float of it
        raise ValueError(f"not a size: {len(whole):,} digits")
    return _bounded(round(float(f"{whole}.{(fraction or '0')[:20]}") * _UNITS[unit]), text)


def _exact(digits: str, text: str) -> int:
    digits = digits.replace(",", "")
    if len(digits.lstrip("0")) > 19:
        raise ValueError(f"not a size: {len(digits):,} digits")
    return _bounded(int(digits), text)


def _bounded(value: int, text: str) -> int:
    if not 0 <= value <= MAX_SIZE:
        raise ValueError(f"not a size: {text[:40]!r} is beyond {MAX_SIZE:,} bytes")
    return value


def _sized(text: str, match: re.Match, group: str = "size") -> int | None:
    """The size a pattern matched, or the exact byte count printed right after it; None for one
    out of range (0 to MAX_SIZE): unknown, rather than a wrong number."""
    if match.group(group) is None:  # the message printed something that is no size: unknown
        return None
    after = text[match.end(group):match.end(group) + 40]
    exact = _EXACT_AFTER.match(after)
    try:
        return _exact(exact.group(1), after) if exact else size_bytes(match.group(group))
    except ValueError:
        return None


def _clean(text: str) -> list[str]:
    """The text's lines as the parser reads them: ANSI codes, rank prefixes and log prefixes gone."""
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    return [_LOG_PREFIX.sub("", _RANK_PREFIX.sub("", line.rstrip())) for line in text.splitlines()]


def parse(text: str) -> OomMessage | None:
    """The last out-of-memory message in `text` (a job's output, other lines and all), or None.

    Linear in the text: where the last message has no list of its own (a one-line repeat, the
    exception's text), each earlier copy of its headline is read only up to the copy after it,
    newest first, until one has a list: every line is read once at most."""
    lines = _clean(text)
    body = "\n".join(lines)
    starts = sorted(((m.start(), index, m) for index, pattern in enumerate(_STARTS) for m in pattern.finditer(body)),
                    key=lambda start: (start[0], start[1]))
    if not starts:
        return None
    begin, index, match = starts[-1]  # a log often repeats a message (every device, the traceback)
    rest = body[begin:]
    match = _STARTS[index].match(rest)  # the same match, its offsets now in `rest`
    message = _headline(_STARTS[index], match, rest)
    message.allocations, message.unreadable_sizes = _allocations(rest.splitlines())
    if not message.allocations:  # a one-line repeat (the exception's text) after the full dump
        end = begin
        for earlier, _, earlier_match in reversed(starts[:-1]):
            if earlier_match.group(0) == match.group(0):
                message.allocations, message.unreadable_sizes = _allocations(body[earlier:end].splitlines())
                if message.allocations:
                    break
                end = earlier
    return message


def _headline(pattern: re.Pattern, match: re.Match, rest: str) -> OomMessage:
    if pattern is _COMPILE:
        space = match.group("space").lower()
        message = OomMessage("compile", space)
        used = _USED.search(rest)
        if used:
            message.used_bytes = _sized(rest, used, "used")
            message.capacity_bytes = _sized(rest, used, "capacity")
        exceeded = _EXCEEDED.search(rest)
        if exceeded:
            message.exceeded_bytes = _sized(rest, exceeded)
        return message
    if pattern is _RESERVE:
        message = OomMessage("runtime", "hbm", requested_bytes=_sized(rest, match))
        capacity = _CAPACITY.search(rest)
        if capacity:
            message.memory_space = capacity.group("space").lower()
            message.capacity_bytes = _sized(rest, capacity)
        allocated = _ALLOCATED.search(rest)
        if allocated:
            message.used_bytes = _sized(rest, allocated)
        _exceeded_from_free(message, rest)
        return message
    if pattern is _ALLOCATE:
        tag = _SPACE_TAG.search(rest[:400])
        message = OomMessage("allocation", tag.group("space").lower() if tag else "hbm",
                             requested_bytes=_sized(rest, match))
        _exceeded_from_free(message, rest)
        return message
    if pattern is _TORCH_CUDA:
        return _torch_cuda(OomMessage("allocation", "device", requested_bytes=_sized(rest, match)),
                           rest[match.end():match.end() + _CUDA_FIGURES])
    if pattern is _TORCH_CUDA_BARE:
        return OomMessage("allocation", "device")
    return OomMessage("allocation", "device", requested_bytes=_sized(rest, match))


def _torch_cuda(message: OomMessage, figures: str) -> OomMessage:
    """The figures of PyTorch's CUDA message, in whichever of its wordings they come."""
    following = _TORCH_CUDA.search(figures) or _TORCH_CUDA_BARE.search(figures)
    figures = figures[:following.start()] if following else figures  # not the next message's
    found = {name: pattern.search(figures) for name, pattern in (
        ("capacity", _CUDA_CAPACITY), ("total", _CUDA_TOTAL), ("free", _CUDA_FREE),
        ("this_process", _CUDA_THIS_PROCESS), ("allowed", _CUDA_ALLOWED), ("by_pytorch", _CUDA_BY_PYTORCH),
        ("already", _CUDA_ALREADY),
        ("cached", _CUDA_CACHED), ("reserved", _CUDA_RESERVED))}

    def size(name: str, group: str = "size") -> int | None:
        return _sized(figures, found[name], group) if found[name] else None

    if found["capacity"]:  # 2.1 on: "a total capacity of T of which F is free"
        message.capacity_bytes, message.free_bytes = size("capacity"), size("capacity", "free")
    else:  # 1.0 to 2.0: "T total capacity; ...; F free"
        message.capacity_bytes, message.free_bytes = size("total"), size("free")
    message.process_bytes = size("this_process")
    message.limit_bytes = size("allowed")
    if found["by_pytorch"]:  # 2.1 on: "A is allocated by PyTorch, and U is reserved by PyTorch but unallocated"
        message.allocated_bytes = size("by_pytorch")
        message.reserved_unallocated_bytes = size("by_pytorch", "unallocated")
    else:
        message.allocated_bytes = size("already")
        if found["cached"]:  # 1.0 to 1.3: "cached" is reserved but unallocated
            message.reserved_unallocated_bytes = size("cached")
        elif size("reserved") is not None and message.allocated_bytes is not None:  # 1.4 to 2.0: R in total
            message.reserved_unallocated_bytes = max(0, size("reserved") - message.allocated_bytes)
    message.processes = [{"pid": int(m.group("pid")), "bytes": _sized(figures, m)}
                         for m in _CUDA_PROCESS.finditer(figures)]
    return message


def _exceeded_from_free(message: OomMessage, rest: str) -> None:
    free = _FREE.search(rest[:400])
    free_bytes = _sized(rest, free) if free else None
    if free_bytes is not None and message.requested_bytes is not None:
        message.exceeded_bytes = max(0, message.requested_bytes - free_bytes)


def _allocations(lines: list[str]) -> tuple[list[Allocation], int]:
    """The listed allocations ("Largest program allocations", "Peak buffers"), and how many were
    left out for a size out of range: an item starts at its `Size:` line; an `Operator:` may run
    over several lines until the next field."""
    found: list[Allocation] = []
    unreadable = 0
    current: Allocation | None = None
    operator: list[str] | None = None
    for line in lines:
        item = _ITEM.match(line)
        fieldname = _FIELD.match(line)
        if operator is not None and (item or fieldname):
            _read_operator(current, " ".join(operator))
            operator = None
        if item:
            size = _sized(line, item)
            current = Allocation(size) if size is not None else None  # its fields go with it
            if current is None:
                unreadable += 1
            else:
                found.append(current)
            continue
        if current is None:
            continue
        if operator is not None:
            operator.append(line.strip())
            continue
        if fieldname is None:
            continue
        value = line[fieldname.end():].strip()
        name = fieldname.group("name")
        if name == "Operator":
            operator = [value]
        elif name == "Shape":
            current.shape = _without_layout(value)
        elif name == "Entry Parameter Subshape":
            current.shape, current.allocation_type = _without_layout(value), "parameter"
        elif name == "Allocation type":
            current.allocation_type = value
        elif name.startswith("="):
            current = None  # the item's closing rule: lines after it are not its fields
    if operator is not None and current is not None:
        _read_operator(current, " ".join(operator))
    return found, unreadable


def _read_operator(allocation: Allocation | None, text: str) -> None:
    if allocation is None:
        return
    op_name, op_type = _OP_NAME.search(text), _OP_TYPE.search(text)
    source_file, source_line = _SOURCE_FILE.search(text), _SOURCE_LINE.search(text)
    allocation.op_name = (op_name or op_type).group(1) if (op_name or op_type) else None
    allocation.source_file = source_file.group(1) if source_file else None
    allocation.source_line = int(source_line.group(1)) if source_line else None


def _without_layout(shape: str) -> str:
    """`f32[1024,1024]{1,0}` -> `f32[1024,1024]`: the layout suffix dropped. Linear by construction
    (the regex it replaces, `\\{[^}]*\\}\\s*$`, backtracked over a line of n `{`: 21 s at 100,000):
    the suffix starts at the first `{` after the last `}` before the final one."""
    shape = shape.strip()
    if not shape.endswith("}"):
        return shape
    start = shape.find("{", shape.rfind("}", 0, len(shape) - 1) + 1, len(shape) - 1)
    return shape[:start] if start != -1 else shape