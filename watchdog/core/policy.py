"""Verdicts -> actions: the ladder the watchdog climbs before an OOM. Pure: no threads, no I/O.

The ladder, one verdict at a time:

- not `leaking`                          -> NONE (and the confirmation count starts over); a
    leak reported without an OOM projected (`leak_detected`) is a signal in the verdict and the
    metrics, never an action
- `leaking`, fewer than `confirm_verdicts` in a row -> NONE: one noisy verdict never acts
- confirmed, OOM far (the pessimistic projection leaves more than the action horizon)
                                         -> WARN, at most once per cooldown
- confirmed, OOM past the run's last step (`last_step`, where the host knows it) -> WARN as above:
    the run finishes first
- confirmed, OOM within the action horizon -> CHECKPOINT_REINIT (save, rebuild in process)
    ... or CHECKPOINT_RESTART (save, exit 42) when `prefer_restart` is set, or when the last
    reinit did not bring the floor back down (`reinit_finished`); once the restart budget
    (`max_restarts`) is spent, the restart is handed over as a stop (`ActionPath._futile`: save,
    exit 45): another reinit could not help. The policy counts no restarts: the run's one count is
    `core/restarts.RunState`, which spans processes and is kept in the host's checkpoints.
- after a checkpoint action, nothing more until its effect is measured (`reinit_finished`: the
  loop rebuilt, and one reading says what came back; a restart replaces the policy with the
  process). From then on the policy watches as it did before the first action: a projected OOM
  is acted on as the first one was, and the limit rule acts at once. A fixed quiet period after
  an action left the job unprotected: on an H100 the leak refilled after the reinit and reached a
  real OOM at step 797, four steps before a 500-step cooldown ended. `cooldown_steps` is only
  the bound for an action whose effect is never measured (a loop that takes the action and does
  not say it rebuilt, a replayed trace): then the policy acts again once it has passed. A reinit
  that gave nothing back is followed by a restart at the next confirmed verdict inside the
  horizon, or at the limit; past the restart budget, by a stop (exit 45), never another reinit.
- the restart budget counts the restarts the watchdog asked for (`WatchdogConfig.watchdog_restarts`,
  kept in the host's checkpoints through `Watchdog.state_dict()`), not the job's preemptions or
  crash restarts, and a restart `restart_window_steps` or more after the previous one starts the
  count over.
- a reinit also escalates when what it leaves behind rose since the previous reinit by
  `min_recovery` of what it freed: a second leak outside the state, which reinits only ratchet.

The limit rule (`limit_reached`, called by the `Judge` instead of `decide`): memory at or over the
limit, within the checkpoint margin of it, or whose next sample could be past it, gets the
checkpoint action at once, from the first sample: no confirmation, no horizon, no first-ramp
caution. Those are there to doubt a projection, and this is no projection: the OOM is here, and
every sample waited for is one the checkpoint may not get. Only an action still being carried out
holds it (its effect not measured yet, within `cooldown_steps`), so memory that stays over the
limit in a loop that never rebuilds gets one action per cooldown, never one per sample.

The action horizon is the latest safe moment, once a save has been measured (`core/action_time.py`):
the pessimistic projection, at the upper edge of its interval, leaves no more than `safety_factor`
times what the action needs: the save's time with its spread (as if the leak went on meanwhile),
or what the newest action took from its decision to the rebuilt state where that is longer; the
gap to the next reading (one more where the ranks agree on actions); the hand-over; and the steps
the leak takes to fill the room the action's own memory needs beyond the excursion the projection
already adds (a save's staging copy, the census that names the leak: measured before). Anything
earlier gains no safety against a projection that holds: it only gives growth that stops less time
to show it stops, and shortens every cycle of a leak that does not. What the projection may get wrong is the
interval's and the limit rule's to cover, not an early action's: acceleration widens the upper edge
(the detector's newest evidence), and a step of a staircase or a fast refill is the limit rule's
(its margin at the alarm's rate, and the pace's look-ahead to the next reading).

Until a save has been measured (a replay: `analyze`, `report`, `bench`; a loop before its first
save), the checkpoint margin the user configured stands in, with the room it has always had: the
horizon is the larger of `lead_factor` checkpoint margins and `horizon_fraction` of the steps
watched so far, so a growth that would need many more runs than this one to fill memory only warns.
(A pure margin there missed three of the bench's 45 leaks, whose recordings end 1,000 to 2,950 steps
before their OOM: docs/detection.md.)

A first steep ramp is treated with caution (until a save has been measured: the latest safe moment
never acts on a ramp earlier than it must). Until the first checkpoint action since the
detector's baseline began (the start of the process, or a reinit that brought memory back down),
a checkpoint also needs the pessimistic projection to reach no further ahead than
`first_ramp_reach` (half) of the steps the growth was seen over (`window_steps`, which may
include a flat stretch before the climb), unless it is imminent: within `lead_factor` checkpoint
margins, plus the longest gap seen between two verdicts (an OOM that could fall between two
samples is imminent too). A climb young for the time it projects to the OOM gets a WARN and no
checkpoint: without phase information it may be an evaluation that keeps its outputs until it
ends, or a cache filling, and those stop by themselves, while a leak keeps going until its
history is long enough for its future, or until it is imminent, and is acted on then. After one
checkpoint action the growth is known to be real and the usual horizon applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from watchdog.core.action_time import ActionTime, reach
from watchdog.core.errors import ConfigError
from watchdog.core.numbers import check_settings
from watchdog.core.verdict import Action, Status, Verdict


@dataclass(frozen=True)
class PolicyConfig:
    checkpoint_margin_steps: int = 50
    """Steps a checkpoint needs to be written: it must be asked for at least this long before OOM."""
    max_restarts: int = 3
    """Restarts the watchdog may ask for in a row (earlier processes included): a loop's guard."""
    restart_window_steps: int = 2000
    """A restart this many training steps or more after the watchdog's previous one starts the count
    over: restarts that far apart are progress, not a loop (0: every restart of the job counts).
    The `Watchdog` applies it when it hands over a restart (`restarts_in_a_row`), to the count every
    host keeps in its checkpoint (`Watchdog.state_dict()`)."""
    prefer_restart: bool = False
    """Restart instead of reinit from the first action (e.g. leaks outside Python's reach)."""
    confirm_verdicts: int = 3
    """Consecutive `leaking` verdicts needed before any action."""
    cooldown_steps: int = 500
    """After a checkpoint action whose effect is never measured (the loop took it and did not say it
    rebuilt: no `Watchdog.reinit_finished`, or a replayed trace), act again only this many steps on.
    An action whose rebuild is measured ends its quiet period then, whatever this says."""
    safety_factor: float = 2.0
    """Once a save has been measured: act when the pessimistic steps to OOM fall to this many times
    what the action needs (`core/action_time.py`: the save with its spread, the gap to the next reading,
    the hand-over, the action's own memory). Twice: over the accelerating leaks, stairs and fast refills
    of tests/test_latest_moment.py (144 runs, three seeds), once let 6 cross the limit by up to 0.1%,
    one and a half 2, twice none (the highest at 0.9997 of it)."""
    lead_factor: float = 4.0
    """Until a save has been measured: act when the pessimistic steps to OOM fall to this many
    checkpoint margins ..."""
    horizon_fraction: float = 0.25
    """... or to this fraction of the steps watched so far, whichever is larger."""
    min_recovery: float = 0.5
    """A reinit worked if the floor came down by at least this share of the growth seen before it."""
    first_ramp_reach: float = 0.5
    """Before the first checkpoint action, a climb is acted on only once its pessimistic projection
    reaches no further ahead than this share of the steps it was seen over (or is imminent)."""
    last_step: int | None = None
    """The step the run ends at, where the host knows it (the trainer does): an OOM projected past
    it, even pessimistically, is a warning, not a checkpoint action, since the run finishes first
    (`bench --endurance` restarted 133 steps before the end against an OOM 2,777 steps past it)."""

    def __post_init__(self) -> None:
        check_settings(self, "policy")
        for name in ("checkpoint_margin_steps", "max_restarts", "cooldown_steps", "restart_window_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"policy.{name}", f"must be a non-negative integer, got {value!r}")
        if not isinstance(self.confirm_verdicts, int) or self.confirm_verdicts < 1:
            raise ConfigError("policy.confirm_verdicts", f"must be at least 1, got {self.confirm_verdicts!r}")
        for name in ("safety_factor", "lead_factor", "horizon_fraction", "first_ramp_reach"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0 or not math.isfinite(value):
                raise ConfigError(f"policy.{name}", f"must be a non-negative number, got {value!r}")
        if self.last_step is not None and (not isinstance(self.last_step, int) or isinstance(self.last_step, bool)
                                           or self.last_step < 0):
            raise ConfigError("policy.last_step", f"must be a non-negative integer or None, got {self.last_step!r}")
        if not 0 <= self.min_recovery <= 1:
            raise ConfigError("policy.min_recovery", f"must be between 0 and 1, got {self.min_recovery!r}")


@dataclass(slots=True)
class InFlight:
    """The checkpoint action a series' policy asked for whose effect is not measured yet: the one
    holder, on the sidecar's side, of "an action is in flight". The policy opens it when it asks
    (`ActionPolicy._checkpoint`) and closes it when the rebuild is measured (`reinit_finished`); a
    restart replaces the policy, and it, with the process. The `Judge` asks it whether one flies and
    keeps on it what it measures meanwhile (the training side's record of the same action is its
    `ActionOutcome`, whose `state` the sidecar sets to measured as this one closes)."""

    step: int  # the step of the verdict it was decided on
    growth: float  # what the leak grew over that verdict's window: what a rebuild should give back
    floor: float | None = None  # the floor it was decided at
    level: float | None = None  # the floor it came at (in the detector's warm-up, the reading)
    peak: float | None = None  # the highest reading since, from its level on, until its rebuild


class ActionPolicy:
    """Turns the detector's verdicts into at most one action per cooldown; see the module docstring."""

    def __init__(self, config: PolicyConfig | None = None, action_time: ActionTime | None = None):
        self.config = config or PolicyConfig()
        self.action_time = action_time or ActionTime()  # what the actions and saves measured (the Judge's)
        self.agreement_gaps = 0  # 1 where the ranks agree on actions: the answer comes a sampling period later
        self.last_step = self.config.last_step  # where the run ends, where known (the host may say later)
        self._first_step: int | None = None
        self._confirmed = 0
        # The checkpoint action this policy asked for whose effect is not measured yet: the one mark of
        # an action in flight for this series (the Judge asks it too). No other before its cooldown ends.
        self.in_flight: InFlight | None = None
        self._warned_until = -math.inf  # no repeated warning before this step
        self._escalate = False  # the last reinit did not bring memory down
        self._after_last_reinit: float | None = None  # memory right after this process's previous reinit
        self._cautious = True  # no checkpoint action yet since the detector's baseline began
        self._previous_step: int | None = None
        self._largest_gap = 0  # steps between two verdicts, at most
        self.excursion_seen = 0.0  # after a rebuild: what the transients spanned before it (the Judge's)

    @property
    def _quiet_until(self) -> float:
        """No checkpoint action before this step: the cooldown of the one in flight."""
        return -math.inf if self.in_flight is None else self.in_flight.step + self.config.cooldown_steps

    @property
    def carrying_out(self) -> int | None:
        """The step of the checkpoint action whose effect is not measured yet, while it holds the next."""
        if self.in_flight is None or (self._previous_step or 0) >= self._quiet_until:
            return None
        return self.in_flight.step

    def rearm(self) -> None:
        """The detector started a new baseline (a reinit brought memory down): the next climb is a
        first ramp again."""
        self._cautious = True

    def latest_safe_steps(self, verdict: Verdict) -> float | None:
        """The horizon once a save has been measured: `safety_factor` times what the action needs
        before the OOM `verdict` projects (see the module docstring); None before (or with no clock
        to count a save's seconds in steps)."""
        times = self.action_time
        if not times.saves:
            return None
        seconds_per_step = _seconds_per_step(verdict)
        steps = times.steps(seconds_per_step) if seconds_per_step > 0 else None
        if steps is None:
            return None
        high = verdict.slope_high_bytes_per_step
        staging = max(0.0, times.own_bytes - verdict.excursion_bytes) / high if high > 0 else 0.0
        # The projection's peak is the floor plus the tallest transient its buckets saw, and after a
        # rebuild the new baseline's buckets have seen few (with a reading a bucket, `sample_every` 8
        # or more, none): what the readings spanned before the rebuild (the Judge's) is room too, in
        # the steps the leak takes to grow it (a sawtooth ten times a sample's rise crossed the limit by
        # 1.5% on its second cycle without it: `python -m watchdog.bench.how_early --sawtooth-mib 100`).
        unseen = max(0.0, self.excursion_seen - verdict.excursion_bytes) / high if high > 0 else 0.0
        return self.config.safety_factor * (reach(steps, self._largest_gap, self.agreement_gaps) + staging) + unseen

    def horizon(self, verdict: Verdict) -> float:
        """How close the pessimistic OOM must be for a checkpoint action on `verdict`: the latest safe
        moment once a save has been measured, else the checkpoint margin's horizon."""
        latest = self.latest_safe_steps(verdict)
        return latest if latest is not None else self.action_horizon_steps(verdict.step, verdict.window_steps)

    def action_horizon_steps(self, step: int, seen_over: float = math.inf) -> float:
        """The horizon until a save has been measured: how close the pessimistic OOM must be for a
        checkpoint action at `step`, for growth seen over `seen_over` steps (see the module
        docstring: the first ramp is held to it)."""
        imminent = self.config.lead_factor * self.config.checkpoint_margin_steps + self._largest_gap
        watched = 0 if self._first_step is None else step - self._first_step
        horizon = max(imminent, self.config.horizon_fraction * watched)
        if self._cautious:
            return min(horizon, max(imminent, self.config.first_ramp_reach * seen_over))
        return horizon

    def decide(self, verdict: Verdict) -> Action:
        step = verdict.step
        if verdict.status is not Status.OOM_PROJECTED:
            self.observe(step)
            return Action.NONE
        self._clock(step)
        self._confirmed += 1
        if self._confirmed < self.config.confirm_verdicts or verdict.step < self._quiet_until:
            return Action.NONE
        if verdict.projected_oom_steps_pessimistic > self.horizon(verdict) or self._run_ends_first(verdict):
            if verdict.step < self._warned_until:
                return Action.NONE
            self._warned_until = verdict.step + self.config.cooldown_steps
            return Action.WARN
        return self._checkpoint(verdict)

    def _run_ends_first(self, verdict: Verdict) -> bool:
        last = self.last_step
        return last is not None and verdict.step + verdict.projected_oom_steps_pessimistic > last

    def limit_reached(self, verdict: Verdict) -> Action:
        """`decide` for a verdict of the limit rule (memory at or over the limit, or within the
        checkpoint margin of it): a checkpoint action unless one was taken within the cooldown."""
        self._clock(verdict.step)
        if verdict.step < self._quiet_until:
            return Action.NONE
        return self._checkpoint(verdict)

    def _checkpoint(self, verdict: Verdict) -> Action:
        """The checkpoint action for `verdict`, then the cooldown."""
        action = self._checkpoint_action()
        self._cautious = False
        self.in_flight = InFlight(verdict.step, max(0.0, verdict.slope_bytes_per_step * verdict.window_steps))
        self._warned_until = self._quiet_until
        self._confirmed = 0
        return action

    def observe(self, step: int) -> None:
        """`decide` on a verdict that is not `oom_projected` at `step`, without the verdict (always NONE):
        a replay builds verdicts only while an OOM is projected."""
        self._clock(step)
        self._confirmed = 0

    def _clock(self, step: int) -> None:
        """Steps watched so far and the longest gap between two verdicts (the horizons use both)."""
        if self._first_step is None:
            self._first_step = step
        elif step - self._previous_step > self._largest_gap:
            self._largest_gap = step - self._previous_step
        self._previous_step = step

    def _checkpoint_action(self) -> Action:
        """A restart where one is wanted; past the budget as well: another reinit could not help, and
        the hand-over stops the job instead (`ActionPath._futile`, exit 45, on `RunState`'s count)."""
        if self.config.prefer_restart or self._escalate:
            return Action.CHECKPOINT_RESTART
        return Action.CHECKPOINT_REINIT

    def reinit_finished(self, floor_before_bytes: float, floor_after_bytes: float) -> bool:
        """Told by the training side after a checkpoint-and-reinit, with floors measured around it.

        Returns whether the reinit recovered the memory (True for a reinit this policy did not ask
        for: another rank's, agreed across ranks, or a drill; the detector then starts a new
        baseline on the rebuilt state, and nothing is escalated). If the floor did not come down by
        `min_recovery` of the growth seen before the action (or at all, when no growth was
        measured), the leak lives outside what a reinit rebuilds: the next checkpoint action is a
        restart.
        """
        asked, self.in_flight = self.in_flight, None
        if asked is None:  # another rank's action (or a drill): it says nothing about a leak here
            self._after_last_reinit = floor_after_bytes
            self._watch_again()
            return True
        recovered = floor_before_bytes - floor_after_bytes
        needed = self.config.min_recovery * asked.growth
        # What a reinit leaves is what it cannot free. If that rose since the previous reinit by
        # `min_recovery` of what this one freed, a second leak lives outside the rebuilt state and
        # each reinit buys a shorter stretch (the endurance bench: nine reinits, the memory after
        # each rising from 740.7 to 766.8 MiB toward an 803.4 MiB budget): restart.
        previous, self._after_last_reinit = self._after_last_reinit, floor_after_bytes
        ratchet = previous is not None and recovered > 0 and \
            floor_after_bytes - previous >= self.config.min_recovery * recovered
        self._escalate = recovered <= 0 or recovered < needed or ratchet
        if self._escalate:
            self.escalate()
        # The effect is measured: watch as before the first action. A reinit that worked leaves a leak
        # still in the code to grow back into the next OOM, and one that did not leaves it growing into
        # this one: either is acted on as soon as it is seen again, by a restart where it did not work
        # (past the restart budget, a stop: ActionPath._futile), never by another reinit that cannot help.
        self._watch_again()
        return not self._escalate

    def escalate(self) -> None:
        """The next checkpoint action is a restart: the reinit did not free the leak (what came back,
        or the loop's census), or the reinits' cycles shrink (`Judge`), each leaving more behind, which
        a new process frees. The leak it survived is confirmation enough: the next verdict that
        projects an OOM inside the horizon acts."""
        self._escalate = True
        self._confirmed = max(self._confirmed, self.config.confirm_verdicts - 1)

    def _watch_again(self) -> None:
        """An action's effect is measured: nothing holds the next one back (its mark is off)."""
        self._warned_until = -math.inf


def _seconds_per_step(verdict: Verdict) -> float:
    """The pace the verdict measured, from its rate in each unit (0 when it has none)."""
    per_step, per_second = verdict.slope_bytes_per_step, verdict.slope_bytes_per_second
    return per_step / per_second if per_step > 0 and per_second > 0 else 0.0
