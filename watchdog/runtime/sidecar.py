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

Many ranks take one decision (`runtime/agreement.py`): when torch.distributed runs several ranks at
`start()`, an action is not handed over by the rank that decided it but held, and on each sampling
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
import math
import os
import queue
import sys
import threading
import time
from collections import deque
from contextlib import nullcontext
from typing import Any

from watchdog.core.config import DEFAULT_STALL_EXIT_SECONDS, WatchdogConfig
from watchdog.core.cycles import futile
from watchdog.core.errors import EXIT_FUTILE, EXIT_INTERRUPTED, EXIT_RESTART_REQUESTED, EXIT_UNSAVED, InputError
from watchdog.core.judge import Judge
from watchdog.core.phase import SAVE, parse_label, phase_label
from watchdog.core.readings import HostReading
from watchdog.core.restarts import RunState
from watchdog.core.sample import Sample
from watchdog.core.verdict import Action, Verdict
from watchdog.forensics.follower import LeakFollower, Suspects
from watchdog.logs import OncePerKind, ensure_readable_output, exception_text, get_logger
from watchdog.records import job_ledger
from watchdog.records.flight_record import FlightRecorder, path_for
from watchdog.records.job_ledger import LoopAccount
from watchdog.runtime import agreement, xla_stats
from watchdog.runtime.action_path import (DEVICE, FORCED, HANDED_OVER, REINITIALISED, RESTART_REQUESTED, UNSAVED,
                                          ActionPath, HandedOver)
from watchdog.runtime.agreement import Agreement, severity
from watchdog.runtime.checkpoint_figures import CheckpointFigures
from watchdog.runtime.compile_watch import CompileWatch
from watchdog.runtime.exit_watch import ExitWatch
from watchdog.runtime.host_watch import HOST, HostWatch, merge_into_rss
from watchdog.readers.sources import (MemoryReading, MemorySource, current_device, device_kind, fresh_reading,
                                      release_host_memory, select_source)
from watchdog.runtime.sampler import (BARRIER, FOLLOW, PHASE_END_REQUEST, REINIT, SAMPLE_REQUEST, STAGED, STOP, Asked,
                                     Sampler, stations)
from watchdog.runtime.stall import StallWatch
from watchdog.station.blocks import ActionOutcome
from watchdog.station.station import Station
from watchdog.station.telemetry import Telemetry
from watchdog.station.trace_sink import TraceSink

log = get_logger(__name__)

__all__ = ["Watchdog", "PhaseScope", "DEVICE", "FORCED", "HANDED_OVER", "REINITIALISED", "RESTART_REQUESTED", "UNSAVED"]
_NEVER = 1 << 62  # no forced action to come


