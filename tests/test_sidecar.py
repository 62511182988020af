"""The Watchdog's threads for real: a failing source never reaches training, stalls are reported,
samples go to the trace, and the history stays bounded."""

import logging
import threading
import time

import pytest

from watchdog import Watchdog, WatchdogConfig
from watchdog.core.errors import ConfigError
from watchdog.core.sample import load_trace
from watchdog.core.verdict import Action
from watchdog.readers.sources import MemoryReading, RssSource
from watchdog.runtime import running as running_module


class BrokenSource:
    """A device whose memory query fails every time (as get_memory_info does under SPMD)."""

    name = "broken"

    def __init__(self):
        self.calls = 0

    def read(self) -> MemoryReading:
        self.calls += 1
        raise RuntimeError("RESOURCE_EXHAUSTED: allocator stats unavailable")


class Captured(logging.Handler):
    def __init__(self):
        super().__init__()
        self.events = []

    def emit(self, record):
        self.events.append(record.msg)


@pytest.fixture
def captured():
    """The sidecar's events, its stall watch's and its station's."""
    handler = Captured()
    loggers = [logging.getLogger(name) for name in ("watchdog.runtime.sidecar", "watchdog.runtime.stall", "watchdog.station")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    yield handler
    for logger, level in zip(loggers, levels):
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_a_source_that_always_raises_leaves_training_running_and_counts_errors(captured):
    source = BrokenSource()
    with Watchdog(WatchdogConfig(sample_every=1), source=source) as wd:
        for step in range(50):
            assert wd.step(step) is None
            if step % 10 == 9:
                wd.drain()
        assert wd.drain()
        errors = wd.telemetry.sample_errors_total
    assert source.calls >= 5
    assert errors == source.calls
    assert wd.telemetry.samples_total == 0
    logged = [e for e in captured.events if e.get("event") == "watchdog_error"]
    assert len(logged) == 1, "one log line per kind of failure, not one per step"
    assert "RESOURCE_EXHAUSTED" in logged[0]["error"]


def test_a_stalled_loop_is_reported_within_the_configured_time(captured):
    # No censuses: the baseline census at the first step is real work between steps (a second or
    # more on a loaded machine), which the stall watch would rightly see as a stall before the loop stops.
    config = WatchdogConfig(sample_every=100, source="rss", memory_limit_bytes=1 << 40,
                            stall_after_seconds=1.0, stall_check_seconds=0.1, forensics=False)
    with Watchdog(config) as wd:
        for step in range(5):
            wd.step(step)
        stopped_at = time.monotonic()
        while not wd.telemetry.stalled and time.monotonic() - stopped_at < 10:
            time.sleep(0.02)
        reported_after = time.monotonic() - stopped_at
        assert wd.telemetry.stalled
        # never before the threshold; after it, within a few checks (a loaded 2-core machine delays
        # the scheduler's thread: 1.6 s was seen beside the whole suite)
        assert 0.9 <= reported_after <= 1.0 + 2.0, reported_after
        wd.step(5)
        deadline = time.monotonic() + 5
        while wd.telemetry.stalled and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not wd.telemetry.stalled
    events = [e["event"] for e in captured.events]
    assert events.count("training_stalled") == 1
    assert "training_resumed" in events
    stalled = next(e for e in captured.events if e["event"] == "training_stalled")
    assert stalled["step"] == 4


def _stuck_in_the_input_pipeline(seconds: float) -> None:
    time.sleep(seconds)  # a hung data loader, a stuck file system read: the stall under test


def test_a_loop_that_stops_stepping_past_the_bound_records_every_stack_and_exits_43(captured, tmp_path, monkeypatch):
    """Issue 50: a stalled rank hung the job for the collectives' 30 minutes. Past
    `stall_exit_after_seconds` the stall watch writes every thread's stack to the flight record and
    the log, and exits 43; `postmortem` names the line the loop was stuck at."""
    from watchdog.core.postmortem import diagnose
    from watchdog.records import flight_record
    from watchdog.runtime import stall

    exits = []

    def exit_process(code):  # the real one ends the process (the slow tests'), and so would the deadline in C
        exits.append(code)
        wd._running.stall._hard.arm(3600)

    monkeypatch.setattr(stall, "exit_process", exit_process)
    trace = tmp_path / "trace.csv"
    config = WatchdogConfig(sample_every=100, source="rss", memory_limit_bytes=1 << 40, trace_file=trace,
                            stall_after_seconds=0.3, stall_check_seconds=0.05, stall_exit_after_seconds=0.6,
                            forensics=False)
    with Watchdog(config) as wd:
        for step in range(3):
            wd.step(step)
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            _stuck_in_the_input_pipeline(0.05)
    assert exits and exits[0] == 43
    record = flight_record.read(f"{trace}{flight_record.SUFFIX}")
    stalled = record["stall"]
    assert stalled["step"] == 2 and stalled["seconds"] >= 0.6 and stalled["rank"] == 0
    assert "test_sidecar.py" in stalled["user"] and "_stuck_in_the_input_pipeline" in stalled["user"], stalled
    training = [thread for thread in stalled["threads"] if thread["training"]]
    assert len(training) == 1 and any("hbm-watchdog" == thread["name"] for thread in stalled["threads"])
    post = diagnose([], record=record)
    assert post.diagnosis == "stalled" and "rank 0 stalled in" in post.explanation
    assert "test_sidecar.py" in post.explanation and "exited 43" in post.explanation
    logged = next(e for e in captured.events if e["event"] == "stall_exit")
    assert logged["exit_code"] == 43 and logged["user"] == stalled["user"]


def test_a_single_process_is_never_ended_for_a_stall_unless_asked(captured):
    config = WatchdogConfig(sample_every=100, source="rss", memory_limit_bytes=1 << 40,
                            stall_after_seconds=0.2, stall_check_seconds=0.05, forensics=False)
    with Watchdog(config) as wd:
        wd.step(0)
        assert wd._running.stall.exit_after is None, "one process: only reported"
        deadline = time.monotonic() + 10  # a loaded machine delays the scheduler's thread
        while not wd.telemetry.stalled and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # well past the stall, still running
    assert [e for e in captured.events if e["event"] == "training_stalled"]
    assert not [e for e in captured.events if e["event"] == "stall_exit"]


@pytest.mark.parametrize("field", ["stall_after_seconds", "stall_check_seconds", "stall_exit_after_seconds"])
@pytest.mark.parametrize("value", [float("inf"), 1e15, 0, -1, True])
def test_a_wait_out_of_range_is_refused_when_the_config_is_made(field, value):
    """Issue 52: inf (or 1e15) was accepted, then start() raised OverflowError and left the sidecar running."""
    with pytest.raises(ConfigError, match=field):
        WatchdogConfig(**{field: value})


def test_a_start_that_fails_leaves_no_thread_behind(monkeypatch):
    import threading

    def refuse(*args):
        raise OverflowError("date value out of range")

    monkeypatch.setattr(running_module, "start_stall_watch", refuse)
    before = {t.name for t in threading.enumerate()}
    wd = Watchdog(WatchdogConfig(sample_every=10, source="rss", memory_limit_bytes=1 << 40, forensics=False))
    with pytest.raises(OverflowError):
        wd.start()
    assert "hbm-watchdog" not in {t.name for t in threading.enumerate()} - before


def test_a_start_that_fails_midway_ends_what_it_had_built_and_a_second_start_runs(tmp_path, monkeypatch):
    """Only the stall watch's start was undone when it failed: a host's watch refused (a budget it
    cannot read) after the flight record was opened left that record saying the process still ran,
    and with several ranks the agreement's thread and group behind. Any part failing ends the rest."""
    import threading

    from watchdog.core.errors import InputError
    from watchdog.records import flight_record

    def refuse(*args):
        raise InputError("--host-memory-limit: refused")

    trace = tmp_path / "trace.csv"
    config = WatchdogConfig(sample_every=10, source="rss", memory_limit_bytes=1 << 40, forensics=False,
                            trace_file=trace)
    before = {t.name for t in threading.enumerate()}
    wd = Watchdog(config)
    with monkeypatch.context() as patched:
        patched.setattr(running_module, "watch_the_host", refuse)
        with pytest.raises(InputError):
            wd.start()
    assert flight_record.read(f"{trace}{flight_record.SUFFIX}")["ended"] == "unclean"
    assert not {t.name for t in threading.enumerate()} - before, "no thread left behind"
    with wd:
        wd.step(0)
        assert wd.drain()
    assert flight_record.read(f"{trace}{flight_record.SUFFIX}")["ended"] == "clean"


def test_samples_go_to_the_trace_and_a_second_run_appends(tmp_path):
    trace = tmp_path / "run" / "trace.csv"
    for run in range(2):
        config = WatchdogConfig(sample_every=2, trace_file=trace, memory_limit_bytes=3 << 30)
        with Watchdog(config, source=RssSource(3 << 30)) as wd:
            for step in range(run * 10, run * 10 + 10):
                wd.step(step)
                wd.drain()
    samples = load_trace(trace)
    assert [s.step for s in samples] == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18]
    assert all(s.bytes_limit == 3 << 30 and s.bytes_used > 0 for s in samples)
    assert all(a.timestamp <= b.timestamp for a, b in zip(samples, samples[1:]))


