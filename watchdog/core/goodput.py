"""Goodput: how much of a job's wall-clock time went into training progress that was kept.

A job is every process a supervisor (or the cluster) starts for it, and every reinit inside them.
Each process appends to one job file, as JSON lines, what its time went to
(`runtime/job_ledger.py` writes them): when it started and from which step, each stretch of
training steps with the compile time inside it, each checkpoint save, restore, reinit and
evaluation, each action the watchdog took with the OOM it projected, and how it ended. This module
reads those lines back and accounts for the time; it decides nothing and does no I/O but reading.

Goodput follows Google's ML Goodput Measurement: the share of elapsed time spent on training steps
whose progress was kept. Badput is the rest, by cause (`CAUSES`). Steps a process ran past the
checkpoint the next process resumed from were redone: their time moves from goodput to `redone`.
Time from a process's last line to the next process's start (work lost with a crashed process,
its exit, the supervisor's backoff) is `disruption`; what no line explains is `other`, so the
causes and goodput always add up to the elapsed time.

What each checkpoint action saved is an estimate, labelled as one: a crash at the OOM it projected
would have cost the steps since the newest checkpoint that would have existed without the action
(the resume point, an earlier save, or the periodic one), at the job's measured seconds per step,
plus a restart (measured in this job when it had one, else this job's first start-up). Against it
stands what the action cost, measured: its save plus the reinit, or plus the restart it asked for.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from watchdog.core.errors import InputError

VERSION = 1
MAX_LINE_CHARS = 4096
SUFFIX = ".job.jsonl"  # beside the trace: `run.csv` -> `run.csv.job.jsonl`
CAUSES = ("startup", "recompilation", "checkpoint_save", "checkpoint_restore", "reinit", "eval", "redone",
          "disruption", "other")
CAUSE_WORDS = {
    "startup": "start-up and first compilation",
    "recompilation": "recompilation",
    "checkpoint_save": "checkpoint save",
    "checkpoint_restore": "checkpoint restore",
    "reinit": "reinit (drop and rebuild)",
    "eval": "evaluation",
    "redone": "steps redone after a restart",
    "disruption": "between processes (crash, exit, backoff)",
    "other": "not accounted for",
}
SPAN_CAUSES = frozenset({"startup", "checkpoint_save", "checkpoint_restore", "reinit", "eval"})


@dataclass(frozen=True)
class ActionEstimate:
    """One checkpoint action: what it cost (measured) against what a crash at its OOM would have cost."""

    kind: str  # checkpoint_reinit | checkpoint_restart
    step: int  # training steps completed when it was taken
    projected_oom_step: int | None  # in training steps; None: no OOM in sight (a drill)
    cost_seconds: float
    crash_lost_steps: int | None
    crash_cost_seconds: float | None
    escalated_at: int | None = None  # a later action answered the same OOM before it came (its crash counts there)
    job_ended_first: bool = False  # the job finished before the step of the OOM it projected: no crash to avoid

    @property
    def saved_seconds(self) -> float | None:
        return None if self.crash_cost_seconds is None else self.crash_cost_seconds - self.cost_seconds

    def fields(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step, "projected_oom_step": self.projected_oom_step,
                "cost_seconds": _round(self.cost_seconds), "crash_lost_steps": self.crash_lost_steps,
                "crash_cost_seconds": _round(self.crash_cost_seconds), "saved_seconds": _round(self.saved_seconds),
                "escalated_at": self.escalated_at, "job_ended_first": self.job_ended_first}


@dataclass(frozen=True)
class Account:
    elapsed_seconds: float
    productive_seconds: float
    badput_seconds: dict[str, float]  # every cause in CAUSES, in that order
    steps_kept: int
    steps_redone: int
    processes: int
    reinits: int
    actions: tuple[ActionEstimate, ...] = ()
    ended: str | None = None  # how the newest process said it ended; None: it did not say (killed, running)

    @property
    def goodput(self) -> float | None:
        return self.productive_seconds / self.elapsed_seconds if self.elapsed_seconds > 0 else None

    @property
    def restarts(self) -> int:
        return max(0, self.processes - 1)

    @property
    def watchdog_cost_seconds(self) -> float:
        return sum(a.cost_seconds for a in self.actions)

    @property
    def crash_cost_avoided_seconds(self) -> float:
        """What crashes at the projected OOMs would have cost (an estimate; drills count nothing)."""
        return sum(a.crash_cost_seconds or 0.0 for a in self.actions)

    @property
    def watchdog_saved_seconds(self) -> float:
        """Crash costs avoided, less every action's measured cost."""
        return self.crash_cost_avoided_seconds - self.watchdog_cost_seconds

    def fields(self) -> dict[str, Any]:
        return {"elapsed_seconds": _round(self.elapsed_seconds), "productive_seconds": _round(self.productive_seconds),
                "goodput": None if self.goodput is None else round(self.goodput, 4),
                "badput_seconds": {cause: _round(s) for cause, s in self.badput_seconds.items()},
                "steps_kept": self.steps_kept, "steps_redone": self.steps_redone, "processes": self.processes,
                "restarts": self.restarts, "reinits": self.reinits, "ended": self.ended,
                "actions": [a.fields() for a in self.actions],
                "watchdog_cost_seconds": _round(self.watchdog_cost_seconds),
                "crash_cost_avoided_seconds_estimate": _round(self.crash_cost_avoided_seconds),
                "watchdog_saved_seconds_estimate": _round(self.watchdog_saved_seconds)}

    def block(self, width: int = 30) -> str:
        """The account for a terminal: goodput, then each cause with a bar of its share."""
        elapsed = self.elapsed_seconds
        share = (lambda s: s / elapsed) if elapsed > 0 else (lambda s: 0.0)
        lines = [f"goodput: {_percent(self.goodput)} of {_duration(elapsed)} elapsed "
                 f"({self.processes} process{'es' if self.processes != 1 else ''}, {self.reinits} reinit"
                 f"{'s' if self.reinits != 1 else ''}; {self.steps_kept} steps kept, {self.steps_redone} redone)",
                 f"  {'training steps kept':<42} {_bar(share(self.productive_seconds), width)} "
                 f"{_duration(self.productive_seconds):>9}"]
        for cause, seconds in self.badput_seconds.items():
            if abs(seconds) >= 0.0005:
                lines.append(f"  {CAUSE_WORDS[cause]:<42} {_bar(share(seconds), width)} {_duration(seconds):>9}")
        if self.actions:
            count = len(self.actions)
            if any(a.crash_cost_seconds is not None for a in self.actions):
                lines.append(f"the watchdog's {count} action{'s' if count != 1 else ''} cost "
                             f"{_duration(self.watchdog_cost_seconds)}; crashes at the OOMs they projected would "
                             f"have cost about {_duration(self.crash_cost_avoided_seconds)}: saved about "
                             f"{_duration(self.watchdog_saved_seconds)} (an estimate)")
            else:
                lines.append(f"the watchdog's {count} action{'s' if count != 1 else ''} cost "
                             f"{_duration(self.watchdog_cost_seconds)}; none had an OOM in sight (drills): "
                             "nothing to save")
            for a in self.actions:
                if a.escalated_at is not None:
                    crash = f"the action at step {a.escalated_at} answered the same OOM"
                elif a.job_ended_first:
                    crash = f"the job ended before the OOM it projected at step {a.projected_oom_step}: nothing saved"
                elif a.crash_cost_seconds is None:
                    crash = "no OOM was in sight"
                else:
                    crash = (f"a crash at step {a.projected_oom_step} would have lost {a.crash_lost_steps} steps "
                             f"and a restart, about {_duration(a.crash_cost_seconds)}")
                lines.append(f"  step {a.step}: {a.kind} cost {_duration(a.cost_seconds)}; {crash}")
        return "\n".join(lines)


