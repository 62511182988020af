"""Scores from per-trace outcomes: pure arithmetic, so it is unit-tested on tiny hand-made cases.

Definitions (the README and `bench` output repeat them):
- a detector "acts" on a trace at its first checkpoint action (a baseline acts when its alert fires);
- true positive: a leak trace acted on at or after the leak's onset; an action before onset, or
  any action on a negative, is a false positive; a leak never acted on (or only before onset) is
  a false negative;
- false alarms: negatives acted on; `alarms_on_clean`: hard negatives (nothing grows) on which the
  leak alarm was ever raised, action or not;
- detection delay: steps from onset to the first OOM-projected alarm at or after onset (else the
  action);
- OOM prevented: acted at least `checkpoint_margin_steps` before the true OOM step;
- projection error: |projected OOM step at the first action - true OOM step| divided by the
  steps that were actually left (true OOM - action step), median over true positives.

The leak report (the other signal, a warning) is scored on its own truth, `floor_leak`: owed on
every trace whose floor rises steadily to its end (OOM-bound leaks and leaks too slow to run
out), false on traces where nothing leaks, either way on growth that stops. A report at or after
onset on an owed trace is a true report; any report on a nothing-leaks trace, or before onset, is
a false one. Report delay: steps from onset to the first report, and that as a share of the
leak's life (onset to the true OOM, or to the trace's end when it never runs out).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TraceOutcome:
    """What one detector did on one labelled trace."""

    trace: str
    leak: bool
    growing: bool
    onset_step: int | None
    oom_step: int | None
    checkpoint_margin_steps: int
    first_report_step: int | None
    first_action_step: int | None
    projected_oom_step_at_action: int | None
    samples: int
    first_oom_alarm_step: int | None = None  # the action path's alarm (a baseline's: its alert)
    floor_leak: bool | None = None  # the leak report's truth (see the module docstring)
    end_step: int = 0  # the trace's last step

    @property
    def reported(self) -> bool:
        """A leak report owed and given, at or after onset."""
        return bool(self.floor_leak) and self.first_report_step is not None \
            and self.first_report_step >= (self.onset_step or 0)

    @property
    def false_report(self) -> bool:
        return self.first_report_step is not None and (
            self.floor_leak is False or (bool(self.floor_leak) and not self.reported))

    @property
    def report_delay_steps(self) -> int | None:
        if not self.reported:
            return None
        return self.first_report_step - (self.onset_step or 0)  # type: ignore[operator]

    @property
    def report_delay_share(self) -> float | None:
        delay = self.report_delay_steps
        if delay is None:
            return None
        life = max(1, (self.oom_step if self.oom_step is not None else self.end_step) - (self.onset_step or 0))
        return delay / life

    @property
    def detected(self) -> bool:
        return (self.leak and self.first_action_step is not None
                and self.first_action_step >= (self.onset_step or 0))

    @property
    def false_positive(self) -> bool:
        return self.first_action_step is not None and not self.detected

    @property
    def prevented(self) -> bool:
        return (self.detected and self.oom_step is not None
                and self.first_action_step <= self.oom_step - self.checkpoint_margin_steps)  # type: ignore[operator]

    @property
    def delay_steps(self) -> int | None:
        if not self.detected:
            return None
        onset = self.onset_step or 0
        alarm = self.first_oom_alarm_step
        detected_at = alarm if alarm is not None and onset <= alarm <= self.first_action_step else \
            self.first_action_step
        return detected_at - onset  # type: ignore[operator]

    @property
    def projection_error(self) -> float | None:
        if not self.detected or self.oom_step is None or self.projected_oom_step_at_action is None:
            return None
        left = max(1, self.oom_step - self.first_action_step)  # type: ignore[operator]
        return abs(self.projected_oom_step_at_action - self.oom_step) / left


@dataclass(frozen=True)
class Score:
    detector: str
    traces: int
    leaks: int
    negatives: int
    true_positives: int
    false_positives: int
    false_negatives: int
    precision: float
    recall: float
    f1: float
    false_alarms: int  # negatives acted on
    alarms_on_clean: int  # hard negatives with the alarm ever up
    median_delay_steps: float | None
    ooms_prevented: int
    median_projection_error: float | None
    samples: int
    seconds: float
    samples_per_second: float
    report_positives: int = 0  # traces owed a leak report
    report_negatives: int = 0  # traces where nothing leaks
    true_reports: int = 0
    false_reports: int = 0  # traces with a false report (nothing leaks, or before onset)
    report_precision: float = 0.0
    report_recall: float = 0.0
    report_f1: float = 0.0
    unbounded_reported: int = 0  # of the owed traces that never run out of memory, reported
    unbounded: int = 0
    median_report_delay_steps: float | None = None
    median_report_delay_share: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def _median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _precision_recall_f1(true: int, false: int, owed: int) -> tuple[float, float, float]:
    """With nothing said and nothing owed, precision is perfect; with nothing said but something owed, 0."""
    precision = _ratio(true, true + false) if true + false else (1.0 if not owed else 0.0)
    recall = _ratio(true, owed)
    return precision, recall, _ratio(2 * precision * recall, precision + recall)


def score(detector: str, outcomes: list[TraceOutcome], seconds: float) -> Score:
    leaks = [o for o in outcomes if o.leak]
    negatives = [o for o in outcomes if not o.leak]
    tp = sum(o.detected for o in leaks)
    fp = sum(o.false_positive for o in outcomes)
    fn = len(leaks) - tp
    precision, recall, f1 = _precision_recall_f1(tp, fp, len(leaks))
    samples = sum(o.samples for o in outcomes)
    owed = [o for o in outcomes if o.floor_leak]
    true_reports = sum(o.reported for o in owed)
    false_reports = sum(o.false_report for o in outcomes)
    report_precision, report_recall, report_f1 = _precision_recall_f1(true_reports, false_reports, len(owed))
    unbounded = [o for o in owed if not o.leak]
    return Score(
        detector=detector, traces=len(outcomes), leaks=len(leaks), negatives=len(negatives),
        true_positives=tp, false_positives=fp, false_negatives=fn,
        precision=precision, recall=recall, f1=f1,
        false_alarms=sum(o.first_action_step is not None for o in negatives),
        alarms_on_clean=sum((o.first_report_step is not None or o.first_action_step is not None)
                            for o in negatives if not o.growing),
        median_delay_steps=_median([o.delay_steps for o in leaks if o.delay_steps is not None]),
        ooms_prevented=sum(o.prevented for o in leaks),
        median_projection_error=_median([e for o in leaks if (e := o.projection_error) is not None]),
        samples=samples, seconds=seconds, samples_per_second=_ratio(samples, seconds),
        report_positives=len(owed), report_negatives=sum(o.floor_leak is False for o in outcomes),
        true_reports=true_reports, false_reports=false_reports,
        report_precision=report_precision, report_recall=report_recall, report_f1=report_f1,
        unbounded_reported=sum(o.reported for o in unbounded), unbounded=len(unbounded),
        median_report_delay_steps=_median([d for o in owed if (d := o.report_delay_steps) is not None]),
        median_report_delay_share=_median([d for o in owed if (d := o.report_delay_share) is not None]),
    )