def test_history_is_bounded():
    config = WatchdogConfig(sample_every=1, history_size=8, memory_limit_bytes=1 << 40)
    with Watchdog(config, source=RssSource(1 << 40)) as wd:
        for step in range(30):
            wd.step(step)
            wd.drain()
    assert len(wd.history) == 8
    assert wd.history[-1].step == 29
    assert wd.telemetry.samples_total == 30


def test_stop_is_idempotent_and_start_returns_self():
    wd = Watchdog(WatchdogConfig(memory_limit_bytes=1 << 40), source=RssSource(1 << 40))
    assert wd.start() is wd
    assert wd.start() is wd
    wd.stop()
    wd.stop()


class SlowSource:
    """A source that takes a while to read, so requests pile up while one is being handled."""

    name = "slow"

    def __init__(self):
        self.calls = 0

    def read(self) -> MemoryReading:
        self.calls += 1
        time.sleep(0.02)
        return MemoryReading(bytes_used=1 << 30, bytes_limit=16 << 30, peak_bytes_used=None)


def test_requests_made_while_one_is_in_flight_coalesce_to_the_newest_step():
    source = SlowSource()
    with Watchdog(WatchdogConfig(sample_every=1), source=source) as wd:
        for step in range(2000):
            wd.step(step)
        assert wd.drain()
        steps = [s.step for s in wd.history]
    assert source.calls < 200  # not one read per step: the sidecar reads at its own pace ...
    assert steps == sorted(steps) and steps[-1] == 1999  # ... always the newest step, the last one too


