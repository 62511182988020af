"""What a checkpoint action takes, as the loop's own actions and saves measured it. Pure: no threads, no I/O.

An action is worth asking for only as early as it needs to be: early enough that the save finishes
before memory reaches the limit, that the save's own memory (its staging copy) fits beside what is
there, and that a gap between readings and the hand-over to the loop are covered (memory may be past
the line at the next look). Anything earlier gains no safety against a projection that holds; it
only gives growth that stops less time to show that it stops, and shortens every cycle of a leak
that does not (issue 62: the 80k-step job's goodput fell from 0.902 to 0.875 with two actions more).

All of it is measured during the run, and kept here:

- the saves' time (`saved`: every save the loop times, `Watchdog.observe_checkpoint`; the newest
  `SAVES_KEPT`), read at the slowest of them: a save that is sometimes slow (the 80k-step job's
  took 7 to 41 ms, and 0.7 to 1.3 s when the disk was busy) is planned for at its slow. Their
  mean plus three standard deviations read one 1.1 s save among three of 20 ms as 1.7 s;
- the action's own memory (`staged`: what it holds beside memory while it is carried out, as high
  as any seen: a save's staging copy, from the reading at the end of a bounded phase named "save",
  which holds the peak since the reading before; the census that names the leak, measured around
  the baseline census and then around each action, from its decision to its rebuilt state: in the
  80k-step job the census at a hand-over lifted the trainer's memory 2.6 MiB, past a budget the
  action had been asked 0.95 MiB under);
- what the newest action took from its decision to the rebuilt state, in steps (`took`: the
  hand-over, the ranks' agreement, the rebuild), which a save in seconds does not count when the
  loop saves between steps.

`steps(seconds_per_step)` is what an action takes, in steps: the larger of the save's time (as if
the leak went on meanwhile: an asynchronous save, another rank, a worker process) and what the
newest action took. None until something was measured: the checkpoint margin the user configured
stands in (`PolicyConfig.checkpoint_margin_steps`). The Judge's limit rule and the lesson a cycle
teaches the next (`core/cycles.py`) look ahead by it; the policy's horizon is `reach` times
`PolicyConfig.safety_factor` (`core/policy.py`).
"""

from __future__ import annotations

import math
from collections import deque

from watchdog.core.pace import HANDOVER_STEPS

SAVES_KEPT = 16  # the newest saves' times read


class ActionTime:
    """The saves' time and memory, and what the newest action took; see the module docstring."""

    __slots__ = ("_seconds", "own_bytes", "took_steps")

    def __init__(self) -> None:
        self._seconds: deque[float] = deque(maxlen=SAVES_KEPT)
        self.own_bytes = 0.0  # what an action holds beside memory while it is carried out, as high as any seen
        self.took_steps: float | None = None  # what the newest action took, decided to rebuilt

    def saved(self, seconds: float) -> None:
        """A save the loop made took `seconds` (a figure that is no finite time is left out)."""
        if isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0:
            self._seconds.append(float(seconds))

    def staged(self, rise_bytes: float) -> None:
        """An action (or its save, or its census) held `rise_bytes` beside memory while it ran."""
        if math.isfinite(rise_bytes) and rise_bytes > self.own_bytes:
            self.own_bytes = float(rise_bytes)

    def took(self, steps: float) -> None:
        """The newest action took `steps` from its decision to the rebuilt state."""
        if math.isfinite(steps) and steps >= 0:
            self.took_steps = float(steps)

    @property
    def saves(self) -> int:
        """Saves timed (of the newest `SAVES_KEPT`): none means the checkpoint margin stands in."""
        return len(self._seconds)

    def save_seconds(self) -> float:
        """A save's time as it is planned for: the slowest of the newest saves (0 with none)."""
        return max(self._seconds, default=0.0)

    def steps(self, seconds_per_step: float) -> float | None:
        """What an action takes, in steps: the larger of a save's time at `seconds_per_step` and what
        the newest action took; None while neither is known (a save needs a clock to count in steps)."""
        took = self.took_steps
        if self._seconds and seconds_per_step > 0:
            save = self.save_seconds() / seconds_per_step
            return save if took is None else max(save, took)
        return took


def reach(action_steps: float, gap: float, agreement_gaps: int = 0) -> float:
    """Steps from a reading to the latest moment an action decided at it must be carried out: what the
    action takes, the gap to the next reading (and one more where the ranks agree on actions: the
    answer comes a sampling period later), and the hand-over once more for what that measure did not see."""
    return action_steps + (1 + agreement_gaps) * gap + HANDOVER_STEPS
