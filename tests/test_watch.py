"""`hbm-watchdog watch`, the parts that need no other process: the time axis, signal names, the
escalation ladder, the reading seam with several devices, the metrics, and a bounded footprint.

The daemon runs here in this process against this very process (never signalled: `act=False`),
fed by a scripted reader; tests/test_watch_e2e.py runs it for real against real jobs.
"""

from __future__ import annotations

import gc
import os
import logging
import math
import signal
import threading
import tracemalloc

import psutil
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ThisProcess, WatchdogEvents, tick_per_read_daemon
from watchdog.core.errors import InputError
from watchdog.core.sample import load_trace
from watchdog.core.verdict import Action
from watchdog.daemon.loop import Daemon, WatchConfig, trace_path_for
from watchdog.daemon.metrics import build_watch_registry
from watchdog.core.readings import DeviceMemory, MemoryReading
from watchdog.daemon.signalling import Escalation, Step, parse_escalation, parse_signal
from watchdog.daemon.timeaxis import TimeAxis

MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture
def captured():
    """The daemon's events and its stations' (conftest's `events` fixture listens to every watchdog logger)."""
    handler = WatchdogEvents()
    loggers = [logging.getLogger(name) for name in ("watchdog.daemon", "watchdog.station")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    yield handler
    for logger, level in zip(loggers, levels):
        logger.removeHandler(handler)
        logger.setLevel(level)


# -- the time axis ---------------------------------------------------------------------------------

def test_seconds_become_samples_rounded_up_so_a_margin_never_shrinks():
    axis = TimeAxis(interval_seconds=2.0, checkpoint_seconds=61.0, safety_seconds=3.0, warmup_seconds=45.0,
                    grace_seconds=120.0)
    policy = axis.policy_config()
    assert policy.checkpoint_margin_steps == 32  # (61 + 3) / 2
    assert policy.cooldown_steps == 60
    assert policy.prefer_restart and policy.max_restarts > 10**6  # the supervisor owns the restart budget
    assert axis.detector_config().warmup_samples == 23  # 45 s / 2 s, rounded up
    assert TimeAxis(interval_seconds=0.1, checkpoint_seconds=0.3, safety_seconds=0.0).policy_config() \
        .checkpoint_margin_steps == 3  # 0.3 / 0.1 is 2.9999999999999996 in floating point
    assert TimeAxis(interval_seconds=0.7, checkpoint_seconds=1.0, safety_seconds=0).policy_config() \
        .checkpoint_margin_steps == 2


def test_defaults_follow_the_interval_and_the_checkpoint_time():
    axis = TimeAxis(interval_seconds=5.0, checkpoint_seconds=90.0, warmup_seconds=0.0)
    assert axis.safety_seconds == 10.0 and axis.grace_seconds == 180.0
    assert axis.margin_seconds == 100.0
    assert axis.warmup_samples == 16  # never fewer than the detector's own warm-up


@pytest.mark.parametrize("field, value", [("interval_seconds", 0), ("interval_seconds", -1.0),
                                          ("checkpoint_seconds", -5), ("grace_seconds", math.nan),
                                          ("interval_seconds", math.inf)])
def test_a_bad_time_is_one_line_naming_the_flag(field, value):
    with pytest.raises(InputError, match="--" + field.removesuffix("_seconds").replace("_", "-")):
        TimeAxis(**{field: value})


# -- signals and the escalation ladder ----------------------------------------------------------

@pytest.mark.parametrize("text, expected", [("TERM", signal.SIGTERM), ("sigterm", signal.SIGTERM),
                                            ("15", signal.SIGTERM), (" usr1 ", signal.SIGUSR1), ("KILL", signal.SIGKILL)])
def test_signal_names(text, expected):
    assert parse_signal(text) is expected


@pytest.mark.parametrize("text", ["FOO", "SIGFOO", "999", "", "-1"])
def test_a_bad_signal_name_is_input_error(text):
    with pytest.raises(InputError, match="not a signal"):
        parse_signal(text)


def test_escalation_none_means_waiting_only():
    assert parse_escalation("none") is None and parse_escalation("KILL") is signal.SIGKILL
    with pytest.raises(InputError, match="--escalate"):
        parse_escalation("nothing")


def test_the_ladder_escalates_once_and_only_while_memory_still_rises():
    ladder = Escalation(grace_seconds=10.0, escalate_to=signal.SIGKILL)
    assert ladder.check(0.0, 100) is Step.WAIT  # nothing signalled
    ladder.signalled(0.0, bytes_used=100)
    ladder.signalled(5.0, bytes_used=150)  # a repeated signal does not move the deadline
    assert ladder.check(9.9, 500) is Step.WAIT
    assert ladder.check(10.0, 90) is Step.EXTEND  # alive, but not growing: saving; another grace period
    assert ladder.check(15.0, 500) is Step.WAIT
    assert ladder.check(20.0, 101) is Step.ESCALATE
    assert ladder.check(25.0, 900) is Step.WAIT
    assert ladder.check(30.0, 900) is Step.GIVE_UP  # escalated once already
    assert not ladder.pending and ladder.check(99.0, 999) is Step.WAIT


def test_without_an_escalation_signal_the_ladder_gives_up_and_a_restart_resets_it():
    ladder = Escalation(grace_seconds=1.0, escalate_to=None)
    ladder.signalled(0.0, 10)
    assert ladder.check(1.0, 20) is Step.GIVE_UP
    ladder.signalled(2.0, 10)
    ladder.reset()
    assert not ladder.pending and ladder.check(10.0, 99) is Step.WAIT


# -- the daemon against this process, fed by a scripted reader ---------------------------------

class ScriptedChips:
    """Two chips: tpu:0 leaks `leak` bytes per read towards its 8 GiB, tpu:1 stays flat; stops the daemon after `reads`."""

    name = "scripted"

    def __init__(self, stop: threading.Event, reads: int, leak: int = 4 * MiB, fail_every: int = 0,
                 failure: Exception = TimeoutError("metrics endpoint busy")):
        self.stop, self.reads, self.leak, self.fail_every, self.failure = stop, reads, leak, fail_every, failure
        self.count = 0

    def read(self):
        self.count += 1
        if self.count >= self.reads:
            self.stop.set()
        if self.fail_every and self.count % self.fail_every == 0:
            raise self.failure
        sawtooth = (self.count % 7) * 16 * MiB
        chips = (DeviceMemory("tpu:0", 4 * GiB + self.leak * self.count + sawtooth, 8 * GiB),
                 DeviceMemory("tpu:1", 4 * GiB + sawtooth, 8 * GiB))
        return MemoryReading(chips[0].bytes_used, chips[0].bytes_limit, devices=chips)


TickPerRead = tick_per_read_daemon()


def run_daemon(tmp_path, reads: int, **reader_options) -> tuple[Daemon, ScriptedChips]:
    axis = TimeAxis(interval_seconds=0.001, checkpoint_seconds=0.05, warmup_seconds=0.0, grace_seconds=0.1)
    config = WatchConfig(axis=axis, act=False, wait_seconds=1.0, trace_file=tmp_path / "trace.csv")
    stop = threading.Event()
    chips = ScriptedChips(stop, reads, **reader_options)
    daemon = TickPerRead(config, ThisProcess(), lambda process: chips, stop=stop)
    assert daemon.run() == 0
    return daemon, chips


def test_a_trace_the_disk_refuses_is_counted_and_the_watch_goes_on(tmp_path, captured, monkeypatch):
    """The daemon's trace is best-effort, as the sidecar's: a full disk costs trace rows, never the watch."""
    from watchdog.core.sample import TraceWriter

    def full_disk(self, sample):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TraceWriter, "write", full_disk)
    daemon, _ = run_daemon(tmp_path, reads=300)
    for name in ("tpu:0", "tpu:1"):
        telemetry = daemon.telemetry[name]
        assert telemetry.samples_total == 300 and telemetry.trace_errors_total >= 1
    failures = captured.named("trace_write_failed")
    assert failures and all(f["error"] == "No space left on device" for f in failures)


