"""The `Watchdog`: a step hook on the training thread and a sidecar thread that does the work
(the sidecar's part is `runtime/sampler.py`'s `Sampler`, built at `start()`).

Training thread                          Sidecar thread
---------------                          --------------
step(n):  remember n                     block on the mailbox
          every N steps: post n          read memory -> Sample -> history
          hand over a pending action     the station: trace, telemetry, Judge -> Verdict, Action,
                                           and its lines (leak report up or down, action_decided)
                                         CHECKPOINT_*: queue it for step()

`step()` is O(1): an attribute write, a modulo, a deque check, and every N steps one put on
a `queue.SimpleQueue` (C code: post and wake-up in one call). It takes no lock the sidecar can
hold, reads no tensor and does no I/O, so it adds no XLA compilation and no device-to-host
transfer.
Actions are carried out by the training thread between steps; the sidecar only asks.

What is leaking is named on the training thread too (`LeakFollower`), at the few moments it is
due: a baseline census at the first `step()` and after each rebuild, a capture of creation sites
armed once a leak is suspected, and a census when an action is handed over. `step()` checks one
deque for that and for actions (`runtime/chores.py`); the census itself (milliseconds to seconds,
logged with its cost) runs only then. What runs once started is built and ended in one place
(`runtime/running.py`).
The action's outcome, its block for the terminal (`action_outcome`), is logged when the loop says
what it did (`log_outcome`, or `carry_out`, which does both), or at the next `step()` if it never says.

The host's memory is watched beside the device's (`HostWatch`, on by `WatchdogConfig.host_memory`):
the sidecar reads it every `host_sample_every` steps, judges it with a Judge of its own and acts on
its verdicts as on the device's, each action saying which memory asked for it. Where the device's
memory is the host's (the `rss` source), there is one series, judged against both budgets.

An action's life once decided is the action path's (`actions/action_path.py`, `Watchdog.actions`):
the hand-over, `carry_out`, the rebuild measured on its record, the block, the restarts.

Many ranks take one decision (`actions/agreement.py`, through the action path): when
torch.distributed runs several ranks at `start()`, an action is not handed over by the rank that
decided it but held, and on each sampling
step every rank offers what it holds (posted to the agreement's thread, which makes one all_gather
on a gloo group of the watchdog's own) and, at the next sampling step, every rank gets the most
severe offer, at the same step. Forced actions (`forced_actions`) and a
loop's own proposals (`propose`, e.g. a preemption) take the same path, so every loop gets them.

The trace file is best-effort telemetry (`TraceSink`): an I/O error writing it never reaches
training or its exit status.

`phase(name)` is an attribute write too: the sidecar reads the phase when it takes a sample, so
each sample (and the trace) carries the phase the loop was in when memory was read.

A stall watch (`runtime/stall.py`, an APScheduler job) reads the step counter: a loop that stops
stepping for longer than `stall_after_seconds` is reported as stalled (a hung collective, a dead
input pipeline), and past `stall_exit_after_seconds` its stacks are recorded and it exits 43.
"""

from __future__ import annotations

import functools
import queue
import sys
from collections import deque
from typing import Any, Callable

from watchdog.actions import agreement
from watchdog.actions.action_path import (DEVICE, FORCED, HANDED_OVER, REINITIALISED, RESTART_REQUESTED, UNSAVED,
                                          ActionPath)
from watchdog.actions.agreement import Agreement
from watchdog.actions.record import ActionOutcome
from watchdog.core.config import WatchdogConfig
from watchdog.core.errors import EXIT_FUTILE, EXIT_INTERRUPTED, EXIT_RESTART_REQUESTED, EXIT_UNSAVED
from watchdog.core.judge import Judge
from watchdog.core.phase import SAVE, parse_label, phase_label
from watchdog.core.readings import HostReading
from watchdog.core.sample import Sample
from watchdog.core.verdict import Action, Verdict
from watchdog.forensics.follower import LeakFollower, Suspects
from watchdog.logs import OncePerKind, ensure_readable_output, exception_text, get_logger
from watchdog.readers.sources import MemoryReading, MemorySource, current_device, select_source
from watchdog.runtime import xla_stats
from watchdog.runtime.checkpoint_figures import CheckpointFigures
from watchdog.runtime.chores import Chores
from watchdog.runtime.host_watch import HostWatch
from watchdog.runtime.running import Running
from watchdog.runtime.sampler import FOLLOW, PHASE_END_REQUEST, REINIT, SAMPLE_REQUEST, STAGED, Asked
from watchdog.station.station import Station
from watchdog.station.telemetry import Telemetry

