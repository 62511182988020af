"""Console rendering for people, JSON for machines: the same events, different clothes."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

from watchdog.commands.cli import main
from watchdog.core.errors import EXIT_BAD_INPUT
from watchdog.logs import OncePerKind, configure_logging, get_logger, log_event, open_log_file, with_units


def test_numbers_get_their_units_on_the_console_only():
    event = with_units(None, "info", {"event": "x", "bytes_after": 1536, "slope_bytes_per_step": 4 << 20,
                                       "checkpoint_seconds": 300.0, "step": 7, "recovered": True})
    assert event == {"event": "x", "bytes_after": "1.5 KiB", "slope_bytes_per_step": "+4.0 MiB/step",
                     "checkpoint_seconds": "5 min", "step": 7, "recovered": True}


@pytest.fixture
def restore_root_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers, root.level = handlers, level


def emit(capsys, fmt: str, level: str) -> str:
    configure_logging(fmt, level)
    log = get_logger("watchdog.test")
    log.info("memory_source_selected", source="rss", bytes_used=1 << 30)
    log_event(log, logging.WARNING, "action_decided", action="checkpoint_reinit", step=3)
    log_event(log, logging.WARNING, "action_outcome", step=3,
              block="── watchdog: checkpoint reinit at step 3 ──\n  done  reinit")
    return capsys.readouterr().err


def test_routine_detail_is_debug_on_the_console_but_stays_in_json(capsys, restore_root_logging):
    console = emit(capsys, "console", "info")
    assert "memory_source_selected" not in console and "action_decided" in console
    assert console.count("── watchdog: checkpoint reinit at step 3 ──\n  done  reinit") == 1
    assert "watchdog_action" not in console and "deprecated" not in console, "one name per event"
    assert "memory_source_selected" in emit(capsys, "console", "debug")
    records = [json.loads(line) for line in emit(capsys, "json", "info").splitlines()]
    assert [r["event"] for r in records] == ["memory_source_selected", "action_decided", "action_outcome"]
    assert not any("deprecated" in r for r in records), "each action said once, under its one name"
    assert records[1]["action"] == "checkpoint_reinit" and records[1]["step"] == 3
    assert records[0]["bytes_used"] == 1 << 30  # raw base units for machines


def test_warning_level_keeps_only_warnings(capsys, restore_root_logging):
    out = emit(capsys, "json", "warning")
    assert [json.loads(line)["event"] for line in out.splitlines()] == ["action_decided", "action_outcome"]


def test_once_per_kind_logs_each_new_kind_and_cause_once_and_counts_every_error(events):
    """The one helper behind the sidecar's, the daemon's, the trace's and the flight record's errors."""
    errors = OncePerKind(get_logger("watchdog.test"), "thing_failed", level="error")
    said = [errors("write", "No space left on device", path="p") for _ in range(3)]
    said.append(errors("write", "Read-only file system", path="p"))  # a new cause at the same place
    said.append(errors("open", "No space left on device", path="p", note="retried in 5 s"))  # a new place
    assert said == [True, False, False, True, True] and errors.count == 5
    logged = events.named("thing_failed")
    assert [(e["kind"], e["level"]) for e in logged] == [("write", "error")] * 2 + [("open", "error")]
    assert logged[0]["note"] == OncePerKind.NOTE and logged[2]["note"] == "retried in 5 s"



def test_a_log_file_gets_every_event_as_json_whatever_the_console_shows(capsys, tmp_path, restore_root_logging):
    path = tmp_path / "run.jsonl"
    path.write_text('{"event": "an earlier run"}\n')
    with open_log_file(path) as handle:
        configure_logging("console", "info", handle)
        get_logger("watchdog.test").info("memory_source_selected", source="rss", bytes_used=1 << 30)
        get_logger("watchdog.test").warning("action_decided", action="checkpoint_reinit", step=3)
        console = capsys.readouterr().err
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in records] == ["an earlier run", "memory_source_selected", "action_decided"]
    assert records[1]["bytes_used"] == 1 << 30  # raw units, routine events included
    assert "memory_source_selected" not in console and "action_decided" in console


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_a_log_file_that_is_not_a_plain_file_is_refused_in_one_line(capsys, tmp_path, kind, restore_root_logging):
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    path = tmp_path / "log"
    if kind == "symlink":
        path.symlink_to(target)
    else:
        path.mkdir()
    assert main(["--log-file", str(path), "analyze", str(tmp_path / "none.csv")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("hbm-watchdog analyze: error: --log-file") and err.count("\n") == 1, err
    assert target.read_text() == "keep me\n"


def test_a_log_file_that_fails_is_said_once_and_the_run_goes_on(capfd, tmp_path, restore_root_logging):
    """Issue 52: `--log-file` on a full disk printed logging's traceback for every event (54 stderr
    lines for 2 events). The disk's refusal (ENOSPC on write, as a full disk gives it) is said once."""
    import errno

    class FullDisk(io.StringIO):
        name = str(tmp_path / "run.jsonl")

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    configure_logging("json", "info", FullDisk())
    for step in range(20):
        get_logger("watchdog.test").warning("action_decided", action="checkpoint_reinit", step=step)
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "cannot write the log" in line]
    assert len(said) == 1 and "No space left on device" in said[0] and "the run goes on" in said[0]
    assert "Traceback" not in err and "Logging error" not in err
    assert err.count('"action_decided"') == 20, "stderr keeps every event"


