"""Goodput: how much of a job's wall-clock time went into training progress that was kept.

A job is every process a supervisor (or the cluster) starts for it, and every reinit inside them.
Each process appends to one job file, as JSON lines, what its time went to
(`records/job_ledger.py` writes them): when it started and from which step, each stretch of
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

import bisect
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from watchdog.core import strict_json
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
    outside_processes: int = 0  # processes recorded by `watch` from outside: their steps are not known

    @property
    def goodput(self) -> float | None:
        """None where nothing can say it: no time yet, or every process watched from outside."""
        if self.elapsed_seconds <= 0 or (self.processes and self.outside_processes == self.processes):
            return None
        return self.productive_seconds / self.elapsed_seconds

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
                "outside_processes": self.outside_processes,
                "actions": [a.fields() for a in self.actions],
                "watchdog_cost_seconds": _round(self.watchdog_cost_seconds),
                "crash_cost_avoided_seconds_estimate": _round(self.crash_cost_avoided_seconds),
                "watchdog_saved_seconds_estimate": _round(self.watchdog_saved_seconds)}

    def block(self, width: int = 30) -> str:
        """The account for a terminal: goodput, then each cause with a bar of its share."""
        elapsed = self.elapsed_seconds
        share = (lambda s: s / elapsed) if elapsed > 0 else (lambda s: 0.0)
        outside = (f"; {self.outside_processes} watched from outside by `watch`, which sees no steps"
                   if self.outside_processes else "")
        lines = [f"goodput: {_percent(self.goodput)} of {_duration(elapsed)} elapsed "
                 f"({self.processes} process{'es' if self.processes != 1 else ''}, {self.reinits} reinit"
                 f"{'s' if self.reinits != 1 else ''}; {self.steps_kept} steps kept, {self.steps_redone} redone"
                 f"{outside})",
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
    (`bounded_lines`): a line without its end is then either the last one or one over the bound.
    Each line is parsed bounded (`core/strict_json.py`: nesting, integers, finite numbers) and its
    fields checked against `FIELDS` before any is used; the error names the line, never its text."""
    for number, line in enumerate(lines, start=1):
        text = line.rstrip("\r\n")
        if len(text) > MAX_LINE_CHARS:
            raise InputError(f"{where}:{number}: a line longer than {MAX_LINE_CHARS} characters")
        if text == line:
            break  # torn: its writer died mid-line
        if not text.strip():
            continue
        try:
            record = strict_json.loads(text, max_depth=2)
        except strict_json.JsonProblem as exc:
            problem = "not a JSON line" if exc.problem == "not JSON" else f"not a job record: {exc.problem}"
            raise InputError(f"{where}:{number}: {problem}") from None
        if not is_record(record):
            raise InputError(f"{where}:{number}: not a job record of version {VERSION}")
        problem = field_problem(record)
        if problem is not None:
            raise InputError(f"{where}:{number}: {problem}")
        yield record


def is_record(record: Any) -> bool:
    """A job record of this version: a JSON object with `v` and an `event`."""
    version = record.get("v") if isinstance(record, dict) else None
    # `true == 1` in Python: a version is an integer, never a bool
    return type(version) is int and version == VERSION and isinstance(record.get("event"), str)


_TIME = "a finite number of seconds"
_COUNT = "a whole number from 0 to 2**52 - 1"
_WORD = "a string"
FIELDS = {
    "t": _TIME,
    "process": {"started": _TIME, "step": _COUNT, "checkpoint_every": _COUNT, "pid": _COUNT, "by": _WORD},
    "span": {"cause": _WORD, "seconds": _TIME, "step": _COUNT},
    "steps": {"first": _COUNT, "last": _COUNT, "seconds": _TIME, "compile_seconds": _TIME},
    "action": {"kind": _WORD, "step": _COUNT, "projected_oom_step": _COUNT},
    "end": {"how": _WORD, "step": _COUNT},
}
"""What each event's fields must be, where present and not null (`t` in every record); an event
not named here is read and ignored (a newer writer's)."""
_CHECKS = {_TIME: lambda v: _number(v, None) is not None and abs(v) < 2**52,
           _COUNT: lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**52,
           _WORD: lambda v: isinstance(v, str) and len(v) <= 64}


