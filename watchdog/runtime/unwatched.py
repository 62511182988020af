"""What an unwatched run gets in the `Watchdog`'s place: one that reads and judges nothing.

A loop then has no `None` to test for. It is the `Watchdog`'s parts without a sampler: drills
(`forced_actions`) and the loop's own proposals (a preemption) wait in the same chores
(`runtime/chores.py`: the most severe is taken) and take the same action path
(`actions/action_path.py`): the record, `carry_out`, the block, the restarts kept in the
checkpoint. With several ranks they are agreed every step, since nothing else paces the offers.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

from watchdog.actions.action_path import ActionPath
from watchdog.actions.agreement import Agreement
from watchdog.actions.record import ActionOutcome
from watchdog.core.verdict import Action
from watchdog.readers.sources import release_host_memory
from watchdog.runtime.checkpoint_figures import CheckpointFigures
from watchdog.runtime.chores import Chores
from watchdog.station.telemetry import Telemetry


class Unwatched:
    """The null watchdog: `step()` hands over drills and proposals only, through the chores and the
    action path it holds (`chores`, `actions`), as the `Watchdog` does; the calls a loop makes are
    the `Watchdog`'s."""

    verdict = host_verdict = limit_bytes = suspects = None
    source_name = "none"
    leak_suspected = watches = False
    saved_state = staticmethod(ActionPath.saved_state)

    def __init__(self, forced_actions: tuple[tuple[int, Action], ...] = (), *, agreement: Agreement | None = None,
                 telemetry: Telemetry | None = None):
        self.telemetry = telemetry
        self.actions = ActionPath(logs_outcomes=True)
        self.actions.ranks = agreement
        self.chores = Chores(self.actions, None, forced_actions)
        self._step = -1

    def start(self) -> "Unwatched":
        return self

    def stop(self, *, clean: bool = True) -> None:
        """Nothing runs: an action's block its loop never logged is dropped with it."""

    def drain(self, timeout: float = 5.0) -> bool:
        return True

    def phase(self, name: str, steps: int | None = None):
        return nullcontext()

    def propose(self, action: Action, origin: str) -> None:
        self.chores.propose(action, None, origin)

    def step(self, step: int) -> Action | None:
        self._step = step
        chores = self.chores
        if step >= chores.next_forced:  # a drill due
            chores.force(step, None)
        action = chores.do(step) if chores.queue else None  # with several ranks: held for the offer
        if self.actions.ranks is not None:  # agreed every step: nothing else paces the offers
            return self.actions.agree_now(step)
        return action

    def carry_out(self, action: Action | None, *, save: Callable[[], object] | None = None,
                  rebuild: Callable[[], None] | None = None, checkpoint: str | None = None) -> bool:
        return self.actions.carry_out(action, save=save, rebuild=rebuild, checkpoint=checkpoint, step=self._step,
                                      saved=self.observe_checkpoint, rebuilt=self.reinit_finished)

    def log_outcome(self, outcome: str, *, checkpoint: str | None = None, exit_code: int | None = None) -> None:
        self.actions.log_outcome(outcome, checkpoint=checkpoint, exit_code=exit_code)

    @property
    def last_action(self) -> ActionOutcome | None:
        return self.actions.last

    def state_dict(self) -> dict:
        return self.actions.run.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.actions.run.load_state_dict(state)

    def ends_at(self, last_step: int | None) -> None:
        self.actions.ends_at(last_step)

    def observe_checkpoint(self, seconds: float) -> None:
        if self.telemetry is not None:
            self.telemetry.part(CheckpointFigures).observe_save(seconds)

    def reinit_finished(self) -> None:
        release_host_memory()
        self.actions.measure_rebuild((None, None), self._step, [])  # rebuilt; nothing measures it

    def record_program(self, tensors) -> None:
        """Nothing to record it in."""
