"""An action's life after it is decided, written once for every host.

decided (the sidecar, a drill, the loop's own proposal) -> agreed (several ranks) -> handed over by
`step()` -> carried out by the loop's `save` and `rebuild` (`carry_out`) or by exit 42 -> its
effect measured (a reinit: one reading after the rebuild) -> the watch resumes.

`ActionPath` holds the part every watcher shares: the record of the action handed over (built once,
`ActionOutcome`), carrying it out, its block on the terminal, and the run's state that spans
processes (`RunState`: restarts so far, the watchdog's own in a row, where the run ends). The
`Watchdog` and the unwatched run's stand-in (`runtime/unwatched.py`) are both one.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import nullcontext
from typing import Callable

from watchdog.core.errors import EXIT_FUTILE, EXIT_RESTART_REQUESTED, EXIT_UNSAVED, InputError
from watchdog.core.restarts import RunState
from watchdog.core.verdict import Action, Verdict
from watchdog.logs import get_logger, log_event
from watchdog.station.blocks import ActionOutcome

log = get_logger(__name__)

DEVICE = "device"  # which memory asked for an action: the device's, or the host's
HANDED_OVER = "handed to the training loop"  # the outcome of an action whose loop never said what it did
REINITIALISED, RESTART_REQUESTED = "reinitialised in process", "exit 42: restart requested"
STOPPED = "exit 45: restarting will not save this job, stopped"
UNSAVED = "the checkpoint failed: exit 44 to restart from the newest one"
FORCED = "forced (a drill)"


_ABSENT = object()


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


class HandedOver:
    """The actions step() handed over: the newest, the one whose block is not logged yet, and
    whether the loop always logs their outcomes itself; with several ranks, the action held for
    the next offer and the one offered, whose answer comes at the next sampling step."""

    __slots__ = ("last", "unlogged", "logs_outcomes", "held", "offered")

    def __init__(self, logs_outcomes: bool):
        self.last: ActionOutcome | None = None
        self.unlogged: ActionOutcome | None = None
        self.logs_outcomes = logs_outcomes
        self.held: tuple | None = None
        self.offered: tuple | None = None


class ActionPath:
    """What a watcher does with an action once `step()` has handed it over (see the module docstring).
    A subclass sets `_handed`, `_run_state` and `restart_window_steps`, and may extend the hooks
    `_suspects`, `_apply_run_state` and `_measure`."""

    _handed: HandedOver
    _run_state: RunState
    restart_window_steps: int = 0
    watches = True  # memory is read and judged (not so for an unwatched run's stand-in)

    # ---- the run's state ---------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a loop keeps in its checkpoint so the job's restarts, the watchdog's restart budget and
        its window, and what each restart bought, span processes. Read it when saving: a restart
        handed over counts at once.

        Returns:
            A small dict of plain ints and lists (JSON-safe), to keep as one entry of the checkpoint
            (`{"watchdog": wd.state_dict()}`) and give back with `load_state_dict`.
        """
        return self._run_state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """A resumed process: what `state_dict()` returned in the process that saved the checkpoint.
        Before `start()`.

        Args:
            state: that dict (older checkpoints' subsets load too).
        Raises:
            ConfigError: a value of the wrong kind (`saved_state` checks one without raising).
        """
        self._run_state.load_state_dict(state)
        self._apply_run_state()

    def ends_at(self, last_step: int | None) -> None:
        """The run ends at `last_step` (the trainer's steps, Lightning's and Hugging Face's `max_steps`),
        unless the policy's settings name an end: an OOM projected past it is a warning."""
        if last_step is not None and last_step >= 0:
            self._run_state.last_step = int(last_step)
            self._apply_run_state()

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

    @property
    def last_action(self) -> ActionOutcome | None:
        """The action step() handed over last: its record, with the verdict behind it, the suspects and,
        once carried out, its outcome and the exit status the process ends with (None: it goes on)."""
        return self._handed.last

    # ---- carrying an action out --------------------------------------------------------------

    def carry_out(self, action: Action | None, *, save: Callable[[], object] | None = None,
                  rebuild: Callable[[], None] | None = None, checkpoint: str | None = None) -> bool:
        """Carry out a checkpoint action with the loop's own `save()` (which may return the
        checkpoint's path, or False when it could not save: `save_result` reads what it returns)
        and `rebuild()` (drop the training state and load it back)::

            action = wd.step(step)
            if action is not None and not wd.carry_out(action, save=save, rebuild=rebuild):
                sys.exit(wd.last_action.exit_code)   # 42: a restart (44: the save failed; 45: in vain)

        Times the save, measures what a rebuild gave back and logs the action's block.

        Args:
            action: what `step()` returned (None and WARN are nothing to do).
            save: writes the checkpoint; returns its path, None/True (saved, no path named), or
                False (it could not save: exit 44). Where restarting would be in vain, the checkpoint
                is still saved, then exit 45.
            rebuild: drops the training state and loads it back; without one a reinit is carried
                out as a restart (exit 42).
            checkpoint: where a framework that saves by itself after the step (Hugging Face's
                Trainer) saves, when it passes no `save`.
        Returns:
            True when training goes on in this process (no action, a WARN, a reinit), False when the
            process should exit with `last_action.exit_code` (42, 44 or 45).
        """
        if action is None or not action.needs_checkpoint:
            return True
        if save is not None:
            started = time.perf_counter()
            with self._timed("checkpoint_save"):
                landed, checkpoint = save_result(save())
            if not landed:
                self.log_outcome(UNSAVED, exit_code=EXIT_UNSAVED)
                return False
            self.observe_checkpoint(time.perf_counter() - started)
        if self.last_action is not None and self.last_action.futile:  # a restart, or a rebuild, would be in vain
            self.log_outcome(STOPPED, checkpoint=checkpoint, exit_code=EXIT_FUTILE)
            return False
        if action is Action.CHECKPOINT_REINIT and rebuild is not None:
            with self._timed("reinit"):
                rebuild()
                self.reinit_finished()
            self.log_outcome(REINITIALISED, checkpoint=checkpoint)
            return True
        self.log_outcome(RESTART_REQUESTED, checkpoint=checkpoint, exit_code=EXIT_RESTART_REQUESTED)
        return False

    def log_outcome(self, outcome: str, *, checkpoint: str | None = None, exit_code: int | None = None) -> None:
        """Log the outcome of the action step() handed over last, its block (`action_outcome`): what
        was seen, what is leaking, what the loop did (`outcome`, `checkpoint`) and, after a reinit,
        what it gave back. `carry_out` calls it; a loop that carries an action out its own way calls
        it once done. Once per action: nothing is logged with no action handed over."""
        handed = self._handed
        decided, handed.unlogged = handed.unlogged, None
        if decided is None:
            return
        decided.outcome, decided.checkpoint, decided.exit_code = outcome, checkpoint, exit_code
        self._measure(decided)
        log_event(log, logging.WARNING, "action_outcome", block=decided.block(), **decided.fields())

    def observe_checkpoint(self, seconds: float) -> None:
        """A save the loop made, timed."""

    def reinit_finished(self) -> None:
        """After checkpoint-and-reinit, between steps."""

    # ---- handing over ------------------------------------------------------------------------

    def _hand_over(self, step: int, action: Action, verdict: Verdict | None, memory: str, origin: str = "",
                   counts: bool = True) -> Action:
        """An action leaves for the training loop: its record, built once (what is leaking is named
        now), and a restart counted (`counts`: the watchdog's, not one a loop proposed on its own
        account, such as a preemption)."""
        handed = self._handed
        if handed.unlogged is not None:  # an earlier one whose outcome its loop never said
            self.log_outcome(HANDED_OVER)
        futile = None
        if action.needs_checkpoint and counts and origin != FORCED:  # the end of one of the leak's cycles
            futile = self._futile(action, self._run_state.cycle_ended(step))
        if action is Action.CHECKPOINT_RESTART:
            self._run_state.restart_handed_over(step, self.restart_window_steps, counts)
        suspects = self._suspects(step) if action.needs_checkpoint else []
        handed.last = handed.unlogged = ActionOutcome(step, action, verdict, suspects=suspects, memory=memory,
                                                      origin=origin, futile=futile)
        return action

    def _futile(self, action: Action, cycle: int | None) -> str | None:
        """Why restarting will not save this job, as of this action (which ends one of its cycles),
        or None. Decided on what every rank shares (the cycles' steps, the restart budget), so every
        rank stops alike."""
        return None

    def _suspects(self, step: int) -> list[str]:
        return []

    def _timed(self, cause: str):
        """Time what runs inside as a span of the job file (`checkpoint_save`, `reinit`), where one is kept."""
        return nullcontext()

    def _apply_run_state(self) -> None:
        """The run's state changed (resumed, or its end known): tell whoever judges."""

    def _measure(self, decided: ActionOutcome) -> None:
        """Add what was measured of the action's effect to its record, before its block is logged."""
