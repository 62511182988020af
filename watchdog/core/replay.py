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
    leak: bool  # a leak was reported at some point (confident steady floor growth)
    first_alarm_step: int | None  # first step at which the leak report was up
    oom_projected: bool  # an OOM near enough to act on was projected at some point (the action path)
    first_oom_projected_step: int | None
    first_action_step: int | None  # first checkpoint action (reinit or restart)
    first_action: Action | None
    slope_bytes_per_step: float  # at the end of the trace
    projected_oom_step: int | None  # at the end of the trace
    projected_oom_step_at_first_action: int | None
    samples: int
    final_verdict: Verdict | None

    def to_json(self) -> dict:
        final = self.final_verdict
        return {
            "leak": self.leak,
            "first_alarm_step": self.first_alarm_step,
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
    """Run the whole trace and sum it up: when each signal first went up, when the first action came."""
    first_leak = first_alarm = first_action_step = projected_at_action = None
    first_action: Action | None = None
    count = 0
    leaking, nothing = Status.LEAKING, Action.NONE
    the_judge = Judge(detector_config, policy_config, memory_limit_bytes=memory_limit_bytes)
    detector = the_judge.detector
    judge = the_judge.judge_quietly  # no verdict is built for a quiet sample: nothing below reads one
    for sample in samples:  # the benchmark's hot loop
        count += 1
        judged = judge(sample)
        if first_leak is None and detector.leak_detected:  # the report's value on every verdict until the next analysis
            first_leak = sample.step
        if judged is None:
            continue
        verdict, action = judged
        if first_alarm is None and verdict.status is leaking:
            first_alarm = verdict.step
        if first_action is None and action is not nothing and action.needs_checkpoint:
            first_action, first_action_step = action, verdict.step
            projected_at_action = verdict.projected_oom_step
    verdict = the_judge.latest
    return ReplayResult(
        leak=first_leak is not None, first_alarm_step=first_leak, oom_projected=first_alarm is not None,
        first_oom_projected_step=first_alarm, first_action_step=first_action_step,
        first_action=first_action,
        slope_bytes_per_step=verdict.slope_bytes_per_step if verdict else 0.0,
        projected_oom_step=verdict.projected_oom_step if verdict else None,
        projected_oom_step_at_first_action=projected_at_action, samples=count, final_verdict=verdict,
    )