def test_each_device_is_judged_on_its_own_and_the_leaking_one_is_named(tmp_path, captured):
    daemon, chips = run_daemon(tmp_path, reads=1500)
    assert set(daemon.devices) == {"tpu:0", "tpu:1"}
    leaking, flat = daemon.telemetry["tpu:0"], daemon.telemetry["tpu:1"]
    assert leaking.verdict.oom_projected and not flat.verdict.oom_projected
    assert leaking.verdict.leak_detected and not flat.verdict.leak_detected
    assert leaking.actions_snapshot()[Action.CHECKPOINT_RESTART] >= 1
    assert not any(flat.actions_snapshot().values())
    (first, *_) = captured.named("would_signal")  # --no-act: the signal that would have gone out
    assert first["device"] == "tpu:0" and first["signal"] == "SIGTERM" and first["pid"] == psutil.Process().pid
    assert daemon.state.signals_snapshot() == {}
    # one trace per device, sample numbers as the step column, real timestamps
    for name in ("tpu:0", "tpu:1"):
        samples = load_trace(trace_path_for(tmp_path / "trace.csv", name, only_device=False))
        assert [s.step for s in samples[:3]] == sorted(s.step for s in samples[:3])
        assert len(samples) == daemon.telemetry[name].samples_total
        assert samples[-1].timestamp > samples[0].timestamp > 1.6e9


