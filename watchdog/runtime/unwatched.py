"""What an unwatched run gets in the `Watchdog`'s place: one that reads and judges nothing.

A loop then has no `None` to test for. Drills (`forced_actions`) and the loop's own proposals (a
preemption) still take the action path a watched run's take (`runtime/action_path.py`): the
record, `carry_out`, the block, the restarts kept in the checkpoint. With several ranks they are
agreed every step, since nothing else paces the offers.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

from watchdog.core.restarts import RunState
from watchdog.core.verdict import Action
from watchdog.runtime.action_path import DEVICE, FORCED, ActionPath, HandedOver
from watchdog.runtime.agreement import Agreement
from watchdog.runtime.checkpoint_figures import CheckpointFigures
from watchdog.readers.sources import release_host_memory
from watchdog.station.telemetry import Telemetry


class Unwatched(ActionPath):
    """The null watchdog: `step()` hands over drills and proposals only."""

    verdict = host_verdict = limit_bytes = suspects = None
    source_name = "none"
    leak_suspected = watches = False

    def __init__(self, forced_actions: tuple[tuple[int, Action], ...] = (), *, agreement: Agreement | None = None,
                 telemetry: Telemetry | None = None):
        self.telemetry = telemetry
        self._forced = dict(forced_actions)
        self._ranks = agreement
        self._proposed: tuple[Action, str] | None = None
        self._handed = HandedOver(logs_outcomes=True)
        self._run_state = RunState.from_environment(os.environ)

    def start(self) -> "Unwatched":
        return self

    def stop(self, *, clean: bool = True) -> None:
        """Nothing runs: an action's block its loop never logged is dropped with it."""

    def drain(self, timeout: float = 5.0) -> bool:
        return True

    def phase(self, name: str, steps: int | None = None):
        return nullcontext()

    def propose(self, action: Action, origin: str) -> None:
        if action.needs_checkpoint:
            self._proposed = (action, origin)

    def step(self, step: int) -> Action | None:
        proposed, self._proposed = self._proposed, None
        action, origin, own = (*proposed, False) if proposed else (self._forced.get(step), FORCED, True)
        if self._ranks is not None:
            agreed = self._ranks.decide(step, action, own=own)
            if agreed is None:
                return None
            origin = agreed.origin(origin if agreed.asked_by == self._ranks.rank else "")
            action, own = agreed.action, agreed.own
        if action is None:
            return None
        return self._hand_over(step, action, None, DEVICE, origin, counts=own)

    def observe_checkpoint(self, seconds: float) -> None:
        if self.telemetry is not None:
            self.telemetry.part(CheckpointFigures).observe_save(seconds)

    def reinit_finished(self) -> None:
        release_host_memory()

    def processes_grown(self) -> list[str]:
        return []

    def record_program(self, tensors) -> None:
        """Nothing to record it in."""