class Watchdog(ActionPath):
    """Watches device memory from a sidecar thread; see the module docstring for the flow, and
    `runtime/action_path.py` for an action's life once handed over (`carry_out`, `state_dict`)."""

    trace_retry_seconds = 30.0  # after a trace I/O error, wait this long before reopening the file

    def __init__(self, config: WatchdogConfig | None = None, *, source: MemorySource | None = None,
                 telemetry: Telemetry | None = None, logs_outcomes: bool = False,
                 agreement: Agreement | None = None):
        """`logs_outcomes`: the loop says what it did with every action (`carry_out`, `log_outcome`),
        perhaps some steps later (after an evaluation): the block is never logged for it at the next step.
        `agreement`: a loop that agrees on more than the watchdog's actions (the trainer: whether
        every rank's save landed) shares its own; by default `start()` joins one when several ranks run."""
        config = config or WatchdogConfig()
        self.config = config
        self.telemetry = telemetry or Telemetry(rank=self.config.rank)
        self.telemetry.part(CheckpointFigures)  # served from the first scrape
        self.station = Station(Judge(self.config.detector, self.config.policy,
                                     memory_limit_bytes=self.config.memory_limit_bytes), self.telemetry, memory=DEVICE)
        self._run_state = RunState.from_environment(os.environ)  # the restart engine's count, until a checkpoint's
        self.history: deque[Sample] = deque(maxlen=self.config.history_size)
        self._source = source
        self._every = self.config.sample_every
        self._newest_step = -1
        self._mailbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._post = self._mailbox.put  # bound once: the hot path skips an attribute lookup
        self._asked = Asked()  # what the training thread asked the sidecar to read
        self._phase = ""  # the loop's phase label; read by the sidecar with each sample
        self._account: LoopAccount | None = None  # this process's share of the job file (rank 0, from start())
        self._exit: ExitWatch | None = None  # every way out of the process ends the records (from start())
        # step() pays for every attribute it reads, and more once an instance has over 30 (CPython's
        # shared-key dict; tests/test_sidecar.py counts them).
        self._handed = HandedOver(logs_outcomes)
        self._drives_follower = self.config.forensics
        self._follower = LeakFollower() if self._drives_follower else None
        # Work for the training thread between steps, in one deque so that step() checks one thing:
        # an action to hand over (a tuple), or FOLLOW (the follower has work, or a block is due).
        self._chores: deque = deque([FOLLOW] if self._drives_follower else [])
        self._flight: FlightRecorder | None = None
        self._thread: threading.Thread | None = None
        self._stall: StallWatch | None = None
        self._host_watch: HostWatch | None = None
        self._error_log = OncePerKind(log, "watchdog_error")  # each kind logged once, every one counted
        self._compile_watch: CompileWatch | None = None
        self._ranks = agreement  # several ranks: the agreement every action goes through
        self._joined: Agreement | None = None  # the agreement start() joined (a loop's own is the loop's to close)
        self._forced = list(self.config.forced_actions)  # (step, action), in step order
        self._forced_at = self._forced[0][0] if self._forced else _NEVER
        if self.config.recompilation.explain and "torch_xla" in sys.modules:
            xla_stats.prepare_compile_analysis()  # before the first graph, or torch_xla never reads it
        self._apply_run_state()

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> "Watchdog":
        """Call on the training thread: the current XLA device is thread-local, so it is captured here."""
        if self._thread is not None:
            return self
        ensure_readable_output()  # where the application configured no logging, its lines are still read
        device = self.config.device or current_device()
        if self._source is None:
            self._source, _ = select_source(self.config.source, device, self.config.memory_limit_bytes,
                                            self.config.replay_trace)
        self.telemetry.device = device
        self.telemetry.source = self._source.name
        flight_path = path_for(self.config.trace_file)  # first: a foreign file there is refused before anything is written
        if flight_path is not None:
            self._flight = FlightRecorder(flight_path, rank=self.config.rank, trace_file=self.config.trace_file)
        if self._ranks is None and self.config.agree_across_ranks:  # every rank at once: making its group is collective
            self._ranks = self._joined = agreement.join(self.config.agreement_timeout_seconds)
        if self._ranks is not None:  # ranks out of step, or a peer lost: raised by the next step(), sampling or not
            self._ranks.report_to(self._chores.append)
        self._open_account(device)
        if device_kind(device) == "xla":
            self._compile_watch = CompileWatch(self.config.recompilation, self.telemetry)
        if device_kind(device) == "cuda" and self._flight is not None:
            _observe_cuda_ooms(self._flight)
        if self.config.trace_file is not None:
            self.station.trace = TraceSink(self.config.trace_file, self.telemetry, lambda: self.trace_retry_seconds)
        if self.config.host_memory:
            self._watch_the_host()
            self._apply_run_state()
        if self._ranks is not None:
            for station in stations(self.station, self._host_watch):
                station.judge.agree_with_ranks()
        sampler = Sampler(self._mailbox, self._asked, self._source, self.station, self._host_watch, self.telemetry,
                          self.history, self._run_state, self._follower, self._chores, self._account,
                          self._flight, self._compile_watch, lambda: self._phase, self._count_error)
        self._thread = threading.Thread(target=sampler.run, name="hbm-watchdog", daemon=True)
        self._thread.start()
        self._exit = ExitWatch(self._leave).arm()
        try:
            self._stall = self._stall_watch()
        except BaseException:  # a failed start leaves no thread behind
            self.stop(clean=False)
            raise
        log.info("watchdog_started", device=device, source=self._source.name, sample_every=self._every,
                 memory_limit_bytes=self.config.memory_limit_bytes, rank=self.config.rank,
                 trace_file=str(self.config.trace_file) if self.config.trace_file else None)
        return self

    def stop(self, *, clean: bool = True) -> None:
        """Idempotent. Processes what was already posted, then flushes the trace. `clean=False`:
        the loop is leaving on an exception, and the flight record must not call that a clean end."""
        self._leave("done" if clean else "error", clean)

    def _leave(self, how: str, clean: bool) -> None:
        """`stop()`, or any other way out of the process (`ExitWatch`): the trace flushed, the flight
        record ended, the job file told `how` ("restart" where the newest action asked for an exit)."""
        if self._thread is None:
            return
        if self._exit is not None:
            self._exit.disarm()
        if self._account is not None:
            asked = self._handed.last.exit_code if self._handed.last is not None else None
            if asked and how in ("done", "exit"):  # the newest action asked for an exit
                how = "futile" if asked == EXIT_FUTILE else "restart"
            self._account.end(how, max(self._newest_step, 0))
        if self._stall is not None:
            self._stall.stop()
            self._stall = None
        self._post((STOP, None))
        self._thread.join(timeout=30)
        self._thread = None
        if self._compile_watch is not None:
            self._compile_watch.close()
        if self._joined is not None:
            self._joined.close()
            self._ranks = self._joined = None
        if self._handed.unlogged is not None:
            self.log_outcome(HANDED_OVER)
        if self._drives_follower:
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

    def _open_account(self, device: str) -> None:
        """This process's share of the job file (`HBMWATCH_JOB_FILE`, which supervise sets, else beside
        the trace), kept by rank 0 alone: the ranks run in step. It begins at the first `step()`."""
        rank = self._ranks.rank if self._ranks is not None else self.config.rank
        if rank != 0:
            return
        compile_seconds = xla_stats.compile_seconds if device_kind(device) == "xla" else (lambda: None)
        self._account = LoopAccount.open(job_ledger.path_for(self.config.trace_file),
                                         compile_seconds=compile_seconds, telemetry=self.telemetry)
        if self._account is not None:
            self._chores.append(FOLLOW)  # the first step() begins it

    def _timed(self, cause: str):
        """A span of the job's time that is no training step (a save, a rebuild), for the job file."""
        return self._account.timed(cause, self._newest_step) if self._account is not None else nullcontext()

    def _watch_the_host(self) -> None:
        """The host's series beside the device's, or one series where they are the same memory."""
        try:
            if self._source.name == "rss":
                self._host_watch = merge_into_rss(self._source, self.config, self.telemetry)
                return
            host_telemetry = Telemetry()
            self._host_watch = HostWatch(self.config, host_telemetry, trace_retry_seconds=lambda: self.trace_retry_seconds)
            self.telemetry.host_series = host_telemetry
        except InputError:
            raise
        except Exception as exc:  # noqa: BLE001 - no /proc (not Linux): the device is still watched
            log.warning("host_memory_unwatched", error=f"{type(exc).__name__}: {exc}")

    def record_program(self, tensors) -> None:
        """Keep the step's traced program in the flight record: its largest ops, each with the Python
        line that asked for it (the user's own, not torch's), so that `postmortem` can name your line
        behind an allocation in XLA's out-of-memory message. Call once, on the training thread, after
        a step is traced and before its sync, with what the step computes (the loss, the parameters,
        the optimizer's state): it lowers that graph to HLO (no compilation, no execution, no
        transfer). Python lines are in the program only under XLA_IR_DEBUG=1 XLA_HLO_DEBUG=1."""
        if self._flight is None or "torch_xla" not in sys.modules:
            return
        from watchdog.forensics.program_sites import program_sites

        started = time.perf_counter()
        try:
            ops = program_sites(list(tensors))
        except Exception as exc:  # noqa: BLE001 - a diagnosis aid never stops training
            log.warning("program_sites_failed", error=f"{type(exc).__name__}: {exc}")
            return
        self._flight.observe_program([op.to_json() for op in ops])
        log.info("program_sites_recorded", ops=len(ops), with_user_lines=sum(1 for op in ops if op.user),
                 seconds=round(time.perf_counter() - started, 3))

    @property
    def checkpoint_figures(self) -> CheckpointFigures:
        """The saves' figures (`hbmwatch_checkpoint_seconds`...), on the device series' telemetry."""
        return self.telemetry.part(CheckpointFigures)

    @property
    def verdict(self) -> Verdict | None:
        """The device series' newest verdict (None before the first sample). An attribute read: a
        loop may read it every step."""
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
        return self._host_watch.station.verdict if self._host_watch is not None and self._host_watch.station is not None else None

    @property
    def judge(self) -> Judge:
        """The device series' Judge (its limit, its detector), for loops and tests that read them."""
        return self.station.judge

    @property
    def source_name(self) -> str:
        return self._source.name if self._source is not None else "none"

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
            if self._ranks is not None:
                return self._agree(step)
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
            self._chores.append((action, self.verdict, DEVICE, origin, False))  # not the watchdog's restart to count

    @property
    def ranks(self) -> int:
        """How many ranks take this watchdog's decisions together (1: this process alone)."""
        return self._ranks.ranks if self._ranks is not None else 1

    def reinit_finished(self) -> None:
        """After checkpoint-and-reinit: one reading now (between steps, so no activations are live)
        tells the policy whether the rebuild brought memory back down or the leak survived it."""
        decided = self._handed.last
        held: list[str] = []
        if self._drives_follower:  # the old state is gone: a new baseline, a new capture
            self._follower.rebuilt(capture=bool(self.telemetry.actions_total))
            held = self._follower.not_freed(self._newest_step)  # the holder named before, looked at again
            self._chores.append(FOLLOW)
        took = before = None
        readings = self._read_between_steps("reinit_read")
        if decided is not None:  # what it freed, like with like, measured here: nothing waits for the sidecar
            decided.not_freed = held
            # measured once: a second call is measured against the floor, as before
            before, decided.readings_before = decided.readings_before, None
            after = _bytes_of(readings, decided.memory)
            if after is not None:
                decided.memory_after_bytes = after
                if before is not None and (then := _bytes_of(before, decided.memory)) is not None:
                    decided.recovered_bytes = then - after
            if decided.verdict is not None:
                took = self._run_state.took_steps = max(0, self._newest_step - decided.verdict.step)  # decided -> rebuilt
        self._post((REINIT, (before, readings, took, bool(held))))  # the action's one message back

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

    def processes_grown(self) -> list[str]:
        """The job's other processes (DataLoader workers) whose own memory grew by
        `host_memory.GROWN_SAID_BYTES` or more since they started, most first, a line each: what the census of this process cannot
        reach, for an action's block."""
        source, host = self._source, self._host_watch
        tree = getattr(source, "tree", None) or (host.memory.tree if host is not None else None)
        return [descendant.line() for descendant in tree.grown()] if tree is not None else []

    def observe_checkpoint(self, seconds: float) -> None:
        """A save the loop made, timed (`hbmwatch_checkpoint_seconds`). The judges learn from it what an
        action takes: from the first one on, actions come at the latest safe moment (`core/action_time.py`).
        `carry_out` times the saves it makes; a loop that saves on its own (every N steps) calls it
        with what its save took, so that the first action already knows."""
        self.checkpoint_figures.observe_save(seconds)
        self._asked.saves.append(seconds)  # told before whatever the sidecar handles next: no message of its own

    @property
    def suspects(self) -> Suspects | None:
        """The newest census's answer to "what is leaking" (also logged as `leak_suspects`)."""
        return self._follower.last if self._follower is not None else None

    def drain(self, timeout: float = 5.0) -> bool:
        """Block until the sidecar has handled everything posted so far; False on timeout."""
        if self._thread is None:
            return True
        done = threading.Event()
        self._post((BARRIER, done))
        return done.wait(timeout)

    def _do_chores(self, step: int) -> Action | None:
        """Between steps, on the training thread: the follower's work, then the most severe action
        waiting, handed over (with several ranks: held for the next agreement)."""
        chores, follow, action = self._chores, False, None
        while chores:
            chore = chores.popleft()
            if chore is FOLLOW:
                follow = True
            elif isinstance(chore, BaseException):  # from the agreement's thread: ranks out of step, a peer lost
                if self._exit is not None and isinstance(chore, agreement.PeerLost):
                    self._exit.failed = True  # exit 43, whatever catches it: no clean end
                raise chore
            elif action is None or severity(chore[0]) > severity(action[0]):
                action = chore
        if follow:
            self._between_steps(step)
        if action is None:
            return None
        if self._ranks is not None:
            held = self._handed.held
            if held is None or severity(action[0]) > severity(held[0]):
                self._handed.held = action
            return None
        return self._hand_over(step, *action)

    def _agree(self, step: int) -> Action | None:
        """A sampling step with several ranks: take the action agreed on the previous sampling step's
        offers, and offer the most severe action held now (its answer comes at the next one)."""
        if self._chores:
            self._do_chores(step)
        handed, ranks = self._handed, self._ranks
        if step == ranks.offered_at:  # the same step again (an accumulation's micro-batches): one offer a step
            return None
        agreed = ranks.collect(step)
        offered, held = handed.offered, handed.held
        if agreed is not None and held is not None and held[4] and severity(held[0]) <= severity(agreed.action):
            held = None  # the watchdog's own, decided on the state the agreed action now replaces
        ranks.post(step, held[0] if held is not None else None, own=held[4] if held is not None else True,
                   every=self._every)
        handed.offered, handed.held = held, None
        if agreed is None:
            return None
        mine = offered is not None and offered[0] is agreed.action and agreed.asked_by == ranks.rank
        # Another rank's restart counts against the watchdog's budget only when its watchdog asked for
        # it: a preemption of one rank is no restart of the watchdog's on the others.
        verdict, memory, origin, counts = offered[1:] if mine else (self.verdict, DEVICE, "", agreed.own)
        return self._hand_over(step, agreed.action, verdict, memory, agreed.origin(origin), counts)

    def _force(self, step: int) -> None:
        """Forced actions due now join the chores; those of steps this process never ran (it resumed
        past them) are dropped."""
        forced = self._forced
        while forced and forced[0][0] <= step:
            at, action = forced.pop(0)
            if at == step:
                log.warning("forced_action", action=action.value, step=step)
                self._chores.append((action, self.verdict, DEVICE, FORCED, True))  # a drill stands for the watchdog
        self._forced_at = forced[0][0] if forced else _NEVER

    def _between_steps(self, step: int) -> None:
        # Its marker was taken off before looking: a capture the sidecar arms meanwhile queues another.
        if self._account is not None:
            self._account.between_steps(step)
        if self._handed.unlogged is not None and not self._handed.logs_outcomes:  # its loop never said
            self.log_outcome(HANDED_OVER)
        if self._drives_follower:
            around = self._read_between_steps("source_read") if self._follower.baseline_due else None
            self._follower.between_steps(step)
            if around is not None:  # the census an action takes holds this much beside memory, at least
                self._post((STAGED, (around, self._read_between_steps("source_read"))))
            if self._follower.pending:
                self._chores.append(FOLLOW)

    @property
    def restart_window_steps(self) -> int:
        return self.config.policy.restart_window_steps

    def _hand_over(self, step: int, action: Action, verdict: Verdict | None, memory: str, origin: str = "",
                   counts: bool = True) -> Action:
        super()._hand_over(step, action, verdict, memory, origin, counts)
        if action is Action.CHECKPOINT_REINIT:  # what the rebuild will be measured against
            self._handed.last.readings_before = self._read_between_steps("rebuild_read")  # sent with those after it
        if self._account is not None and counts and action.needs_checkpoint:  # the watchdog's, not a preemption
            self._account.action(action.value, step, _projected_oom(step, verdict))
        if not self._handed.logs_outcomes:  # its block is logged at the next step, if the loop says nothing
            self._chores.append(FOLLOW)
        return action

    def _futile(self, action: Action, cycle: int | None) -> str | None:
        """Restarting will not save this job: a restart past the watchdog's restart budget (a rebuild
        did not free the leak, or the host's memory wants a new process, and restarts in a row are
        spent), or cycles that shrink, or one no longer than the reinit before it took (`core/cycles.py`).
        Decided on what every rank shares: the cycles' steps, the restarts."""
        policy, run = self.config.policy, self._run_state
        if action is Action.CHECKPOINT_RESTART and run.budget_spent >= policy.max_restarts:
            return (f"its {policy.max_restarts} restarts in a row are spent and it needs another "
                    f"(cycles of {', '.join(f'{n:,}' for n in run.cycles) or 'unknown'} steps)")
        return futile(run.cycles, cycle, run.took_steps)

    def _suspects(self, step: int) -> list[str]:
        """What is leaking, named now: this process's census (where it finds nothing growing, what a
        climbing phase's newest run held at its end), and the job's processes that grew."""
        named = []
        if self._drives_follower:
            named = self._follower.name(step) or self._follower.held_by_phase()
        return named + self.processes_grown()

    def _phase_ended(self, label: str) -> None:
        """The loop's phase changed on the training thread (a scope left, or another phase said): the
        job's account follows it; where a bounded phase ended, one reading now, labelled with it,
        whose peak since the previous reading is the phase's last (an evaluation's end-of-pass copy of
        its predictions, a save's staging copy), and a climbing phase's run is counted."""
        if self._account is not None:  # an evaluation's time is no training step's
            self._account.phase(_bounded(self._phase), self._newest_step,
                                "checkpoint_save" if parse_label(self._phase).name == SAVE else "eval")
        phase = parse_label(label)
        if not phase.bounded:
            return
        if self._thread is not None and self._newest_step >= 0:
            self._asked.ends.append((self._newest_step, label))
            self._post(PHASE_END_REQUEST)
        if self._drives_follower and self._follower.phases_climbing:
            self._follower.phase_ended(phase.name, self._newest_step)

    def _apply_run_state(self) -> None:
        run = self._run_state
        for station in stations(self.station, self._host_watch):
            station.judge.ends_at(run.last_step)
            station.telemetry.restarts_total = run.restarts_so_far

    def _measure(self, decided: ActionOutcome) -> None:
        """Into the flight record (what a reinit gave back is on the record already: `reinit_finished`)."""
        if decided.suspects and self._flight is not None:  # every loop's outcome comes through here
            self._flight.observe_action(decided.step, decided.suspects)

    def _count_error(self, kind: str, exc: BaseException) -> None:
        self.telemetry.sample_errors_total += 1
        self._error_log(kind, type(exc).__name__, error=exception_text(exc))

    def _stall_watch(self) -> StallWatch:
        """Started on the training thread (whose stack says where a stall is). A stalled rank hangs
        every other rank: with several ranks a stall ends the process unless told otherwise."""
        exit_after = self.config.stall_exit_after_seconds
        if exit_after is None and self._ranks is not None:
            exit_after = DEFAULT_STALL_EXIT_SECONDS
        rank = self._ranks.rank if self._ranks is not None else self.config.rank
        return StallWatch(lambda: self._newest_step, self.telemetry, report_after=self.config.stall_after_seconds,
                          check_every=self.config.stall_check_seconds, exit_after=exit_after, flight=self._flight,
                          rank=rank, waiting=self._ranks.waiting_for if self._ranks is not None else None).start()


@functools.lru_cache(maxsize=256)
def _label(name: str, steps: int | None) -> str:
    """A phase's label, validated once (a bad name raises ConfigError the first time, every time)."""
    return phase_label(name, steps)


def _bytes_of(readings: tuple, memory: str) -> float | None:
    """The reading of the memory that asked for an action, of a `_read_between_steps` pair."""
    reading = readings[1] if memory == HOST else readings[0]
    return None if reading is None else float(reading.bytes_used)


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


def _projected_oom(step: int, verdict: Verdict | None) -> int | None:
    """The OOM an action was decided against, in the job file's steps (done after `step(step)`)."""
    if verdict is None or verdict.projected_oom_step is None or not math.isfinite(verdict.projected_oom_step):
        return None
    return step + 1 + max(0, round(verdict.projected_oom_step - verdict.step))


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
