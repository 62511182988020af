"""An action's life after it is decided, written once for every host.

decided (the sidecar, a drill, the loop's own proposal) -> agreed (several ranks) -> handed over by
`step()` -> carried out by the loop's `save` and `rebuild` (`carry_out`) or by exit 42 -> its
effect measured (a reinit: one reading after the rebuild) -> the watch resumes.

`ActionPath` is that life, a part every watcher holds (the `Watchdog`, and the unwatched run's
stand-in, `runtime/unwatched.py`), not a base class: agreeing with the other ranks, the record of
the action handed over (built once, `ActionOutcome`), carrying it out, measuring a rebuild on the
record, its block on the terminal, and the run's state that spans processes (`RunState`: restarts
so far, the watchdog's own in a row, where the run ends: the one count of restarts).
"""

from __future__ import annotations

import logging
import math
import os
import time
from concurrent.futures import Future
from contextlib import nullcontext
from typing import Callable, NamedTuple

from watchdog.actions.agreement import Agreement, severity
from watchdog.actions.record import EXITED, HANDED, REBUILT, SAVED, ActionOutcome
from watchdog.core.cycles import futile
from watchdog.core.errors import EXIT_FUTILE, EXIT_RESTART_REQUESTED, EXIT_UNSAVED, InputError
from watchdog.core.policy import PolicyConfig
from watchdog.core.restarts import RunState
from watchdog.core.verdict import Action, Decided, Verdict
from watchdog.logs import get_logger, log_event
from watchdog.records.flight_record import FlightRecorder
from watchdog.records.job_ledger import LoopAccount

log = get_logger(__name__)

DEVICE = "device"  # which memory asked for an action: the device's, or the host's
HANDED_OVER = "handed to the training loop"  # the outcome of an action whose loop never said what it did
REINITIALISED, RESTART_REQUESTED = "reinitialised in process", "exit 42: restart requested"
STOPPED = "exit 45: restarting will not save this job, stopped"
UNSAVED = "the checkpoint failed: exit 44 to restart from the newest one"
FORCED = "forced (a drill)"


_ABSENT = object()


class Offer(NamedTuple):
    """An offer in flight to the other ranks: the step it was posted at, the action offered (None:
    nothing), and its answer to come (`Agreement.post`), collected at the next sampling step."""

    step: int
    decided: Decided | None
    answer: Future


def _reason(exc: Exception) -> str:
    """Why a saved state was refused, in one line, whatever the exception's own text does."""
    if isinstance(exc, InputError):
        return str(exc)
    try:
        return f"{type(exc).__name__} reading it: {exc}"[:300]
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises too
        return f"{type(exc).__name__} reading it"


def save_result(result: object) -> tuple[bool, str | None]:
    """What a loop's `save()` returned, read: (whether it saved, the checkpoint's path if it named one).

    - a path (a non-empty `str` or an `os.PathLike`): saved, there;
    - None (it returns nothing), or a true truth value (`True`, numpy's `True_`): saved, no path named;
    - a false truth value (`False`, numpy's `False_`) or anything else false (0, an empty string):
      it could not save (exit 44);
    - anything else is read by its truth, no path named, and said (`save_result_unclear`); a value
      whose truth cannot be read (a NumPy array of several) is a save that could not be confirmed:
      not saved.

    Never the value's text as a path: `str(numpy.False_)` is 'False'."""
    if result is None:
        return True, None
    if isinstance(result, (str, os.PathLike)):
        try:
            path = os.fspath(result)
        except Exception:  # noqa: BLE001 - a PathLike whose __fspath__ raises names nothing
            path = ""
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        return (True, path) if path else (False, None)
    try:
        truth = bool(result)
    except Exception as exc:  # noqa: BLE001 - an array of several, a value that refuses: not confirmed
        log.warning("save_result_unclear", returned=type(result).__name__, saved=False, error=type(exc).__name__,
                    note="save() should return its checkpoint's path, True or None when it saved, False when it "
                         "could not; a value whose truth cannot be read is a save not confirmed (exit 44)")
        return False, None
    if not _truth_value(result):
        log.warning("save_result_unclear", returned=type(result).__name__, saved=truth,
                    note="save() should return its checkpoint's path, True or None when it saved, False when it "
                         "could not; other values are read by their truth")
    return truth, None