class ScriptedSource:
    """Memory as the loop's phase makes it: a test double for a device whose numbers we choose."""

    name = "scripted"

    def __init__(self):
        self.bytes_used = 1 << 30

    def read(self) -> MemoryReading:
        return MemoryReading(self.bytes_used, 2 << 30, None)


def test_phase_labels_every_sample_and_the_trace_taken_in_it(tmp_path):
    source = ScriptedSource()
    trace = tmp_path / "trace.csv"
    with Watchdog(WatchdogConfig(sample_every=1, trace_file=trace), source=source) as wd:
        for step in range(5):
            wd.step(step)
            wd.drain()
        with wd.phase("eval", steps=3):  # the loop's counter keeps rising through the phase
            for step in range(5, 8):
                source.bytes_used += 1 << 20
                wd.step(step)
                wd.drain()
        source.bytes_used = 1 << 30
        wd.step(8)
        wd.drain()
        wd.phase("checkpoint")  # a plain call sets it until the next one
        wd.step(9)
        wd.drain()
        wd.phase("train")
        wd.step(10)
        wd.drain()
    phases = [(s.step, s.phase) for s in load_trace(trace)]
    # each bounded phase's end takes one more reading, labelled with it: its peak since the previous
    # reading is the phase's last (with either form: leaving the `with`, or the next phase said)
    assert phases == [(0, ""), (1, ""), (2, ""), (3, ""), (4, ""), (5, "eval/3"), (6, "eval/3"), (7, "eval/3"),
                      (7, "eval/3"), (8, ""), (9, "checkpoint"), (9, "checkpoint"), (10, "train")]


def test_a_phase_is_checked_once_and_then_only_an_attribute_write():
    wd = Watchdog(WatchdogConfig(sample_every=1))  # not started: the phase is the loop's, not the thread's
    with pytest.raises(ConfigError, match="phase"):
        wd.phase("eval predictions")
    from watchdog.runtime.sidecar import _label

    scope = wd.phase("eval", steps=100)
    checked = _label.cache_info()
    assert wd._phase == "eval/100"
    wd.phase("eval", steps=100).end()
    assert _label.cache_info().hits == checked.hits + 1 and _label.cache_info().misses == checked.misses
    scope.end()
    assert wd._phase == ""