# ---- the file ---------------------------------------------------------------------------------

def path_beside(trace_file: str | os.PathLike) -> str:
    return f"{os.fspath(trace_file)}{SUFFIX}"


def parse_lines(lines: Iterable[str], where: str = "job file") -> Iterator[dict[str, Any]]:
    """The job file's records. A last line without its newline is one its writer never finished
    (skipped); a line longer than MAX_LINE_CHARS (its newline aside), wherever it is, and any other
    line that is not a record of ours is an InputError naming it. `lines` come from a bounded read
    (`bounded_lines`): a line without its end is then either the last one or one over the bound."""
    for number, line in enumerate(lines, start=1):
        text = line.rstrip("\r\n")
        if len(text) > MAX_LINE_CHARS:
            raise InputError(f"{where}:{number}: a line longer than {MAX_LINE_CHARS} characters")
        if text == line:
            break  # torn: its writer died mid-line
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except ValueError:
            raise InputError(f"{where}:{number}: not a JSON line") from None
        if not is_record(record):
            raise InputError(f"{where}:{number}: not a job record of version {VERSION}")
        yield record


def is_record(record: Any) -> bool:
    """A job record of this version: a JSON object with `v` and an `event`."""
    return isinstance(record, dict) and record.get("v") == VERSION and isinstance(record.get("event"), str)


# How every record this project writes begins (`json.dumps` of {"v", "event", ...}): a job file
# whose only line was torn before its end is ours when what is there begins so.
RECORD_START = '{"v": %d, "event": "' % VERSION


