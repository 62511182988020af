"""Console rendering for people, JSON for machines: the same events, different clothes."""

from __future__ import annotations

import json
import logging

import pytest

from watchdog.logs import configure_logging, get_logger, with_units


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
