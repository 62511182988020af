"""`hbm-watchdog postmortem PATH [--log FILE] [--json]`: how a run ended, and why.
`hbm-watchdog postmortem --oom-log FILE [--json]`: what XLA's or PyTorch CUDA's out-of-memory message says.

PATH is a trace CSV or the folder holding it; beside the trace, the flight record
(`TRACE.flight.json`, `records/flight_record.py`) says what the live watchdog knew and whether
it stopped in order. `--log` is the job's output, read for XLA's or PyTorch CUDA's message. The diagnosis is
`watchdog.core.postmortem`'s.

A job's output (or any file holding it) is read for XLA's (or PyTorch CUDA's) out-of-memory message, in any of its
layouts, or PyTorch's CUDA one (`watchdog.core.oom_message`): its kind (compile, runtime,
allocation), the memory space, used / capacity / exceeded / requested bytes, the largest
allocations with their op and Python `file:line`, and those grouped by Python line, biggest first;
for CUDA, free / allocated / reserved-but-unallocated bytes, this process's and the others' use,
and fragmentation named as such. With several messages the last one
is read. A file with no out-of-memory message is one line on stderr and exit status 2.

An error names the file, the line and the problem, never what the file holds: the trace may be
whatever a flight record names (`_samples`).
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from watchdog.core import strict_json
from watchdog.core.errors import InputError, TraceFormatError
from watchdog.core.inputs import open_regular
from watchdog.core.numbers import option
from watchdog.core.oom_message import OomMessage, parse
from watchdog.core.postmortem import PostMortem, diagnose
from watchdog.core.printable import printable_lines
from watchdog.core.sample import TRACE_HEADER, Sample, load_trace
from watchdog.core.units import format_bytes, positive_size
from watchdog.records import flight_record

FLIGHT_RECORD_NAME, EXITS_NAME, OUTPUT_NAME = "flight.json", "exits.jsonl", "output.log"  # supervise's folder
STACK_FRAMES_SHOWN = 12  # of the training thread's stack after a stall (the flight record keeps more)
MAX_LOG_BYTES = 256 << 20  # the tail of a longer log is read: the message that ended the job is at its end
HOW_TO_GET_LINES = ("no Python lines in the message: run PyTorch/XLA with XLA_IR_DEBUG=1 XLA_HLO_DEBUG=1 "
                    "(hbm-watchdog train --hlo-source-lines) so that each op carries its source_file and "
                    "source_line into the program")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", nargs="?", metavar="PATH", help="a trace CSV, or the folder holding it")
    parser.add_argument("--log", metavar="FILE",
                        help="the job's output, read for its out-of-memory message (XLA's or PyTorch CUDA's)")
    parser.add_argument("--oom-log", metavar="FILE",
                        help="only parse the out-of-memory message (XLA's or PyTorch CUDA's) in FILE")
    parser.add_argument("--memory-limit", metavar="SIZE", default=None, type=option(positive_size),
                        help="the budget, when neither the trace nor the flight record has one")
    parser.add_argument("--json", action="store_true", help="one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.oom_log is not None:
        given = [name for name, value in (("PATH", args.path), ("--log", args.log),
                                          ("--memory-limit", args.memory_limit)) if value is not None]
        if given:
            raise InputError(f"--oom-log reads one log alone; {' and '.join(given)} would be ignored: "
                             "give either --oom-log FILE, or PATH [--log FILE]")
        message = parse(_read_tail(args.oom_log, "--oom-log"))
        if message is None:
            raise InputError(f"{args.oom_log}: no out-of-memory message (XLA's or PyTorch CUDA's) in it")
        print(strict_json.dumps(message.to_json()) if args.json else printable_lines(summary(message)))
        return 0
    if args.path is None:
        raise InputError("postmortem needs a trace (or its folder), or --oom-log FILE")
    path = Path(args.path)
    trace, record, exit_description, log_file = _what_was_left(path)
    log_file = args.log or log_file
    samples = _samples(trace)
    if trace is not None and not samples and record is None:
        raise InputError(f"{trace}:2: the trace has a header but no samples")
    output = _read_tail(log_file, "--log") if log_file else None
    oom = parse(output) if output is not None else None
    post = diagnose(samples, record=record, oom=oom, exit_description=exit_description,
                    memory_limit_bytes=args.memory_limit, output=output)
    print(strict_json.dumps(post.to_json()) if args.json else report(trace or path, post, record))
    return 0


def _what_was_left(path: Path) -> tuple[Path | None, dict | None, str | None, str | None]:
    """The trace, the flight record, the last recorded exit and the job's output a path leads to:
    a trace file; a folder holding traces; or `supervise --postmortem-dir`'s folder."""
    supervised = path / FLIGHT_RECORD_NAME if path.is_dir() else None
    if supervised is not None and (supervised.exists() or (path / EXITS_NAME).exists()):
        record = flight_record.load(supervised)
        named = record.get("trace_file") if record else None
        # Only an absolute path (what records hold now): a relative one was relative to the job's own
        # folder, and read from here it named another run's trace.
        trace = Path(named) if named and os.path.isabs(named) and Path(named).exists() else None
        output = path / OUTPUT_NAME
        return trace, record, _last_exit(path / EXITS_NAME), str(output) if output.exists() else None
    trace = find_trace(path)
    return trace, flight_record.load(f"{trace}{flight_record.SUFFIX}"), None, None