def test_a_leak_report_is_logged_with_its_rate_when_it_goes_up_and_once_when_the_growth_stops(captured):
    """The report is a warning, never an action: one line when it goes up, one when it comes down."""
    source = ScriptedSource()  # a 2 GiB device: 64 KiB/step for 1,500 steps is 94 MiB, an OOM far away
    with Watchdog(WatchdogConfig(sample_every=1), source=source) as wd:
        for step in range(3000):
            source.bytes_used = (1 << 30) + min(step, 1500) * (64 << 10) + (step % 8) * (4 << 20)
            wd.step(step)
            wd.drain()
    events = [e for e in captured.events if e["event"] in ("leak_detected", "leak_report_cleared", "action_decided")]
    assert [e["event"] for e in events] == ["leak_detected", "leak_report_cleared"], events
    up, down = events
    assert up["slope_bytes_per_step"] == pytest.approx(64 << 10, rel=0.1) and not up["oom_projected"]
    assert "leak detected, no action" in up["explanation"]
    assert up["step"] < 1500 < down["step"] <= 1500 + 320  # the detector's recovery bound


def test_the_stall_watch_writes_nothing_routine_into_a_users_log():
    """A user's `logging.basicConfig(level=logging.INFO)` sees none of the scheduler's lines for
    each stall check, while apscheduler stays untouched for the user's own schedulers."""
    from watchdog.runtime.stall import SCHEDULER_LOGGER

    class Everything(logging.Handler):
        def __init__(self):
            super().__init__()
            self.records = []

        def emit(self, record):
            self.records.append(record)

    root, seen = logging.getLogger(), Everything()
    old_level = root.level
    root.addHandler(seen)
    root.setLevel(logging.INFO)
    try:
        config = WatchdogConfig(sample_every=100, source="rss", memory_limit_bytes=1 << 40,
                                stall_after_seconds=60.0, stall_check_seconds=0.02)
        with Watchdog(config) as wd:
            for step in range(1, 4):
                wd.step(step)
                deadline = time.monotonic() + 10
                while wd.telemetry.training_step != step and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert wd.telemetry.training_step == step, "the stall check ran after each step"
        logging.getLogger("apscheduler.scheduler").info("a user's own scheduler line")
        logging.getLogger(SCHEDULER_LOGGER).warning("a missed run")
    finally:
        root.removeHandler(seen)
        root.setLevel(old_level)
    ours = [r for r in seen.records if r.name == SCHEDULER_LOGGER or r.name.startswith("apscheduler.executors")]
    assert ours and all(r.levelno >= logging.WARNING for r in ours), [r.getMessage() for r in ours]
    assert (SCHEDULER_LOGGER, "WARNING", "a missed run") in [(r.name, r.levelname, r.getMessage()) for r in ours]
    users = [(r.name, r.levelname, r.getMessage()) for r in seen.records if r.name == "apscheduler.scheduler"]
    assert users == [("apscheduler.scheduler", "INFO", "a user's own scheduler line")], "the user's scheduler keeps its lines"


def test_the_watchdogs_restarts_in_a_row_span_processes_through_its_state_dict():
    """The restart budget counts the watchdog's own restarts in a row, in every loop: it counts one
    when it hands a restart over, a loop keeps `state_dict()` in its checkpoint, and the next
    process gets it back with `load_state_dict`; a restart after the window starts over."""
    from watchdog.core.policy import PolicyConfig

    quiet = dict(host_memory=False, forensics=False, memory_limit_bytes=1 << 40,
                 policy=PolicyConfig(restart_window_steps=100))

    def watchdog(saved: dict, *forced: int) -> Watchdog:
        wd = Watchdog(WatchdogConfig(forced_actions=tuple((s, Action.CHECKPOINT_RESTART) for s in forced), **quiet))
        wd.load_state_dict(saved)
        return wd

    first = watchdog({"restarts_so_far": 5}, 10)
    assert first.state_dict() == {"restarts_so_far": 5, "watchdog_restarts": 5, "watchdog_restart_step": None, "cycles": []}, \
        "a host that never kept the watchdog's own: every restart counts"
    assert [first.step(s) for s in range(12)].count(Action.CHECKPOINT_RESTART) == 1
    saved = first.state_dict()
    assert saved == {"restarts_so_far": 6, "watchdog_restarts": 6, "watchdog_restart_step": 10, "cycles": []}

    second = watchdog(saved, 50)
    assert second.state_dict()["watchdog_restarts"] == 6, "the budget starts where the last process left it"
    for s in range(11, 52):
        second.step(s)
    assert second.state_dict()["watchdog_restarts"] == 7, "40 steps later: a loop"

    third = watchdog(second.state_dict(), 400)
    for s in range(51, 401):
        third.step(s)
    assert third.state_dict() == {"restarts_so_far": 8, "watchdog_restarts": 1, "watchdog_restart_step": 400, "cycles": []}, \
        "350 steps of progress"

    fourth = watchdog(third.state_dict())
    fourth.propose(Action.CHECKPOINT_RESTART, "stop signal")
    assert fourth.step(401) is Action.CHECKPOINT_RESTART
    assert fourth.state_dict() == {**third.state_dict(), "restarts_so_far": 9}, \
        "a preemption is a restart of the job, not the watchdog's; drills and proposals end no leak's cycle"
    with pytest.raises(ConfigError, match="watchdog_restarts"):
        fourth.load_state_dict({"watchdog_restarts": "7"})


