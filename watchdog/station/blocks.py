"""The terminal's two blocks, what a person reads of a long job: an action's outcome (what the
watchdog saw, what is leaking, what the loop did, what it gave back) and the run's summary (how it
ended). Pure: records in, text out; the trainer, the callbacks and `watch` fill the records and log
them (events `action_outcome`, `run_summary`) with the text as the `block` field, which the console
prints as is and JSON carries beside the raw fields.

Words: an action's *outcome* is this block; the *leak report* is the leak signal (leak_report.py);
`hbm-watchdog report` is the command that draws a trace (commands/report.py).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field

from watchdog.core.errors import EXIT_FUTILE, EXIT_RESTART_REQUESTED, EXIT_UNSAVED
from watchdog.core.units import format_bytes, format_duration
from watchdog.core.verdict import Action, Status, Verdict

RULE_WIDTH = 78

# An action's states on its record (`ActionOutcome.state`), in order: handed to the loop by `step()`,
# its checkpoint saved, the training state rebuilt in process, that rebuild measured by the sidecar
# (its reading judged); or the process leaving for it (exit 42, 44, 45). Decided and agreed come
# before the record (`core.verdict.Decided`, the ranks' agreement).
HANDED, SAVED, REBUILT, MEASURED, EXITED = "handed over", "saved", "rebuilt", "measured", "exited"


def _title(text: str) -> str:
    return f"── {text} " + "─" * max(3, RULE_WIDTH - len(text) - 4)


def _rows(rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(label) for label, _ in rows)
    return [f"  {label.ljust(width)}  {value}" for label, value in rows]


def _words(action: Action) -> str:
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
class ActionOutcome:
    """One action of the watchdog, from what it saw to what it gave back (the `action_outcome` block)."""

    step: int
    action: Action
    verdict: Verdict | None  # what the decision was based on
    suspects: list[str] = field(default_factory=list)  # what is leaking, with its holder
    checkpoint: str | None = None  # path of the checkpoint saved for it
    outcome: str = ""  # "reinitialised in process", "exit 42: restart requested", ...
    recovered_bytes: float | None = None  # measured after a reinit: the reading before it less the one after
    memory_after_bytes: float | None = None
    memory: str = "device"  # which memory asked for it: "device", or "host" (the host's RAM)
    origin: str = ""  # who decided it, when not this rank's watchdog alone: "forced (a drill)", "asked by rank 0, ..."
    exit_code: int | None = None  # the status the process ends with for it (42, 44, 45); None: training went on
    futile: str | None = None  # why restarting will not save this job, where it will not (then: exit 45)
    not_freed: list[str] = field(default_factory=list)  # after a reinit: what its census named, still held
    # A reinit's readings of each memory at its hand-over (device, host), which the sidecar measures its
    # rebuild against: they travel with the readings after it, in one message (`Watchdog.reinit_finished`).
    readings_before: tuple | None = field(default=None, repr=False)
    state: str = HANDED  # where the action is (above): moved by the action path, closed by the sidecar

    def block(self) -> str:
        rows = []
        verdict = self.verdict
        if verdict is not None:
            where = "host memory " if self.memory == "host" else ""
            rows.append(("seen", f"{where}floor rising {rate_text(verdict.slope_bytes_per_step)} "
                                 f"at {format_bytes(verdict.floor_bytes)}; {oom_text(verdict)}"))
        for index, suspect in enumerate(self.suspects or ["no growing group of live tensors or Python buffers found"]):
            rows.append(("leaking" if index == 0 else "", suspect))
        if self.origin:
            rows.append(("decided", self.origin))
        done_as = self.done_as()
        if done_as is not self.action:  # the title names what was done; this row, what was asked
            rows.append(("asked", f"{_words(self.action)}; with no rebuild given, the loop saves and exits "
                                  f"{self.exit_code} to be restarted"))
        if self.futile:
            rows.append(("in vain", f"restarting will not save this job: {self.futile}"))
        done = [self.outcome or self.action.value]
        if self.checkpoint:
            done.insert(0, f"checkpoint {self.checkpoint}")
        rows.append(("done", ", ".join(done)))
        for index, line in enumerate(self.not_freed):
            rows.append(("not freed" if index == 0 else "", f"the rebuild did not free it: {line}" if index == 0 else line))
        if self.recovered_bytes is not None:
            after = f" (memory now {format_bytes(self.memory_after_bytes, 2)})" if self.memory_after_bytes is not None else ""
            rows.append(("recovered", f"{format_bytes(self.recovered_bytes, 2)} given back{after}" if self.recovered_bytes > 0
                         else f"nothing given back{after}: the leak outlives a rebuild, the next action restarts"))
        memory = " (host memory)" if self.memory == "host" else ""
        title = {EXIT_UNSAVED: "checkpoint failed", EXIT_FUTILE: "checkpoint and stop"}.get(self.exit_code,
                                                                                          _words(done_as))
        return "\n".join([_title(f"watchdog: {title} at step {self.step:,}{memory}"), *_rows(rows)])

    def done_as(self) -> Action:
        """What the loop did with the action, which the block's title names: a reinit the loop carried
        out as an exit 42 (no rebuild given: `carry_out(action, save=...)` alone) is a restart."""
        if self.action is Action.CHECKPOINT_REINIT and self.exit_code == EXIT_RESTART_REQUESTED:
            return Action.CHECKPOINT_RESTART
        return self.action

    def fields(self) -> dict:
        """The raw fields for JSON logs (base units)."""
        verdict = self.verdict
        return {"step": self.step, "action": self.action.value, "memory": self.memory, "suspects": self.suspects,
                "checkpoint": self.checkpoint, "outcome": self.outcome, "origin": self.origin, "exit_code": self.exit_code,
                "futile": self.futile, "not_freed": self.not_freed,
                "recovered_bytes": self.recovered_bytes,
                "slope_bytes_per_step": verdict.slope_bytes_per_step if verdict else None,
                "projected_oom_step": verdict.projected_oom_step if verdict else None}


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
        return "\n".join([_title(f"hbm-watchdog {self.command}: {self.outcome}"), *_rows(rows)])

    def _verdict_text(self) -> str:
        verdict = self.verdict
        if verdict is None:
            return "no samples"
        text = verdict.status.label
        if verdict.slope_bytes_per_step > 0 and verdict.status is not Status.HEALTHY:
            text += f", floor {rate_text(verdict.slope_bytes_per_step)}; {oom_text(verdict)}"
        return text