def field_problem(record: dict[str, Any]) -> str | None:
    """What is wrong with a job record's fields, naming the field (never its value), or None."""
    fields = {"t": _TIME, **FIELDS.get(record["event"], {})}
    for name, what in fields.items():
        value = record.get(name)
        if value is not None and not _CHECKS[what](value):
            return f"field {name!r} of a {record['event']!r} record: expected {what}"
    return None


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
    process: int  # the index of the process that ran it


@dataclass
class _Process:
    started: float
    last_t: float
    first_step: int
    checkpoint_every: int
    startup: float = 0.0
    restore: float = 0.0
    gap_before: float = 0.0
    outside: bool = False  # recorded by `watch` (`by`: "watch"): its time is not split into steps and spans
    compile_cause: str = "startup"  # what the next stretch's compile time is: the first graphs, a reinit's, or recompilation
    saves: list[int] = field(default_factory=list)  # steps checkpointed in this process, not for an action


@dataclass
class _PendingAction:
    kind: str
    step: int
    projected_oom_step: int | None
    process: int  # its index among the job's processes
    saves_before: int  # how many of its process's saves came before it
    checkpoint_every: int
    resumable: int | None = None  # the newest checkpoint a crash could resume from, without this action
    cost: float = 0.0
    waiting_for: str | None = "checkpoint_save"  # checkpoint_save -> reinit -> reinit_compile | restart


def account(records: Iterable[dict[str, Any]]) -> Account:
    """The job's time, from its records (those after its last `job` line, when it has one).

    Total over any dicts (a field of the wrong type or out of range counts as absent) and linear
    in the records, but for a log factor: each record is handled once, in O(1), and what needs the
    whole job (steps redone past a later resume point, the checkpoint a crash would have resumed
    from, the action that answered the same OOM) is settled at the end by a sort or a stack."""
    records = list(records)
    starts = [i for i, r in enumerate(records) if r.get("event") == "job"]
    if starts:
        records = records[starts[-1]:]
    badput = dict.fromkeys(CAUSES, 0.0)
    kept: list[_Chunk] = []
    processes: list[_Process] = []
    actions: list[_PendingAction] = []
    newest_action: dict[int, _PendingAction] = {}  # process index -> the newest action it took
    job_start: float | None = None
    last_t: float | None = None
    reinits = 0
    ended: str | None = None
    for record in records:
        event, t = record.get("event"), _number(record.get("t"), None)
        if event == "job":
            job_start = t
        elif event == "process":
            started = _number(record.get("started"), t)
            if started is None:
                started = processes[-1].last_t if processes else (job_start if job_start is not None else 0.0)
            process = _Process(started=started, last_t=started, first_step=_count(record.get("step")),
                               checkpoint_every=_count(record.get("checkpoint_every")),
                               outside=record.get("by") == "watch")
            if processes:  # the time since the previous process's last line
                process.gap_before = max(0.0, started - processes[-1].last_t)
                badput["disruption"] += process.gap_before
            if job_start is None or started < job_start:  # a clock that went back starts the job earlier
                job_start = started
            processes.append(process)
            ended = None
        elif not processes:
            continue  # nothing to hang it on: a file cut at its head
        elif event == "span":
            cause, seconds = record.get("cause"), max(0.0, _number(record.get("seconds")))
            if not isinstance(cause, str) or cause not in SPAN_CAUSES:
                continue
            badput[cause] += seconds
            index = len(processes) - 1
            process = processes[index]
            if cause == "startup":
                process.startup += seconds
            elif cause == "checkpoint_restore":
                process.restore += seconds
            elif cause == "checkpoint_save":
                newest = newest_action.get(index)
                if newest is None or newest.waiting_for != "checkpoint_save":  # an action's save: not without it
                    process.saves.append(_count(record.get("step")))
            elif cause == "reinit":
                reinits += 1
                process.compile_cause = "reinit"  # a rebuilt state's first steps may compile again
            _charge(newest_action.get(index), cause, seconds)
        elif event == "steps":
            first, last = _count(record.get("first")), _count(record.get("last"))
            seconds, compile_seconds = max(0.0, _number(record.get("seconds"))), max(0.0, _number(
                record.get("compile_seconds")))
            compile_seconds = min(compile_seconds, seconds)
            index = len(processes) - 1
            process = processes[index]
            badput[process.compile_cause] += compile_seconds
            if process.compile_cause == "reinit":
                _charge(newest_action.get(index), "reinit_compile", compile_seconds)
            process.compile_cause = "recompilation"
            if last > first:
                kept.append(_Chunk(first, last, seconds - compile_seconds, index))
        elif event == "action":
            index = len(processes) - 1
            process = processes[index]
            oom = record.get("projected_oom_step")
            action = _PendingAction(
                kind=str(record.get("kind")), step=_count(record.get("step")),
                projected_oom_step=None if oom is None else _count(oom), process=index,
                saves_before=len(process.saves), checkpoint_every=process.checkpoint_every)
            actions.append(action)
            newest_action[index] = action
        elif event == "end":
            ended = str(record.get("how"))
        if t is not None and processes:
            processes[-1].last_t = max(processes[-1].last_t, t)
            last_t = t if last_t is None else max(last_t, t)
    for index, process in enumerate(processes[1:]):  # a restart's cost runs until the next process trains
        _charge(newest_action.get(index), "restart", process.gap_before + process.startup + process.restore)
    if not processes:
        return Account(0.0, 0.0, badput, 0, 0, 0, 0)
    kept, steps_redone = _redo_past_resumes(kept, [p.first_step for p in processes], badput)
    _resumable(actions, processes)
    elapsed = max(0.0, (last_t if last_t is not None else processes[-1].last_t) - job_start)
    productive = sum(chunk.seconds for chunk in kept)
    accounted = productive + sum(badput[c] for c in CAUSES if c != "other")
    # Records that overlap in time (clocks that went back, processes out of order) can account for
    # more than the span from the first start to the last line: the job took at least what they say.
    if accounted > elapsed:
        elapsed = accounted
    badput["other"] = elapsed - accounted
    finished_at = _count(records[-1].get("step")) if ended == "done" and records[-1].get("event") == "end" else None
    estimates = _estimates(actions, processes, kept, finished_at)
    return Account(elapsed_seconds=elapsed, productive_seconds=productive, badput_seconds=badput,
                   steps_kept=sum(c.last - c.first for c in kept), steps_redone=steps_redone,
                   processes=len(processes), reinits=reinits, actions=estimates, ended=ended,
                   outside_processes=sum(p.outside for p in processes))


