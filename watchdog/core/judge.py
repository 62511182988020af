"""The one pipeline: a sample in, a verdict and an action out.

    Sample -> limit rule -> LeakDetector -> Verdict -> ActionPolicy -> Action
                                  ^                          |
                                  +---- reinit / restart feedback (what an action gave back)

Every caller drives this object and nothing else: the sidecar thread (one sample every N steps),
`analyze`, `report` and `bench` (a recorded trace, sample by sample), the Lightning callback
(through the sidecar). None of them wires a detector to a policy, so "analyze says exactly what
the live watchdog would have said" holds by construction. Pure: no threads, no I/O, no torch.

Each sample carries the loop's phase (`watchdog.core.phase`). Training samples (or samples with
no phase) feed the detector's floor; a sample from a bounded phase (an evaluation) is a transient
to the detector, and the judge watches the phase's own growth for an OOM before the phase ends.

The limit rule has two parts. Which limit: the smaller of the device's and the configured budget
(`effective_limit`). And what memory at it means: a reading at or over that limit (less the
detector's `headroom_bytes`, the line every projection aims at), or within the checkpoint margin
of it, is acted on from the first sample, whatever the detector says, warm-up included: memory
over the budget is the one case that needs no trend. "Within the checkpoint margin" in bytes is
what the floor could add in `checkpoint_margin_steps` at the pessimistic rate of the detector's
OOM projection while one is up (`LeakDetector.rising_bytes_per_step`): a reading that close to the line may
not leave a checkpoint asked for now the time to finish. Once a save has been measured (`saved`),
the margin is the latest safe moment's instead (`core/action_time.py`: what the action takes and
holds, twice over), the same figure the policy's horizon and the lesson look ahead by. Any other rate is zero (warm-up, no
growth, and growth the detector still doubts: a compile cache or a first ramp measured over a
margin of hundreds of steps would put a healthy job at 60% of its limit "within reach" of it, six
false actions on the bench), so then only a reading at the line acts, or one whose next sample
could already be past it: with a new high among the newest readings, the highest of them carried
forward at their pace (`core/pace.py`: floor and peak climbing through every quarter of twelve
readings) over two sample gaps and the action's hand-over. That part needs twelve readings, no
trend: it is what acts on a leak too fast for the detector's warm-up, and on the same leak again
after every reinit, before the limit. The verdict says so (`oom_projected`, the OOM due in the
steps to the line, the rate seen), and the policy answers with `limit_reached`: a checkpoint action
at once, unless one is still being carried out (`watchdog.core.policy`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from watchdog.core.action_time import ActionTime, reach
from watchdog.core.cycles import Cycle, Lesson, shrinking
from watchdog.core.detector import DetectorConfig, LeakDetector
from watchdog.core.pace import Pace
from watchdog.core.phase import (CLIMB_RUNS, SAVE, NewestPhases, NextRun, PeakClimb, PhaseEpisode, PhaseForecast,
                                 parse_label)
from watchdog.core.policy import ActionPolicy, PolicyConfig
from watchdog.core.sample import Sample
from watchdog.core.units import format_bytes, format_limit
from watchdog.core.verdict import Action, Status, Verdict

_NO_LIMIT_SEEN = -1  # sentinel: no sample's bytes_limit has been seen yet (None is a real value)
_NO_LINE = math.inf  # no limit known: the limit rule never acts
_NO_ACTION = Action.NONE
_OOM_PROJECTED = Status.OOM_PROJECTED
FALLEN_SIGMAS = 4.0  # a reading this many floor noises under the projected floor: the projection no longer holds


def effective_limit(device_limit_bytes: int | None, budget_bytes: int | None) -> int | None:
    """The limit projections aim at: the smaller of the device's own limit and the configured budget.

    Either may be unknown (None, or 0 from a runtime that reports no limit); with neither known
    there is no limit and no OOM can be projected. The one copy of this rule in the code base.
    """
    if device_limit_bytes and budget_bytes:
        return min(device_limit_bytes, budget_bytes)
    return device_limit_bytes or budget_bytes or None


class Recovery(NamedTuple):
    """What a checkpoint-and-reinit (or a restart) gave back, measured once the new state has settled."""

    floor_before_bytes: float  # the fitted floor before the action
    bytes_after: float  # one reading after the rebuild (no activations live), or of the restarted process
    recovered: bool  # the policy's call: enough came back, else the next action is a restart

    @property
    def recovered_bytes(self) -> float:
        return self.floor_before_bytes - self.bytes_after


class Judge:
    """Turns samples into (verdict, action) pairs; owns the detector, the policy and the limit rule.

    `judge(sample)` returns a plain `(verdict, action)` tuple: it runs once per sample in a replay.
    """

    def __init__(self, detector_config: DetectorConfig | None = None, policy_config: PolicyConfig | None = None,
                 *, memory_limit_bytes: int | None = None):
        self.memory_limit_bytes = memory_limit_bytes
        self.detector = LeakDetector(detector_config, effective_limit(None, memory_limit_bytes))
        self.action_time = ActionTime()  # what the actions and saves measured: the latest safe moment's figures
        self._use_policy(ActionPolicy(policy_config, action_time=self.action_time))
        self._latest: Verdict | None = None
        self._unjudged: Sample | None = None  # the newest sample, when judge_quietly built no verdict for it
        self._device_limit: int | None = _NO_LIMIT_SEEN
        self._floor_before_restart: float | None = None
        self._update = self.detector.update  # bound once: judge() runs once per sample
        self._route = self._update
        self._previous_step = -math.inf
        self._label = ""  # the phase label of the last sample
        self._episode: PhaseEpisode | None = None  # the bounded phase running now, if any
        self._phase_steps = NewestPhases()  # how long each bounded phase ran last time (the newest names')
        self._climbs = NewestPhases()  # each bounded phase's newest runs' peaks (the newest names')
        self.climbing_phases: frozenset[str] = frozenset()  # bounded phases whose newest runs peak higher each time
        self._next_run: tuple[str, NextRun] | None = None  # a phase whose next run would peak past the line
        self._margin_steps = self.policy.config.checkpoint_margin_steps
        self._line = _NO_LINE  # the limit rule's line: the effective limit less the headroom
        self._pace = Pace()  # the newest readings: the limit rule's reach before any trend
        self._cycle: Cycle | None = None  # where this cycle started: the first reading of a fresh state
        self._taught = 0.0  # the leak's rate as the newest action's cycle measured it (bytes per step)
        self._cycles: list[float] = []  # this process's cycles' lengths, in steps, to their actions
        self._lesson: Lesson | None = None  # that rate, carried into the cycle after a rebuild (core/cycles.py)
        self._gap = 0.0  # steps between the newest two readings
        self._spread = 0.0  # what the transients spanned in this process, seen so far (`Pace.spread`)
        self._before_rebuild: float | None = None  # a reading when the newest reinit was handed over
        self._set_limit(effective_limit(None, memory_limit_bytes))

    def agree_with_ranks(self) -> None:
        """Actions are agreed across ranks, and reach the loop one sampling period later: the limit
        rule and the policy's horizon look that much further ahead."""
        self._pace.agreement_gaps = self.policy.agreement_gaps = 1

    def saved(self, seconds: float) -> None:
        """Told of every save the loop timed (`Watchdog.observe_checkpoint`): what an action takes, from
        now on the policy's horizon and the limit rule's margin (`core/action_time.py`)."""
        self.action_time.saved(seconds)

    def staged(self, rise_bytes: float) -> None:
        """Told what an action's work held beside memory, measured around it (the census that names a
        leak, taken for the baseline): room the next action needs (`core/action_time.py`)."""
        self.action_time.staged(rise_bytes)

    @property
    def limit_bytes(self) -> int | None:
        """The effective limit as of the newest sample."""
        return self.detector.limit_bytes

    @property
    def newest_rise_bytes_per_second(self) -> float:
        """How fast the newest readings (up to the pace's twelve) rose, per second: what was seen, for
        words, never a reason to act (0 without a rise or a clock)."""
        rise, per_step = self._pace.rise(), self._pace.seconds_per_step
        return rise / per_step if per_step > 0 else 0.0

    def ends_at(self, last_step: int | None) -> None:
        """The run ends at `last_step` (the host knows it: the trainer's steps, Lightning's and Hugging
        Face's `max_steps`), unless the policy's settings already name an end: an OOM projected past it
        is a warning, since the run finishes first."""
        if last_step is not None and last_step >= 0 and self.policy.config.last_step is None:
            self.policy.last_step = int(last_step)

    def _fresh_policy(self) -> ActionPolicy:
        """A policy starting over, keeping the run's end (the restarts are `RunState`'s)."""
        policy = ActionPolicy(self.policy.config, action_time=self.action_time)
        policy.last_step, policy.agreement_gaps = self.policy.last_step, self.policy.agreement_gaps
        return policy

    @property
    def latest(self) -> Verdict | None:
        """The verdict on the newest sample (built now if `judge_quietly` skipped it)."""
        if self._unjudged is not None:
            self._latest, self._unjudged = self.detector.verdict(self._unjudged), None
        return self._latest

    def judge(self, sample: Sample) -> tuple[Verdict, Action]:
        if sample.bytes_limit != self._device_limit:
            self._device_limit = sample.bytes_limit
            self._set_limit(effective_limit(sample.bytes_limit, self.memory_limit_bytes))
        if sample.phase != self._label or sample.step < self._previous_step:
            self._transition(sample)
        self._begin(sample)
        self._unjudged = None
        in_flight = self.policy.in_flight
        if in_flight is not None and in_flight.peak is not None:  # being carried out: what it holds beside memory
            in_flight.peak = max(in_flight.peak, sample.bytes_used, sample.peak_bytes_used or 0)
        fresh = self._pace.add(sample.step, sample.timestamp, sample.bytes_used)
        verdict = self._route(sample)  # the detector, or the watch on a bounded phase
        if fresh:  # what the transients span about the readings' line, for the cycles after a rebuild
            self._spread = max(self._spread, verdict.excursion_bytes, self._pace.spread())
        if self._within_reach(sample.step, sample.bytes_used, fresh, sample.peak_bytes_used):
            return self._at_limit(sample, verdict)
        if self._next_run is not None and self._episode is None:
            verdict = _climb_verdict(sample, verdict, *self._next_run, self.detector.limit_bytes)
        self._latest = verdict
        return verdict, self._act(verdict, sample.bytes_used)

    def judge_quietly(self, sample: Sample) -> tuple[Verdict, Action] | None:
        """`judge`, except that a sample judged while no OOM is projected returns None and builds no verdict.

        The policy can only answer NONE to a verdict that is not `oom_projected`, and the detector's
        status changes only at its analyses, so such a sample needs the detector's bookkeeping and
        the policy's clock, not a verdict: every verdict and action after it is what `judge` gives
        (tests/test_replay.py), and `latest` builds the skipped verdict when asked. The replay's hot
        loop (`analyze`, `report`, `bench`): most samples of a trace are quiet.
        """
        step = sample.step
        if (sample.bytes_limit != self._device_limit or sample.phase != self._label or step < self._previous_step
                or self._episode is not None or self._next_run is not None or self._cycle is None
                or self._lesson is not None or self.policy.in_flight is not None):
            return self.judge(sample)  # a limit, a phase, a process or a cycle changed: the whole way
        self._gap, self._previous_step = step - self._previous_step, step
        fresh = self._pace.add(step, sample.timestamp, sample.bytes_used)
        detector = self.detector
        detector.absorb(sample)
        at_limit = self._within_reach(step, sample.bytes_used, fresh, sample.peak_bytes_used)
        if detector.status is not _OOM_PROJECTED and not at_limit:
            self._unjudged = sample
            self._observe(step)
            return None
        self._unjudged = None
        verdict = detector.verdict(sample)
        if at_limit:
            return self._at_limit(sample, verdict)
        self._latest = verdict
        return verdict, self._act(verdict, sample.bytes_used)

    def _begin(self, sample: Sample) -> None:
        """The reading's place in its cycle: the first of a fresh state starts one; steps between readings."""
        step = sample.step
        self._gap = step - self._previous_step if self._previous_step > -math.inf else 0.0
        self._previous_step = step
        if self._cycle is None:
            self._cycle = Cycle(step, float(sample.bytes_used))

    def _within_reach(self, step: float, used: float, fresh: bool, peak: float | None = None) -> bool:
        """The limit rule's test: at the line, within the checkpoint margin of it at the alarm's rate,
        within a checkpoint margin, a gap and a hand-over of it at the rate the cycle before measured
        (`core/cycles.py`), or close enough that the next sample could be past it at the newest
        readings' pace (asked only when `fresh`: the pace's window is full and holds a new high). The
        lesson carries the reading's peak since the previous one forward (a step's own transient)."""
        line = self._line
        rising = self.detector.rising_bytes_per_step
        if used >= line or (rising and used + rising * self._margin(rising) >= line):
            return True
        lesson = self._lesson
        if lesson is not None:
            if not lesson.borne_out(step, used):
                self._lesson = None  # this cycle does not rise as the one before did: no such leak now
            elif lesson.reaches(used if peak is None else max(used, peak), line, self._lesson_reach()):
                return True
        return fresh and self._pace.reaches(line, self._phase_left())

    def _lesson_reach(self) -> float:
        """Steps the lesson looks ahead: what an action takes (`core/action_time.py`: the newest
        reinit from its decision to the rebuilt state, or a save where that is longer; else a
        checkpoint's margin), a gap between readings (two where ranks agree), and the hand-over once
        more for what that measure did not see."""
        took = self.action_time.steps(self._seconds_per_step())
        return reach(self._margin_steps if took is None else took, self._gap, self._pace.agreement_gaps)

    def _seconds_per_step(self) -> float:
        """The loop's pace: the detector's over its history, else the newest readings' (0: unknown)."""
        return self.detector.seconds_per_step or self._pace.seconds_per_step

    def _margin(self, rising: float) -> float:
        """Steps the limit rule's margin looks ahead at the alarm's `rising` rate: the latest safe
        moment once a save has been measured (`safety_factor` times the lesson's reach and the steps
        the action's own memory takes at that rate), else the checkpoint margin the user configured."""
        if self.action_time.saves and self._seconds_per_step() > 0 and rising > 0:
            own = self.action_time.own_bytes / rising
            return self.policy.config.safety_factor * (self._lesson_reach() + own)
        return self._margin_steps

    def _phase_left(self) -> float:
        """Steps until the bounded phase running now ends, where known (its growth stops there)."""
        episode = self._episode
        if episode is None or episode.expected_steps is None:
            return math.inf
        return episode.first_step + episode.expected_steps - episode.last_step

    def _act(self, verdict: Verdict, used: float) -> Action:
        if verdict.status is _OOM_PROJECTED and self._fallen(verdict, used):
            self._observe(verdict.step)  # the projection no longer holds: its confirmation starts over
            return _NO_ACTION
        action = self._decide(verdict)
        if action is not _NO_ACTION and action.needs_checkpoint:
            self._acted_at(verdict, verdict.floor_bytes)
        return action

    def _fallen(self, verdict: Verdict, used: float) -> bool:
        """The reading is under the floor the projection counts down from, by more than the floors'
        noise: memory fell since the analysis (an evaluation the loop did not announce ended, a cache
        was cleared), and the projection, which holds until the next one, no longer does. A floor is
        a minimum, so no reading of a floor that rises as projected is ever that far below it."""
        floor = verdict.floor_bytes
        return floor is not None and used < floor - FALLEN_SIGMAS * self.detector.floor_noise

    def _acted_at(self, verdict: Verdict, level: float | None) -> None:
        """A checkpoint action ends this cycle: its floor, and the rate it measured (the detector's,
        else the cycle's rise from its first reading), for the next cycle."""
        in_flight = self.policy.in_flight  # the policy opened it as it asked
        if in_flight is not None:
            in_flight.floor, in_flight.level, in_flight.peak = verdict.floor_bytes, level, level
        cycle = self._cycle
        rate = verdict.slope_bytes_per_step
        if rate <= 0 and cycle is not None and level is not None:
            rate = cycle.rate(verdict.step, level)
        self._taught = max(rate, 0.0)
        if cycle is not None:
            self._cycles = [*self._cycles[-3:], verdict.step - cycle.start_step]

    def _set_limit(self, limit: int | None) -> None:
        """The effective limit changed: the detector projects against it, the limit rule acts at it."""
        self.detector.set_limit(limit)
        self._line = _NO_LINE if limit is None else limit - self.detector.config.headroom_bytes

    def _at_limit(self, sample: Sample, verdict: Verdict) -> tuple[Verdict, Action]:
        """The limit rule acts: memory at the line, within the checkpoint margin of it, or within reach
        of it at the newest readings' pace."""
        lesson = self._lesson
        verdict = _limit_verdict(sample, verdict, self._line, self.detector.rising_bytes_per_step,
                                 self._margin(self.detector.rising_bytes_per_step), self._pace, lesson,
                                 self._lesson_reach())
        action = self.policy.limit_reached(verdict)
        if action.needs_checkpoint:
            self._acted_at(verdict, verdict.floor_bytes if verdict.floor_bytes is not None else sample.bytes_used)
        elif self.policy.carrying_out is not None:  # said as it is: nothing was done about this reading yet
            verdict = verdict._replace(explanation=f"{verdict.explanation}; the action asked at step "
                                                   f"{self.policy.carrying_out:,} is not carried out yet")
        self._latest = verdict
        return verdict, action

    def _use_policy(self, policy: ActionPolicy) -> None:
        self.policy = policy
        self._decide, self._observe = policy.decide, policy.observe  # bound once: they run once per sample

    def _transition(self, sample: Sample) -> None:
        if sample.step < self._previous_step:
            self._new_process()
        if sample.phase != self._label:
            self._phase_changed(sample)
        self._route = self._update if self._episode is None else self._in_phase

    def _new_process(self) -> None:
        """Steps went back: a restarted process appending to the same trace. Its sidecar started
        from scratch (the detector sees the same and resets itself), so a replay does too; the
        run's end carries over (the restarts are counted by `RunState`, never here)."""
        self._use_policy(self._fresh_policy())  # no action in flight: it was the old process's
        self._cycle, self._previous_step = None, -math.inf  # the new process's first reading starts a cycle
        self._label, self._episode, self._phase_steps = "", None, NewestPhases()
        self._pace.clear()
        self._forget_peaks()

    # -- bounded phases --------------------------------------------------------------------------

    def _phase_changed(self, sample: Sample) -> None:
        """A phase ended or began: remember how long a bounded one ran and how high it peaked, start
        watching a new one. The pace starts over: its readings climbed in the phase that ended (an
        evaluation's ramp, whose last reading may carry the next phase's label)."""
        self._pace.clear()
        episode = self._episode
        if episode is not None and episode.n:
            name = episode.phase.name
            if name == SAVE:  # what a save holds beside what is there: the room an action needs
                self.action_time.staged(episode.staged)
            self._phase_steps[name] = episode.span
            climb = self._climbs.get(name) or PeakClimb()
            self._climbs[name] = climb  # the newest phase named: bounded memory, bounded work below
            climb.add(episode.first_step, episode.peak)
            self.climbing_phases = frozenset(n for n, c in self._climbs.items() if c.climbing)
            following = climb.next_run()
            if following is not None and following.peak >= self._line:
                self._next_run = (name, following)
            elif self._next_run is not None and self._next_run[0] == name:
                self._next_run = None
        self._label = sample.phase
        phase = parse_label(sample.phase)
        if not phase.bounded:
            self._episode = None
            return
        expected = phase.planned_steps if phase.planned_steps is not None else self._phase_steps.get(phase.name)
        self._episode = PhaseEpisode(phase, expected, sample.step, sample.timestamp)

    def _forget_peaks(self) -> None:
        """The runs' peaks describe a state that is gone (a rebuild that gave memory back, a new process)."""
        self._climbs, self._next_run, self.climbing_phases = NewestPhases(), None, frozenset()

    def _in_phase(self, sample: Sample) -> Verdict:
        """The detector's verdict on the floor (the sample is a transient to it), unless the phase's
        own growth reaches the limit before the phase ends: then that is the verdict."""
        floor_verdict = self.detector.update_transient(sample)
        episode = self._episode
        episode.add(sample.step, sample.timestamp, sample.bytes_used, sample.peak_bytes_used)
        limit = self.detector.limit_bytes
        if limit is None:
            return floor_verdict
        config = self.detector.config
        room = limit - config.headroom_bytes - episode.peak
        forecast = episode.forecast(room, config.interval_z, config.rise_sigmas, config.max_extrapolation)
        if forecast is None:
            return floor_verdict
        return _phase_verdict(sample, episode, forecast, floor_verdict, limit)

    def rebuild_starts(self, bytes_before: float) -> None:
        """Told when a checkpoint-and-reinit is handed to the loop, with one reading taken between steps
        after the allocator handed freed pages back (`release_host_memory`): what the rebuild is then
        measured against, like with like. A rebuild credited with what the allocator gave back read
        "recovered 217 MiB" while a global list still held every leaked tensor."""
        self._before_rebuild = float(bytes_before)

    def reinit_finished(self, bytes_after: float, took_steps: float | None = None, held: bool = False) -> Recovery | None:
        """Told after a checkpoint-and-reinit, with one reading taken between steps (freed pages handed
        back first, as before it), and how many steps the action took from its decision to the rebuilt
        state (`took_steps`: hand-over, save, rebuild), which the next cycle's lesson looks ahead by.

        If memory came back down, the old trend described the old process state: the detector
        starts a new baseline, and the next cycle knows the rate this one measured. If not, or where
        the loop's census found what it named still held after the rebuild (`held`), the leak lives
        outside what a reinit rebuilds: the next action is a restart, and where memory did not come
        down its history is kept, so that restart comes quickly. "Before" is the reading `rebuild_starts` was told, else the floor the
        action was taken at, else the level it was taken at (an action in the detector's warm-up).
        None when nothing was known to compare against.
        """
        before, self._before_rebuild = self._before_rebuild, None
        in_flight = self.policy.in_flight  # closed by the policy below
        level = in_flight.level if in_flight is not None else None
        if level is not None and in_flight.peak is not None:  # its census, its save's copy, beside memory
            self.action_time.staged(in_flight.peak - level)
        if before is None:
            verdict = self.latest
            before = verdict.floor_bytes if verdict is not None and verdict.floor_bytes is not None else level
        if before is None:
            return None
        if took_steps is not None:
            self.action_time.took(took_steps)
        recovered = self.policy.reinit_finished(before, bytes_after)
        if held or (recovered and shrinking(self._cycles)):  # left behind: a new process frees it
            self.policy.escalate()
        self._pace.clear()  # the readings before the rebuild describe the state it dropped
        if recovered:
            self.detector.reset()
            self.policy.rearm()
            self._forget_peaks()
            self._new_cycle()
        elif self._taught > 0:  # the leak goes on where the rebuild left it: its rate is known already
            self._lesson = Lesson(self._taught, self._previous_step)
        return Recovery(before, float(bytes_after), recovered)

    def _new_cycle(self) -> None:
        """A fresh state: the next reading starts a cycle, which knows the rate the one before measured."""
        self._cycle = None
        self._lesson = Lesson(self._taught, self._previous_step) if self._taught > 0 else None
        self.policy.excursion_seen = self._spread  # the new baseline's buckets have seen few of them

    def restarted(self) -> None:
        """Told that the process being judged was replaced by a new one (restarted after an action,
        or by a supervisor after a crash), before the new process's first sample.

        Everything measured so far describes the old process, so the detector starts a new baseline
        and the policy's clock starts over (the caller counts steps again from the new process's
        first sample; a cooldown left over from the old one would silence the new one), keeping the
        run's end. What the restart gave back is measured by `restart_settled`, once the new
        process has loaded: its first reading is only an interpreter starting up.

        "Before" is the floor the last checkpoint action was taken at: between the signal and its
        exit the old process stops growing and tears down, and a verdict on those last samples
        describes its teardown, not the floor it reached. Without an action (a crash), the newest
        verdict's floor.
        """
        verdict = self.latest
        before = self.policy.in_flight.floor if self.policy.in_flight is not None else None
        if before is None and verdict is not None:
            before = verdict.floor_bytes
        self._floor_before_restart = before
        self._latest = self._unjudged = None
        self.detector.reset()
        self._pace.clear()
        self._forget_peaks()
        self._cycle = self._lesson = None  # a new process climbs as it starts up: no rate carries into that
        self._use_policy(self._fresh_policy())

    def restart_settled(self, bytes_after: float) -> Recovery | None:
        """One reading of the restarted process once it has settled, against the old process's floor.

        Once per restart; None when no floor of the old process was known (or already measured).
        """
        before, self._floor_before_restart = self._floor_before_restart, None
        if before is None:
            return None
        return Recovery(before, float(bytes_after), bytes_after < before)


