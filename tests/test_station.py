"""The station: one series' path, written once, driven alike by the sidecar and the daemon."""

import ast
import math
from pathlib import Path

from hypothesis import given, strategies as st

from watchdog.core.judge import Judge
from watchdog.core.sample import Sample, read_trace
from watchdog.core.verdict import Action, Status, Verdict
from watchdog.station.station import Station
from watchdog.station.telemetry import Telemetry
from watchdog.station.trace_sink import TraceSink

MiB, GiB = 1 << 20, 1 << 30
PACKAGE = Path(__file__).resolve().parents[1] / "watchdog"


def leaking(steps: int, rate: int = 4 * MiB, base: int = GiB):
    """A leak with the training sawtooth on top, toward a 2 GiB limit."""
    for step in range(steps):
        yield Sample(step, 1000.0 + step * 0.1, base + step * rate + (step % 8) * (8 * MiB), 2 * GiB)


def test_a_leak_goes_through_the_station_into_its_trace_telemetry_and_lines(tmp_path, events):
    telemetry = Telemetry()
    trace = TraceSink(tmp_path / "trace.csv", telemetry, lambda: 30.0)
    station = Station(Judge(memory_limit_bytes=2 * GiB), telemetry, trace, device="tpu:0", pid=123)
    acted = []
    for sample in leaking(300):
        verdict, action = station.observe(sample)
        if action is not Action.NONE:
            acted.append((sample.step, action))
        if action.needs_checkpoint:
            break
    station.close()

    assert acted and acted[-1][1].needs_checkpoint
    last_step = acted[-1][0]
    assert telemetry.samples_total == last_step + 1 and telemetry.sample.step == last_step
    assert telemetry.verdict is verdict is station.verdict and verdict.status is Status.OOM_PROJECTED
    assert sum(telemetry.actions_snapshot().values()) == len(acted)
    assert [s.step for s in read_trace(tmp_path / "trace.csv")] == list(range(last_step + 1))
    lines = [e for e in events.events if e["event"] == "action_decided"]
    assert [(e["step"], e["action"]) for e in lines] == [(step, a.value) for step, a in acted]
    assert all(e["device"] == "tpu:0" and e["pid"] == 123 and e["status"] in ("suspect", "oom_projected")
               for e in lines)
    assert lines[-1]["projected_oom_step"] == verdict.projected_oom_step


def test_what_a_reinit_gave_back_is_measured_and_said_with_the_series_context(events):
    station = Station(Judge(memory_limit_bytes=2 * GiB), Telemetry(), memory="host")
    for sample in leaking(300):
        _, action = station.observe(sample)
        if action.needs_checkpoint:
            break
    recovery = station.reinit_finished(float(GiB))
    assert recovery is not None and recovery.recovered_bytes > 0
    [line] = events.named("reinit_measured")
    assert line["memory"] == "host" and line["recovered_bytes"] == recovery.recovered_bytes


def test_a_restart_starts_the_judge_over_and_is_counted():
    telemetry = Telemetry()
    station = Station(Judge(memory_limit_bytes=2 * GiB), telemetry)
    for sample in leaking(100):
        station.observe(sample)
    station.restarted()
    assert telemetry.restarts_total == 1
    verdict, _ = station.observe(Sample(0, 2000.0, GiB, 2 * GiB))
    assert verdict.status is Status.WARMING_UP


def test_no_host_logs_what_the_station_logs():
    """The station's lines are written in one module: a host that logged its own `action_decided`
    or leak report would be a second verdict-to-action path."""
    owned = {"action_decided", "leak_detected", "leak_report_cleared", "reinit_measured", "restart_measured"}
    writers = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "log_event":
                name = node.args[2]  # log_event(logger, level, event, ...)
                if isinstance(name, ast.Constant) and name.value in owned:
                    writers.setdefault(name.value, set()).add(str(path.relative_to(PACKAGE)))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("info", "warning", "error", "log") and node.args):
                name = node.args[1] if node.func.attr == "log" and len(node.args) > 1 else node.args[0]
                if isinstance(name, ast.Constant) and name.value in owned:
                    writers.setdefault(name.value, set()).add(str(path.relative_to(PACKAGE)))
    assert writers and set(writers) == owned
    assert all(files <= {"station/station.py", "station/leak_report.py"} for files in writers.values()), writers


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
steps = st.floats(min_value=0, allow_nan=False)  # inf allowed: "no OOM in sight"


@given(step=st.integers(0, 2**52), timestamp=finite, floor=st.none() | finite,
       projected=st.none() | st.integers(0, 2**52), oom_steps=steps, oom_seconds=steps, pessimistic=steps)
def test_a_verdict_at_another_sample_changes_those_fields_and_keeps_the_rest(step, timestamp, floor, projected,
                                                                             oom_steps, oom_seconds, pessimistic):
    analysis = Verdict(step=7, timestamp=1.0, status=Status.SUSPECT, floor_bytes=5.0, excursion_bytes=2.0,
                       limit_bytes=100.0, slope_bytes_per_step=3.0, slope_low_bytes_per_step=1.0,
                       slope_high_bytes_per_step=4.0, slope_bytes_per_second=30.0, projected_oom_step=40,
                       projected_oom_steps=33.0, projected_oom_seconds=3.3, explanation="why",
                       projected_oom_steps_pessimistic=20.0, window_steps=64.0, leak_detected=True)
    moved = analysis.at(step, timestamp, floor_bytes=floor, projected_oom_step=projected,
                        projected_oom_steps=oom_steps, projected_oom_seconds=oom_seconds,
                        projected_oom_steps_pessimistic=pessimistic)
    expected = analysis._replace(step=step, timestamp=timestamp, floor_bytes=floor, projected_oom_step=projected,
                                 projected_oom_steps=oom_steps, projected_oom_seconds=oom_seconds,
                                 projected_oom_steps_pessimistic=pessimistic)
    assert type(moved) is Verdict and moved == expected and moved.oom_projected is False
    assert math.isinf(Verdict(step=0, timestamp=0.0, status=Status.HEALTHY).projected_oom_steps)


def test_the_statuses_read_as_words():
    assert [s.label for s in Status] == ["warming up", "healthy", "suspect", "OOM projected"]
    assert Verdict(step=0, timestamp=0.0, status=Status.OOM_PROJECTED).oom_projected