def _truth_value(value: object) -> bool:
    """A bool, or numpy's (`numpy.bool_`, named `numpy.bool` since NumPy 2), read without importing numpy."""
    kind = type(value)
    return kind is bool or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


class ActionPath:
    """The part every watcher holds for an action's life (see the module docstring): the run's state
    (`RunState`, the one count of restarts), the actions on it (below), the agreement
    with the other ranks, and the records the path writes to (the job file's account, the flight
    record), given at `start()`. What it takes is a `Decided` (`core/verdict.py`).

    `policy`: the watchdog's (its restart budget and window, whether restarting is in vain); None
    for a stand-in that judges nothing. `every`: the sampling period, at whose steps the ranks
    agree. `suspects(step)` names what is leaking when an action leaves; `read(kind)` reads each
    memory between steps (what a rebuild is measured against); `verdict()`, the newest, is what an
    action another rank asked for is said to be decided on; `block_due()` asks for `between_steps`
    at the next step, where the loop may never say what it did with an action handed over."""

    def __init__(self, *, logs_outcomes: bool, policy: PolicyConfig | None = None, every: int = 1,
                 suspects: Callable[[int], list[str]] = lambda step: [],
                 read: Callable[[str], tuple] | None = None,
                 verdict: Callable[[], Verdict | None] = lambda: None,
                 block_due: Callable[[], None] = lambda: None):
        self.run = RunState.from_environment(os.environ)  # the restart engine's count, until a checkpoint's
        # The actions on the path, each a fact held here only: the newest handed over (`last`, its
        # record, which says whether its block is logged), and with several ranks the one held for
        # the next offer and the offer in flight, whose answer comes at the next sampling step.
        self.last: ActionOutcome | None = None
        self.held: Decided | None = None
        self.offered: Offer | None = None
        self.logs_outcomes = logs_outcomes  # the loop always says what it did (else: at the next step)
        self.policy = policy
        self.ranks: Agreement | None = None  # several ranks: the agreement every action goes through
        self.account: LoopAccount | None = None  # the job file's share of this process (rank 0)
        self.flight: FlightRecorder | None = None
        self._every, self._suspects, self._read, self._verdict = every, suspects, read, verdict
        self._block_due = block_due

    # ---- choosing and agreeing -----------------------------------------------------------------

    def take(self, step: int, decided: Decided) -> Action | None:
        """The most severe action waiting, between steps: handed over now, or with several ranks held
        for the next offer."""
        if self.ranks is None:
            return self.hand_over(step, decided)
        if self.held is None or severity(decided.action) > severity(self.held.action):
            self.held = decided
        return None

    def agree(self, step: int) -> Action | None:
        """A sampling step with several ranks: take the action agreed on the previous sampling step's
        offers, and offer the most severe action held now (its answer comes at the next one)."""
        ranks, offered, held = self.ranks, self.offered, self.held
        if offered is not None and step == offered.step:  # the same step again (an accumulation's micro-batches)
            return None  # one offer a step
        agreed = ranks.collect(offered.answer, offered.step, step) if offered is not None else None
        if agreed is not None and held is not None and held.own and severity(held.action) <= severity(agreed.action):
            held = None  # the watchdog's own, decided on the state the agreed action now replaces
        answer = ranks.post(step, held.action if held is not None else None,
                            own=held.own if held is not None else True, every=self._every)
        self.offered, self.held = Offer(step, held, answer), None
        return None if agreed is None else self._agreed(step, agreed, offered.decided, self._verdict())

    def agree_now(self, step: int) -> Action | None:
        """A stand-in's step with several ranks, which nothing else paces: the most severe action any
        rank offers at `step` (this rank's, the one held), agreed now (every rank waits for every
        other) and handed over."""
        held, self.held = self.held, None
        agreed = self.ranks.decide(step, held.action if held is not None else None,
                                   own=held.own if held is not None else True)
        return None if agreed is None else self._agreed(step, agreed, held, None)

    def _agreed(self, step: int, agreed, offered: Decided | None, verdict: Verdict | None) -> Action:
        """The agreed action handed over: this rank's own offer where it is the one agreed (its
        verdict, memory and reason), else the asking rank's, said as such (`Agreed.origin`)."""
        mine = offered is not None and offered.action is agreed.action and agreed.asked_by == self.ranks.rank
        # Another rank's restart counts against the watchdog's budget only when its watchdog asked for
        # it: a preemption of one rank is no restart of the watchdog's on the others.
        ours = offered if mine else Decided(agreed.action, verdict, DEVICE, "", agreed.own)
        return self.hand_over(step, ours._replace(origin=agreed.origin(ours.origin)))

    # ---- handing over --------------------------------------------------------------------------

    def hand_over(self, step: int, decided: Decided) -> Action:
        """An action leaves for the training loop: its record, built once (what is leaking is named
        now, and a rebuild's "before" read), and a restart counted (`own`: the watchdog's, not one a
        loop proposed on its own account, such as a preemption)."""
        run = self.run
        action, verdict, memory, origin, own = decided
        if self.unlogged is not None:  # an earlier one whose outcome its loop never said
            self.log_outcome(HANDED_OVER)
        futile = None
        if action.needs_checkpoint and own and origin != FORCED:  # the end of one of the leak's cycles
            futile = self._futile(action, run.cycle_ended(step))
        if action is Action.CHECKPOINT_RESTART:
            run.restart_handed_over(step, self.policy.restart_window_steps if self.policy else 0, own)
        suspects = self._suspects(step) if action.needs_checkpoint else []
        self.last = ActionOutcome(step, action, verdict, suspects=suspects, memory=memory,
                                  origin=origin, futile=futile)
        if action is Action.CHECKPOINT_REINIT and self._read is not None:  # what the rebuild is measured against
            self.last.readings_before = self._read("rebuild_read")
        if self.account is not None and own and action.needs_checkpoint:  # the watchdog's, not a preemption
            self.account.action(action.value, step, projected_oom(step + 1, verdict))
        if not self.logs_outcomes:  # its block is logged at the next step, if the loop says nothing
            self._block_due()
        return action

    def _futile(self, action: Action, cycle: int | None) -> str | None:
        """Restarting will not save this job: a restart past the watchdog's restart budget (a rebuild
        did not free the leak, or the host's memory wants a new process, and restarts in a row are
        spent), or cycles that shrink, or one no longer than the reinit before it took (`core/cycles.py`).
        Decided on what every rank shares: the cycles' steps, the restarts. Never for a stand-in."""
        policy, run = self.policy, self.run
        if policy is None:
            return None
        if action is Action.CHECKPOINT_RESTART and run.budget_spent >= policy.max_restarts:
            return (f"its {policy.max_restarts} restarts in a row are spent and it needs another "
                    f"(cycles of {', '.join(f'{n:,}' for n in run.cycles) or 'unknown'} steps)")
        return futile(run.cycles, cycle, run.took_steps)

    # ---- carrying it out -----------------------------------------------------------------------

    def carry_out(self, action: Action | None, *, save: Callable[[], object] | None,
                  rebuild: Callable[[], None] | None, checkpoint: str | None, step: int,
                  saved: Callable[[float], None], rebuilt: Callable[[], None]) -> bool:
        """`Watchdog.carry_out`: `saved(seconds)` is told the save's time, `rebuilt()` runs after the
        rebuild (its reading); `step`, the newest, stamps the job file's spans."""
        if action is None or not action.needs_checkpoint:
            return True
        if save is not None:
            started = time.perf_counter()
            with self._timed("checkpoint_save", step):
                landed, checkpoint = save_result(save())
            if not landed:
                self.log_outcome(UNSAVED, exit_code=EXIT_UNSAVED)
                return False
            if self.last is not None:
                self.last.state = SAVED
            saved(time.perf_counter() - started)
        if self.last is not None and self.last.futile:  # a restart, or a rebuild, would be in vain
            self.log_outcome(STOPPED, checkpoint=checkpoint, exit_code=EXIT_FUTILE)
            return False
        if action is Action.CHECKPOINT_REINIT and rebuild is not None:
            with self._timed("reinit", step):
                rebuild()
                rebuilt()
            self.log_outcome(REINITIALISED, checkpoint=checkpoint)
            return True
        self.log_outcome(RESTART_REQUESTED, checkpoint=checkpoint, exit_code=EXIT_RESTART_REQUESTED)
        return False

    def _timed(self, cause: str, step: int):
        """A span of the job's time that is no training step (a save, a rebuild), for the job file."""
        return self.account.timed(cause, step) if self.account is not None else nullcontext()

    def measure_rebuild(self, readings: tuple, step: int, not_freed: list[str]) -> tuple[tuple | None, int | None]:
        """The newest action's rebuild, measured on its record from the readings after it (like with
        like: `read`'s pair before and after), and what the reinit took, decided to rebuilt; measured
        once (a second call is measured against the floor, as before). Returns the readings before
        it and the steps it took, for the judges."""
        decided = self.last
        if decided is None:
            return None, None
        decided.state, decided.not_freed = REBUILT, not_freed
        before, decided.readings_before = decided.readings_before, None
        after = _bytes_of(readings, decided.memory)
        if after is not None:
            decided.memory_after_bytes = after
            if before is not None and (then := _bytes_of(before, decided.memory)) is not None:
                decided.recovered_bytes = then - after
        took = None
        if decided.verdict is not None:
            took = self.run.took_steps = max(0, step - decided.verdict.step)
        return before, took

    def log_outcome(self, outcome: str, *, checkpoint: str | None = None, exit_code: int | None = None) -> None:
        """`Watchdog.log_outcome`: the newest action's block, once."""
        decided = self.unlogged
        if decided is None:
            return
        decided.logged = True
        decided.outcome, decided.checkpoint, decided.exit_code = outcome, checkpoint, exit_code
        if exit_code is not None:
            decided.state = EXITED
        if decided.suspects and self.flight is not None:  # every loop's outcome comes through here
            self.flight.observe_action(decided.step, decided.suspects)
        log_event(log, logging.WARNING, "action_outcome", block=decided.block(), **decided.fields())

    @property
    def unlogged(self) -> ActionOutcome | None:
        """The newest action handed over, while its block is not logged yet."""
        last = self.last
        return last if last is not None and not last.logged else None

    @property
    def waiting(self) -> Action | None:
        """The checkpoint action handed over that the loop has not carried out yet (its record still
        says handed over): what a loop that cannot stop where it is (Lightning's validation, Hugging
        Face's evaluation) carries out once it can. Held on the record, nowhere else."""
        last = self.last
        if last is None or last.logged or last.state != HANDED or not last.action.needs_checkpoint:
            return None
        return last.action

    def between_steps(self) -> None:
        """The block of an action whose loop never said what it did, logged at the next step."""
        if self.unlogged is not None and not self.logs_outcomes:
            self.log_outcome(HANDED_OVER)

    # ---- the run's state -----------------------------------------------------------------------

    def ends_at(self, last_step: int | None) -> bool:
        """The run ends at `last_step` (None or negative: not known, ignored); whether it was taken."""
        if last_step is None or last_step < 0:
            return False
        self.run.last_step = int(last_step)
        return True

    @staticmethod
    def saved_state(state: object, where: str) -> dict | None:
        """A `state_dict()` read back from a checkpoint, checked: a plain dict of the keys it keeps, or
        None (logged as `watchdog_state_unread` with `where`) when `load_state_dict` would refuse it.
        A bad saved state never stops training, whatever it is or does when read (a mapping whose
        `get` raises, a key whose `__eq__` does, a value whose `__repr__` does): the restart budget
        then counts every restart of the job instead."""
        if state is None:
            return None
        try:
            if not isinstance(state, dict):
                raise InputError(f"expected the dict state_dict() returns, got {type(state).__name__}")
            # dict's own lookup, never a subclass's: only what `load_state_dict` reads is kept
            kept = {name: value for name in RunState.KEPT if (value := dict.get(state, name, _ABSENT)) is not _ABSENT}
            RunState().load_state_dict(kept)  # its types and bounds
        except Exception as exc:  # noqa: BLE001 - whatever the saved object does, training goes on
            log.warning("watchdog_state_unread", path=where, error=_reason(exc),
                        note="the restart budget counts every restart of the job instead")
            return None
        return kept


def _bytes_of(readings: tuple, memory: str) -> float | None:
    """The reading of the memory that asked for an action, of a `read` pair (the device's, the host's)."""
    reading = readings[0] if memory == DEVICE else readings[1]
    return None if reading is None else float(reading.bytes_used)


def projected_oom(steps_done: int, verdict: Verdict | None) -> int | None:
    """The OOM an action was decided on `verdict` against, in the job file's steps (`steps_done` when
    it was handed over: `step(n)` means n + 1 done); None where none was projected. Every job file's
    writer counts it here (the action path's account, the trainer's ledger)."""
    if verdict is None or verdict.projected_oom_step is None or not math.isfinite(verdict.projected_oom_step):
        return None
    return steps_done + max(0, round(verdict.projected_oom_step - verdict.step))