# ---- a loop of one's own, with no logging set up (issue 53) -----------------------------------------

OWN_LOOP = Path(__file__).parent / "jobs" / "own_loop.py"


@pytest.mark.slow
def test_a_loop_of_ones_own_with_no_logging_set_up_reads_well_on_a_terminal_and_is_json_in_a_pipe():
    """Issue 53: in a loop written from the README, every event printed as a Python dict, even on a
    terminal, each action twice (its old name too), the block as one escaped string. Now: JSON lines
    in a pipe, the console's rendering on a terminal, each action once."""
    import subprocess
    import sys

    from conftest import REPO, hbm_watchdog_env, run_on_a_pty

    piped = subprocess.run([sys.executable, str(OWN_LOOP)], capture_output=True, text=True, timeout=120,
                           cwd=REPO, env=hbm_watchdog_env())
    assert piped.returncode == 0, piped.stderr[-2000:]
    records = [json.loads(line) for line in piped.stderr.splitlines()]  # every line strict JSON
    events = [r["event"] for r in records]
    assert events.count("action_decided") == 1 and events.count("action_outcome") == 1, events
    assert not any("deprecated" in r for r in records) and "watchdog_action" not in events
    code, screen = run_on_a_pty([sys.executable, str(OWN_LOOP)], timeout=120)
    text = screen.decode("utf-8", "replace")
    assert code == 0, text[-2000:]
    assert "{'" not in text and '{"' not in text, "no Python dict and no JSON on a terminal"
    assert text.count("── watchdog: checkpoint reinit at step") == 1, text
    assert "\\n" not in text and "  recovered" in text, "the block printed as a block"
    assert "action_decided" in text and "watchdog_action" not in text


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["lightning", "huggingface"])
def test_under_lightning_and_hugging_face_the_watchdogs_lines_read_as_text_each_action_once(tmp_path, framework):
    """Issue 53: under Lightning and Hugging Face the lines read `ERROR:watchdog.station.station:{...}`
    and each action came twice. Here the script configures nothing; what it imports may (torch_xla,
    imported by Lightning, logs through the root logger, which installs Python's default handler).
    Either way a person reads our events: as that handler's text (`WARNING:watchdog...:event: k=v`,
    the action's block as a block), or as JSON lines where nothing else is set up; never a Python
    dict, each action once."""
    import subprocess
    import sys

    from conftest import REPO, hbm_watchdog_env

    out = subprocess.run([sys.executable, str(OWN_LOOP.parent / "framework_lines.py"), framework, str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=REPO, env=hbm_watchdog_env())
    assert out.returncode == 42, out.stderr[-3000:]  # the drill's restart: saved, exit 42
    err = out.stderr
    assert "{'" not in err and ":{" not in err, err[-3000:]
    as_json = [json.loads(line) for line in err.splitlines() if line.startswith("{") and '"logger": "watchdog.' in line]
    outcomes = sum(r["event"] == "action_outcome" for r in as_json) + err.count("── watchdog: checkpoint restart at step")
    assert outcomes == 1, err[-3000:]
    assert "watchdog_action" not in err and "watchdog_acted" not in err and "deprecated" not in err