log = get_logger(__name__)

__all__ = ["Watchdog", "PhaseScope", "DEVICE", "FORCED", "HANDED_OVER", "REINITIALISED", "RESTART_REQUESTED", "UNSAVED"]


class Watchdog:
    """Watches device memory from a sidecar thread (the module docstring says how), built from parts
    it holds: the station that judges (`station`), the action path (`actions`, `actions/action_path.py`:
    an action's life once decided), the work between steps and the follower that names what leaks
    (`chores`, `runtime/chores.py`), and what runs once started (`runtime/running.py`: the sampler
    on the sidecar thread, the host's watch, the records, the stall and exit watches)."""

    trace_retry_seconds = 30.0  # after a trace I/O error, wait this long before reopening the file
    watches = True  # memory is read and judged (not so for the unwatched run's stand-in)
    saved_state = staticmethod(ActionPath.saved_state)

    def __init__(self, config: WatchdogConfig | None = None, *, source: MemorySource | None = None,
                 telemetry: Telemetry | None = None, logs_outcomes: bool = False,
                 agreement: Agreement | None = None):
        """`logs_outcomes`: the loop says what it did with every action (`carry_out`, `log_outcome`),
        perhaps some steps later (after an evaluation): the block is never logged for it at the next step.
        `agreement`: a loop that agrees on more than the watchdog's actions (the trainer: whether
        every rank's save landed) shares its own; by default `start()` joins one when several ranks run."""
        self.config = config = config or WatchdogConfig()
        self.telemetry = telemetry or Telemetry(rank=config.rank)
        self.telemetry.part(CheckpointFigures)  # served from the first scrape
        self.station = Station(Judge(config.detector, config.policy, memory_limit_bytes=config.memory_limit_bytes),
                               self.telemetry, memory=DEVICE)
        self.actions = ActionPath(logs_outcomes=logs_outcomes, policy=config.policy, every=config.sample_every,
                                  suspects=self._suspects, read=self._read_between_steps,
                                  verdict=lambda: self.telemetry.verdict,
                                  block_due=lambda: self._chores.append(FOLLOW))
        self._mailbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._post = self._mailbox.put  # bound once: the hot path skips an attribute lookup
        follower = LeakFollower(read=lambda: self._read_between_steps("source_read"),
                                staged=lambda *around: self._post((STAGED, around))) if config.forensics else None
        self.chores = Chores(self.actions, follower, config.forced_actions)
        self._chores = self.chores.queue  # step() checks this one deque, bound once
        self._agree_with(agreement)
        self.history: deque[Sample] = deque(maxlen=config.history_size)
        self._source, self._running = source, None  # the parts start() runs (None: not running)
        self._every, self._newest_step, self._phase = config.sample_every, -1, ""  # the phase: read with each sample
        self._asked = Asked()  # what the training thread asked the sidecar to read
        self._error_log = OncePerKind(log, "watchdog_error")  # each kind logged once, every one counted
        self._forced_at = self.chores.next_forced
        if config.recompilation.explain and "torch_xla" in sys.modules:
            xla_stats.prepare_compile_analysis()  # before the first graph, or torch_xla never reads it
        self._apply_run_state()

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> "Watchdog":
        """Call on the training thread: the current XLA device is thread-local, so it is captured here."""
        if self._running is not None:
            return self
        ensure_readable_output()  # where the application configured no logging, its lines are still read
        config = self.config
        device = config.device or current_device()
        if self._source is None:
            self._source, _ = select_source(config.source, device, config.memory_limit_bytes, config.replay_trace)
        self.telemetry.device, self.telemetry.source = device, self._source.name
        self._running = Running.start(
            config, device=device, source=self._source, telemetry=self.telemetry, station=self.station,
            actions=self.actions, chores=self.chores, history=self.history, mailbox=self._mailbox,
            asked=self._asked, rank=lambda: self._rank, newest_step=lambda: self._newest_step,
            phase_now=lambda: self._phase, count_error=self._count_error, leave=self._leave,
            retry_seconds=lambda: self.trace_retry_seconds, run_state_changed=self._apply_run_state)
        self._agree_with(self.actions.ranks)  # the ranks start() joined, if it did
        log.info("watchdog_started", device=device, source=self._source.name, sample_every=self._every,
                 memory_limit_bytes=config.memory_limit_bytes, rank=config.rank,
                 trace_file=str(config.trace_file) if config.trace_file else None)
        return self

    def stop(self, *, clean: bool = True) -> None:
        """Idempotent. Processes what was already posted, then flushes the trace. `clean=False`:
        the loop is leaving on an exception, and the flight record must not call that a clean end."""
        self._leave("done" if clean else "error", clean)

    def _leave(self, how: str, clean: bool) -> None:
        """`stop()`, or any other way out of the process (`ExitWatch`): every running part ended."""
        running = self._running
        if running is not None:
            running.end(how, clean, newest_step=max(self._newest_step, 0), telemetry=self.telemetry)
            self._running = None
            self._agree_with(self.actions.ranks)  # an agreement start() joined is closed and gone

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exception: BaseException | None, *tb: object) -> None:
        self.stop_leaving(exception)

    def stop_leaving(self, exception: BaseException | None) -> None:
        """`stop()` for a loop leaving with `exception` (None: its end). An exception (an
        OutOfMemoryError) is no clean end, and neither is `PeerLost` (exit 43: another rank died or
        stalled, nothing saved); SystemExit (`sys.exit(42)`, a restart asked for; Lightning's
        SIGTERM) and KeyboardInterrupt are the loop's own ways out."""
        clean = not isinstance(exception, (Exception, agreement.PeerLost))
        self._leave(_way_out(exception) if clean else "error", clean)

    def record_program(self, tensors) -> None:
        """Keep the step's traced program in the flight record (`forensics/program_sites.py`), so that
        `postmortem` can name your line behind an allocation in XLA's out-of-memory message. Call once,
        on the training thread, after a step is traced and before its sync, with what the step
        computes (the loss, the parameters, the optimizer's state): it lowers that graph to HLO (no
        compilation, no execution, no transfer)."""
        flight = self._running.flight if self._running is not None else None
        if flight is not None and "torch_xla" in sys.modules:
            from watchdog.forensics.program_sites import record_program

            record_program(flight, tensors)

    # ---- what a loop reads ---------------------------------------------------------------------

    @property
    def checkpoint_figures(self) -> CheckpointFigures:
        """The saves' figures (`hbmwatch_checkpoint_seconds`...), on the device series' telemetry."""
        return self.telemetry.part(CheckpointFigures)

    @property
    def verdict(self) -> Verdict | None:
        """The device series' newest verdict (None before the first sample): an attribute read."""
        return self.telemetry.verdict

    @property
    def limit_bytes(self) -> int | None:
        """The budget the device series is judged against (the tighter one, where the host's is the same memory)."""
        return self.station.judge.limit_bytes

    @property
    def leak_suspected(self) -> bool:
        """A leak is worth naming now: the watchdog has warned or acted, or reports a leak with no OOM
        projected, in either memory (with an OOM projected, the action path's WARN follows within a
        few verdicts). What arms the forensics' capture of creation sites; attribute reads only."""
        if self.telemetry.actions_total:
            return True
        return any(v is not None and v.leak_detected and not v.oom_projected for v in (self.verdict, self.host_verdict))

    @property
    def host_verdict(self) -> Verdict | None:
        """The host series' newest verdict (None where the host is not watched apart from the device)."""
        host = self._host_watch.station if self._host_watch is not None else None
        return host.verdict if host is not None else None

    @property
    def judge(self) -> Judge:
        """The device series' Judge (its limit, its detector), for loops and tests that read them."""
        return self.station.judge

    @property
    def source_name(self) -> str:
        return self._source.name if self._source is not None else "none"

    @property
    def suspects(self) -> Suspects | None:
        """The newest census's answer to "what is leaking" (also logged as `leak_suspects`)."""
        return self.chores.follower.last if self.chores.follower is not None else None

    @property
    def ranks(self) -> int:
        """How many ranks take this watchdog's decisions together (1: this process alone)."""
        return self.actions.ranks.ranks if self.actions.ranks is not None else 1

    def _agree_with(self, ranks: Agreement | None) -> None:
        """The ranks every action is agreed with (None: this process alone): the action path's, and
        its `agree` bound once for step()'s sampling steps (the hot path skips an attribute lookup)."""
        self.actions.ranks = ranks
        self._agree = self.actions.agree if ranks is not None else None

    @property
    def _rank(self) -> int:
        return self.actions.ranks.rank if self.actions.ranks is not None else self.config.rank

    @property
    def _host_watch(self) -> HostWatch | None:
        return self._running.host_watch if self._running is not None else None

    # ---- the training thread's side ------------------------------------------------------------

    def step(self, step: int) -> Action | None:
        """Call once per training step, after the step is dispatched: O(1), no lock, no I/O, no tensor read.

        With several ranks, every rank must call it with the same step numbers (the global step):
        on sampling steps the ranks agree, and every rank gets the same action at the same step.

        Args:
            step: the loop's step counter (monotonic; going back means a new process).
        Returns:
            None, or the `Action` to carry out now (`carry_out`); `last_action` is its record.
        """
        self._newest_step = step
        if step >= self._forced_at:  # a drill due
            self._forced_at = self.chores.force(step, self.telemetry.verdict)
        if step % self._every == 0:
            asked = self._asked
            asked.step, asked.phase = step, self._phase
            if not asked.posted:  # one request in flight at most: the sidecar reads the newest step
                asked.posted = True
                self._post(SAMPLE_REQUEST)
            agree = self._agree
            if agree is not None:
                if self._chores:
                    self.chores.do(step)
                return agree(step)
        if self._chores:  # rare: an action, a baseline, a capture's steps, a block to log
            return self.chores.do(step)
        return None

    def phase(self, name: str, steps: int | None = None) -> "PhaseScope":
        """Tell the watchdog which phase the loop is in; also a context manager that restores the
        phase it replaced::

            with wd.phase("eval", steps=len(val_loader)):   # or wd.phase("eval") ... wd.phase("train")
                for batch in val_loader:
                    evaluate(batch)
                    wd.step(global_step)

        "train" is the steady phase, whose floor the leak detector extrapolates. Any other name is
        a bounded phase: it ends, and what it allocates goes when it ends, so its growth is judged
        against the peak it reaches by its end (`steps`, if known: how many `step()` calls it
        lasts; else as long as it ran last time), not extrapolated past it
        (`watchdog.core.phase`). `step()` keeps counting through the phase. A bounded phase's end
        (the `with` left, or the next `phase()` said) takes one reading labelled with it, whose peak
        is what the phase's last moments held (an evaluation's end-of-pass copy, a save's staging copy).

        Args:
            name: a letter, then up to 31 of [A-Za-z0-9_.-] ("eval", "save"; "train": training).
            steps: how many `step()` calls the phase lasts, where known.
        Returns:
            A `PhaseScope`: leaving it (`with`, or `.end()`) puts the phase it replaced back.
        Raises:
            ConfigError: a bad name or length, the first time it is used (then an attribute write).
        """
        label = _label(name, steps)
        scope = PhaseScope(self, self._phase)
        ended, self._phase = self._phase, label
        if ended != label:  # the plain form's end too: `wd.phase("train")` after `wd.phase("eval")`
            self._phase_ended(ended)
        return scope

    def propose(self, action: Action, origin: str) -> None:
        """Ask for a checkpoint action on the loop's own account: handed back by the next `step()`, or
        with several ranks at the next sampling step, agreed like the watchdog's own. Call on the
        training thread (a signal handler on it is fine: it only appends).

        Args:
            action: `Action.CHECKPOINT_RESTART` (save, exit 42) or `CHECKPOINT_REINIT`; others are ignored.
            origin: why, for the action's block ("preempted", "stop signal").
        """
        self.chores.propose(action, self.verdict, origin)

    def carry_out(self, action: Action | None, *, save: Callable[[], object] | None = None,
                  rebuild: Callable[[], None] | None = None, checkpoint: str | None = None) -> bool:
        """Carry out a checkpoint action with the loop's own `save()` and `rebuild()` (drop the
        training state and load it back)::

            action = wd.step(step)
            if action is not None and not wd.carry_out(action, save=save, rebuild=rebuild):
                sys.exit(wd.last_action.exit_code)   # 42: a restart (44: the save failed; 45: in vain)

        Times the save, measures what a rebuild gave back and logs the action's block.

        Args:
            action: what `step()` returned (None and WARN are nothing to do).
            save: writes the checkpoint; returns its path, None/True (saved, no path named), or
                False (it could not save: exit 44), as `save_result` reads it. Where restarting
                would be in vain, the checkpoint is still saved, then exit 45.
            rebuild: drops the training state and loads it back; without one a reinit is carried
                out as a restart (exit 42).
            checkpoint: where a framework that saves by itself after the step (Hugging Face's
                Trainer) saves, when it passes no `save`.
        Returns:
            True when training goes on in this process (no action, a WARN, a reinit), False when the
            process should exit with `last_action.exit_code` (42, 44 or 45).
        """
        return self.actions.carry_out(action, save=save, rebuild=rebuild, checkpoint=checkpoint,
                                      step=self._newest_step, saved=self.observe_checkpoint,
                                      rebuilt=self.reinit_finished)

    def log_outcome(self, outcome: str, *, checkpoint: str | None = None, exit_code: int | None = None) -> None:
        """Log the outcome of the action step() handed over last, its block (`action_outcome`): what
        was seen, what is leaking, what the loop did (`outcome`, `checkpoint`) and, after a reinit,
        what it gave back. `carry_out` calls it; a loop that carries an action out its own way calls
        it once done. Once per action: nothing is logged with no action handed over."""
        self.actions.log_outcome(outcome, checkpoint=checkpoint, exit_code=exit_code)

    @property
    def last_action(self) -> ActionOutcome | None:
        """The action step() handed over last: its record, with the verdict behind it, the suspects and,
        once carried out, its outcome and the exit status the process ends with (None: it goes on).
        Its `state` says where it is: handed over, saved, rebuilt, measured (the sidecar judged the
        reading after the rebuild), or exited (`actions/record.py`)."""
        return self.actions.last

    def state_dict(self) -> dict:
        """What a loop keeps in its checkpoint so the job's restarts, the watchdog's restart budget and
        its window, and what each restart bought, span processes. Read it when saving: a restart
        handed over counts at once.

        Returns:
            A small dict of plain ints and lists (JSON-safe), to keep as one entry of the checkpoint
            (`{"watchdog": wd.state_dict()}`) and give back with `load_state_dict`.
        """
        return self.actions.run.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """A resumed process: what `state_dict()` returned in the process that saved the checkpoint.
        Before `start()`.

        Args:
            state: that dict (older checkpoints' subsets load too).
        Raises:
            ConfigError: a value of the wrong kind (`saved_state` checks one without raising).
        """
        self.actions.run.load_state_dict(state)
        self._apply_run_state()

    def ends_at(self, last_step: int | None) -> None:
        """The run ends at `last_step` (the trainer's steps, Lightning's and Hugging Face's `max_steps`),
        unless the policy's settings name an end: an OOM projected past it is a warning."""
        if self.actions.ends_at(last_step):
            self._apply_run_state()

    def reinit_finished(self) -> None:
        """After checkpoint-and-reinit: one reading now (between steps, so no activations are live)
        tells the policy whether the rebuild brought memory back down or the leak survived it."""
        held = self.chores.after_rebuild(self._newest_step, capture=bool(self.telemetry.actions_total))
        readings = self._read_between_steps("reinit_read")
        before, took = self.actions.measure_rebuild(readings, self._newest_step, held)
        self._post((REINIT, (self.actions.last, before, readings, took, bool(held))))  # the action's one message back

    def observe_checkpoint(self, seconds: float) -> None:
        """A save the loop made, timed (`hbmwatch_checkpoint_seconds`). The judges learn from it what an
        action takes: from the first one on, actions come at the latest safe moment (`core/action_time.py`).
        `carry_out` times the saves it makes; a loop that saves on its own (every N steps) calls it
        with what its save took, so that the first action already knows."""
        self.checkpoint_figures.observe_save(seconds)
        self._asked.saves.append(seconds)  # told before whatever the sidecar handles next: no message of its own

    def drain(self, timeout: float = 5.0) -> bool:
        """Block until the sidecar has handled everything posted so far; False on timeout."""
        sampler = self._running.sampler if self._running is not None else None
        return sampler.drain(timeout) if sampler is not None else True

    # ---- between steps -------------------------------------------------------------------------

    def _read_between_steps(self, kind: str) -> tuple[MemoryReading | None, HostReading | None]:
        """One reading of each memory between steps (`Running.read`); none before `start()`."""
        return self._running.read(kind) if self._running is not None else (None, None)

    def _suspects(self, step: int) -> list[str]:
        """What is leaking, named as an action leaves: this process's census (where it finds nothing
        growing, what a climbing phase's newest run held at its end), and the job's processes that grew."""
        return self.chores.suspects(step) + (self._running.processes_grown() if self._running is not None else [])

    def _phase_ended(self, label: str) -> None:
        """The loop's phase changed on the training thread (a scope left, or another phase said): the
        job's account follows it; where a bounded phase ended, one reading now, labelled with it,
        whose peak since the previous reading is the phase's last (an evaluation's end-of-pass copy of
        its predictions, a save's staging copy), and a climbing phase's run is counted."""
        if self.actions.account is not None:  # an evaluation's time is no training step's
            self.actions.account.phase(_bounded(self._phase), self._newest_step,
                                       "checkpoint_save" if parse_label(self._phase).name == SAVE else "eval")
        phase = parse_label(label)
        if not phase.bounded:
            return
        if self._running is not None and self._newest_step >= 0:
            self._asked.ends.append((self._newest_step, label))
            self._post(PHASE_END_REQUEST)
        self.chores.phase_ended(phase.name, self._newest_step)

    def _apply_run_state(self, judged: list[Station] | None = None) -> None:
        """The run's state changed (resumed, its end known, or the stations started): the judges and
        the telemetry are told."""
        run = self.actions.run
        for station in judged or (self._running.stations() if self._running is not None else [self.station]):
            station.judge.ends_at(run.last_step)
            station.telemetry.restarts_total = run.restarts_so_far

    def _count_error(self, kind: str, exc: BaseException) -> None:
        self.telemetry.sample_errors_total += 1
        self._error_log(kind, type(exc).__name__, error=exception_text(exc))


