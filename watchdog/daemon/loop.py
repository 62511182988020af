"""The daemon: find the target, sample it on a time axis, judge every device, signal before the OOM.

    wait for the target (--wait-seconds) -> attach: a new segment for every device
      every --interval seconds, tick k of the segment:
        read every device -> Sample(step=k, timestamp=now) -> that device's station:
          trace CSV, telemetry (Prometheus), Judge -> verdict, action, and its lines
        -> CHECKPOINT_*: the signal (once per tick, whichever device asked)
        -> after a signal: the escalation ladder, sample by sample
    the target exits -> wait for it to come back (pattern, pidfile) -> attach again ...

Each device goes through its own `Station` (`station/station.py`), the sidecar's path: a Judge,
telemetry, a best-effort trace, and the same lines (`leak_detected`, `action_decided`,
`restart_measured`) as in process. The daemon supplies the readings and carries out what a
checkpoint action asks for: a signal, then the escalation ladder. A new segment (a restarted
process) tells every station `restarted()` and numbers samples from 0 again (so the trace shows
the new segment as steps going back, which every analysis command reads as a new process); once
the new process has warmed up, the station measures what the restart gave back
(`restart_measured`, like the sidecar's `reinit_measured`).

Failures of one reading (a vanished child, a permission error, a busy endpoint that raises or
times out) are counted and logged once per kind; the loop carries on. A tick that the reading
overran is skipped, never squeezed in, so sample numbers stay proportional to time.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from watchdog.core.errors import InputError
from watchdog.core.judge import Judge, effective_limit
from watchdog.core.sample import Sample, labelled_trace_path
from watchdog.core.verdict import Action, Verdict
from watchdog.daemon.job_file import TargetAccount
from watchdog.daemon.metrics import WatchState
from watchdog.core.readings import DeviceMemory, MemorySource
from watchdog.readers.outside import PROCESS_DEVICE, PartialReading
from watchdog.daemon.signalling import Escalation, Step, disposition, send, unhandled_words
from watchdog.daemon.stopping import StopFlag
from watchdog.daemon.targets import Finder, WatchedProcess, running
from watchdog.daemon.timeaxis import TimeAxis
from watchdog.logs import OncePerKind, exception_text, get_logger
from watchdog.readers.host_memory import HOST_DEVICE, RssSource
from watchdog.station.station import Station
from watchdog.station.telemetry import Telemetry
from watchdog.station.trace_sink import TraceSink

log = get_logger(__name__)

HANDOVER_CHECK_SECONDS = 1.0  # how often a pattern's target is checked for a job it launched (or a larger child)
WAIT_POLL_SECONDS = 1.0  # at most this long between looks for the target while it is away
TRACE_RETRY_SECONDS = 30.0  # after a trace I/O error, the daemon goes on and reopens the file this much later


@dataclass(frozen=True)
class WatchConfig:
    axis: TimeAxis = field(default_factory=TimeAxis)
    memory_limit_bytes: int | None = None
    signal: signal.Signals = signal.SIGTERM
    signal_group: bool = False
    escalate_to: signal.Signals | None = signal.SIGKILL
    act: bool = True
    """False (`--no-act`): every signal the daemon would send is a warning instead."""
    wait_seconds: float = 300.0
    """How long to wait for the target to appear, at start and after it exits."""
    trace_file: Path | None = None


class _Device:
    """One device: its station (Judge, telemetry, trace, the lines it logs), and whether a restart's
    recovery is still to be measured."""

    def __init__(self, name: str, source: str, config: WatchConfig, trace_path: Path | None, pid: int):
        axis = config.axis
        telemetry = Telemetry(device=name, source=source)
        judge = Judge(axis.detector_config(), axis.policy_config(), memory_limit_bytes=config.memory_limit_bytes)
        trace = (TraceSink(trace_path, telemetry, lambda: TRACE_RETRY_SECONDS, flush_every=max(1, axis.samples(5.0)),
                           named_by_user=trace_path == config.trace_file)  # a device's own name: no link followed
                 if trace_path else None)
        self.station = Station(judge, telemetry, trace, device=name, pid=pid)
        self.telemetry = telemetry
        self.settle_pending = False  # a restart's recovery is measured once the new process warmed up


def trace_path_for(base: Path, device: str, only_device: bool) -> Path:
    """One device: the path given. Several: one trace each, `trace.tpu-0.csv` beside `trace.csv`."""
    return base if only_device else labelled_trace_path(base, device)


class Daemon:
    """Runs until the target is gone for good or `stop` is set; see the module docstring."""

    def __init__(self, config: WatchConfig, finder: Finder,
                 make_reader: Callable[[psutil.Process], MemorySource] = lambda process: RssSource(
                     pid=process.pid, kernel_limits=True), *,
                 stop: threading.Event | StopFlag | None = None):
        self.config = config
        self.finder = finder
        self.make_reader = make_reader
        self.stop = stop or threading.Event()
        self.state = WatchState()
        self.devices: dict[str, _Device] = {}
        self.telemetry: dict[str, Telemetry] = {}  # device -> telemetry, what the collector reads
        self._interval = config.axis.interval_seconds
        self._warmup = config.axis.warmup_samples
        self._handover_every = max(1, config.axis.samples(HANDOVER_CHECK_SECONDS))
        self._escalation = Escalation(config.axis.grace_seconds, config.escalate_to)  # type: ignore[arg-type]
        self._signalled_at: float | None = None  # monotonic time of the last signal to the current target
        self._restart_after_signal = False  # the current target replaced one the daemon had signalled
        self._error_log = OncePerKind(log, "watch_error")  # each kind once; the counter has them all
        self._exited: tuple[int, float] | None = None  # the process watched last, gone: never attached again
        self._leak_seen = False  # the first leak seen is measured against what the time axis can protect
        self._account: TargetAccount | None = None  # the watched target's share of the job file

    # -- the life of the daemon ---------------------------------------------------------------

    def run(self) -> int:
        """0 when stopped or when the target is gone for good; InputError when it never appeared."""
        try:
            target = self._wait_for_target(first=True)
            while target is not None:
                self._watch(target)
                self._exited = target.identity
                if self.stop.is_set() or not self.finder.comes_back:
                    break
                target = self._wait_for_target(first=False)
        finally:
            for device in self.devices.values():
                device.station.close()
        log.info("watch_ended", attachments=self.state.attachments, signals=self.state.signals_snapshot(),
                 errors=self.errors, stopped=self.stop.is_set())
        return 0

    def _wait_for_target(self, first: bool) -> WatchedProcess | None:
        deadline = time.monotonic() + self.config.wait_seconds
        poll = min(self._interval, WAIT_POLL_SECONDS)
        announced = False
        while not self.stop.is_set():
            try:
                process = self.finder.find()
            except psutil.Error as exc:
                self._count_error("find", exc)
                process = None
            if process is not None and not self._gone(process):
                target = WatchedProcess(process)
                self._check_may_signal(target, first)
                return target
            if time.monotonic() >= deadline:
                why = self.finder.why_not_found()
                if first:
                    raise InputError(f"no target after {self.config.wait_seconds:g} s (--wait-seconds): {why}")
                log.info("target_did_not_return", target=self.finder.description, waited_seconds=self.config.wait_seconds,
                         reason=why)
                return None
            if not announced:
                log.info("waiting_for_target", target=self.finder.description, reason=self.finder.why_not_found(),
                         wait_seconds=self.config.wait_seconds)
                announced = True
            self.stop.wait(poll)
        return None

    def _gone(self, process: psutil.Process) -> bool:
        """A process found that cannot be watched, whatever the finder said: one that no longer runs
        (a zombie), or the very process whose exit ended the last watch. Attaching to either ended at
        once and found it again: 22,000 attachments and 9 MiB of log in 12 s, never waiting
        --wait-seconds. It is waited on like no process at all."""
        try:
            identity = (process.pid, process.create_time())
        except psutil.Error:
            return True
        return identity == self._exited or not running(process)

    def _check_may_signal(self, target: WatchedProcess, first: bool) -> None:
        """At start, a process the daemon may not signal is the user's to fix; later, it is watched anyway."""
        if not self.config.act:
            return
        try:
            target.signal(0)
        except PermissionError:
            message = (f"no permission to signal PID {target.pid} ({_owner(target)}): run the daemon as that "
                       f"user (or with CAP_KILL), or watch only with --no-act")
            if first:
                target.close()
                raise InputError(message) from None
            log.error("cannot_signal_target", pid=target.pid, reason=message, note="watching without acting")
        except ProcessLookupError:
            pass  # gone already: the watch loop notices

    # -- one process ------------------------------------------------------------------------------

    def _attach(self, target: WatchedProcess, *, restart: bool = True) -> MemorySource:
        """A new segment. After a restart, what it gave back is measured once the new process warmed
        up; a handover to a child is no restart (the child's memory was inside the tree watched)."""
        self.state.attachments += 1
        self.state.watched_pid = target.pid
        self._unread_since: float | None = None  # the first of the failed readings since the last good one
        since_signal = None if self._signalled_at is None else round(time.monotonic() - self._signalled_at, 3)
        self._restart_after_signal = since_signal is not None
        self._signalled_at = None
        log.info("target_attached", pid=target.pid, target=self.finder.description, command=target.command_line(),
                 attachment=self.state.attachments, seconds_since_signal=since_signal)
        for device in self.devices.values():  # a new segment: every judge starts over
            device.station.context["pid"] = target.pid
            if restart:
                device.station.restarted()
            else:  # a handover: the same job, in a child the tree held already
                device.station.judge.restarted()
            device.settle_pending = restart
        self._escalation.reset()
        self._handler_checked = False  # whether it saves on the signal: asked once it has started up
        self._account = TargetAccount.of(target.process)  # the job file its supervise named, if any
        return self.make_reader(target.process)

    def _watch(self, target: WatchedProcess) -> None:
        """Until the target exits or the daemon is stopped; closes the target (its pidfd) either way."""
        gone = False  # seen gone: it may still be tearing down (its memory is, its process not yet)
        try:
            reader = self._attach(target)
            start, tick = time.monotonic(), 0
            while not self.stop.is_set():
                if not target.alive():
                    gone = True
                    log.info("target_exited", pid=target.pid, signalled=self._signalled_at is not None)
                    return
                if tick and tick % self._handover_every == 0:
                    child = self.finder.handover(target.process)
                    if child is not None:
                        log.info("target_handed_over", from_pid=target.pid, to_pid=child.pid,
                                 note="a matching child holds more memory than the process watched")
                        target.close()
                        target = WatchedProcess(child)
                        reader = self._attach(target, restart=False)
                        start, tick = time.monotonic(), 0
                        continue
                readings = self._read(reader)
                if readings is None:
                    gone = True
                    log.info("target_exited", pid=target.pid, signalled=self._signalled_at is not None, during="read")
                    return
                if readings:
                    self._judge_all(target, reader.name, tick, readings)
                tick = self._sleep_until_next_tick(start, tick)
        finally:
            if self._account is not None:  # what the daemon knows of it, for the job's goodput
                self._account.record(signalled=self._signalled_at is not None, exited=gone or not target.alive())
                self._account = None
            target.close()
            self.state.watched_pid = 0  # while waiting for it to come back, no PID is watched

    def _read(self, reader: MemorySource) -> tuple[DeviceMemory, ...] | None:
        """The devices' readings; None once the process is gone; [] after a counted failure. A device
        that has given no reading for --wait-seconds since the target was attached (a TPU's metrics
        endpoint that never answers: the daemon ran on, judging only the host) is bad input: one
        line, exit 2."""
        try:
            reading = reader.read()
        except psutil.NoSuchProcess:
            return None
        except PartialReading as partial:  # a device failed: the others are judged all the same
            self._count_error("read", partial.error)
            self._unread(partial.error)
            return partial.reading.each_device(PROCESS_DEVICE)
        except Exception as exc:  # noqa: BLE001 - a daemon outlives any one failed reading
            self._count_error("read", exc)
            self._unread(exc)
            return ()
        self._unread_since = None
        return reading.each_device(PROCESS_DEVICE)

    def _unread(self, error: BaseException) -> None:
        """A reading failed: since when, and past --wait-seconds of nothing but failures, say so and stop."""
        now = time.monotonic()
        if self._unread_since is None:
            self._unread_since = now
        elif now - self._unread_since >= self.config.wait_seconds:
            raise InputError(f"no reading of the devices for {self.config.wait_seconds:g} s (--wait-seconds) "
                             f"while the target ran: {exception_text(error)}")

    def _sleep_until_next_tick(self, start: float, tick: int) -> int:
        """Wait for the next tick of this segment; ticks the last one overran are skipped."""
        now = time.monotonic()
        following = max(tick + 1, math.floor((now - start) / self._interval) + 1)
        self.stop.wait(max(0.0, start + following * self._interval - now))
        return following

    # -- judging and acting ---------------------------------------------------------------------------

    def _device(self, name: str, source: str, only_device: bool, pid: int) -> _Device:
        device = self.devices.get(name)
        if device is None:
            base = self.config.trace_file
            device = _Device(name, source, self.config, trace_path_for(base, name, only_device) if base else None, pid)
            self.devices[name] = device
            self.telemetry[name] = device.telemetry
        return device

    def _judge_all(self, target: WatchedProcess, source: str, tick: int, readings: tuple[DeviceMemory, ...]) -> None:
        now = time.time()
        asking: tuple[str, Verdict, Action] | None = None
        # The host beside chips is never the only device, even on a tick when the chips failed.
        only = len(readings) == 1 and readings[0].device != HOST_DEVICE
        for reading in readings:
            device = self._device(reading.device, source, only_device=only, pid=target.pid)
            # the limit judged, in the trace too: the reader's (the host's budget, a chip's) lowered by --memory-limit
            limit = effective_limit(reading.bytes_limit, self.config.memory_limit_bytes)
            sample = Sample(tick, now, reading.bytes_used, limit, reading.peak_bytes_used)
            verdict, action = device.station.observe(sample)
            if not self._leak_seen and (verdict.leak_detected or verdict.oom_projected) and limit:
                self._say_reach(reading.device, device.station.judge, verdict, limit - sample.bytes_used)
            telemetry = device.telemetry
            telemetry.training_step, telemetry.last_step_monotonic = tick, time.monotonic()
            if device.settle_pending and tick >= self._warmup:
                device.settle_pending = False
                device.station.restart_settled(float(sample.bytes_used), after_signal=self._restart_after_signal)
            if action.needs_checkpoint:  # WARN: the station's line says it all
                asking = asking or (reading.device, verdict, action)
        total = sum(r.bytes_used for r in readings)
        if not self._handler_checked and (tick >= self._warmup or asking is not None):
            self._check_handler(target)
        if asking is not None:
            self._signal(target, *asking, total)
        self._escalate(target, total)

    def _check_handler(self, target: WatchedProcess) -> None:
        """Whether the target saves on the signal, as far as the kernel can say (a handler of its own),
        asked once it has started up (a trainer installs its handler with its imports, or at `fit`) or
        before a signal that comes sooner: one that does not is told now, not after its checkpoint is lost."""
        self._handler_checked = True
        found = disposition(target.pid, self.config.signal)
        words = unhandled_words(target.pid, self.config.signal, found)
        if words is not None:
            log.warning("target_unprepared", pid=target.pid, signal=self.config.signal.name,
                        disposition=found.value, note=words)

    def _say_reach(self, device: str, judge: Judge, verdict: Verdict, left_bytes: float) -> None:
        """The first leak seen, at the rate it rises, against what this watch's interval can protect:
        a warning when it is too fast for it (the user learns it now, not after an OOM)."""
        self._leak_seen = True
        rate = verdict.slope_bytes_per_second if verdict.slope_bytes_per_second > 0 else \
            judge.newest_rise_bytes_per_second
        beyond, words = self.config.axis.reach.seen(rate, left_bytes)
        (log.warning if beyond else log.info)("leak_reach", device=device, step=verdict.step,
                                              rate_bytes_per_second=round(rate), left_bytes=round(left_bytes),
                                              beyond_reach=beyond, note=words)

    def _signal(self, target: WatchedProcess, device: str, verdict: Verdict, action: Action, total: int) -> None:
        fields = dict(pid=target.pid, device=device, step=verdict.step, action=action.value,
                      explanation=verdict.explanation,
                      bytes_used=total, limit_bytes=verdict.limit_bytes, floor_bytes=verdict.floor_bytes,
                      slope_bytes_per_second=verdict.slope_bytes_per_second,
                      projected_oom_seconds=_seconds(verdict.projected_oom_seconds),
                      projected_oom_seconds_pessimistic=_seconds(_pessimistic_seconds(verdict, self._interval)),
                      checkpoint_margin_seconds=self.config.axis.margin_seconds)
        if not self.config.act:
            log.warning("would_signal", signal=self.config.signal.name, **fields, note="--no-act: warning only")
            return
        if self._escalation.pending:
            return  # signalled already: the escalation ladder owns this process now
        if self._send(target, self.config.signal, "target_signalled", fields):
            self._signalled_at = time.monotonic()
            self._escalation.signalled(self._signalled_at, total)

    def _escalate(self, target: WatchedProcess, total: int) -> None:
        step = self._escalation.check(time.monotonic(), total)
        if step is Step.ESCALATE:
            self._send(target, self._escalation.escalate_to, "target_escalated",
                       dict(pid=target.pid, bytes_used=total, grace_seconds=self._escalation.grace_seconds,
                            note="still running and still growing after the grace period"))
        elif step is Step.EXTEND:
            log.info("target_still_saving", pid=target.pid, bytes_used=total,
                     note="alive after the grace period, memory not above the signal's: waiting another")
        elif step is Step.GIVE_UP:
            log.warning("target_ignores_signal", pid=target.pid, bytes_used=total,
                        note="still running and growing; nothing left to escalate to")

    def _send(self, target: WatchedProcess, signum: signal.Signals, event: str, fields: dict) -> bool:
        try:
            sent = send(target, signum, self.config.signal_group)
        except ProcessLookupError:
            log.warning("signal_not_sent", signal=signum.name, reason="the process is gone", **fields)
            return False
        except PermissionError:
            log.error("signal_not_sent", signal=signum.name, reason="no permission", **fields)
            return False
        self.state.count_signal(signum.name)
        log.error(event, signal=signum.name, process_group=sent.group, **fields)
        return True

    @property
    def errors(self) -> int:
        """Errors so far (reads, sends, re-attachments), each kind logged once."""
        return self._error_log.count

    def _count_error(self, kind: str, exc: BaseException) -> None:
        for device in self.devices.values():
            device.telemetry.sample_errors_total += 1
        self._error_log(kind, type(exc).__name__, error=exception_text(exc))


def _pessimistic_seconds(verdict: Verdict, interval: float) -> float:
    """The pessimistic projection in seconds, at the pace the samples were actually taken."""
    steps = verdict.projected_oom_steps_pessimistic
    if verdict.projected_oom_steps and math.isfinite(verdict.projected_oom_steps) and verdict.projected_oom_steps > 0:
        return steps * verdict.projected_oom_seconds / verdict.projected_oom_steps
    return steps * interval


def _seconds(value: float) -> float | None:
    return round(value, 1) if math.isfinite(value) else None


def _owner(target: WatchedProcess) -> str:
    try:
        return f"owned by {target.process.username()}"
    except (psutil.Error, KeyError):
        return "owner unknown"