_QUOTED = re.compile(r"""(:\s*|,?\s*got\s*)?['"].*$""")  # a problem's quote of the file's text, to its end


def _samples(trace: Path | None) -> list[Sample]:
    """The trace's samples. Its errors name the file, the line and the problem, without the quote
    of the line that the trace reader gives: the path may come from a flight record and name any
    file (`/etc/shadow`), whose text is nobody's business here."""
    if trace is None:
        return []
    try:
        return load_trace(trace)
    except TraceFormatError as exc:
        problem = str(exc)[len(f"{exc.path}:{exc.line}: "):]
        if "'" in problem or '"' in problem:
            problem = ("not a trace CSV: its first line is not the trace header " + ",".join(TRACE_HEADER)
                       if exc.line == 1 else _QUOTED.sub("", problem) + " (its text not shown)")
        raise InputError(f"{exc.path}:{exc.line}: {problem}") from None


def _last_exit(path: Path) -> str | None:
    """The newest exit `supervise` recorded: a short string (or number), else nothing known."""
    try:
        with open_regular(path, "r", encoding="utf-8", errors="replace") as handle:
            lines = [line for line in handle.read().splitlines() if line.strip()]
        entry = strict_json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None
    value = entry.get("exit") if isinstance(entry, dict) else None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value if isinstance(value, str) and 0 < len(value) <= 64 and value.isprintable() else None


def after_a_crash(folder: Path | None, output: str, exit_description: str) -> str:
    """What `supervise` prints when its child crashed: everything the folder holds, else the exit
    and XLA's message in the child's output."""
    oom = parse(output)
    unusable = ""
    if folder is not None:
        try:
            trace, record, _, _ = _what_was_left(folder)
        except InputError as exc:  # a flight record it cannot use: the exit and the message still count
            trace, record, unusable = None, None, f"(no flight record: {exc})"
        if record is not None or trace is not None:
            unreadable = ""
            try:
                samples = _samples(trace)
            except InputError as exc:  # the post-mortem goes on without the trend
                samples, unreadable = [], f"\n(no trend: {exc})"
            post = diagnose(samples, record=record, oom=oom, exit_description=exit_description, output=output)
            return report(trace or folder, post, record) + unreadable
    lines = [f"the job exited with {exit_description}" + (
        " (sent from outside the job: a preemption, `hbm-watchdog watch` acting before an OOM, or a person)"
        if "SIGTERM" in (exit_description or "") else "")]
    lines.append(summary(oom) if oom is not None else "no out-of-memory message in its output")
    if folder is None:
        lines.append("(with --postmortem-dir, the watchdog's flight record and the trend go in the post-mortem too)")
    elif unusable:
        lines.append(unusable)
    return "\n".join(lines)


def find_trace(path: Path) -> Path:
    """The trace a path names: the file itself, or in a folder the one trace with a flight record
    beside it, else `trace.csv`, else the only CSV there."""
    if not path.is_dir():
        return path
    traces = sorted(path.glob("*.csv"))
    recorded = [t for t in traces if Path(f"{t}{flight_record.SUFFIX}").exists()]
    for candidates in (recorded, [t for t in traces if t.name == "trace.csv"], traces):
        if len(candidates) == 1:
            return candidates[0]
    raise InputError(f"{path}: no trace CSV in it" if not traces else
                     f"{path}: {len(traces)} trace CSVs in it; name one")


