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
deque for that and for actions (`_chores`); the census itself (milliseconds to seconds, logged
with its cost) runs only then.
The action's outcome, its block for the terminal (`action_outcome`), is logged when the loop says
what it did (`log_outcome`, or `carry_out`, which does both), or at the next `step()` if it never says.

The host's memory is watched beside the device's (`HostWatch`, on by `WatchdogConfig.host_memory`):
the sidecar reads it every `host_sample_every` steps, judges it with a Judge of its own and acts on
its verdicts as on the device's, each action saying which memory asked for it. Where the device's
memory is the host's (the `rss` source), there is one series, judged against both budgets.

An action's life once decided is the action path's (`runtime/action_path.py`, `Watchdog.actions`):
the hand-over, `carry_out`, the rebuild measured on its record, the block, the restarts.

Many ranks take one decision (`runtime/agreement.py`, through the action path): when
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

from watchdog.core.config import WatchdogConfig
from watchdog.core.errors import EXIT_FUTILE, EXIT_INTERRUPTED, EXIT_RESTART_REQUESTED, EXIT_UNSAVED
from watchdog.core.judge import Judge
from watchdog.core.phase import SAVE, parse_label, phase_label
from watchdog.core.readings import HostReading
from watchdog.core.sample import Sample
from watchdog.core.verdict import Action, Decided, Verdict
from watchdog.forensics.follower import LeakFollower, Suspects
from watchdog.logs import OncePerKind, ensure_readable_output, exception_text, get_logger
from watchdog.records import job_ledger
from watchdog.records.flight_record import FlightRecorder, path_for
from watchdog.records.job_ledger import LoopAccount
from watchdog.runtime import agreement, xla_stats
from watchdog.runtime.action_path import (DEVICE, FORCED, HANDED_OVER, REINITIALISED, RESTART_REQUESTED, UNSAVED,
                                          ActionPath)
from watchdog.runtime.agreement import Agreement, severity
from watchdog.runtime.checkpoint_figures import CheckpointFigures
from watchdog.runtime.compile_watch import CompileWatch
from watchdog.runtime.exit_watch import ExitWatch
from watchdog.runtime.host_watch import watch_the_host
from watchdog.readers.sources import (MemoryReading, MemorySource, current_device, device_kind, fresh_reading,
                                      release_host_memory, select_source)
from watchdog.runtime.sampler import FOLLOW, PHASE_END_REQUEST, REINIT, SAMPLE_REQUEST, STAGED, Asked, Sampler, stations
from watchdog.runtime.stall import start_stall_watch
from watchdog.station.blocks import ActionOutcome
from watchdog.station.station import Station
from watchdog.station.telemetry import Telemetry
from watchdog.station.trace_sink import TraceSink

log = get_logger(__name__)

__all__ = ["Watchdog", "PhaseScope", "DEVICE", "FORCED", "HANDED_OVER", "REINITIALISED", "RESTART_REQUESTED", "UNSAVED"]
_NEVER = 1 << 62  # no forced action to come


