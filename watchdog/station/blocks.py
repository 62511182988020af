"""The terminal's blocks, what a person reads of a long job: their ruled title and aligned rows,
the words for a rate and a projected OOM, and the run's summary (how it ended). An action's block
(what the watchdog saw, what is leaking, what the loop did, what it gave back) is drawn by its
record, `actions/record.py`'s `ActionOutcome`, with these. Pure: records in, text out; the
trainer, the callbacks and `watch` fill the records and log them (events `action_outcome`,
`run_summary`) with the text as the `block` field, which the console prints as is and JSON carries
beside the raw fields.

Words: an action's *outcome* is this block; the *leak report* is the leak signal (leak_report.py);
`hbm-watchdog report` is the command that draws a trace (commands/report.py).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass

from watchdog.core.units import format_bytes, format_duration
from watchdog.core.verdict import Action, Status, Verdict

RULE_WIDTH = 78

def block_title(text: str) -> str:
    return f"── {text} " + "─" * max(3, RULE_WIDTH - len(text) - 4)


def block_rows(rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(label) for label, _ in rows)
    return [f"  {label.ljust(width)}  {value}" for label, value in rows]


def action_words(action: Action) -> str:
    return action.value.replace("_", " ")


def rate_text(bytes_per_step: float) -> str:
    return f"{'+' if bytes_per_step >= 0 else ''}{format_bytes(bytes_per_step)}/step"


def oom_text(verdict: Verdict) -> str:
    """`OOM in ~8 s (step 271)`, or what is known when no OOM is projected."""
    if verdict.projected_oom_step is None or not math.isfinite(verdict.projected_oom_steps):
        return "no OOM projected"
    if verdict.projected_oom_steps <= 0:
        return f"at the limit now (step {verdict.projected_oom_step:,})"
    when = (f"~{format_duration(verdict.projected_oom_seconds)}" if math.isfinite(verdict.projected_oom_seconds)
            else f"{verdict.projected_oom_steps:,.0f} steps")
    if when == "~0 s":  # sooner than a second is still steps away: say how many
        when = f"{verdict.projected_oom_steps:,.1f} steps"
    return f"OOM in {when} (step {verdict.projected_oom_step:,})"


@dataclass
class RunSummary:
    """How a run ended, for the last lines of the terminal."""

    command: str  # "train", "watch", ...
    outcome: str  # "done", "restart requested (exit 42)", ...
    steps_done: int
    steps_total: int | None = None
    first_step: int = 0
    steps_per_second: float | None = None
    reinits: int = 0
    restarts: int = 0
    peak_bytes: float | None = None
    limit_bytes: float | None = None
    verdict: Verdict | None = None
    trace_file: str | None = None
    checkpoint_dir: str | None = None
    newest_checkpoint_step: int | None = None

    def block(self) -> str:
        steps = f"{self.steps_done:,}" + (f" / {self.steps_total:,}" if self.steps_total else "")
        if self.first_step:
            steps += f" (this run from {self.first_step:,})"
        if self.steps_per_second:
            steps += f", {self.steps_per_second:.1f} steps/s"
        rows = [("steps", steps), ("reinits", f"{self.reinits}    restarts {self.restarts}")]
        if self.peak_bytes is not None:
            peak = format_bytes(self.peak_bytes, 2)
            if self.limit_bytes:
                peak += f" of {format_bytes(self.limit_bytes, 2)} budget ({self.peak_bytes / self.limit_bytes:.0%})"
            rows.append(("peak memory", peak))
        rows.append(("watchdog", self._verdict_text()))
        if self.trace_file:
            rows.append(("trace", self.trace_file))
        if self.checkpoint_dir:
            newest = f" (newest: step {self.newest_checkpoint_step:,})" if self.newest_checkpoint_step is not None else ""
            rows.append(("checkpoints", f"{self.checkpoint_dir}{newest}"))
        if self.trace_file:
            picture = shlex.quote(str(self.trace_file).rsplit(".", 1)[0] + ".png")
            rows.append(("draw it", f"hbm-watchdog report {shlex.quote(self.trace_file)} -o {picture}"))
        return "\n".join([block_title(f"hbm-watchdog {self.command}: {self.outcome}"), *block_rows(rows)])

    def _verdict_text(self) -> str:
        verdict = self.verdict
        if verdict is None:
            return "no samples"
        text = verdict.status.label
        if verdict.slope_bytes_per_step > 0 and verdict.status is not Status.HEALTHY:
            text += f", floor {rate_text(verdict.slope_bytes_per_step)}; {oom_text(verdict)}"
        return text
