"""Run every detector over a labelled corpus, in this process, sample by sample, and time it.

hbm-watchdog runs through `watchdog.core.replay.replay` (the same path as `analyze` and the sidecar:
detector + action policy, with each trace's checkpoint margin). A baseline has no policy: its
alert firing is its action, as an alert rule wired to a checkpoint hook would be.
"""

from __future__ import annotations

import dataclasses
import time
from math import inf as INF
from typing import Callable, Iterable

from watchdog.bench.baselines import BASELINES, Detector
from watchdog.bench.corpus import LabelledTrace
from watchdog.bench.scoring import Score, TraceOutcome, score
from watchdog.core.verdict import Status

OURS = "hbm-watchdog"

Runner = Callable[[LabelledTrace], TraceOutcome]


def _outcome(trace: LabelledTrace, alarm: int | None, action: int | None, projected: int | None,
             oom_alarm: int | None) -> TraceOutcome:
    return TraceOutcome(
        trace=trace.name, leak=trace.leak, growing=trace.growing, onset_step=trace.onset_step,
        oom_step=trace.oom_step, checkpoint_margin_steps=trace.checkpoint_margin_steps,
        first_report_step=alarm, first_action_step=action, projected_oom_step_at_action=projected,
        samples=len(trace.samples), first_oom_alarm_step=oom_alarm, floor_leak=trace.floor_leak,
        end_step=trace.samples[-1].step if trace.samples else 0)


def run_ours(trace: LabelledTrace, detector_config=None, policy_config=None) -> TraceOutcome:
    from watchdog.core.policy import PolicyConfig
    from watchdog.core.replay import replay

    policy = dataclasses.replace(policy_config or PolicyConfig(),
                                 checkpoint_margin_steps=trace.checkpoint_margin_steps)
    result = replay(trace.samples, memory_limit_bytes=trace.limit_bytes, detector_config=detector_config,
                    policy_config=policy)
    return _outcome(trace, result.first_leak_report_step, result.first_action_step,
                    result.projected_oom_step_at_first_action, result.first_oom_projected_step)


def run_baseline(make: Callable[[int | None], Detector], trace: LabelledTrace) -> TraceOutcome:
    """Replay the whole trace (so the speed figure is honest) and note when the alert first fired."""
    detector = make(trace.limit_bytes)
    fired_at = projected = None
    for sample in trace.samples:
        verdict = detector.update(sample)
        if fired_at is None and verdict.status is Status.OOM_PROJECTED:
            fired_at, projected = sample.step, verdict.projected_oom_step
    return _outcome(trace, fired_at, fired_at, projected, fired_at)  # one alert: report, alarm and action


def detectors(names: Iterable[str] | None = None, detector_config=None,
              policy_config=None) -> dict[str, Runner]:
    """Name -> runner; ours first, then the baselines in a fixed order."""
    runners: dict[str, Runner] = {OURS: lambda t: run_ours(t, detector_config, policy_config)}
    for name, make in BASELINES.items():
        runners[name] = lambda t, make=make: run_baseline(make, t)
    if names is None:
        return runners
    return {name: runners[name] for name in names}


def evaluate(traces: list[LabelledTrace], runners: dict[str, Runner], repeat: int = 1,
             progress: Callable[[int], None] | None = None) -> tuple[list[Score], dict[str, list[TraceOutcome]]]:
    """Score each runner on the traces; `progress(n)` is told after each replayed trace.

    Each trace is timed `repeat` times and the fastest counts, as timeit does: on a shared
    machine the slower passes measure the other tenants, not the detector. Replays are
    deterministic, so the outcome is the first pass's.
    """
    scores, outcomes = [], {}
    for name, runner in runners.items():
        results, seconds = [], 0.0
        for trace in traces:
            fastest = INF
            for _ in range(repeat):
                start = time.perf_counter()
                outcome = runner(trace)
                fastest = min(fastest, time.perf_counter() - start)
                if progress:
                    progress(1)
            results.append(outcome)
            seconds += fastest
        scores.append(score(name, results, seconds))
        outcomes[name] = results
    return scores, outcomes