def _limit_verdict(sample: Sample, verdict: Verdict, line: float, rising: float, margin_steps: float,
                   pace: Pace, lesson: Lesson | None = None, lesson_reach: float = 0.0) -> Verdict:
    """OOM_PROJECTED: the limit rule's verdict on `sample`, from the detector's (or the phase's) `verdict`.

    The OOM is due now when the reading is at the line, else in the steps the rise takes to reach
    it: the alarm's pessimistic rate within the checkpoint margin, or the newest readings' pace
    within its reach (`Pace.reach`: two sample gaps and the action's hand-over). What the detector measured (floor, slopes, the leak report) is kept, and the
    rate seen stands in for a slope it has not measured yet: the rule needs no trend, but says what
    there is of one. After a rebuild, the rate the cycle before measured (`lesson`) reaches as far as
    a checkpoint's margin, a gap and a hand-over (`lesson_reach`). It says what was seen, never what
    was done: the policy decides that.
    """
    used = sample.bytes_used
    limit = verdict.limit_bytes
    paced = pace.rate()
    seen = paced or pace.rise()  # the words need a rate even where the pace has no window yet
    slope = verdict.slope_bytes_per_step if verdict.slope_bytes_per_step > 0 else seen
    per_second = verdict.slope_bytes_per_second
    if verdict.slope_bytes_per_step <= 0 and seen > 0:
        sps = pace.seconds_per_step
        per_second = seen / sps if sps > 0 else 0.0
        verdict = verdict._replace(slope_bytes_per_step=seen, slope_high_bytes_per_step=max(
            seen, verdict.slope_high_bytes_per_step), slope_bytes_per_second=per_second)
    rate = ""
    high = used if sample.peak_bytes_used is None else max(used, sample.peak_bytes_used)
    taught = lesson is not None and lesson.reaches(high, line, lesson_reach)
    if used >= line or (rising <= 0 and paced <= 0 and not taught):  # at the line (near 2**63 a float sum may reach it first)
        steps = 0.0
        headroom = "" if line == limit else f" less its headroom ({format_bytes(line)})"
        if slope > 0:
            rate = f", rising {format_bytes(slope)}/step"
        explanation = (f"memory {format_bytes(used)} at or over the {format_limit(limit)} limit{headroom}{rate}: "
                       "the limit rule needs no trend")
    elif rising > 0 and used + rising * margin_steps >= line:
        steps = (line - used) / rising
        explanation = (f"memory {format_bytes(used)} within the {margin_steps:,.0f}-step checkpoint margin of the "
                       f"{format_limit(limit)} limit: {format_bytes(line - used)} left, rising up to "
                       f"{format_bytes(rising)}/step")
    elif taught and not (paced > 0 and pace.reaches(line)):
        steps = (line - used) / lesson.rate
        explanation = (f"memory {format_bytes(used)}, {format_bytes(line - used)} under the {format_limit(limit)} limit: "
                       f"at the {format_bytes(lesson.rate)}/step the leak rose in the cycle before (to step "
                       f"{lesson.from_step:,}), {steps:,.0f} steps of room, within a checkpoint's margin, a gap "
                       f"between readings and the hand-over ({lesson_reach:,.0f} steps)")
        if slope <= 0:  # the rate it acts on is the one it says
            slope = lesson.rate
            verdict = verdict._replace(slope_bytes_per_step=slope, slope_high_bytes_per_step=slope)
    else:
        steps = (line - used) / paced if paced > 0 else 0.0
        explanation = (f"memory {format_bytes(used)}, rising {format_bytes(paced)}/step to new highs over the "
                       f"newest {pace.readings} readings: its peak could be past the {format_limit(limit)} limit "
                       f"before an action at the next reading, {pace.gap:,.0f} steps on ({format_bytes(line - used)} left)")
    seconds = 0.0  # due now
    if steps:  # at the pace measured: steps per second from the slope in each unit
        seconds = steps * slope / per_second if per_second > 0 and slope > 0 else math.inf
    return verdict._replace(status=Status.OOM_PROJECTED, projected_oom_step=math.ceil(sample.step + steps),
                            projected_oom_steps=steps, projected_oom_seconds=seconds,
                            projected_oom_steps_pessimistic=steps, explanation=explanation)


