"""The sidecar thread's part of the `Watchdog`: memory read when asked, judged, recorded.

    mailbox -> handle(messages) -> read the source -> Sample -> the device's station (and the host's)
            -> a checkpoint action -> the chores, as it is decided (before the station's lines)
            -> the verdict and action -> the flight record

Everything here runs on the sidecar thread; the training thread only posts to the mailbox and reads
the chores (`runtime/sidecar.py`). The messages:

- `sample`: read the newest step the training thread asked for (`Asked.step`), in the phase it
  was in then, and any bounded phase that ended before it;
- `phase_end`: a bounded phase ended: one reading labelled with it (its last moments' peak);
- `reinit`: the readings before and after a rebuild, measured on the training thread, told to the
  judges (what the rebuild gave back, or that the leak survived it);
- `staged`: readings around a baseline census: what an action's census holds beside memory;
- `barrier`: answered when everything posted before it is handled (`Watchdog.drain`);
- `stop`: the last one.

The saves the loop timed ride with whatever comes next (`Asked.saves`), told to the judges first.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from watchdog.actions.action_path import DEVICE
from watchdog.actions.record import MEASURED, ActionOutcome
from watchdog.core.action_time import SAVES_KEPT
from watchdog.core.phase import STEADY_LABELS
from watchdog.core.readings import HostReading, MemoryReading, MemorySource
from watchdog.core.restarts import RunState
from watchdog.core.sample import Sample
from watchdog.core.verdict import Action, Decided, Verdict
from watchdog.forensics.follower import LeakFollower
from watchdog.records.flight_record import FlightRecorder
from watchdog.records.job_ledger import LoopAccount
from watchdog.runtime.allocator_figures import AllocatorFigures
from watchdog.runtime.compile_watch import CompileWatch
from watchdog.runtime.host_watch import HOST, HostWatch
from watchdog.station.station import Station
from watchdog.station.telemetry import Telemetry

SAMPLE, PHASE_END, REINIT, STAGED, BARRIER, STOP = "sample", "phase_end", "reinit", "staged", "barrier", "stop"
SAMPLE_REQUEST = (SAMPLE, None)  # the step and phase to sample are read from `Asked` when handled
PHASE_END_REQUEST = (PHASE_END, None)  # the phases that ended are read from `Asked.ends` when handled
FOLLOW = "follow"  # a chore for the training thread: the follower has work, or a block is due


def stations(device: Station, host_watch: HostWatch | None) -> list[Station]:
    """The stations that judge: the device's, and the host's where it is judged apart."""
    host = host_watch.station if host_watch is not None else None
    return [device] if host is None else [device, host]


class Asked:
    """What the training thread asked the sidecar to read, in one object: the newest sampling step
    and the phase the loop was in then, whether a request is on its way, the bounded phases that
    ended since, `(step, label)`, and the saves timed since (seconds), which ride with the next
    message instead of one of their own."""

    __slots__ = ("step", "phase", "posted", "ends", "saves")

    def __init__(self) -> None:
        # the saves: at most what a judge reads (a loop saving while no sidecar runs keeps the newest)
        self.step, self.phase, self.posted, self.ends, self.saves = 0, "", False, deque(), deque(maxlen=SAVES_KEPT)


@dataclass(eq=False)
class Sampler:
    """The sidecar thread's work (the module docstring), over the parts the `Watchdog` built at
    `start()`. `chores` is the training thread's deque: an action to hand over, or `FOLLOW`."""

    mailbox: queue.SimpleQueue
    asked: Asked
    source: MemorySource
    station: Station
    host_watch: HostWatch | None
    telemetry: Telemetry
    history: deque
    run_state: RunState
    follower: LeakFollower | None
    chores: deque
    account: LoopAccount | None
    flight: FlightRecorder | None
    compile_watch: CompileWatch | None
    phase_now: Callable[[], str]  # the loop's phase as of now (an attribute read)
    count_error: Callable[[str, BaseException], None]
    thread: threading.Thread | None = field(default=None, init=False)

    def start(self) -> "Sampler":
        """The sidecar thread, running `run`."""
        self.thread = threading.Thread(target=self.run, name="hbm-watchdog", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        """What was posted before is handled, then the thread ends (waited for 30 s at most)."""
        self.mailbox.put((STOP, None))
        self.thread.join(timeout=30)

    def drain(self, timeout: float) -> bool:
        """Block until everything posted so far is handled; False on timeout."""
        done = threading.Event()
        self.mailbox.put((BARRIER, done))
        return done.wait(timeout)

    def run(self) -> None:
        """The sidecar thread: until `stop` is handled."""
        while True:
            messages = [self.mailbox.get()]
            while not self.mailbox.empty():
                messages.append(self.mailbox.get_nowait())
            self.handle(messages)
            if any(kind == STOP for kind, _ in messages):
                return

    def handle(self, messages: list[tuple[str, Any]]) -> None:
        self._tell_saves()  # the saves timed before these messages were posted come first
        for kind, payload in messages:
            try:
                if kind == SAMPLE:
                    # Cleared before the step is read, so a step requested meanwhile is either read
                    # now or posted anew: never lost. Reading memory for a step long gone would
                    # mislabel it, so only the newest requested step is sampled.
                    asked = self.asked
                    asked.posted = False
                    step, asked_in = asked.step, asked.phase
                    self._phases_ended(before=step)  # its readings come first: steps never go back
                    # A reading belongs to a bounded phase the loop was in when it asked or is in
                    # now (a step asked just before an evaluation is read inside it): then the
                    # phase's end reading, posted after, is never followed by its own older reading.
                    self._sample(step, asked_in if asked_in not in STEADY_LABELS else self.phase_now())
                elif kind == PHASE_END:
                    self._phases_ended()
                elif kind == REINIT:
                    self._after_reinit(*payload)
                elif kind == STAGED:
                    self._census_held(*payload)
                elif kind == BARRIER:
                    payload.set()
            except Exception as exc:  # noqa: BLE001 - the sidecar must outlive any single failure
                self.count_error(kind, exc)

    def stations(self) -> list[Station]:
        return stations(self.station, self.host_watch)

    # ---- a reading ----------------------------------------------------------------------------

    def _phases_ended(self, before: float = math.inf) -> None:
        """One reading for each bounded phase that ended before step `before`, labelled with it, in
        the order they ended. A sample asked for after a phase ended may be handled first (its step
        is read when it is handled), so each takes the phase ends before its step, and leaves the
        later ones: the trace's steps never go back, which would read as a new process."""
        ends = self.asked.ends
        while ends and ends[0][0] < before:
            step, label = ends.popleft()
            self._sample(step, label, every_memory=True)

    def _sample(self, step: int, phase: str, every_memory: bool = False) -> None:
        """One reading of memory at `step`, taken in `phase` (the loop's phase when the step asked for
        it), judged. `every_memory`: the host's too, whatever its cadence (a phase's end)."""
        try:
            reading = self.source.read()
        except Exception as exc:  # noqa: BLE001 - a failing source is counted, never raised
            self.count_error("source_read", exc)
            return
        sample = Sample(step, time.time(), reading.bytes_used, reading.bytes_limit, reading.peak_bytes_used, phase)
        self.history.append(sample)
        if self.run_state.cycle_from is None:  # this process's first reading begins its first cycle
            self.run_state.cycle_from = step
        telemetry = self.telemetry
        telemetry.chips = reading.devices
        if reading.allocator is not None:
            telemetry.part(AllocatorFigures).observe(reading.allocator)
        verdict, action = self.station.observe(sample, functools.partial(self._queue, DEVICE))
        self._arm_follower(action, verdict)
        if self.follower is not None:  # an attribute write: the training thread reads it when a phase ends
            self.follower.phases_climbing = self._climbing_phases()
        if self.account is not None and self.account.due():  # a stretch of steps for the job file
            self.chores.append(FOLLOW)
        if self.host_watch is not None and (every_memory or self.host_watch.due(step)):
            self._watch_host_at(step, phase)
        if self.flight is not None:
            self.flight.observe(step, verdict, actions={a.value: n for a, n in telemetry.actions_snapshot().items() if n},
                                suspects=self.follower.last if self.follower is not None else None,
                                **self._compile_figures())
        if self.compile_watch is not None:  # after the memory pipeline: nothing here may delay an action
            self.compile_watch.observe(sample.step)

    def _compile_figures(self) -> dict:
        """The compile watch's newest figures, for the flight record (none off XLA)."""
        if self.compile_watch is None:
            return {"compilations": None, "recompilation": None}
        figures = self.compile_watch.figures
        return {"compilations": figures.compilations, "recompilation": figures.finding}

    def _climbing_phases(self) -> frozenset[str]:
        climbing = frozenset()
        for station in self.stations():
            climbing |= station.judge.climbing_phases
        return climbing

    def _watch_host_at(self, step: int, phase: str) -> None:
        host = self.host_watch
        try:
            judged = host.observe(step, phase, functools.partial(self._queue, HOST))  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - a failing read is counted, never raised
            self.count_error("host_read", exc)
            return
        if judged is None:  # one memory: the device's series is the host's, and so is its verdict
            if self.flight is not None and self.telemetry.verdict is not None:
                self.flight.observe_host(host.reading, self.telemetry.verdict)  # type: ignore[union-attr]
            return
        verdict, action = judged
        self._arm_follower(action, verdict)
        if self.flight is not None:
            self.flight.observe_host(host.reading, verdict)  # type: ignore[union-attr]

    def _queue(self, memory: str, action: Action, verdict: Verdict) -> None:
        """The in-process loop's part of an action, called by its station as it is decided, before
        any line is written: a checkpoint queued for the training thread, which takes the most severe
        waiting (`Chores.do`)."""
        if action.needs_checkpoint:
            self.chores.append(Decided(action, verdict, memory))

    def _arm_follower(self, action: Action, verdict: Verdict) -> None:
        """A leak suspected in either memory (an action, or a leak with no OOM projected): the follower
        captures where its tensors are made."""
        if self.follower is not None and (action is not Action.NONE
                                          or (verdict.leak_detected and not verdict.oom_projected)):
            if self.follower.arm():
                self.chores.append(FOLLOW)

    # ---- what the training thread measured ----------------------------------------------------

    def _tell_saves(self) -> None:
        """Every station's judge learns the saves the loop timed (`observe_checkpoint`): what an action takes."""
        saves = self.asked.saves
        while saves:
            seconds = saves.popleft()
            for station in self.stations():
                try:
                    station.judge.saved(seconds)
                except Exception as exc:  # noqa: BLE001 - the sidecar must outlive any single failure
                    self.count_error("saved", exc)

    def _census_held(self, before: tuple, after: tuple) -> None:
        """Readings between steps around a baseline census (each memory's, freed pages handed back
        first): how far its peak rose is what the census an action takes holds beside memory."""
        host = self.host_watch.station if self.host_watch is not None else None
        for station, start, end in ((self.station, before[0], after[0]), (host, before[1], after[1])):
            if station is not None and start is not None and end is not None:
                peak = end.peak_bytes_used if end.peak_bytes_used is not None else end.bytes_used
                station.judge.staged(max(peak, end.bytes_used) - start.bytes_used)

    def _after_reinit(self, record: ActionOutcome | None, before: tuple | None, readings: tuple, took: int | None,
                      held: bool) -> None:
        """The rebuild measured (`reinit_measured`), and the action's record closed."""
        if before is not None:  # what the rebuild is measured against, read when it was handed over
            self._before_rebuild(*before)
        device, host = readings
        if self.host_watch is not None:
            self.host_watch.reinit_finished(host, took, held)
        if device is not None:
            self.station.reinit_finished(float(device.bytes_used), took, held)  # logged as `reinit_measured`
        if record is not None:
            record.state = MEASURED

    def _before_rebuild(self, device: MemoryReading | None, host: HostReading | None) -> None:
        if device is not None:
            self.station.judge.rebuild_starts(device.bytes_used)
        if host is not None:
            self.host_watch.station.judge.rebuild_starts(host.bytes_used)  # type: ignore[union-attr]