def _redo_past_resumes(kept: list[_Chunk], resumed_from: list[int],
                       badput: dict[str, float]) -> tuple[list[_Chunk], int]:
    """Each process resumed from a step (`resumed_from`, by process). The steps that count are those
    of the timeline that ended the job, followed back from its last process: a process is on it when
    it reached the step the next one on it resumed from (its checkpoint could be that one), and its
    steps past that step are redone. A process off it (a restart that resumed from an older
    checkpoint and died, after which the job went on from a newer one) redid all it did. One pass
    back over the processes, one over the stretches. (A cut by every later resume, the suffix
    minimum, counted an abandoned start from step 0 as redoing every step before it.)"""
    highest = list(resumed_from)
    for chunk in kept:
        highest[chunk.process] = max(highest[chunk.process], chunk.last)
    keep_below: list[float] = [0.0] * len(resumed_from)
    frontier = math.inf  # the step the next process on the timeline resumed from
    for index in range(len(resumed_from) - 1, -1, -1):
        if frontier == math.inf or resumed_from[index] <= frontier <= highest[index]:
            keep_below[index], frontier = frontier, resumed_from[index]
        else:  # off the timeline: everything it did was done again, or lost
            keep_below[index] = resumed_from[index]
    remaining, redone = [], 0
    for chunk in kept:
        resume = keep_below[chunk.process]
        if chunk.last > resume:
            cut = max(chunk.first, int(resume))
            moved = chunk.seconds * (chunk.last - cut) / (chunk.last - chunk.first)
            badput["redone"] += moved
            redone += chunk.last - cut
            chunk.last, chunk.seconds = cut, chunk.seconds - moved
        if chunk.last > chunk.first:
            remaining.append(chunk)
    return remaining, redone