def report(trace: Path, post: PostMortem, record: dict | None) -> str:
    """What a person reads after the job died."""
    ended = ("ended cleanly" if post.ended == "clean" else
             "stopped sampling with no shutdown recorded" + ("" if record else " (no flight record beside the trace)"))
    last = f", last step {post.last_step:,}" if post.last_step is not None else ""
    exited = "" if not post.exit else f", {post.exit}" if post.exit.startswith("exit ") else f", exit {post.exit}"
    lines = [f"{trace}: {ended}{last}{exited}"]
    if post.limit_bytes:
        lines.append(f"  memory  peak {_size(post.peak_bytes)} of {_size(post.limit_bytes)}, floor "
                     f"{'+' if (post.floor_slope_bytes_per_step or 0) >= 0 else ''}"
                     f"{_size(post.floor_slope_bytes_per_step)}/step at the end")
    signals = []
    if post.leak_reported_at is not None:
        signals.append(f"leak reported at step {post.leak_reported_at:,}")
    if post.oom_projected_at is not None:
        signals.append(f"OOM projected at step {post.oom_projected_at:,}")
    lines.append(f"  signals {', '.join(signals) if signals else 'none'}")
    for index, suspect in enumerate(post.suspects[:3]):
        lines.append(f"  {'leaking' if index == 0 else '':7} {suspect}")
    at_action = post.action_suspects or {}
    if at_action.get("lines") and at_action["lines"][:3] != post.suspects[:3]:  # a reinit since: the whole leak
        lines.append(f"  at the action of step {at_action.get('step') or 0:,} (before its reinit):")
        lines += [f"          {suspect}" for suspect in at_action["lines"][:3]]
    lines.append(f"  cause   {post.diagnosis}: {post.explanation}")
    training = next((thread for thread in (post.record_stall or {}).get("threads") or [] if thread.get("training")), None)
    frames = (training.get("frames") or []) if training is not None else post.dumped_stack
    if frames:
        lines.append("the training thread's stack when it was ended, innermost last:")
        lines += [f"  {frame}" for frame in frames[-STACK_FRAMES_SHOWN:]]
    if post.oom_message is not None:
        lines.append("")
        lines.append(summary(post.oom_message))
    if post.user_lines:
        lines.append("your lines behind those allocations (from the program the watchdog recorded), biggest first:")
        lines += [f"  {line.text()}" for line in post.user_lines[:10]]
    return printable_lines("\n".join(lines))  # a record's or a log's text never acts on the terminal


def _read_tail(path: str, option_name: str) -> str:
    try:
        with open_regular(path, "rb", what=f"{option_name} ") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - MAX_LOG_BYTES))
            return handle.read().decode("utf-8", errors="replace")
    except InputError:
        raise
    except OSError as exc:
        raise InputError(f"{option_name} {path}: {exc.strerror or exc}") from None


def _size(value: int | None) -> str:
    return format_bytes(value) if value is not None else "?"


def summary(message: OomMessage) -> str:
    """What a person reads: the kind and sizes, then the Python lines that asked for the memory."""
    headline = {"compile": f"the program does not fit in {message.memory_space} (found while compiling)",
                "runtime": f"the program could not be loaded into {message.memory_space}",
                "allocation": f"a buffer could not be allocated in {message.memory_space}"}[message.kind]
    figures = [f"{name} {_size(value)}" for name, value in
               (("used", message.used_bytes), ("capacity", message.capacity_bytes),
                ("exceeded by", message.exceeded_bytes), ("requested", message.requested_bytes),
                ("free", message.free_bytes), ("allocated by PyTorch", message.allocated_bytes),
                ("reserved but unallocated", message.reserved_unallocated_bytes),
                ("this process in all", message.process_bytes))
               if value is not None]
    lines = [f"out of memory: {headline}" + (f"; {', '.join(figures)}" if figures else "")]
    if message.processes:
        others = ", ".join(f"pid {p['pid']} {_size(p['bytes'])}" for p in message.processes)
        lines.append(f"other processes on the device: {others}")
    if message.fragmented:
        lines.append(f"fragmentation: the allocator held {_size(message.reserved_unallocated_bytes)} unused, more than "
                     f"the {_size(message.requested_bytes)} asked for, but in no block large enough "
                     f"(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets its blocks grow)")
    sites = message.python_sites
    if sites:
        lines.append("where the memory was asked for, biggest first:")
        for site in sites[:10]:
            count = f"{site.allocations} allocation{'s' if site.allocations != 1 else ''}"
            lines.append(f"  {format_bytes(site.bytes):>10}  {site.file}:{site.line}  ({count})")
    elif message.allocations:
        lines.append(HOW_TO_GET_LINES)
    if message.unreadable_sizes:
        count = message.unreadable_sizes
        lines.append(f"({count} listed allocation{'s' if count != 1 else ''} left out: a size beyond 2**63 - 1 bytes)")
    for allocation in message.allocations[:5]:
        what = allocation.op_name or allocation.allocation_type or "?"
        lines.append(f"  {format_bytes(allocation.size_bytes):>10}  {allocation.shape or ''}  {what[:100]}")
    return "\n".join(lines)
