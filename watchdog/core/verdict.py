"""The vocabulary passed down the pipeline: source -> Sample -> detector -> Verdict -> policy -> Action.

These types are shared by the pure parts (detector, policy, replay) and the threaded ones
(sidecar, station, exporter), so they live alone and import nothing heavy.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import NamedTuple


class Status(str, Enum):
    """Where the action path stands. The leak report is not a status: it is `Verdict.leak_detected`,
    and may be up under any of these (a slow leak is reported long before an OOM is projected)."""

    WARMING_UP = "warming_up"  # not enough history to say anything
    HEALTHY = "healthy"  # floor flat, or no projected OOM
    SUSPECT = "suspect"  # floor rising, not (yet) an OOM to act on
    OOM_PROJECTED = "oom_projected"  # the peak reaches the limit soon enough, on enough evidence, to act

    @property
    def label(self) -> str:
        """For a person: "warming up", "healthy", "suspect", "OOM projected"."""
        return "OOM projected" if self is Status.OOM_PROJECTED else self.value.replace("_", " ")


class Action(str, Enum):
    NONE = "none"
    WARN = "warn"
    CHECKPOINT_REINIT = "checkpoint_reinit"  # save, rebuild in process, carry on
    CHECKPOINT_RESTART = "checkpoint_restart"  # save, exit 42, let the supervisor restart

    @property
    def needs_checkpoint(self) -> bool:
        return self in (Action.CHECKPOINT_REINIT, Action.CHECKPOINT_RESTART)


class Decided(NamedTuple):
    """A checkpoint action decided, on its way to the training loop: what, on which verdict, for which
    memory, and who decided it. Made where it is decided (the sidecar, a drill, the loop's proposal);
    the training thread hands it over (`actions/action_path.py`), whose record it becomes."""

    action: Action
    verdict: "Verdict | None"
    memory: str  # which memory asked: "device" or "host"
    origin: str = ""  # who decided, where not this rank's watchdog alone: "forced (a drill)", "stop signal"
    own: bool = True  # the watchdog's (its restart counts against the budget), not one a loop proposed


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
        return self.status is Status.OOM_PROJECTED

    def at(self, step: int, timestamp: float, floor_bytes: float | None, projected_oom_step: int | None,
           projected_oom_steps: float, projected_oom_seconds: float,
           projected_oom_steps_pessimistic: float) -> "Verdict":
        """This analysis's verdict at another sample: the fields a sample changes, the rest kept.

        The detector builds its analysis's verdict once, by name, when a bucket closes, and calls
        this at every sample in between. Positional inside, in the field order (written here once,
        beside the fields, and checked against `_replace` by tests/test_station.py): a keyword
        construction of all 17 fields costs about three times as much, once per sample."""
        (_, _, status, _, excursion, limit, slope, low, high, per_second, _, _, _, explanation, _, window,
         leak) = self
        return _new(Verdict, (step, timestamp, status, floor_bytes, excursion, limit, slope, low, high, per_second,
                              projected_oom_step, projected_oom_steps, projected_oom_seconds, explanation,
                              projected_oom_steps_pessimistic, window, leak))


_new = tuple.__new__