@pytest.mark.parametrize("failure", [TimeoutError("metrics endpoint busy"), psutil.AccessDenied(4242, "tree")],
                         ids=["busy endpoint", "permission"])
def test_a_failing_reading_is_counted_and_logged_once_and_the_watch_goes_on(tmp_path, captured, failure):
    daemon, chips = run_daemon(tmp_path, reads=300, fail_every=3, failure=failure)
    assert daemon.errors == 100
    (error,) = captured.named("watch_error")
    assert type(failure).__name__ in error["error"]
    assert daemon.telemetry["tpu:0"].samples_total == 200
    assert daemon.telemetry["tpu:0"].sample_errors_total >= 99  # counted from the first device's creation on


def test_a_reading_that_overruns_its_interval_skips_ticks_so_steps_stay_proportional_to_time(tmp_path):
    """A busy endpoint: each reading takes about four intervals. Sample numbers are ticks, so the
    slope per step stays a slope per interval, and no burst of catch-up samples follows."""
    import time

    class Slow(ScriptedChips):
        def read(self):
            time.sleep(0.02)
            return super().read()

    axis = TimeAxis(interval_seconds=0.005, checkpoint_seconds=0.05, warmup_seconds=0.0)
    stop = threading.Event()
    daemon = Daemon(WatchConfig(axis=axis, act=False, trace_file=tmp_path / "trace.csv"), ThisProcess(),
                    lambda process: Slow(stop, reads=40), stop=stop)
    daemon.run()
    steps = [s.step for s in load_trace(trace_path_for(tmp_path / "trace.csv", "tpu:0", only_device=False))]
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    assert len(steps) == 40 and min(gaps) >= 4, gaps
    seconds = [s.timestamp for s in load_trace(trace_path_for(tmp_path / "trace.csv", "tpu:0", only_device=False))]
    per_step = (seconds[-1] - seconds[0]) / (steps[-1] - steps[0])
    assert per_step == pytest.approx(0.005, rel=0.5)


def test_the_metrics_merge_every_device_into_one_family_each(tmp_path):
    daemon, _ = run_daemon(tmp_path, reads=400)
    daemon.state.watched_pid = 1234
    daemon.state.count_signal("SIGTERM")
    text = generate_latest(build_watch_registry(daemon.state, daemon.telemetry)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}  # a duplicate family would fail here
    used = {s.labels["device"]: s.value for s in families["hbmwatch_memory_used_bytes"].samples}
    assert set(used) == {"tpu:0", "tpu:1"} and used["tpu:0"] > used["tpu:1"]
    assert families["hbmwatch_watched_pid"].samples[0].value == 1234
    (signals,) = families["hbmwatch_signals"].samples
    assert signals.labels == {"signal": "SIGTERM"} and signals.value == 1
    assert {s.labels["source"] for s in families["hbmwatch_build_info"].samples} == {"scripted"}
    assert text.count("# TYPE hbmwatch_memory_used_bytes gauge") == 1


def test_the_daemon_holds_no_more_python_memory_after_thousands_of_samples(tmp_path):
    """Bounded history (the detector), no per-sample residue (logs, traces, telemetry): measured
    while the daemon runs, between its 1,000th and 4,000th sample."""
    axis = TimeAxis(interval_seconds=0.0005, checkpoint_seconds=0.05, warmup_seconds=0.0)
    config = WatchConfig(axis=axis, act=False, trace_file=tmp_path / "trace.csv")
    stop = threading.Event()
    snapshots = {}

    class Reads(ScriptedChips):
        def read(self):
            if self.count + 1 in (1000, 4000):
                gc.collect()
                snapshots[self.count + 1] = tracemalloc.take_snapshot()
            return super().read()

    tracemalloc.start()
    try:
        Daemon(config, ThisProcess(), lambda process: Reads(stop, reads=4000, leak=0), stop=stop).run()
    finally:
        tracemalloc.stop()
    grown = sum(stat.size_diff for stat in snapshots[4000].compare_to(snapshots[1000], "filename"))
    assert grown < 64 * 1024, f"{grown} bytes more after 3000 more samples"


