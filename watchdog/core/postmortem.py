"""How a run ended, from what it left: the trace, the flight record, the job's output. Pure.

`diagnose` reads the trend at the end of the trace (through the same `replay` as `analyze`), what
the live watchdog recorded (its signals and suspects, `records/flight_record.py`), how the process
ended (a clean stop recorded, or not) and XLA's out-of-memory message, and says in one word what
most likely ended the run:

- `leak`: the watchdog had projected the OOM, or reported a leak whose floor ended near the limit;
- `sudden_step`: the last reading is far above the trend and what came before it (a long batch, a
  new sequence length, an evaluation's first run);
- `too_large_from_start`: XLA could not compile or load the program in the first steps;
- `host_memory`: the host's series reached its budget (where the host is watched);
- `unknown`: none of those (or the run ended cleanly: nothing to diagnose).

XLA's message names each allocation's innermost Python frame (torch's `linear.py` for a layer's
matmul). Where the flight record holds the traced program's largest ops with the user's own line
of each (`program_sites`, recorded under `--hlo-source-lines`), `user_lines` traces the message's
allocations back to those lines, matched by op name and shape (else by XLA's file:line and shape).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from watchdog.core.errors import InputError
from watchdog.core.numbers import MAX_SIZE, MAX_STEP
from watchdog.core.oom_message import OomMessage
from watchdog.core.replay import replay
from watchdog.core.sample import Sample
from watchdog.core.units import format_bytes, format_limit

NEAR_THE_LIMIT = 0.9  # a floor plus transient this close to the limit ran out by growth
FIRST_STEPS = 3  # samples a run "from the start" has at most when XLA refuses its program
SUDDEN_FACTOR = 6.0  # the last reading this many noise widths above the ones before it


@dataclass(frozen=True)
class UserLine:
    """Where the user's own code asked for memory that XLA's message lists under another frame."""

    where: str  # "path:line in function" (several, joined with " or ", where one op could be any of them)
    bytes: int
    allocations: int
    named_by_xla: tuple[str, ...]  # the innermost file:line XLA's message gave for them

    def text(self) -> str:
        plural = "s" if self.allocations != 1 else ""
        named = f"; XLA names {', '.join(self.named_by_xla)}" if self.named_by_xla else ""
        return f"{self.where} ({self.allocations} allocation{plural}, {format_bytes(self.bytes)}{named})"


MAX_LINES_NAMED = 3  # of the user's lines one op could come from, the rest counted


def _lines_text(users: set[str]) -> str:
    names = sorted(users)
    more = len(names) - MAX_LINES_NAMED
    return " or ".join(names[:MAX_LINES_NAMED]) + (f" or {more:,} other line{'s' if more > 1 else ''}" if more > 0 else "")


def user_lines(oom: OomMessage | None, program: list[dict] | None) -> list[UserLine]:
    """The message's allocations traced back to the user's lines through the program's table."""
    if oom is None or not program:
        return []
    by_op, by_frame = defaultdict(set), defaultdict(set)
    for op in program:
        if op.get("user"):
            by_op[(op.get("op_name"), op.get("shape"))].add(op["user"])
            by_frame[(op.get("innermost"), op.get("shape"))].add(op["user"])
    # Each key's lines joined once (linear in the program), not once per allocation: 4,000 of each
    # with one shared key took 7 s, sorting and joining 4,000 lines for every allocation.
    op_lines = {key: _lines_text(users) for key, users in by_op.items()}
    frame_lines = {key: _lines_text(users) for key, users in by_frame.items()}
    grouped: dict[str, list] = {}
    for allocation in oom.allocations:
        named = f"{allocation.source_file}:{allocation.source_line}" if allocation.source_file else ""
        where = op_lines.get((allocation.op_name, allocation.shape)) or frame_lines.get((named, allocation.shape))
        if not where:
            continue
        entry = grouped.setdefault(where, [0, 0, set()])
        entry[0] += allocation.size_bytes
        entry[1] += 1
        if named:
            entry[2].add(named)
    found = [UserLine(where, size, count, tuple(sorted(named))) for where, (size, count, named) in grouped.items()]
    return sorted(found, key=lambda line: (-line.bytes, line.where))


