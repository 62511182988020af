"""The vocabulary passed down the pipeline: source -> Sample -> detector -> Verdict -> policy -> Action.

These types are shared by the pure parts (detector, policy, replay) and the threaded ones
(sidecar, exporter), so they live alone and import nothing heavy.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import NamedTuple


class Status(str, Enum):
    WARMING_UP = "warming_up"  # not enough history to say anything
    HEALTHY = "healthy"  # floor flat, or no projected OOM
    SUSPECT = "suspect"  # floor rising, not (yet) an OOM to act on; `leak_detected` may still be up
    LEAKING = "leaking"  # an OOM projected near enough to act on: the action path's alarm is up


class Action(str, Enum):
    NONE = "none"
    WARN = "warn"
    CHECKPOINT_REINIT = "checkpoint_reinit"  # save, rebuild in process, carry on
    CHECKPOINT_RESTART = "checkpoint_restart"  # save, exit 42, let the supervisor restart

    @property
    def needs_checkpoint(self) -> bool:
        return self in (Action.CHECKPOINT_REINIT, Action.CHECKPOINT_RESTART)


class Verdict(NamedTuple):
    """What the detector believes after one sample.

    Slopes are floor growth. `*_high` is the pessimistic edge of the slope interval, which is
    what actions use; `projected_oom_step` uses floor + typical excursion against the limit
    (OOM happens at the peak, not at the floor).

    Immutable, as a NamedTuple rather than a frozen dataclass: one is built for every sample, and
    a frozen dataclass's __init__ costs five times as much (a third of a replay's time).
    """

    step: int
    timestamp: float
    status: Status
    floor_bytes: float | None = None
    excursion_bytes: float = 0.0
    limit_bytes: float | None = None
    slope_bytes_per_step: float = 0.0
    slope_low_bytes_per_step: float = 0.0
    slope_high_bytes_per_step: float = 0.0
    slope_bytes_per_second: float = 0.0
    projected_oom_step: int | None = None
    projected_oom_steps: float = math.inf
    projected_oom_seconds: float = math.inf
    explanation: str = ""
    projected_oom_steps_pessimistic: float = math.inf  # from the high edge of the slope interval; actions use it
    window_steps: float = 0.0  # span of history the slope was fitted over
    leak_detected: bool = False  # the leak report: confident steady floor growth, however far the OOM

    @property
    def oom_projected(self) -> bool:
        """The other signal, the action path: the peak reaches the limit soon enough to act on."""
        return self.status is Status.LEAKING