def test_trace_paths():
    assert trace_path_for(__import__("pathlib").Path("/x/trace.csv"), "process", only_device=True).name == "trace.csv"
    assert trace_path_for(__import__("pathlib").Path("/x/trace.csv"), "tpu:3", only_device=False).name == "trace.tpu-3.csv"


def test_a_slow_leak_is_reported_for_its_device_with_its_rate_and_never_signalled(tmp_path, captured):
    daemon, _ = run_daemon(tmp_path, reads=1500, leak=256 << 10)  # 375 MiB of 8 GiB: an OOM far off
    [reported] = captured.named("leak_detected")
    assert reported["device"] == "tpu:0" and reported["pid"] == psutil.Process().pid
    assert reported["slope_bytes_per_step"] == pytest.approx(256 << 10, rel=0.1) and not reported["oom_projected"]
    assert daemon.telemetry["tpu:0"].verdict.leak_detected and not daemon.telemetry["tpu:1"].verdict.leak_detected
    assert captured.named("would_signal") == [] and captured.named("action_decided") == []


class OverBudget:
    """One process 28% over its 1 GiB budget from its first reading (the probe's forking target):
    the detector is still warming up for all of it. Stops the daemon after `reads`."""

    name = "scripted"

    def __init__(self, stop: threading.Event, reads: int):
        self.stop, self.reads, self.count = stop, reads, 0

    def read(self):
        self.count += 1
        if self.count >= self.reads:
            self.stop.set()
        return MemoryReading(int(1.28 * GiB) + self.count * MiB)


@pytest.mark.parametrize("reads", [1, 5])
def test_a_target_over_its_budget_from_the_start_is_signalled_at_the_first_sample_and_once(tmp_path, captured,
                                                                                           reads):
    axis = TimeAxis(interval_seconds=0.001, checkpoint_seconds=0.05, warmup_seconds=60.0, grace_seconds=60.0)
    config = WatchConfig(axis=axis, memory_limit_bytes=GiB, act=False, wait_seconds=1.0)
    stop = threading.Event()
    daemon = Daemon(config, ThisProcess(), lambda process: OverBudget(stop, reads), stop=stop)
    assert daemon.run() == 0
    [signalled] = captured.named("would_signal")  # one signal per grace period, not one per sample
    assert signalled["signal"] == "SIGTERM" and signalled["limit_bytes"] == GiB
    assert "at or over the 1.0 GiB limit" in signalled["explanation"]
    telemetry = daemon.telemetry["process"]
    assert telemetry.samples_total == reads and telemetry.verdict.oom_projected
    assert telemetry.actions_snapshot()[Action.CHECKPOINT_RESTART] == 1
    assert daemon.devices["process"].station.judge.detector.status.value == "warming_up"


# -- the target's PID: ASCII digits, bounded, never init -------------------------------------------

@pytest.mark.parametrize("text", ["\u00b2", "9" * 5000, "\u0661", "\uff15\uff10", "1", "0", "-4242", "4194304",
                                  "42 43", ""])
def test_a_pidfile_that_names_no_process_to_watch_is_waited_on_never_read_as_one(tmp_path, text):
    """Issue 24, items 14-15: '²' and 5,000 digits passed `isdigit()` and failed in `int()`
    (ValueError); '١' (an Arabic-Indic one) was read as PID 1, and the daemon attached to init."""
    from watchdog.daemon.targets import PidfileFinder

    pidfile = tmp_path / "job.pid"
    pidfile.write_text(text, encoding="utf-8")
    finder = PidfileFinder(pidfile)
    assert finder.find() is None
    reason = finder.why_not_found()
    assert "not a PID to watch" in reason and len(reason) < 300