@dataclass
class PostMortem:
    ended: str  # clean / unclean
    last_step: int | None
    exit: str | None  # the exit status or signal name, where supervise recorded it
    floor_slope_bytes_per_step: float | None
    peak_bytes: float | None
    limit_bytes: float | None
    leak_reported_at: int | None
    oom_projected_at: int | None
    suspects: list[str] = field(default_factory=list)
    diagnosis: str = "unknown"
    explanation: str = ""
    oom_message: OomMessage | None = None
    record_host: dict | None = None  # the flight record's `host`: where the host is watched
    record_stall: dict | None = None  # the flight record's `stall`: where the threads were when a stall ended it
    dumped_stack: list[str] = field(default_factory=list)  # the training thread's, from faulthandler's dump in the output
    action_suspects: dict | None = None  # what was leaking at the newest checkpoint action (before its reinit)
    user_lines: list[UserLine] = field(default_factory=list)  # the message's allocations, traced to your lines

    def to_json(self) -> dict[str, Any]:
        return {"ended": self.ended, "last_step": self.last_step, "exit": self.exit,
                "floor_slope_bytes_per_step": self.floor_slope_bytes_per_step, "peak_bytes": self.peak_bytes,
                "limit_bytes": self.limit_bytes, "leak_reported_at": self.leak_reported_at,
                "oom_projected_at": self.oom_projected_at, "suspects": self.suspects,
                "diagnosis": self.diagnosis, "explanation": self.explanation,
                "oom_message": self.oom_message.to_json() if self.oom_message is not None else None}


# ---- the flight record's fields, checked before any is used ---------------------------------------

def _step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_STEP


