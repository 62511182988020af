"""How many times the job has been restarted, as its restart engine tells each new process.

`hbm-watchdog supervise` sets `HBMWATCH_RESTART_COUNT` (JobSet's manifests set the same variable
from the pod's restart-attempt annotation through the downward API); torchrun sets
`TORCHELASTIC_RESTART_COUNT`. The first one set wins; neither: 0, a first start.
"""

from __future__ import annotations

from watchdog.core.errors import ConfigError, InputError
from watchdog.core.numbers import MAX_STEP, parse_count

RESTART_COUNT_ENV = "HBMWATCH_RESTART_COUNT"
TORCHRUN_RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


def restarts_so_far(environ) -> int:
    """The job's restarts so far; a value that is no count is one line naming the variable (InputError)."""
    for name in (RESTART_COUNT_ENV, TORCHRUN_RESTART_COUNT_ENV):
        text = environ.get(name, "").strip()
        if text:
            try:
                return parse_count(text)
            except InputError as exc:
                raise InputError(f"{name}: {exc}") from None
    return 0


def restarts_in_a_row(count: int, previous_step: int | None, step: int, window: int) -> int:
    """The watchdog's restarts in a row once it restarts at `step`: one more, or one again when its
    previous restart was `window` steps or more before (progress, not a loop; 0: never again)."""
    if window and previous_step is not None and step - previous_step >= window:
        return 1
    return count + 1


class RunState:
    """The watchdog's state that spans a run's processes, kept in a checkpoint (`state_dict`) and given
    back on resume (`load_state_dict`): every restart of the job so far, and of those the restarts
    the watchdog itself asked for, in a row, with the newest one's step (what the restart budget
    counts; a preemption is not the watchdog's to spend), and where the run ends. Pure: no I/O past
    the environment's count."""

    __slots__ = ("restarts_so_far", "watchdog_restarts", "watchdog_restart_step", "last_step", "cycles", "cycle_from",
                 "took_steps")
    COUNTS = ("restarts_so_far", "watchdog_restarts", "watchdog_restart_step")
    KEPT = (*COUNTS, "cycles")  # what a checkpoint keeps
    CYCLES_KEPT = 8  # the newest cycles' lengths a checkpoint keeps

    def __init__(self, restarts: int = 0):
        self.restarts_so_far = restarts
        self.last_step: int | None = None  # where the run ends, where the host knows it (each process does)
        self.watchdog_restarts: int | None = None  # None: not known (every restart then counts)
        self.watchdog_restart_step: int | None = None
        self.cycles: list[int] = []  # what each restart bought: each process's first cycle, in steps (core/cycles.py)
        self.cycle_from: int | None = None  # where this cycle began: a rebuild's step, or this process's first
        self.took_steps: int | None = None  # what this process's newest reinit took, decided to rebuilt

    @classmethod
    def from_environment(cls, environ) -> "RunState":
        return cls(restarts_so_far(environ))

    @property
    def budget_spent(self) -> int:
        """The restarts the policy's budget counts: the watchdog's own, where they are known."""
        return self.restarts_so_far if self.watchdog_restarts is None else self.watchdog_restarts

    def restart_handed_over(self, step: int, window: int, own: bool) -> None:
        """A restart leaves for the loop at `step`: the job's count grows, and so does the watchdog's
        (starting over `window` steps after its previous one) when it is the watchdog's own (`own`)."""
        if own:
            self.watchdog_restarts = restarts_in_a_row(self.budget_spent, self.watchdog_restart_step, step, window)
            self.watchdog_restart_step = step
        elif self.watchdog_restarts is None:  # from now on the job's count is no longer the watchdog's
            self.watchdog_restarts = self.restarts_so_far
        self.restarts_so_far += 1

    def cycle_ended(self, step: int) -> int | None:
        """A leak's cycle ended with a checkpoint action at `step`: its length, from where it began
        (`cycle_from`: the previous action's step, or this process's first reading). A process's first
        cycle is what a restart bought: kept in `cycles`, across processes."""
        length = step - self.cycle_from if self.cycle_from is not None and step >= self.cycle_from else None
        if length is not None and self.took_steps is None:  # no rebuild yet in this process: its first cycle
            self.cycles = [*self.cycles[1 - self.CYCLES_KEPT:], length]
        self.cycle_from = step  # the next cycle begins with its rebuild (a new process: at its first reading)
        return length

    def state_dict(self) -> dict:
        return {"restarts_so_far": self.restarts_so_far, "watchdog_restarts": self.budget_spent,
                "watchdog_restart_step": self.watchdog_restart_step, "cycles": list(self.cycles)}

    def load_state_dict(self, state: object) -> None:
        """Take back a `state_dict()` (older checkpoints hold only some of its keys). The job's count
        is the larger of the saved one and the restart engine's; a bad value raises ConfigError."""
        if not isinstance(state, dict):
            raise ConfigError("state", f"expected the dict state_dict() returns, got {type(state).__name__}")
        checked = {name: _count(name, state.get(name)) for name in self.COUNTS}
        cycles = state.get("cycles")
        if cycles is not None and (not isinstance(cycles, list) or len(cycles) > self.CYCLES_KEPT):
            raise ConfigError("cycles", f"must be a list of at most {self.CYCLES_KEPT} step counts, got {cycles!r:.60}")
        if checked["restarts_so_far"] is not None:
            self.restarts_so_far = max(self.restarts_so_far, checked["restarts_so_far"])
        self.watchdog_restarts = checked["watchdog_restarts"]
        self.watchdog_restart_step = checked["watchdog_restart_step"]
        self.cycles = [_count("cycles", length) for length in cycles or ()]


def _count(name: str, value: object) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < MAX_STEP):
        raise ConfigError(name, f"must be a non-negative integer below {MAX_STEP:,}, got {value!r}")
    return value
