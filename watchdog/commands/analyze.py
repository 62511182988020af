"""`hbm-watchdog analyze TRACE... [--memory-limit BYTES] [--json]`: what the watchdog would have done.

Each trace is replayed through the online detector and the action policy sample by sample, the
same path the sidecar takes (`watchdog.core.replay`), so the answer is what a live run would have seen
at each step, not a hindsight fit. Pure Python: no torch, so it starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import math

from watchdog.core import strict_json
from watchdog.core.errors import InputError
from watchdog.core.numbers import option
from watchdog.core.replay import ReplayResult, replay
from watchdog.core.sample import read_trace
from watchdog.core.units import format_bytes, positive_size


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="trace CSV files (step,timestamp,bytes_used,...)")
    parser.add_argument("--memory-limit", metavar="SIZE", default=None, type=option(positive_size),
                        help="a budget (e.g. 16GiB) when the trace has no limit, or one lower than the device's")
    parser.add_argument("--json", action="store_true", help="one JSON object per trace per line")


def run(args: argparse.Namespace) -> int:
    for path in args.traces:
        result = replay(read_trace(path), memory_limit_bytes=args.memory_limit)
        if result.samples == 0:
            raise InputError(f"{path}:2: the trace has a header but no samples")
        print(strict_json.dumps({"trace": path, **result.to_json()}) if args.json else summary(path, result))
    return 0


ENDED = {"healthy": "ended healthy", "leak_reported": "ended with a leak reported (no OOM projected)",
         "oom_projected": "ended with an OOM projected", "warming_up": "ended still warming up"}


def summary(path: str, result: ReplayResult) -> str:
    """A few lines a person reads: what the run ended as and, apart, what happened on the way."""
    final = result.final_verdict
    assert final is not None
    lines = [f"{path}: {ENDED[result.ended]} ({result.samples:,} samples, last step {final.step:,})"]
    on_the_way = _on_the_way(result)
    if on_the_way:
        lines.append(f"  on the way: {on_the_way}")
    if final.floor_bytes is not None:
        limit = format_bytes(final.limit_bytes) if final.limit_bytes else "unknown"
        lines.append(f"  floor {format_bytes(final.floor_bytes)}, transient {format_bytes(final.excursion_bytes)}, "
                     f"limit {limit}")
    lines.append(f"  slope {format_bytes(final.slope_bytes_per_step)}/step "
                 f"({format_bytes(final.slope_low_bytes_per_step)} to {format_bytes(final.slope_high_bytes_per_step)})")
    if result.first_action_step is not None:
        assert result.first_action is not None
        lines.append(f"  {result.first_action.value} asked for at step {result.first_action_step:,}"
                     + (f" (projected OOM then: step {result.projected_oom_step_at_first_action:,})"
                        if result.projected_oom_step_at_first_action is not None else ""))
    if result.projected_oom_step is not None and math.isfinite(final.projected_oom_steps):
        lines.append(f"  projected OOM at step {result.projected_oom_step:,}")
    if final.explanation:
        lines.append(f"  {final.explanation}")
    return "\n".join(lines)


def _on_the_way(result: ReplayResult) -> str:
    """The two signals as they went: "leak reported at steps 7,136-8,608, cleared; OOM projected
    from step 9,000"."""
    parts = []
    for up, cleared in result.leak_report_spans[:3]:
        parts.append(f"leak reported at steps {up:,}-{cleared:,}, cleared" if cleared is not None
                     else f"leak reported from step {up:,}")
    if len(result.leak_report_spans) > 3:
        parts.append(f"{len(result.leak_report_spans) - 3} more leak reports")
    if result.first_oom_projected_step is not None:
        parts.append(f"OOM first projected near enough to act on at step {result.first_oom_projected_step:,}")
    return "; ".join(parts)