def _size(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and 0 <= value < MAX_SIZE


def _signed(value: Any) -> bool:  # a slope or a difference of sizes: either sign, bounded like a size
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and abs(value) < MAX_SIZE


def _text(value: Any) -> bool:
    return isinstance(value, str)


def _flag(value: Any) -> bool:
    return isinstance(value, bool)


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(check(item) for item in value)


_STEP, _SIZE, _SIGNED, _TEXT = ((_step, "a step (0 to 2**52 - 1)"), (_size, "a size in bytes (0 to 2**63 - 1)"),
                                (_signed, "a finite number"), (_text, "a string"))
_VERDICT = {"step": _STEP, "status": _TEXT, "explanation": _TEXT, "floor_bytes": _SIZE, "excursion_bytes": _SIGNED,
            "limit_bytes": _SIZE, "slope_bytes_per_step": _SIGNED, "projected_oom_step": _STEP,
            "leak_reported": (_flag, "true or false"), "oom_projected": (_flag, "true or false")}
_HOST = {"domain": _TEXT, "bytes_used": _SIZE, "bytes_limit": _SIZE, "process_bytes": _SIZE,
         "available_bytes": _SIZE, "oom_kills": _STEP, "peak_bytes_used": _SIZE, "age_seconds": _SIZE,
         "leak_reported_at": _STEP, "oom_projected_at": _STEP, "verdict": _VERDICT}
_PROGRAM_SITE = {"op_name": _TEXT, "shape": _TEXT, "innermost": _TEXT, "user": _TEXT, "bytes": _SIZE}
_DEVICE_OOM = {"device": _TEXT, "requested_bytes": _SIZE, "limit_bytes": _SIZE, "free_bytes": _SIZE, "step": _STEP}
_THREAD_ID = re.compile(r"0x[0-9a-f]{1,16}")
_THREAD = {"name": _TEXT, "training": (_flag, "true or false"), "frames": (_list_of(_text), "a list of strings")}
_STALL = {"step": _STEP, "seconds": _SIGNED, "rank": _STEP, "where": _TEXT, "user": _TEXT,
          "collective": (_flag, "true or false"), "threads": [_THREAD],
          "waiting": {"step": _STEP, "ranks": (_list_of(_step), "a list of ranks")},
          "armed": (_flag, "true or false"), "exit_code": _STEP, "stacks": _TEXT,
          "training_thread": (lambda v: isinstance(v, str) and _THREAD_ID.fullmatch(v) is not None,
                              "a thread id written 0x and hex digits")}
RECORD_FIELDS: dict[str, Any] = {
    "version": _STEP, "written_at": _SIZE, "ended": _TEXT, "trace_file": _TEXT, "last_step": _STEP, "leak_reported_at": _STEP, "oom_projected_at": _STEP,
    "suspects_step": _STEP, "compilations": _STEP, "creation_sites": (_flag, "true or false"),
    "verdict": _VERDICT, "host": _HOST, "process": {}, "recompilation": {},
    "suspects": (_list_of(_text), "a list of strings"),
    "actions": (lambda v: isinstance(v, dict) and all(_step(n) for n in v.values()), "an object of counts"),
    "program_sites": [_PROGRAM_SITE], "device_oom": _DEVICE_OOM, "stall": _STALL,
    "action_suspects": {"step": _STEP, "lines": (_list_of(_text), "a list of strings")},
}
"""Every field of a flight record, and what each must be (null or absent: unknown): the one list,
for the writer (`records/flight_record.py` starts its record from it, and writes nothing else) and
for every reader (`diagnose` checks them before using any). A nested object is its own table of
fields (`{}`: not checked); `[table]` is a list of such objects."""


def record_problem(record: Any, fields: Any = None, where: str = "") -> str | None:
    """What is wrong with a flight record's fields, in words naming the field (never its value),
    or None: every field `RECORD_FIELDS` names is null, absent, or of its type and in its range."""
    fields = RECORD_FIELDS if fields is None else fields
    if not isinstance(record, dict):
        return f"field {where!r}: expected an object" if where else "expected a JSON object"
    for name, expected in fields.items():
        value = record.get(name)
        label = f"{where}.{name}" if where else name
        if value is None:
            continue
        if isinstance(expected, dict):
            problem = record_problem(value, expected, label)
        elif isinstance(expected, list):
            if not isinstance(value, list):
                return f"field {label!r}: expected a list of objects"
            problem = next((p for i, item in enumerate(value)
                            if (p := record_problem(item, expected[0], f"{label}[{i}]")) is not None), None)
        else:
            check, what = expected
            problem = None if check(value) else f"field {label!r}: expected {what}"
        if problem is not None:
            return problem
    return None


def diagnose(samples: Sequence[Sample], *, record: dict | None = None, oom: OomMessage | None = None,
             exit_description: str | None = None, memory_limit_bytes: int | None = None,
             output: str | None = None) -> PostMortem:
    """Everything known about how the run ended; `record` is the flight record (or None), `output`
    the job's output (where faulthandler wrote the stacks of a process the stall watch ended from C).
    InputError (naming the field) for a record whose fields are not what `RECORD_FIELDS` says."""
    record = record or {}
    problem = record_problem(record)
    if problem is not None:
        raise InputError(f"flight record: {problem}")
    if oom is None and record.get("device_oom"):  # no log given: what the allocator's OOM observer wrote
        oom = _observed(record["device_oom"])
    result = replay(samples, memory_limit_bytes=memory_limit_bytes)
    final = result.final_verdict
    live = record.get("verdict") or {}
    limit = live.get("limit_bytes") or (final.limit_bytes if final else None) or memory_limit_bytes
    peak = max((max(s.bytes_used, s.peak_bytes_used or 0) for s in samples), default=None)
    post = PostMortem(
        ended="clean" if record.get("ended") == "clean" else "unclean",
        # the trace is written in batches: the flight record may have seen later steps
        last_step=max(s for s in (samples[-1].step if samples else None, record.get("last_step")) if s is not None)
        if samples or record.get("last_step") is not None else None,
        exit=exit_description,
        floor_slope_bytes_per_step=final.slope_bytes_per_step if final else live.get("slope_bytes_per_step"),
        peak_bytes=float(peak) if peak is not None else None, limit_bytes=float(limit) if limit else None,
        leak_reported_at=_first(record.get("leak_reported_at"), result.first_leak_report_step),
        oom_projected_at=_first(record.get("oom_projected_at"), result.first_oom_projected_step),
        suspects=list(record.get("suspects") or []), oom_message=oom, record_host=record.get("host"),
        record_stall=record.get("stall"), action_suspects=record.get("action_suspects"),
        user_lines=user_lines(oom, record.get("program_sites")))
    armed = post.record_stall if (post.record_stall or {}).get("armed") else None
    if armed is not None:
        if post.ended == "clean" or not ended_from_c(exit_description, armed):
            post.record_stall = None  # a deadline that never came: nothing stalled
        elif output and armed.get("training_thread"):
            post.dumped_stack = dumped_stack(output, armed["training_thread"])
    post.diagnosis, post.explanation = _cause(post, samples, final)
    post.explanation += _allocator_limit(record.get("device_oom"), oom)
    if post.user_lines:
        post.explanation += "; the largest allocations come from your lines " + ", ".join(
            line.text() for line in post.user_lines[:3])
    return post


def _observed(device_oom: dict) -> OomMessage:
    """The CUDA allocator's own OOM, as its observer recorded it in the flight record."""
    return OomMessage("allocation", "device", requested_bytes=device_oom.get("requested_bytes"),
                      capacity_bytes=device_oom.get("limit_bytes"), free_bytes=device_oom.get("free_bytes"))


def _allocator_limit(device_oom: dict | None, oom: OomMessage | None) -> str:
    """PyTorch's message names the device's capacity; the process's share under
    `set_per_process_memory_fraction` is what ran out. torch 2.11 prints it ("L allowed;"), earlier
    versions compute it and leave it out, and the OOM observer is handed it either way. Said where
    it is the smaller."""
    limit = (device_oom or {}).get("limit_bytes") or (oom.limit_bytes if oom is not None else None)
    if oom is None or not limit or not oom.capacity_bytes or limit >= oom.capacity_bytes:
        return ""
    return (f"; the allocator's limit was {format_limit(limit)}, its share of the device's "
            f"{format_bytes(oom.capacity_bytes)} (set_per_process_memory_fraction)")


def _first(*steps: int | None) -> int | None:
    known = [s for s in steps if s is not None]
    return min(known) if known else None


_EXIT = re.compile(r"(?:exit )?(\d{1,3})")
_DUMP_HEAD = re.compile(r"(?:Current thread|Thread) (0x[0-9a-f]{1,16}) \(most recent call first\):")
_DUMP_FRAME = re.compile(r'  File "(.{1,4096})", line (\d{1,9}) in (\S{1,256})')
_LIBRARY = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ")


def ended_from_c(exit_description: str | None, armed: dict) -> bool:
    """The process exited with the status the stall watch's deadline in C exits with."""
    matched = _EXIT.fullmatch((exit_description or "").strip())
    return matched is not None and int(matched.group(1)) == armed.get("exit_code")


def dumped_stack(output: str, thread: str) -> list[str]:
    """The frames faulthandler wrote for `thread` ("0x7f..."), the newest dump of it in `output`,
    innermost last (as the flight record keeps stacks): "file:line in function". One pass, linear."""
    wanted, frames, reading = int(thread, 16), [], False
    found: list[str] = []
    for line in output.splitlines():
        head = _DUMP_HEAD.match(line)
        if head is not None:
            if reading:
                found = frames
            reading, frames = int(head.group(1), 16) == wanted, []
            continue
        frame = _DUMP_FRAME.match(line) if reading else None
        if frame is not None:
            frames.append(f"{frame.group(1)}:{frame.group(2)} in {frame.group(3)}")
        elif reading and line.strip():
            found, reading = frames, False
    if reading:
        found = frames
    return list(reversed(found))


def _stalled_in_c(post: PostMortem, stalled: dict) -> str:
    stack = post.dumped_stack
    user = next((frame for frame in reversed(stack) if not any(part in frame for part in _LIBRARY)), None)
    where = (f"; its training thread was in {user or stack[-1]}" + (f" (innermost: {stack[-1]})" if user and user != stack[-1] else "")
             if stack else "; faulthandler wrote every thread's stack to its stderr (the job's output)")
    return (f"rank {stalled.get('rank') or 0} made no step for {stalled.get('seconds') or 0:.0f} s after step "
            f"{post.last_step or 0:,} while something held the GIL (a C call that never releases it: a regex, a C "
            f"extension's loop), so the stall watch could not run: its deadline in C ended the process (exit "
            f"{stalled.get('exit_code')}){where}; restart from the newest checkpoint")


def _cause(post: PostMortem, samples: Sequence[Sample], final) -> tuple[str, str]:
    stalled = post.record_stall
    if stalled and stalled.get("armed"):
        return "stalled", _stalled_in_c(post, stalled)
    if stalled:
        place = stalled.get("user") or stalled.get("where") or "an unknown place"
        inner = stalled.get("where")
        within = f" (innermost: {inner})" if inner and inner != place else ""
        waiting = stalled.get("waiting")
        if waiting:
            ranks = waiting.get("ranks")
            whom = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else "another rank"
            what = (f"was not stalled itself: it waited in the watchdog's agreement for {whom} (whose offer of step "
                    f"{waiting.get('step') or 0:,} never came), called from")
        else:
            what = ("waited in a collective for another rank, called from" if stalled.get("collective")
                    else "stalled in")
        return "stalled", (f"rank {stalled.get('rank') or 0} {what} {place}{within}: no step for "
                           f"{stalled.get('seconds') or 0:.0f} s after step {stalled.get('step') or 0:,}; the watchdog "
                           "recorded every thread's stack in the flight record and exited 43 (restart from the "
                           "newest checkpoint)")
    over = _over_the_limit(samples, post.limit_bytes)
    if post.ended == "clean" and post.oom_message is None:
        if over is None:
            return "unknown", "the run ended cleanly: the watchdog stopped in order"
        diagnosis, explanation = _trend_cause(post, final)
        return diagnosis, f"the run ended cleanly, but {over}" + (f"; {explanation}" if explanation else "")
    oom = post.oom_message
    if oom is not None and oom.kind in ("compile", "runtime") and len(samples) <= FIRST_STEPS:
        what = "compile" if oom.kind == "compile" else "load"
        return ("too_large_from_start",
                f"XLA could not {what} the program in the first steps ({len(samples)} sample(s) taken): it needs "
                f"more {oom.memory_space} than there is, whatever the trend")
    host = _host_ran_out(post.record_host) if oom is None else None  # XLA's message names the device
    if host is not None:
        return "host_memory", host
    sudden = _sudden_step(samples)
    if sudden is not None:
        return "sudden_step", sudden
    diagnosis, explanation = _trend_cause(post, final)
    if explanation:
        return diagnosis, explanation
    if oom is not None and oom.memory_space == "device" and oom.kind == "allocation":  # PyTorch's CUDA allocator
        return "unknown", _device_oom_text(oom) + ": no trend or jump before it explains it"
    return "unknown", "no trend, jump or message explains the end" + (
        "" if oom is not None else " (no out-of-memory message given: --log names the job's output)")


def _trend_cause(post: PostMortem, final) -> tuple[str, str]:
    """A leak that ran out, as the watchdog saw it (its projection, or its report near the limit),
    or ("unknown", "") when the trend does not explain the end."""
    limit = post.limit_bytes
    if post.oom_projected_at is not None:
        return "leak", (f"a leak that ran out: the watchdog projected the OOM at step {post.oom_projected_at:,}"
                        f" (floor rising {format_bytes(post.floor_slope_bytes_per_step or 0)}/step)")
    if post.leak_reported_at is not None and final is not None and limit and final.floor_bytes is not None \
            and final.floor_bytes + final.excursion_bytes >= NEAR_THE_LIMIT * limit:
        return "leak", (f"a leak that ran out: reported at step {post.leak_reported_at:,}, floor then "
                        f"{format_bytes(final.floor_bytes)} plus {format_bytes(final.excursion_bytes)} of transients "
                        f"against {format_bytes(limit)}")
    return "unknown", ""


def _over_the_limit(samples: Sequence[Sample], limit: float | None) -> str | None:
    """Where the trace went over its limit, in words, or None: a run can end cleanly after that."""
    if not limit:
        return None
    over = [s for s in samples if max(s.bytes_used, s.peak_bytes_used or 0) >= limit]
    if not over:
        return None
    worst = max(over, key=lambda s: max(s.bytes_used, s.peak_bytes_used or 0))
    return (f"its memory went over the {format_limit(limit)} limit: {len(over):,} sample(s) from step "
            f"{over[0].step:,}, up to {format_bytes(max(worst.bytes_used, worst.peak_bytes_used or 0))} at step "
            f"{worst.step:,}")


def _device_oom_text(oom: OomMessage) -> str:
    """PyTorch's CUDA allocator ran out, in its own figures (what it was asked for, what it had)."""
    words = ["PyTorch's CUDA allocator ran out"]
    if oom.requested_bytes is not None:
        words.append(f"asked for {format_bytes(oom.requested_bytes)}")
    if oom.free_bytes is not None:
        words.append(f"{format_bytes(oom.free_bytes)} free")
    limit = oom.limit_bytes or oom.capacity_bytes
    if limit:
        words.append(f"of its {format_limit(limit)} limit")
    return ", ".join(words)


def _host_ran_out(host: dict | None) -> str | None:
    """The host's series at its budget, or its OOM projected, in the flight record's `host`."""
    if not host or not host.get("bytes_limit"):
        return None
    used, limit = host.get("bytes_used") or 0, host["bytes_limit"]
    kills = host.get("oom_kills") or 0
    projected = host.get("oom_projected_at")
    if used < NEAR_THE_LIMIT * limit and projected is None and not kills:
        return None
    words = [f"the host's memory ran out: {format_bytes(used)} of its {format_limit(limit)} budget "
             f"({host.get('domain', 'budget')}) at the last reading"]
    if projected is not None:
        words.append(f"the watchdog had projected the host's OOM at step {projected:,}")
    if kills:
        words.append(f"the kernel's OOM killer has killed {kills} process(es) in the job's memory cgroup")
    return "; ".join(words) + " (the kernel's SIGKILL leaves no Python traceback)"


def _sudden_step(samples: Sequence[Sample]) -> str | None:
    """The last reading far above the ones before it: a step that allocated far more."""
    if len(samples) < 10:
        return None
    before = [s.bytes_used for s in samples[-11:-1]]
    middle = statistics.median(before)
    noise = statistics.median(abs(b - middle) for b in before) or max(1.0, 0.01 * middle)
    jump = samples[-1].bytes_used - max(before)
    if jump > SUDDEN_FACTOR * noise and jump > 0.05 * middle:
        return (f"a sudden step: the last reading (step {samples[-1].step:,}) is {format_bytes(jump)} above "
                f"anything in the ten before it, far beyond their spread ({format_bytes(noise)}): a step "
                "that asked for far more memory (a long batch, a new shape, an evaluation's first run)")
    return None