def test_a_pidfile_naming_the_daemon_itself_is_no_target(tmp_path):
    """Issue 64's probe: `--pid` refuses the daemon's own PID, but a pidfile naming it (written by a
    shell that then exec'd the daemon) was attached, judged, and would have been signalled. It is
    waited on like no process, as --pid refuses it."""
    import os

    from watchdog.daemon.targets import PidfileFinder

    pidfile = tmp_path / "job.pid"
    pidfile.write_text(str(os.getpid()))
    finder = PidfileFinder(pidfile)
    assert finder.find() is None and "the daemon itself" in finder.why_not_found()


@pytest.mark.parametrize("pid", ["1", "0", "\u0661", "\u00b2", "9" * 5000, "-1"])
def test_pid_one_and_anything_not_a_pid_is_refused_by_the_parser_in_one_line(pid, capsys):
    from watchdog.commands.cli import main

    assert main(["watch", "--pid", pid]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--pid" in err[0] and len(err[0]) < 300


# ------------------------------------------------------------------------ stopping from a signal handler

def test_a_signal_handler_that_sets_the_stop_flag_ends_a_wait_at_once_and_takes_no_lock():
    """`watch`'s SIGTERM handler runs between two bytecodes of the main thread, which may be inside
    the daemon's own wait: setting the flag there must take no lock that wait could hold (an Event's
    does, and a loaded CI saw the daemon never stop)."""
    from watchdog.daemon.stopping import StopFlag

    flag = StopFlag()
    previous = signal.signal(signal.SIGALRM, lambda *_: flag.set())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        assert flag.wait(60) is True  # a missed wake-up would return False after a minute
        assert flag.is_set() and flag.wait(0) is True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        flag.close()
    assert not StopFlag().wait(0.01), "a flag nobody set stays clear"


def test_the_stop_flag_can_be_set_from_another_thread_and_many_times():
    from watchdog.daemon.stopping import StopFlag

    flag = StopFlag()
    setter = threading.Timer(0.05, lambda: [flag.set() for _ in range(100_000)])
    setter.start()
    try:
        assert flag.wait(60) is True
    finally:
        setter.join()
        flag.close()


@pytest.mark.parametrize("cmdline, ours", [
    (["/venv/bin/python", "/venv/bin/hbm-watchdog", "supervise", "--", "python", "train.py"], True),
    (["hbm-watchdog", "watch", "--cmd-pattern", "train.py"], True),
    (["/usr/bin/python3.11", "-m", "watchdog", "--log-format", "json", "supervise", "--", "python", "train.py"], True),
    (["python", "-I", "/site-packages/watchdog/actions/job_group.py", "30.0"], True),  # supervise's guard
    (["python", "-X", "dev", "-m", "watchdog.commands.cli", "watch"], True),
    (["/venv/bin/python", "/venv/bin/hbm-watchdog", "--log-level", "info", "--quiet", "supervise", "--", "x"], True),
    (["python", "-m", "watchdog", "--log-format", "json", "train", "--no-watchdog", "--steps", "9"], False),  # a job
    (["hbm-watchdog", "train", "--checkpoint-dir", "supervise"], False),
    (["python", "train.py", "--wrapper", "hbm-watchdog"], False),
    (["python", "-m", "watchdog.watchmedo", "train.py"], False),  # the file-events package of the same name
    (["python", "-c", "import watchdog; train()", "hbm-watchdog"], False),
    (["bash", "-c", "hbm-watchdog supervise -- python train.py"], False),  # a shell: the user's launcher
    ([], False),
])
def test_the_watchdogs_own_commands_are_never_targets(cmdline, ours):
    """Issue 63, item 1: `watch --cmd-pattern 'python .*train\\.py'` matched `hbm-watchdog supervise --
    python train.py` and watched it for its first 6 s; our own commands are now never targets."""
    from watchdog.daemon.targets import is_ours

    assert is_ours(cmdline) is ours


class FastLeak:
    """One process tree read against the host's 64 GiB: 1 GiB, then 20 MiB more per read, a sawtooth
    of 4 MiB; stops the daemon after `reads`."""

    name = "rss"

    def __init__(self, stop: threading.Event, reads: int):
        self.stop, self.reads, self.count = stop, reads, 0

    def read(self):
        self.count += 1
        if self.count >= self.reads:
            self.stop.set()
        used = GiB + 20 * MiB * self.count + (self.count % 3) * 4 * MiB
        return MemoryReading(used, 64 * GiB)


def test_a_watch_trace_says_the_limit_judged_and_report_replays_its_signals(tmp_path, captured):
    """Issue 63, item 4: the trace's `bytes_limit` held the host's RAM, not `--memory-limit`, so
    `report` drew a 23.5 GiB limit and none of the signals. The trace now says the limit judged, and
    the replay acts where the daemon did."""
    from watchdog.commands.report import collect

    budget = int(1.5 * GiB)  # 25 reads of headroom: only the limit rule's pace, inside the 30 s warm-up
    axis = TimeAxis(interval_seconds=0.1, checkpoint_seconds=3.0, warmup_seconds=30.0)
    config = WatchConfig(axis=axis, memory_limit_bytes=budget, act=False, wait_seconds=1.0,
                         trace_file=tmp_path / "watch.csv")
    stop = threading.Event()
    assert TickPerRead(config, ThisProcess(), lambda process: FastLeak(stop, 30), stop=stop).run() == 0
    trace = load_trace(tmp_path / "watch.csv")
    assert {s.bytes_limit for s in trace} == {budget}
    signalled = captured.named("would_signal")
    assert signalled and signalled[0]["bytes_used"] < budget
    picture = collect(trace)
    assert picture.limit == budget
    acted = [step for step, action in picture.actions if action.needs_checkpoint]
    assert acted and acted[0] == signalled[0]["step"], (acted, signalled[0])


def test_the_defaults_say_what_they_protect_and_a_leak_too_fast_for_them_is_said_when_first_seen():
    """Issue 63, item 2: with the old defaults (2 s, 30 s) a script leaking 2 MiB every 12 ms into
    500 MiB of headroom was signalled only over its limit, and its user learned it after the fact.
    The defaults now reach it (0.1 s: measured, timeaxis.py), and the reach is said in words."""
    axis = TimeAxis()
    assert (axis.interval_seconds, axis.warmup_seconds) == (0.1, 30.0)
    reach = axis.reach
    assert (reach.only_at_limit_below, reach.before_limit_from) == pytest.approx((1.2, 2.0))
    assert "less than 1.2 s is signalled only at the limit" in reach.words()
    rate, headroom = 2 * MiB / 0.012, 500 * MiB  # the script: 3 s to fill the headroom
    assert reach.seen(rate, headroom)[0] is False
    old = TimeAxis(interval_seconds=2.0).reach
    beyond, words = old.seen(rate, headroom)
    assert beyond and "less than 40 s" in words and "--interval 0.15 or less reaches it" in words


def test_the_first_leak_seen_is_measured_against_the_reach_once(tmp_path, captured):
    axis = TimeAxis(interval_seconds=2.0, checkpoint_seconds=3.0)  # the old default interval
    config = WatchConfig(axis=axis, memory_limit_bytes=int(1.5 * GiB), act=False, wait_seconds=1.0)
    stop = threading.Event()
    assert TickPerRead(config, ThisProcess(), lambda process: FastLeak(stop, 30), stop=stop).run() == 0
    [said] = captured.named("leak_reach")
    assert said["beyond_reach"] and said["level"] == "warning" and "may be signalled only at the limit" in said["note"]


def test_what_a_process_does_with_a_signal_is_read_from_its_masks():
    """Issue 63, item 3: a script without a SIGTERM handler is ended by the signal without a save;
    the kernel says so (SigCgt, SigIgn), and the daemon tells the user before the signal."""
    from watchdog.daemon.signalling import Disposition, disposition, unhandled_words

    status = "Name:\tpython\nSigIgn:\t0000000001001000\nSigCgt:\t0000000180004002\n"  # INT, TERM caught; PIPE ignored
    assert disposition(1, signal.SIGTERM, status) is Disposition.CAUGHT
    assert disposition(1, signal.SIGINT, status) is Disposition.CAUGHT
    assert disposition(1, signal.SIGPIPE, status) is Disposition.IGNORED
    assert disposition(1, signal.SIGUSR1, status) is Disposition.DEFAULT
    assert disposition(1, signal.SIGTERM, "Name:\tx\n") is Disposition.UNKNOWN
    assert "does not handle SIGTERM: a signal ends it without a checkpoint" in unhandled_words(
        7, signal.SIGTERM, Disposition.DEFAULT)
    assert unhandled_words(7, signal.SIGTERM, Disposition.CAUGHT) is None
    assert disposition(os.getpid(), signal.SIGINT) is Disposition.CAUGHT, "Python's own KeyboardInterrupt"