def test_every_stall_watch_with_an_exit_bound_keeps_a_deadline_where_the_gil_does_not_reach(tmp_path, captured):
    """Issue 64: a loop holding the GIL starved the stall watch's thread, so the bound was never kept.
    Whenever a stall watch may end the process, a deadline in C (`runtime/hard_exit.py`: a POSIX timer,
    signal 43, faulthandler's stacks, `_exit(43)`) is armed beside it, and the flight record says so
    before it can be needed; stopping releases both. (The slow test in tests/test_postmortem.py ends a
    process stuck in a regex with it.)"""
    from watchdog.records import flight_record
    from watchdog.runtime.hard_exit import HardExit

    trace = tmp_path / "trace.csv"
    config = WatchdogConfig(sample_every=100, source="rss", memory_limit_bytes=1 << 40, trace_file=trace,
                            stall_exit_after_seconds=60, forensics=False, host_memory=False)
    with Watchdog(config) as wd:
        wd.step(0)
        hard = wd._running.stall._hard
        assert hard is not None and hard.exit_code == 43, hard and hard.why
        armed = flight_record.read(f"{trace}{flight_record.SUFFIX}")["stall"]
        assert armed["armed"] and armed["exit_code"] == 43 and armed["seconds"] >= 60
        assert int(armed["training_thread"], 16) == threading.get_ident()
        with Watchdog(config) as second:  # one deadline per process: the second keeps its Python bound
            assert second._running.stall._hard is None
    assert flight_record.read(f"{trace}{flight_record.SUFFIX}")["stall"] is None
    again = HardExit.acquire()
    assert again is not None, "released with the watch"
    again.release()
    unbounded = Watchdog(WatchdogConfig(sample_every=100, source="rss", memory_limit_bytes=1 << 40, forensics=False,
                                        host_memory=False))
    with unbounded:
        assert unbounded._running.stall._hard is None, "no exit bound (one process, none asked): no deadline"


class LaggingSource(ScriptedSource):
    """A reading that takes a while: the loop runs ahead of the sidecar, as it does under load."""

    def read(self) -> MemoryReading:
        time.sleep(0.003)
        return super().read()


def test_a_phase_that_ends_while_the_sidecar_lags_never_sends_the_trace_back_in_steps(tmp_path):
    """A sample asked for inside an evaluation, read after the loop has left it and asked for the next
    step, read the newest step first; the phase's end reading then came with an older step, and steps
    going back read as a new process (the detector and the policy start over)."""
    trace = tmp_path / "trace.csv"
    with Watchdog(WatchdogConfig(sample_every=1, trace_file=trace, forensics=False, host_memory=False),
                  source=LaggingSource()) as wd:
        step = 0
        for _ in range(20):
            for _ in range(5):
                step += 1
                wd.step(step)
            with wd.phase("eval", steps=3):
                for _ in range(3):
                    step += 1
                    wd.step(step)
        wd.drain()
    samples = load_trace(trace)
    steps = [s.step for s in samples]
    assert steps == sorted(steps), steps
    assert sum(1 for s in samples if s.phase == "eval/3") >= 20, "every evaluation's end was read"


