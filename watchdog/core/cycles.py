"""What one cycle of a leak teaches the next. Pure: no threads, no I/O.

A cycle runs from a fresh state (the process's start, or a rebuild that gave memory back) to the
checkpoint action that ended it. The leak is still in the code, so after the rebuild it refills,
and the next cycle starts from scratch for the detector: its warm-up, its buckets, a confirmed
candidate, about 40 samples before it projects anything. A cycle whose headroom is shorter than
that (a leak half outside the rebuilt state leaves less of it; a large `sample_every` leaves few
samples in it) crossed the limit on its second cycle, while the first one had measured the
leak's rate.

So the rate the cycle before measured (`Lesson`) carries over a rebuild in process (not a restart:
a new process climbs as it starts up, at a rate no leak has, and the `watch` daemon's lesson from
one cycle signalled the next in its start-up, each faster): from the first reading after the
rebuild, memory that the known rate would bring to the line within the checkpoint margin, a
gap between samples and the action's hand-over is acted on (`Judge`'s limit rule, which gains
this rate beside the detector's). The lesson holds while the readings bear it out: a cycle whose
memory rose less than a quarter of what the rate predicts, over a dozen readings, has no such leak
any more (it was fixed, or the rebuild freed its cause), and the lesson is dropped.

Cycles that shrink say the same thing twice over. Within a process, each rebuild leaving more behind
(the judge's reinits: `shrinking`), a restart is due, since a new process frees what a rebuild leaves.
Across processes (`RunState.cycles`: what each restart bought, the first cycle of each process), each
of three clearly shorter than the one before says that restarting will not save the job, and so does a
cycle no longer than its action took to carry out (the leak refills before its save is done): `futile`.
"""

from __future__ import annotations

from typing import NamedTuple

BORNE_OUT = 0.25  # a cycle's rise must reach this share of what the lesson predicts ...
READINGS_TO_DOUBT = 12  # ... once it has had this many readings, or the lesson is dropped
SHRINKING_CYCLES = 3  # this many cycles in a row, each shorter than the one before: restarting is in vain
SHRINKS = 0.85  # ... each at most this share of the one before (a steady leak's cycles differ by a few steps)


class Lesson:
    """The leak's rate, as the cycle before measured it, and the evidence of this cycle so far."""

    __slots__ = ("rate", "from_step", "_first", "_readings")

    def __init__(self, rate: float, from_step: int):
        self.rate = rate  # bytes per step
        self.from_step = from_step  # the step of the action whose cycle taught it
        self._first: tuple[float, float] | None = None  # this cycle's first reading (step, bytes)
        self._readings = 0

    def borne_out(self, step: float, used: float) -> bool:
        """One more reading of this cycle; False once the readings contradict the lesson."""
        if self._first is None:
            self._first = (step, used)
        self._readings += 1
        if self._readings < READINGS_TO_DOUBT:
            return True
        first_step, first_bytes = self._first
        return used - first_bytes >= BORNE_OUT * self.rate * (step - first_step)

    def reaches(self, used: float, line: float, steps: float) -> bool:
        """Whether memory at `used` reaches `line` within `steps` at the known rate."""
        return used + self.rate * steps >= line


class Cycle(NamedTuple):
    """One cycle: where it started and what it had reached when its action came."""

    start_step: float
    start_bytes: float

    def rate(self, step: float, floor: float) -> float:
        """Its average rise per step up to `step`, at `floor` (0 when it did not rise)."""
        return max(0.0, (floor - self.start_bytes) / (step - self.start_step)) if step > self.start_step else 0.0


def shrinking(lengths: list[float]) -> bool:
    """The newest `SHRINKING_CYCLES` lengths each at most `SHRINKS` of the one before."""
    newest = lengths[-SHRINKING_CYCLES:]
    return len(newest) == SHRINKING_CYCLES and all(b <= SHRINKS * a for a, b in zip(newest, newest[1:]))


def futile(restarts: list[int], cycle: float | None = None, took_steps: float | None = None) -> str | None:
    """Why restarting will not save the job, or None: what each restart bought (`restarts`: each
    process's first cycle, in steps, oldest first) shrinking, or this cycle (`cycle` steps) no longer
    than the action before it took from its decision to the rebuilt state (`took_steps`)."""
    if shrinking(restarts):
        said = ", ".join(f"{n:,}" for n in restarts[-SHRINKING_CYCLES:])
        return f"each restart bought fewer steps than the one before ({said})"
    if cycle is not None and took_steps is not None and cycle <= took_steps:
        return (f"the leak refilled in {cycle:,.0f} steps, no more than the action before took to carry out "
                f"({took_steps:,.0f} steps)")
    return None
