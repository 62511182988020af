"""The station: one memory series' whole path, written once for every loop.

    sample -> telemetry -> Judge -> verdict, action -> the action, to the loop (`act`)
           -> trace -> the leak report's lines (up, cleared) -> the action's line (`action_decided`)
    what the action gave back (a reinit, a restart) -> the Judge, and its line

Every series goes through one: the sidecar's device series and its host series (in the training
process), and each device the `watch` daemon reads (outside it). A loop supplies only what it alone
knows: how memory is read (it builds the `Sample`), and what it does with an action (queue it for
the training thread, or signal a process: `act`, called before anything is written, so that a trace
on a slow disk, a slow terminal or a stderr nobody reads never holds an action back). It never
decides what to log or count: the station's
lines and counters are the same whichever loop drives it, so a log pipeline or a dashboard reads
the trainer, a Lightning job and a watched process alike.

`context` goes on every line the station logs, to say which series it is: `memory="device"` or
`"host"` in process, `device=` and `pid=` for the daemon (which updates `pid` when it attaches to
a new process).

Not thread-safe: one thread drives a station (the sidecar's, or the daemon's loop).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Protocol

from watchdog.core.judge import Judge, Recovery
from watchdog.core.sample import Sample
from watchdog.core.verdict import Action, Verdict
from watchdog.logs import get_logger, log_event
from watchdog.station import leak_report
from watchdog.station.telemetry import Telemetry

log = get_logger(__name__)


class TraceSinkLike(Protocol):
    def write(self, sample: Sample) -> None: ...

    def close(self) -> None: ...


class Station:
    def __init__(self, judge: Judge, telemetry: Telemetry, trace: TraceSinkLike | None = None, **context: Any):
        self.judge = judge
        self.telemetry = telemetry
        self.trace = trace
        self.context = context

    @property
    def verdict(self) -> Verdict | None:
        """The newest verdict (None before the first sample)."""
        return self.telemetry.verdict

    def observe(self, sample: Sample, act: Callable[[Action, Verdict], None] | None = None) -> tuple[Verdict, Action]:
        """Judge `sample`; an action goes to `act` (the loop's: it carries it out) and is counted
        before the sample is traced and the lines are logged."""
        telemetry = self.telemetry
        telemetry.sample = sample
        telemetry.peak_bytes_seen = max(telemetry.peak_bytes_seen, sample.bytes_used, sample.peak_bytes_used or 0)
        telemetry.samples_total += 1
        verdict, action = self.judge.judge(sample)
        previous, telemetry.verdict = telemetry.verdict, verdict
        if action is not Action.NONE:
            if act is not None:
                act(action, verdict)
            telemetry.count_action(action)
        if self.trace is not None:
            self.trace.write(sample)
        leak_report.log_change(log, previous, verdict, **self.context)
        if action is not Action.NONE:
            log_action(action, verdict, self.context)
        return verdict, action

    def reinit_finished(self, bytes_now: float, took_steps: float | None = None, held: bool = False) -> Recovery | None:
        """After a rebuild in process: what it gave back (None when the judge had nothing to compare)."""
        recovery = self.judge.reinit_finished(bytes_now, took_steps, held)
        if recovery is not None:
            log.info("reinit_measured", **self.context, **_recovery_fields(recovery))
        return recovery

    def restarted(self) -> None:
        """A new process: the judge starts over, and the restart is counted."""
        self.judge.restarted()
        self.telemetry.restarts_total += 1

    def restart_settled(self, bytes_now: float, **fields: Any) -> Recovery | None:
        """Once the new process warmed up: what the restart gave back."""
        recovery = self.judge.restart_settled(bytes_now)
        if recovery is not None:
            log.info("restart_measured", **self.context, **_recovery_fields(recovery), **fields)
        return recovery

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()


def log_action(action: Action, verdict: Verdict, context: dict[str, Any]) -> None:
    """`action_decided`: what the watchdog decided and why (what the host then did is `action_outcome`)."""
    level = logging.WARNING if action is Action.WARN else logging.ERROR
    log_event(log, level, "action_decided", action=action.value, **context, step=verdict.step,
            status=verdict.status.value, explanation=verdict.explanation,
            projected_oom_step=verdict.projected_oom_step, projected_oom_steps=_finite(verdict.projected_oom_steps),
            projected_oom_seconds=_finite(verdict.projected_oom_seconds))


def _recovery_fields(recovery: Recovery) -> dict[str, Any]:
    return dict(floor_before_bytes=recovery.floor_before_bytes, bytes_after=recovery.bytes_after,
                recovered_bytes=recovery.recovered_bytes, recovered=recovery.recovered)


def _finite(value: float) -> float | None:
    return round(value, 1) if math.isfinite(value) else None
