"""`hbm-watchdog postmortem --oom-log FILE [--json]`: what XLA's out-of-memory message says.

A job's output (or any file holding it) is read for XLA's out-of-memory message, in any of its
layouts (`watchdog.core.oom_message`): its kind (compile, runtime, allocation), the memory space,
used / capacity / exceeded / requested bytes, the largest allocations with their op and Python
`file:line`, and those grouped by Python line, biggest first. With several messages the last one
is read. A file with no out-of-memory message is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json

from watchdog.core.errors import InputError
from watchdog.core.inputs import open_regular
from watchdog.core.oom_message import OomMessage, parse
from watchdog.core.units import format_bytes

MAX_LOG_BYTES = 256 << 20  # the tail of a longer log is read: the message that ended the job is at its end
HOW_TO_GET_LINES = ("no Python lines in the message: run PyTorch/XLA with XLA_IR_DEBUG=1 XLA_HLO_DEBUG=1 "
                    "so that each op carries its source_file and source_line into the program")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--oom-log", metavar="FILE", required=True,
                        help="a job's output holding XLA's out-of-memory message")
    parser.add_argument("--json", action="store_true", help="one JSON object (oom, kind, memory_space, ...)")


def run(args: argparse.Namespace) -> int:
    message = parse(_read_tail(args.oom_log))
    if message is None:
        raise InputError(f"{args.oom_log}: no out-of-memory message from XLA in it")
    print(json.dumps(message.to_json()) if args.json else summary(message))
    return 0


def _read_tail(path: str) -> str:
    try:
        with open_regular(path, "rb", what="--oom-log ") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - MAX_LOG_BYTES))
            return handle.read().decode("utf-8", errors="replace")
    except InputError:
        raise
    except OSError as exc:
        raise InputError(f"--oom-log {path}: {exc.strerror or exc}") from None


def _size(value: int | None) -> str:
    return format_bytes(value) if value is not None else "?"


def summary(message: OomMessage) -> str:
    """What a person reads: the kind and sizes, then the Python lines that asked for the memory."""
    headline = {"compile": f"the program does not fit in {message.memory_space} (found while compiling)",
                "runtime": f"the program could not be loaded into {message.memory_space}",
                "allocation": f"a buffer could not be allocated in {message.memory_space}"}[message.kind]
    figures = [f"{name} {_size(value)}" for name, value in
               (("used", message.used_bytes), ("capacity", message.capacity_bytes),
                ("exceeded by", message.exceeded_bytes), ("requested", message.requested_bytes))
               if value is not None]
    lines = [f"out of memory: {headline}" + (f"; {', '.join(figures)}" if figures else "")]
    sites = message.python_sites
    if sites:
        lines.append("where the memory was asked for, biggest first:")
        for site in sites[:10]:
            count = f"{site.allocations} allocation{'s' if site.allocations != 1 else ''}"
            lines.append(f"  {format_bytes(site.bytes):>10}  {site.file}:{site.line}  ({count})")
    elif message.allocations:
        lines.append(HOW_TO_GET_LINES)
    for allocation in message.allocations[:5]:
        what = allocation.op_name or allocation.allocation_type or "?"
        lines.append(f"  {format_bytes(allocation.size_bytes):>10}  {allocation.shape or ''}  {what[:100]}")
    return "\n".join(lines)