def _resumable(actions: list[_PendingAction], processes: list[_Process]) -> None:
    """Each action's newest checkpoint at or before its step among its process's start and the saves
    before it: offline, values in ascending order into a prefix-maximum (Fenwick) tree over the saves'
    order, each action asked once its step's values are in. O(n log n) per process."""
    by_process: dict[int, list[_PendingAction]] = {}
    for action in actions:
        by_process.setdefault(action.process, []).append(action)
    for index, waiting in by_process.items():
        process = processes[index]
        saves = process.saves
        tree = [-1] * (len(saves) + 1)  # 1-based; -1: none yet
        order = sorted(range(len(saves)), key=saves.__getitem__)
        position = 0
        for action in sorted(waiting, key=lambda a: a.step):
            while position < len(order) and saves[order[position]] <= action.step:
                i = order[position] + 1
                while i <= len(saves):
                    tree[i] = max(tree[i], saves[order[position]])
                    i += i & -i
                position += 1
            best, i = -1, action.saves_before
            while i > 0:
                best, i = max(best, tree[i]), i - (i & -i)
            if process.first_step <= action.step:
                best = max(best, process.first_step)
            action.resumable = best if best >= 0 else None


def _charge(action: _PendingAction | None, cause: str, seconds: float) -> None:
    """Add a measured span to `action`, if it is waiting for this one."""
    if action is None or action.waiting_for != cause:
        return
    action.cost += seconds
    action.waiting_for = {"checkpoint_save": "reinit" if action.kind == "checkpoint_reinit" else "restart",
                          "reinit": "reinit_compile"}.get(cause)


def _answered_later(actions: list[_PendingAction]) -> list[int | None]:
    """For each action, the step of the first later action taken at or before the OOM it projected
    (None: none). Right to left, a stack holds the later actions whose step is below every one
    between: the first later action at or before a step is among them, found by bisection."""
    answers: list[int | None] = [None] * len(actions)
    stack: list[int] = []  # steps, rising from the bottom (far right) to the top (the nearest later action)
    for index in range(len(actions) - 1, -1, -1):
        oom = actions[index].projected_oom_step
        if oom is not None:
            found = bisect.bisect_right(stack, oom)  # stack[:found]: the later actions at or before the OOM
            if found:
                answers[index] = stack[found - 1]  # the nearest of them
        step = actions[index].step
        while stack and stack[-1] >= step:
            stack.pop()
        stack.append(step)
    return answers


def _estimates(actions: list[_PendingAction], processes: list[_Process], kept: list[_Chunk],
               finished_at: int | None) -> tuple[ActionEstimate, ...]:
    steps = sum(c.last - c.first for c in kept)
    per_step = sum(c.seconds for c in kept) / steps if steps else 0.0
    restarts = [p.gap_before + p.startup + p.restore for p in processes[1:]]
    restart_cost = (sum(restarts) / len(restarts)) if restarts else processes[0].startup + processes[0].restore
    estimates = []
    # An action followed by another before the OOM it projected (a reinit that did not free
    # enough, escalated to a restart) did not avert that crash alone: it is counted once, at the last.
    for a, later in zip(actions, _answered_later(actions)):
        lost = crash_cost = None
        ended_first = finished_at is not None and a.projected_oom_step is not None and \
            a.projected_oom_step > finished_at
        if later is None and not ended_first and a.projected_oom_step is not None and a.projected_oom_step >= a.step:
            resumable = [a.resumable] if a.resumable is not None else []
            if a.checkpoint_every:
                resumable.append(a.projected_oom_step // a.checkpoint_every * a.checkpoint_every)
            lost = a.projected_oom_step - max(resumable, default=0)
            crash_cost = lost * per_step + restart_cost
        estimates.append(ActionEstimate(a.kind, a.step, a.projected_oom_step, a.cost, lost, crash_cost, later,
                                        ended_first))
    return tuple(estimates)


def _number(value: Any, default: float | None = 0.0) -> float | None:
    """A finite number of seconds (bounded: below 2**52 in magnitude), else `default`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    if isinstance(value, int):
        return float(value) if -2**52 < value < 2**52 else default
    return value if math.isfinite(value) and abs(value) < 2**52 else default


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