def could_be_a_torn_record(fragment: str) -> bool:
    """Whether a line cut short (no newline) is the start of a record this project wrote."""
    return bool(fragment) and (fragment.startswith(RECORD_START) or RECORD_START.startswith(fragment))


def read(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a job file; an InputError for a file that is missing, not regular or not ours."""
    from watchdog.core.inputs import open_regular

    where = os.fspath(path)
    try:
        with open_regular(path, "r", encoding="utf-8", errors="replace", newline="", what="job file ") as handle:
            return list(parse_lines(bounded_lines(handle), where))
    except OSError as exc:
        raise InputError(f"job file {where}: {exc.strerror or exc}") from None


def bounded_lines(handle) -> Iterator[str]:
    """A text handle's lines, none longer than the bound plus its line end: a longer one comes
    cut, without its end, and `parse_lines` refuses it."""
    while True:
        line = handle.readline(MAX_LINE_CHARS + 2)
        if not line:
            return
        yield line


# ---- the account ------------------------------------------------------------------------------

@dataclass
class _Chunk:
    first: int  # training steps [first, last)
    last: int
    seconds: float  # compile time taken out


@dataclass
class _Process:
    started: float
    last_t: float
    first_step: int
    checkpoint_every: int
    startup: float = 0.0
    restore: float = 0.0
    gap_before: float = 0.0
    compile_cause: str = "startup"  # what the next stretch's compile time is: the first graphs, a reinit's, or recompilation
    saves: list[int] = field(default_factory=list)  # steps checkpointed in this process, not for an action


@dataclass
class _PendingAction:
    kind: str
    step: int
    projected_oom_step: int | None
    checkpoints_before: list[int]  # steps a crash could resume from, without this action
    checkpoint_every: int
    process: int  # its index among the job's processes
    cost: float = 0.0
    waiting_for: str | None = "checkpoint_save"  # checkpoint_save -> reinit -> reinit_compile | restart


def account(records: Iterable[dict[str, Any]]) -> Account:
    """The job's time, from its records (those after its last `job` line, when it has one)."""
    records = list(records)
    starts = [i for i, r in enumerate(records) if r.get("event") == "job"]
    if starts:
        records = records[starts[-1]:]
    badput = dict.fromkeys(CAUSES, 0.0)
    kept: list[_Chunk] = []
    processes: list[_Process] = []
    actions: list[_PendingAction] = []
    job_start: float | None = None
    last_t: float | None = None
    steps_redone = reinits = 0
    ended: str | None = None
    for record in records:
        event, t = record["event"], _number(record.get("t"), None)
        if event == "job":
            job_start = t
        elif event == "process":
            started = _number(record.get("started"), t)
            process = _Process(started=started, last_t=started, first_step=_count(record.get("step")),
                               checkpoint_every=_count(record.get("checkpoint_every")))
            if processes:  # the time since the previous process's last line
                process.gap_before = max(0.0, started - processes[-1].last_t)
                badput["disruption"] += process.gap_before
            elif job_start is None or started < job_start:
                job_start = started
            steps_redone += _redo_past(kept, process.first_step, badput)
            processes.append(process)
            ended = None
        elif not processes:
            continue  # nothing to hang it on: a file cut at its head
        elif event == "span":
            cause, seconds = record.get("cause"), max(0.0, _number(record.get("seconds")))
            if cause not in SPAN_CAUSES:
                continue
            badput[cause] += seconds
            process = processes[-1]
            if cause == "startup":
                process.startup += seconds
            elif cause == "checkpoint_restore":
                process.restore += seconds
            elif cause == "checkpoint_save":
                newest = _newest_of(actions, len(processes) - 1)
                if newest is None or newest.waiting_for != "checkpoint_save":  # an action's save: not without it
                    process.saves.append(_count(record.get("step")))
            elif cause == "reinit":
                reinits += 1
                process.compile_cause = "reinit"  # a rebuilt state's first steps may compile again
            _charge(_newest_of(actions, len(processes) - 1), cause, seconds)
        elif event == "steps":
            first, last = _count(record.get("first")), _count(record.get("last"))
            seconds, compile_seconds = max(0.0, _number(record.get("seconds"))), max(0.0, _number(
                record.get("compile_seconds")))
            compile_seconds = min(compile_seconds, seconds)
            process = processes[-1]
            badput[process.compile_cause] += compile_seconds
            if process.compile_cause == "reinit":
                _charge(_newest_of(actions, len(processes) - 1), "reinit_compile", compile_seconds)
            process.compile_cause = "recompilation"
            if last > first:
                kept.append(_Chunk(first, last, seconds - compile_seconds))
        elif event == "action":
            process = processes[-1]
            oom = record.get("projected_oom_step")
            actions.append(_PendingAction(
                kind=str(record.get("kind")), step=_count(record.get("step")),
                projected_oom_step=None if oom is None else _count(oom),
                checkpoints_before=[process.first_step, *process.saves], checkpoint_every=process.checkpoint_every,
                process=len(processes) - 1))
        elif event == "end":
            ended = str(record.get("how"))
        if t is not None and processes:
            processes[-1].last_t = max(processes[-1].last_t, t)
            last_t = t if last_t is None else max(last_t, t)
    for index, process in enumerate(processes[1:]):  # a restart's cost runs until the next process trains
        _charge(_newest_of(actions, index), "restart", process.gap_before + process.startup + process.restore)
    if not processes:
        return Account(0.0, 0.0, badput, 0, 0, 0, 0)
    elapsed = max(0.0, (last_t if last_t is not None else processes[-1].last_t) - job_start)
    productive = sum(chunk.seconds for chunk in kept)
    badput["other"] = elapsed - productive - sum(badput[c] for c in CAUSES if c != "other")
    finished_at = _count(records[-1].get("step")) if ended == "done" and records[-1]["event"] == "end" else None
    estimates = _estimates(actions, processes, kept, finished_at)
    return Account(elapsed_seconds=elapsed, productive_seconds=productive, badput_seconds=badput,
                   steps_kept=sum(c.last - c.first for c in kept), steps_redone=steps_redone,
                   processes=len(processes), reinits=reinits, actions=estimates, ended=ended)


def _redo_past(kept: list[_Chunk], resumed_from: int, badput: dict[str, float]) -> int:
    """A process resumed from `resumed_from`: steps recorded beyond it are redone, their time badput."""
    redone = 0
    for chunk in list(kept):
        if chunk.last <= resumed_from:
            continue
        cut = max(chunk.first, resumed_from)
        moved = chunk.seconds * (chunk.last - cut) / (chunk.last - chunk.first)
        badput["redone"] += moved
        redone += chunk.last - cut
        chunk.last, chunk.seconds = cut, chunk.seconds - moved
        if chunk.last == chunk.first:
            kept.remove(chunk)
    return redone


def _newest_of(actions: list[_PendingAction], process: int) -> _PendingAction | None:
    """The newest action the process at index `process` took, if any."""
    return next((a for a in reversed(actions) if a.process == process), None)


def _charge(action: _PendingAction | None, cause: str, seconds: float) -> None:
    """Add a measured span to `action`, if it is waiting for this one."""
    if action is None or action.waiting_for != cause:
        return
    action.cost += seconds
    action.waiting_for = {"checkpoint_save": "reinit" if action.kind == "checkpoint_reinit" else "restart",
                          "reinit": "reinit_compile"}.get(cause)


def _estimates(actions: list[_PendingAction], processes: list[_Process], kept: list[_Chunk],
               finished_at: int | None) -> tuple[ActionEstimate, ...]:
    steps = sum(c.last - c.first for c in kept)
    per_step = sum(c.seconds for c in kept) / steps if steps else 0.0
    restarts = [p.gap_before + p.startup + p.restore for p in processes[1:]]
    restart_cost = (sum(restarts) / len(restarts)) if restarts else processes[0].startup + processes[0].restore
    estimates = []
    for index, a in enumerate(actions):
        lost = crash_cost = None
        # An action followed by another before the OOM it projected (a reinit that did not free
        # enough, escalated to a restart) did not avert that crash alone: it is counted once, at the last.
        later = next((b.step for b in actions[index + 1:] if a.projected_oom_step is not None
                      and b.step <= a.projected_oom_step), None)
        ended_first = finished_at is not None and a.projected_oom_step is not None and \
            a.projected_oom_step > finished_at
        if later is None and not ended_first and a.projected_oom_step is not None and a.projected_oom_step >= a.step:
            resumable = [s for s in a.checkpoints_before if s <= a.step]
            if a.checkpoint_every:
                resumable.append(a.projected_oom_step // a.checkpoint_every * a.checkpoint_every)
            lost = a.projected_oom_step - max(resumable, default=0)
            crash_cost = lost * per_step + restart_cost
        estimates.append(ActionEstimate(a.kind, a.step, a.projected_oom_step, a.cost, lost, crash_cost, later,
                                        ended_first))
    return tuple(estimates)


def _number(value: Any, default: float | None = 0.0) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return default
    return float(value)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**52 else 0


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def _percent(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.1f}%"


def _bar(share: float, width: int) -> str:
    filled = int(round(max(0.0, min(1.0, share)) * width))
    return "#" * filled + "." * (width - filled) + f" {100 * share:5.1f}%"


def _duration(seconds: float) -> str:
    if abs(seconds) < 100:
        return f"{seconds:.1f} s"
    if abs(seconds) < 6000:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"