def _climb_verdict(sample: Sample, floor: Verdict, name: str, run: NextRun, limit: int | None) -> Verdict:
    """OOM_PROJECTED at the next run of a phase whose peaks climb, from now until it starts: acted
    on before it, when that is within the checkpoint margin. A floor verdict that projects an OOM
    sooner stands."""
    step = sample.step
    steps = max(0.0, run.start - step)
    if floor.oom_projected and floor.projected_oom_steps_pessimistic <= steps:
        return floor
    explanation = (f"{name} runs peak higher each time (+{format_bytes(run.climb)} a run, {CLIMB_RUNS} runs); the next, "
                   f"due at step {math.ceil(run.start):,}, would peak at {format_bytes(run.peak)}, past the "
                   f"{format_limit(limit)} limit")
    return floor._replace(status=Status.OOM_PROJECTED, limit_bytes=limit, projected_oom_step=math.ceil(run.start),
                          projected_oom_steps=steps, projected_oom_seconds=math.inf,
                          projected_oom_steps_pessimistic=steps, explanation=explanation,
                          window_steps=max(floor.window_steps, run.seen_over))


def _phase_verdict(sample: Sample, episode: PhaseEpisode, forecast: PhaseForecast, floor: Verdict,
                   limit: int) -> Verdict:
    """OOM_PROJECTED: the peak reaches the limit inside a bounded phase (not a leak, but an OOM to act on)."""
    step = sample.step
    steps = max(0.0, forecast.oom_x - step)
    pessimistic = max(0.0, forecast.oom_x_high - step)
    sps = forecast.seconds_per_step
    name = episode.phase.name
    # The window the growth was seen over, for the policy's caution on a first ramp: a phase whose
    # end is unknown is known to end, so its ramp never earns trust by its length (0): only an
    # imminent OOM acts on it before a first checkpoint action.
    seen_over = float(episode.last_step - episode.first_step) if forecast.end_step is not None else 0.0
    ends = (f"before it ends at step {math.ceil(forecast.end_step):,}" if forecast.end_step is not None
            else "its end unknown (first run)")
    explanation = (f"{name} phase: memory rising {format_bytes(forecast.slope)}/step; peak reaches the "
                   f"{format_limit(limit)} limit at step {math.ceil(forecast.oom_x):,}, in {steps:,.0f} steps, {ends}")
    return Verdict(step=step, timestamp=sample.timestamp, status=Status.OOM_PROJECTED, floor_bytes=floor.floor_bytes,
                   excursion_bytes=float(episode.peak) - (floor.floor_bytes or 0.0), limit_bytes=limit,
                   slope_bytes_per_step=forecast.slope, slope_low_bytes_per_step=forecast.slope,
                   slope_high_bytes_per_step=forecast.high, slope_bytes_per_second=forecast.slope / sps if sps > 0 else 0.0,
                   projected_oom_step=math.ceil(forecast.oom_x), projected_oom_steps=steps,
                   projected_oom_seconds=steps * sps if sps > 0 else math.inf, explanation=explanation,
                   projected_oom_steps_pessimistic=pessimistic, window_steps=seen_over, leak_detected=floor.leak_detected)