@functools.lru_cache(maxsize=256)
def _label(name: str, steps: int | None) -> str:
    """A phase's label, validated once (a bad name raises ConfigError the first time, every time)."""
    return phase_label(name, steps)


def _bounded(label: str) -> bool:
    return parse_label(label).bounded


def _way_out(exception: BaseException | None) -> str:
    """The job file's word for a loop's own way out of `with Watchdog(...)`: its end, or a SystemExit."""
    if isinstance(exception, KeyboardInterrupt):
        return "interrupted"
    if not isinstance(exception, SystemExit) or exception.code in (None, 0):
        return "done"
    if exception.code in (EXIT_RESTART_REQUESTED, EXIT_UNSAVED):
        return "restart"
    if exception.code == EXIT_FUTILE:
        return "futile"
    return "interrupted" if exception.code == EXIT_INTERRUPTED else "error"


class PhaseScope:
    """What `Watchdog.phase()` returns: leaving a `with` block puts the phase it replaced back."""

    __slots__ = ("_watchdog", "_previous")

    def __init__(self, watchdog: Watchdog, previous: str):
        self._watchdog, self._previous = watchdog, previous

    def __enter__(self) -> "PhaseScope":
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()

    def end(self) -> None:
        """Put back the phase this one replaced (for hooks that start and end a phase apart)."""
        watchdog = self._watchdog
        ended, watchdog._phase = watchdog._phase, self._previous
        if ended != self._previous:
            watchdog._phase_ended(ended)
