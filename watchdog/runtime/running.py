"""What a started `Watchdog` runs: built in one place (`Running.start`), ended in one place (`end`).

`start()` builds, in this order, because each needs the one before: the flight record (first: a
foreign file at its path is refused before anything is written), the agreement with the other
ranks (joining it is collective: every rank at once), the job file (rank 0's), the compile watch
(XLA), the CUDA allocator's OOM observer, the trace, the host's watch, the sidecar thread
(`Sampler`), the exit watch and the stall watch. A start that fails anywhere ends what it built:
no thread, agreement or open record is left behind (the flight record says `unclean`).

`end()` is every way out (`stop()`, and whatever `ExitWatch` sees): the job file told how the run
ended, the threads stopped (what was posted is handled first), the agreement a start joined
closed, an action whose loop never said what it did logged, the flight record and the traces ended.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from watchdog.actions import agreement
from watchdog.actions.action_path import HANDED_OVER, ActionPath
from watchdog.core.config import WatchdogConfig
from watchdog.core.errors import EXIT_FUTILE
from watchdog.core.readings import HostReading
from watchdog.logs import get_logger
from watchdog.readers.sources import MemoryReading, MemorySource, device_kind, fresh_reading, release_host_memory
from watchdog.records import job_ledger
from watchdog.records.flight_record import FlightRecorder, path_for
from watchdog.records.job_ledger import LoopAccount
from watchdog.runtime import xla_stats
from watchdog.runtime.chores import Chores
from watchdog.runtime.compile_watch import CompileWatch
from watchdog.runtime.exit_watch import ExitWatch
from watchdog.runtime.host_watch import HostWatch, watch_the_host
from watchdog.runtime.sampler import FOLLOW, Asked, Sampler, stations
from watchdog.runtime.stall import StallWatch, start_stall_watch
from watchdog.station.station import Station
from watchdog.station.telemetry import Telemetry
from watchdog.station.trace_sink import TraceSink

log = get_logger(__name__)


@dataclass(eq=False)
class Running:
    """The parts a started watchdog runs, and the parts they end with (the action path, the chores,
    the device's station). None where a part is not run (no trace file, one rank, not XLA)."""

    source: MemorySource
    actions: ActionPath
    chores: Chores
    station: Station
    count_error: Callable[[str, BaseException], None]
    flight: FlightRecorder | None = None
    joined: agreement.Agreement | None = None  # the agreement start() joined (a loop's own is the loop's to close)
    host_watch: HostWatch | None = None
    compile_watch: CompileWatch | None = None
    sampler: Sampler | None = None
    exit: ExitWatch | None = None
    stall: StallWatch | None = None
    ended: bool = field(default=False, init=False)

    @classmethod
    def start(cls, config: WatchdogConfig, *, device: str, source: MemorySource, telemetry: Telemetry,
              station: Station, actions: ActionPath, chores: Chores, history: deque, mailbox, asked: Asked,
              rank: Callable[[], int], newest_step: Callable[[], int], phase_now: Callable[[], str],
              count_error: Callable[[str, BaseException], None], leave: Callable[[str, bool], None],
              retry_seconds: Callable[[], float], run_state_changed: Callable[[list[Station]], None]) -> "Running":
        """Build and start every part, on the training thread (`Watchdog.start`'s docstring says why); a
        start that fails ends what it built and raises."""
        running = cls(source, actions, chores, station, count_error)
        try:
            running._build(config, device, telemetry, history, mailbox, asked, rank, newest_step, phase_now, leave,
                           retry_seconds, run_state_changed)
        except BaseException:  # a start that fails anywhere leaves no thread, agreement or open record behind
            running.end("error", False, newest_step=max(newest_step(), 0), telemetry=telemetry)
            raise
        return running

    def _build(self, config: WatchdogConfig, device: str, telemetry: Telemetry, history: deque, mailbox,
               asked: Asked, rank, newest_step, phase_now, leave, retry_seconds, run_state_changed) -> None:
        actions, chores, station = self.actions, self.chores, self.station
        flight_path = path_for(config.trace_file)
        if flight_path is not None:
            self.flight = actions.flight = FlightRecorder(flight_path, rank=config.rank, trace_file=config.trace_file)
        if actions.ranks is None and config.agree_across_ranks:
            actions.ranks = self.joined = agreement.join(config.agreement_timeout_seconds)
        if actions.ranks is not None:  # ranks out of step, or a peer lost: raised by the next step()
            actions.ranks.report_to(chores.queue.append)
        if rank() == 0:  # the job file is rank 0's: the ranks run in step; it begins at the first step()
            compile_seconds = xla_stats.compile_seconds if device_kind(device) == "xla" else (lambda: None)
            actions.account = LoopAccount.open(job_ledger.path_for(config.trace_file),
                                               compile_seconds=compile_seconds, telemetry=telemetry)
            if actions.account is not None:
                chores.queue.append(FOLLOW)
        if device_kind(device) == "xla":
            self.compile_watch = CompileWatch(config.recompilation, telemetry)
        if device_kind(device) == "cuda" and self.flight is not None:
            _observe_cuda_ooms(self.flight)
        if config.trace_file is not None:
            station.trace = TraceSink(config.trace_file, telemetry, retry_seconds)
        if config.host_memory:
            self.host_watch = watch_the_host(self.source, config, telemetry, retry_seconds)
        run_state_changed(self.stations())  # the host's judge too
        if actions.ranks is not None:
            for judged in self.stations():
                judged.judge.agree_with_ranks()
        self.sampler = Sampler(mailbox, asked, self.source, station, self.host_watch, telemetry, history,
                               actions.run, chores.follower, chores.queue, actions.account, self.flight,
                               self.compile_watch, phase_now, self.count_error).start()
        self.exit = ExitWatch(leave).arm()
        chores.failed = self.exit.fail
        self.stall = start_stall_watch(config, newest_step, telemetry, self.flight, actions.ranks, rank())

    def stations(self) -> list[Station]:
        """The stations that judge: the device's, and the host's where it is judged apart."""
        return stations(self.station, self.host_watch)

    def read(self, kind: str) -> tuple[MemoryReading | None, HostReading | None]:
        """One reading of each memory between steps, on the training thread, freed heap pages handed
        back first (glibc's `malloc_trim`): before a rebuild and after it alike, so what a rebuild is
        credited with is what it freed, never what the allocator gave back. Never raises (`kind`
        names a failure, counted)."""
        release_host_memory()
        device = host = None
        try:
            device = fresh_reading(self.source)
            watch = self.host_watch
            if watch is not None and watch.station is not None:
                host = watch.memory.read()
        except Exception as exc:  # noqa: BLE001 - never raise into training
            self.count_error(kind, exc)
        return device, host

    def processes_grown(self) -> list[str]:
        """The job's other processes (DataLoader workers) whose own memory grew by
        `host_memory.GROWN_SAID_BYTES` or more since they started, most first, a line each: what the
        census of this process cannot reach, for an action's block."""
        host = self.host_watch
        tree = getattr(self.source, "tree", None) or (host.memory.tree if host is not None else None)
        return [descendant.line() for descendant in tree.grown()] if tree is not None else []

    def end(self, how: str, clean: bool, *, newest_step: int, telemetry: Telemetry) -> None:
        """Every part ended, once (the module docstring); `how` is the job file's word for the way out,
        "restart" where the newest action asked for an exit."""
        if self.ended:
            return
        self.ended = True
        if self.exit is not None:
            self.exit.disarm()
        actions = self.actions
        if actions.account is not None:
            asked = actions.last.exit_code if actions.last is not None else None
            if asked and how in ("done", "exit"):  # the newest action asked for an exit
                how = "futile" if asked == EXIT_FUTILE else "restart"
            actions.account.end(how, newest_step)
        if self.stall is not None:
            self.stall.stop()
        if self.sampler is not None:
            self.sampler.stop()
        if self.compile_watch is not None:
            self.compile_watch.close()
        if self.joined is not None:
            self.joined.close()
            actions.ranks = actions.offered = None  # its offer in flight went with it
        if actions.unlogged is not None:
            actions.log_outcome(HANDED_OVER)
        self.chores.close()
        if self.flight is not None:
            self.flight.ended(clean)
        missed = 0
        for station in self.stations():
            if station.trace is not None:
                station.close()
                missed += station.trace.samples_missed
        if self.sampler is not None:  # a start refused before anything ran says only why (its error)
            log.info("watchdog_stopped", samples=telemetry.samples_total, sample_errors=telemetry.sample_errors_total,
                     trace_errors=telemetry.trace_errors_total, samples_missing_from_trace=missed)


def _observe_cuda_ooms(flight: FlightRecorder) -> None:
    """Have PyTorch's CUDA allocator tell the flight record of an OOM as it happens (torch's OOM
    observer; it cannot be removed, so it outlives the watchdog and keeps recording)."""
    import torch

    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is not None:
        attach(flight.observe_device_oom)