def test_one_checkpoint_and_reinit_crosses_threads_twice_and_never_waits_on_the_sidecar():
    """Issue 59: the action's path took two round trips between the threads, the second blocking the
    training thread (`drain(timeout=10)`) until the sidecar had measured the rebuild. Now: the action
    to the training thread, and one message back with everything the sidecar measures the rebuild by
    (the readings before and after it; the save's time rides along), measured by a profiler on every
    thread (`python -m watchdog.bench.action_path`)."""
    from watchdog.bench.action_path import measure

    figures = measure()
    assert figures["measured"], "the first action's rebuild was measured within the loop's steps"
    assert figures["crossings"] == ["to the training thread: the action", "to the sidecar: reinit"]
    assert figures["training_waits_seconds"] == []
    assert "watchdog.core.policy" in figures["by_module"] and "watchdog.station.station" in figures["by_module"]


def test_an_actions_record_says_where_it_is_from_its_hand_over_to_its_measure_or_its_exit():
    """Issue 59: an action is one record with states. A reinit's goes handed over -> saved -> rebuilt
    and is closed by the sidecar (measured) once the reading after the rebuild is judged; a restart's,
    and a failed save's, end exited, with the status the process leaves with."""
    class Flat:
        name = "scripted"

        def read(self) -> MemoryReading:
            return MemoryReading(1 << 30, 4 << 30, None)

    forced = ((3, Action.CHECKPOINT_REINIT), (6, Action.CHECKPOINT_RESTART), (9, Action.CHECKPOINT_RESTART))
    config = WatchdogConfig(sample_every=1, host_memory=False, forensics=False, memory_limit_bytes=4 << 30,
                            forced_actions=forced)
    seen = []
    with Watchdog(config, source=Flat()) as wd:
        for step in range(10):
            action = wd.step(step)
            assert wd.drain()
            if action is None:
                continue
            record = wd.last_action
            seen.append(record.state)
            if action is Action.CHECKPOINT_REINIT:
                assert wd.carry_out(action, save=lambda: "ckpt", rebuild=lambda: seen.append(record.state))
                assert record.state in ("rebuilt", "measured")
                assert wd.drain()
                seen.append(record.state)
            else:
                assert not wd.carry_out(action, save=lambda: "ckpt" if step == 6 else False)
                seen.append((record.state, record.exit_code))
    assert seen == ["handed over", "saved", "measured", "handed over", ("exited", 42), "handed over", ("exited", 44)]


class Unread(logging.Handler):
    """A stderr nobody reads (or a terminal that renders slowly): writing `event`'s line blocks
    until the test lets it go."""

    def __init__(self, event: str):
        super().__init__()
        self.event, self.writing, self.let_go = event, threading.Event(), threading.Event()

    def emit(self, record):
        if isinstance(record.msg, dict) and record.msg.get("event") == self.event:
            self.writing.set()
            self.let_go.wait(30)


def test_an_action_reaches_the_loop_while_its_line_cannot_be_written():
    """The sidecar wrote `action_decided` before it queued the action: a slow terminal held the
    action back for as long as the line took (the README's loop, on a terminal in CI, ended with the
    action decided and never handed over), and a stderr nobody reads held it back for good. The
    station now hands the action to the loop before it writes anything."""
    source = ScriptedSource()  # 1 GiB of a 2 GiB limit
    unread = Unread("action_decided")
    logger = logging.getLogger("watchdog.station.station")
    level = logger.level
    logger.addHandler(unread)
    logger.setLevel(logging.INFO)
    config = WatchdogConfig(sample_every=1, host_memory=False, forensics=False, memory_limit_bytes=2 << 30)
    try:
        with Watchdog(config, source=source) as wd:
            step = 0
            while not unread.writing.is_set() and step < 250:  # 4 MiB a step: the limit at step 256
                step += 1
                source.bytes_used = (1 << 30) + step * (4 << 20)
                action = wd.step(step)
                assert action is None, "no action handed over before its line"
                wd.drain(timeout=0.5)  # returns early once the sidecar is held in the line's write
            assert unread.writing.is_set(), "the leak was acted on"
            decided_at, deadline = step, time.monotonic() + 5
            while action is None and time.monotonic() < deadline:
                step += 1
                action = wd.step(step)
                time.sleep(0.01)
            assert action is not None and action.needs_checkpoint, "handed over while its line is still being written"
            assert not unread.let_go.is_set() and wd.last_action.step == decided_at + 1
            unread.let_go.set()
    finally:
        unread.let_go.set()
        logger.removeHandler(unread)
        logger.setLevel(level)