class Watchdog:
    """Watches device memory from a sidecar thread (the module docstring says how), built from parts
    it holds: the station that judges (`station`, and the host's in `HostWatch`), the sampler that
    runs the sidecar (`runtime/sampler.py`, from `start()`), the follower that names what leaks, and
    the action path (`actions`, `runtime/action_path.py`): an action's life once decided."""

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
        self._agree_with(agreement)
        self.history: deque[Sample] = deque(maxlen=config.history_size)
        self._source = source
        self._every, self._newest_step, self._phase = config.sample_every, -1, ""  # the phase: read with each sample
        self._mailbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._post = self._mailbox.put  # bound once: the hot path skips an attribute lookup
        self._asked = Asked()  # what the training thread asked the sidecar to read
        self._follower = LeakFollower(read=lambda: self._read_between_steps("source_read"),
                                      staged=lambda *around: self._post((STAGED, around))) if config.forensics else None
        # Work for the training thread between steps, in one deque so that step() checks one thing:
        # an action to hand over (a `Decided`), or FOLLOW (the follower has work, or a block is due).
        self._chores: deque = deque([FOLLOW] if config.forensics else [])
        self._flight = self._sampler = self._stall = self._host_watch = self._compile_watch = self._exit = None
        self._joined: Agreement | None = None  # the agreement start() joined (a loop's own is the loop's to close)
        self._error_log = OncePerKind(log, "watchdog_error")  # each kind logged once, every one counted
        self._forced = list(config.forced_actions)  # (step, action), in step order
        self._forced_at = self._forced[0][0] if self._forced else _NEVER
        if config.recompilation.explain and "torch_xla" in sys.modules:
            xla_stats.prepare_compile_analysis()  # before the first graph, or torch_xla never reads it
        self._apply_run_state()

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> "Watchdog":
        """Call on the training thread: the current XLA device is thread-local, so it is captured here."""
        if self._sampler is not None:
            return self
        ensure_readable_output()  # where the application configured no logging, its lines are still read
        config, actions = self.config, self.actions
        device = config.device or current_device()
        if self._source is None:
            self._source, _ = select_source(config.source, device, config.memory_limit_bytes, config.replay_trace)
        self.telemetry.device, self.telemetry.source = device, self._source.name
        flight_path = path_for(config.trace_file)  # first: a foreign file there is refused before anything is written
        if flight_path is not None:
            self._flight = actions.flight = FlightRecorder(flight_path, rank=config.rank, trace_file=config.trace_file)
        if actions.ranks is None and config.agree_across_ranks:  # every rank at once: making its group is collective
            self._agree_with(agreement.join(config.agreement_timeout_seconds))
            self._joined = actions.ranks
        if actions.ranks is not None:  # ranks out of step, or a peer lost: raised by the next step(), sampling or not
            actions.ranks.report_to(self._chores.append)
        if self._rank == 0:  # the job file is rank 0's: the ranks run in step; it begins at the first step()
            compile_seconds = xla_stats.compile_seconds if device_kind(device) == "xla" else (lambda: None)
            actions.account = LoopAccount.open(job_ledger.path_for(config.trace_file),
                                               compile_seconds=compile_seconds, telemetry=self.telemetry)
            if actions.account is not None:
                self._chores.append(FOLLOW)
        if device_kind(device) == "xla":
            self._compile_watch = CompileWatch(config.recompilation, self.telemetry)
        if device_kind(device) == "cuda" and self._flight is not None:
            _observe_cuda_ooms(self._flight)
        if config.trace_file is not None:
            self.station.trace = TraceSink(config.trace_file, self.telemetry, lambda: self.trace_retry_seconds)
        if config.host_memory:
            self._host_watch = watch_the_host(self._source, config, self.telemetry, lambda: self.trace_retry_seconds)
            self._apply_run_state()
        if actions.ranks is not None:
            for station in stations(self.station, self._host_watch):
                station.judge.agree_with_ranks()
        self._sampler = Sampler(self._mailbox, self._asked, self._source, self.station, self._host_watch,
                                self.telemetry, self.history, actions.run, self._follower, self._chores,
                                actions.account, self._flight, self._compile_watch, lambda: self._phase,
                                self._count_error).start()
        self._exit = ExitWatch(self._leave).arm()
        try:
            self._stall = start_stall_watch(config, lambda: self._newest_step, self.telemetry, self._flight,
                                            actions.ranks, self._rank)
        except BaseException:  # a failed start leaves no thread behind
            self.stop(clean=False)
            raise
        log.info("watchdog_started", device=device, source=self._source.name, sample_every=self._every,
                 memory_limit_bytes=config.memory_limit_bytes, rank=config.rank,
                 trace_file=str(config.trace_file) if config.trace_file else None)
        return self

    def stop(self, *, clean: bool = True) -> None:
        """Idempotent. Processes what was already posted, then flushes the trace. `clean=False`:
        the loop is leaving on an exception, and the flight record must not call that a clean end."""
        self._leave("done" if clean else "error", clean)

    def _leave(self, how: str, clean: bool) -> None:
        """`stop()`, or any other way out of the process (`ExitWatch`): the trace flushed, the flight
        record ended, the job file told `how` ("restart" where the newest action asked for an exit)."""
        if self._sampler is None:
            return
        if self._exit is not None:
            self._exit.disarm()
        actions = self.actions
        if actions.account is not None:
            asked = actions.last.exit_code if actions.last is not None else None
            if asked and how in ("done", "exit"):  # the newest action asked for an exit
                how = "futile" if asked == EXIT_FUTILE else "restart"
            actions.account.end(how, max(self._newest_step, 0))
        if self._stall is not None:
            self._stall.stop()
            self._stall = None
        self._sampler.stop()
        self._sampler = None
        if self._compile_watch is not None:
            self._compile_watch.close()
        if self._joined is not None:
            self._joined.close()
            self._agree_with(None)
            self._joined = None
        if actions.unlogged is not None:
            actions.log_outcome(HANDED_OVER)
        if self._follower is not None:
            self._follower.close()
        if self._flight is not None:
            self._flight.ended(clean)
        missed = 0
        for station in stations(self.station, self._host_watch):
            if station.trace is not None:
                station.close()
                missed += station.trace.samples_missed
        log.info("watchdog_stopped", samples=self.telemetry.samples_total,
                 sample_errors=self.telemetry.sample_errors_total, trace_errors=self.telemetry.trace_errors_total,
                 samples_missing_from_trace=missed)

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
        if self._flight is not None and "torch_xla" in sys.modules:
            from watchdog.forensics.program_sites import record_program

            record_program(self._flight, tensors)

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
        return self._follower.last if self._follower is not None else None

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
        if step >= self._forced_at:
            self._force(step)
        if step % self._every == 0:
            asked = self._asked
            asked.step, asked.phase = step, self._phase
            if not asked.posted:  # one request in flight at most: the sidecar reads the newest step
                asked.posted = True
                self._post(SAMPLE_REQUEST)
            agree = self._agree
            if agree is not None:
                if self._chores:
                    self._do_chores(step)
                return agree(step)
        if self._chores:  # rare: an action, a baseline, a capture's steps, a block to log
            return self._do_chores(step)
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
        if action.needs_checkpoint:
            self._chores.append(Decided(action, self.verdict, DEVICE, origin, own=False))  # not the watchdog's restart to count

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
        reading after the rebuild), or exited (`station/blocks.py`)."""
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
        held: list[str] = []
        if self._follower is not None:  # the old state is gone: a new baseline, a new capture; the holder named, again
            held = self._follower.after_rebuild(self._newest_step, capture=bool(self.telemetry.actions_total))
            self._chores.append(FOLLOW)
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

    def processes_grown(self) -> list[str]:
        """The job's other processes (DataLoader workers) whose own memory grew by
        `host_memory.GROWN_SAID_BYTES` or more since they started, most first, a line each: what the
        census of this process cannot reach, for an action's block."""
        source, host = self._source, self._host_watch
        tree = getattr(source, "tree", None) or (host.memory.tree if host is not None else None)
        return [descendant.line() for descendant in tree.grown()] if tree is not None else []

    def drain(self, timeout: float = 5.0) -> bool:
        """Block until the sidecar has handled everything posted so far; False on timeout."""
        return self._sampler.drain(timeout) if self._sampler is not None else True

    # ---- between steps -------------------------------------------------------------------------

    def _do_chores(self, step: int) -> Action | None:
        """Between steps, on the training thread: the follower's work, then the most severe action
        waiting, taken by the action path (handed over, or with several ranks held for the next offer)."""
        chores, follow, action = self._chores, False, None
        while chores:
            chore = chores.popleft()
            if chore is FOLLOW:
                follow = True
            elif isinstance(chore, BaseException):  # from the agreement's thread: ranks out of step, a peer lost
                if self._exit is not None and isinstance(chore, agreement.PeerLost):
                    self._exit.failed = True  # exit 43, whatever catches it: no clean end
                raise chore
            elif action is None or severity(chore.action) > severity(action.action):
                action = chore
        if follow:
            self._between_steps(step)
        if action is None:
            return None
        return self.actions.take(step, action)

    def _force(self, step: int) -> None:
        """Forced actions due now join the chores; those of steps this process never ran (it resumed
        past them) are dropped."""
        forced = self._forced
        while forced and forced[0][0] <= step:
            at, action = forced.pop(0)
            if at == step:
                log.warning("forced_action", action=action.value, step=step)
                self._chores.append(Decided(action, self.verdict, DEVICE, FORCED))  # a drill stands for the watchdog
        self._forced_at = forced[0][0] if forced else _NEVER

    def _between_steps(self, step: int) -> None:
        # Its marker was taken off before looking: a capture the sidecar arms meanwhile queues another.
        if self.actions.account is not None:
            self.actions.account.between_steps(step)
        self.actions.between_steps()
        if self._follower is not None:
            self._follower.between_steps(step)
            if self._follower.pending:
                self._chores.append(FOLLOW)

    def _read_between_steps(self, kind: str) -> tuple[MemoryReading | None, HostReading | None]:
        """One reading of each memory between steps, on the training thread, freed heap pages handed
        back first (glibc's `malloc_trim`): before a rebuild and after it alike, so what a rebuild is
        credited with is what it freed, never what the allocator gave back."""
        release_host_memory()
        device = host = None
        try:
            device = fresh_reading(self._source) if self._source is not None else None
            watch = self._host_watch
            if watch is not None and watch.station is not None:
                host = watch.memory.read()
        except Exception as exc:  # noqa: BLE001 - never raise into training
            self._count_error(kind, exc)
        return device, host

    def _suspects(self, step: int) -> list[str]:
        """What is leaking, named as an action leaves: this process's census (where it finds nothing
        growing, what a climbing phase's newest run held at its end), and the job's processes that grew."""
        named = self._follower.suspects(step) if self._follower is not None else []
        return named + self.processes_grown()

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
        if self._sampler is not None and self._newest_step >= 0:
            self._asked.ends.append((self._newest_step, label))
            self._post(PHASE_END_REQUEST)
        if self._follower is not None and self._follower.phases_climbing:
            self._follower.phase_ended(phase.name, self._newest_step)

    def _apply_run_state(self) -> None:
        """The run's state changed (resumed, or its end known): the judges and the telemetry are told."""
        run = self.actions.run
        for station in stations(self.station, self._host_watch):
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


def _observe_cuda_ooms(flight: FlightRecorder) -> None:
    """Have PyTorch's CUDA allocator tell the flight record of an OOM as it happens (torch's OOM
    observer; it cannot be removed, so it outlives the watchdog and keeps recording)."""
    import torch

    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is not None:
        attach(flight.observe_device_oom)
