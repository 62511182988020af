"""Replay a trace through the judge, sample by sample, as the sidecar would.

Pure: `analyze`, `report` and the benchmark all go through here, and the sidecar drives the same
`Judge`, so what they say is exactly what the live watchdog would have said at each step (no
hindsight). A recorded trace cannot show what
an action would have changed, so the replay carries on after one as if nothing was done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from watchdog.core.detector import DetectorConfig
from watchdog.core.judge import Judge
from watchdog.core.policy import PolicyConfig
from watchdog.core.sample import Sample
from watchdog.core.verdict import Action, Status, Verdict


@dataclass(frozen=True)
class ReplayResult:
    """How a trace went, in the two signals' own words: the leak report (confident steady floor
    growth, a warning) and the OOM projection (near enough to act on), and what was asked."""

    leak_reported: bool  # the leak report was up at some point
    first_leak_report_step: int | None  # first step at which it was up
    leak_report_spans: tuple[tuple[int, int | None], ...]  # (up, cleared) steps; None: still up at the end
    oom_projected: bool  # an OOM near enough to act on was projected at some point (the action path)
    first_oom_projected_step: int | None
    first_action_step: int | None  # first checkpoint action (reinit or restart)
    first_action: Action | None
    slope_bytes_per_step: float  # at the end of the trace
    projected_oom_step: int | None  # at the end of the trace
    projected_oom_step_at_first_action: int | None
    samples: int
    final_verdict: Verdict | None

    @property
    def ended(self) -> str:
        """What the run ended as: `oom_projected`, `leak_reported`, `healthy` or `warming_up`."""
        final = self.final_verdict
        if final is None or final.status is Status.WARMING_UP:
            return "warming_up"
        if final.oom_projected:
            return "oom_projected"
        return "leak_reported" if final.leak_detected else "healthy"

    def to_json(self) -> dict:
        final = self.final_verdict
        return {
            "ended": self.ended,
            "leak_reported": self.leak_reported,
            "first_leak_report_step": self.first_leak_report_step,
            "leak_report_spans": [list(span) for span in self.leak_report_spans],
            "oom_projected": self.oom_projected,
            "first_oom_projected_step": self.first_oom_projected_step,
            "first_action_step": self.first_action_step,
            "first_action": self.first_action.value if self.first_action else None,
            "slope_bytes_per_step": self.slope_bytes_per_step,
            "projected_oom_step": self.projected_oom_step,
            "projected_oom_step_at_first_action": self.projected_oom_step_at_first_action,
            "samples": self.samples,
            "status": final.status.value if final else None,
            "explanation": final.explanation if final else "",
        }


def replay_steps(samples: Iterable[Sample], *, memory_limit_bytes: int | None = None,
                 detector_config: DetectorConfig | None = None,
                 policy_config: PolicyConfig | None = None) -> Iterator[tuple[Sample, Verdict, Action]]:
    """Yield (sample, verdict, action) for each sample; lazy, so a 1M-sample trace streams."""
    judge = Judge(detector_config, policy_config, memory_limit_bytes=memory_limit_bytes).judge
    for sample in samples:
        yield (sample, *judge(sample))


def replay(samples: Iterable[Sample], *, memory_limit_bytes: int | None = None,
           detector_config: DetectorConfig | None = None,
           policy_config: PolicyConfig | None = None) -> ReplayResult:
    """Run the whole trace and sum it up: when each signal went up (and the report down), when
    the first action came."""
    spans: list[list] = []  # [up, cleared] steps of the leak report
    first_oom_projected = first_action_step = projected_at_action = None
    first_action: Action | None = None
    count = 0
    reported = False
    oom_projected, nothing = Status.OOM_PROJECTED, Action.NONE
    the_judge = Judge(detector_config, policy_config, memory_limit_bytes=memory_limit_bytes)
    detector = the_judge.detector
    judge = the_judge.judge_quietly  # no verdict is built for a quiet sample: nothing below reads one
    for sample in samples:  # the benchmark's hot loop
        count += 1
        judged = judge(sample)
        if detector.leak_detected != reported:  # the report's value on every verdict until the next analysis
            reported = not reported
            if reported:
                spans.append([sample.step, None])
            else:
                spans[-1][1] = sample.step
        if judged is None:
            continue
        verdict, action = judged
        if first_oom_projected is None and verdict.status is oom_projected:
            first_oom_projected = verdict.step
        if first_action is None and action is not nothing and action.needs_checkpoint:
            first_action, first_action_step = action, verdict.step
            projected_at_action = verdict.projected_oom_step
    verdict = the_judge.latest
    return ReplayResult(
        leak_reported=bool(spans), first_leak_report_step=spans[0][0] if spans else None,
        leak_report_spans=tuple((up, cleared) for up, cleared in spans),
        oom_projected=first_oom_projected is not None, first_oom_projected_step=first_oom_projected,
        first_action_step=first_action_step, first_action=first_action,
        slope_bytes_per_step=verdict.slope_bytes_per_step if verdict else 0.0,
        projected_oom_step=verdict.projected_oom_step if verdict else None,
        projected_oom_step_at_first_action=projected_at_action, samples=count, final_verdict=verdict,
    )
