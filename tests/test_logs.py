"""Console rendering for people, JSON for machines: the same events, different clothes."""

from __future__ import annotations

import json
import logging

import pytest

from watchdog.commands.cli import main
from watchdog.core.errors import EXIT_BAD_INPUT
from watchdog.logs import configure_logging, get_logger, open_log_file, with_units


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
    log.warning("watchdog_action", action="checkpoint_reinit", step=3)
    log.warning("watchdog_acted", step=3, block="── watchdog: checkpoint reinit at step 3 ──\n  done  reinit")
    return capsys.readouterr().err


def test_routine_detail_is_debug_on_the_console_but_stays_in_json(capsys, restore_root_logging):
    console = emit(capsys, "console", "info")
    assert "memory_source_selected" not in console and "watchdog_action" in console
    assert "── watchdog: checkpoint reinit at step 3 ──\n  done  reinit" in console
    assert "memory_source_selected" in emit(capsys, "console", "debug")
    records = [json.loads(line) for line in emit(capsys, "json", "info").splitlines()]
    assert [r["event"] for r in records] == ["memory_source_selected", "watchdog_action", "watchdog_acted"]
    assert records[0]["bytes_used"] == 1 << 30  # raw base units for machines


def test_warning_level_keeps_only_warnings(capsys, restore_root_logging):
    out = emit(capsys, "json", "warning")
    assert [json.loads(line)["event"] for line in out.splitlines()] == ["watchdog_action", "watchdog_acted"]


def test_a_log_file_gets_every_event_as_json_whatever_the_console_shows(capsys, tmp_path, restore_root_logging):
    path = tmp_path / "run.jsonl"
    path.write_text('{"event": "an earlier run"}\n')
    with open_log_file(path) as handle:
        configure_logging("console", "info", handle)
        get_logger("watchdog.test").info("memory_source_selected", source="rss", bytes_used=1 << 30)
        get_logger("watchdog.test").warning("watchdog_action", action="checkpoint_reinit", step=3)
        console = capsys.readouterr().err
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in records] == ["an earlier run", "memory_source_selected", "watchdog_action"]
    assert records[1]["bytes_used"] == 1 << 30  # raw units, routine events included
    assert "memory_source_selected" not in console and "watchdog_action" in console


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
