"""The capture window on a real file system: off (a link to /dev/null), on once found, off again after.

Only torch_xla's side is played here: the compile counter, and appending a report to the analysis
path the way torch_xla does (open in append mode, write, close, at each compilation). The real
runtime is in tests/test_xla_recompilation.py.
"""

from __future__ import annotations

import logging
import os

import pytest

from watchdog.core.compile_causes import SourceView
from watchdog.core.recompilation import RecompilationConfig
from watchdog.runtime import compile_watch, xla_stats
from watchdog.station.telemetry import Telemetry
from watchdog.runtime.xla_stats import CompileAnalysis

CONFIG = RecompilationConfig(warmup_steps=10, capture_compiles=2, capture_steps=50)


def report(line: int) -> str:
    """One compilation report, as torch_xla 2.9 writes it (abridged to what is parsed)."""
    body = ["Compilation Cause", "  most likely user code trying to access tensor value before torch_xla.sync",
            "Graph Info: ", f"  Graph Hash: hash{line}", "  Number of Graph Inputs: 3",
            "Python Frame Triggered Execution: ", f"  train (/home/me/train.py:{line})", "-" * 20]
    return "\n".join(f"Compilation Analysis: {text}" for text in body) + "\n"


class Runtime:
    """torch_xla as far as the watch can see it: a counter, and reports appended at each compilation."""

    def __init__(self, monkeypatch, path):
        self.compiles, self.path = 0, path
        monkeypatch.setattr(xla_stats, "compilations", lambda: self.compiles)
        monkeypatch.setattr(xla_stats, "compile_seconds", lambda: self.compiles * 0.5)
        monkeypatch.setattr(xla_stats, "cached_graphs", lambda: self.compiles)

    def compile(self, line: int = 88) -> None:
        self.compiles += 1
        if self.path is not None:
            with open(self.path, "a") as handle:
                handle.write(report(line))


@pytest.fixture
def owned(tmp_path):
    path = tmp_path / "compile-analysis.txt"
    path.symlink_to(os.devnull)
    return CompileAnalysis(path, owned=True, unavailable=None)


def watch(analysis, telemetry=None):
    source = SourceView(code_at=lambda path, line: "loss.item()", shorten=os.path.basename)
    return compile_watch.CompileWatch(CONFIG, telemetry or Telemetry(), analysis=analysis, source=source)


def test_the_capture_is_off_until_found_on_for_a_bounded_window_then_off(monkeypatch, owned, caplog):
    runtime, telemetry = Runtime(monkeypatch, owned.path), Telemetry()
    w = watch(owned, telemetry)
    for step in range(0, 10):  # warm-up compiles: reported into /dev/null
        runtime.compile(line=1)
        w.observe(step)
    step = 10
    while w.figures.detected is not True:
        runtime.compile(line=1)
        w.observe(step)
        step += 1
    assert owned.path.is_file() and not owned.path.is_symlink(), "found: the capture is on"
    assert w.figures.finding is None, "the cause is reported once captured"
    with caplog.at_level(logging.WARNING, logger="watchdog.runtime.compile_watch"):
        for _ in range(2):
            runtime.compile(line=88)
            w.observe(step)
            step += 1
    assert owned.path.is_symlink(), "reported: the capture is off again"
    finding = w.figures.finding
    assert (finding["cause"], finding["file"], finding["line"]) == ("value_read", "/home/me/train.py", 88)
    assert finding["compiles_explained"] == 2, "only what came after the finding was read"
    assert finding["explanation"].startswith("graph recompiled every step: `loss.item()` at train.py:88")
    assert finding["compile_seconds_after_warmup"] == pytest.approx(0.5 * finding["compiles_after_warmup"])
    assert any(r.levelno == logging.WARNING and "recompilation" in str(r.msg) for r in caplog.records)
    assert w.figures.steps_per_recompilation == pytest.approx(1.0, rel=0.2)


def test_when_the_analysis_cannot_be_read_the_finding_says_why_at_once(monkeypatch):
    runtime, telemetry = Runtime(monkeypatch, None), Telemetry()
    w = watch(CompileAnalysis(None, owned=False, unavailable="torch_xla ran a graph before the watchdog"),
              telemetry)
    step = 0
    while w.figures.finding is None and step < 100:
        runtime.compile()
        w.observe(step)
        step += 1
    finding = w.figures.finding
    assert finding["cause"] == "unknown" and finding["line"] is None
    assert finding["explanation"].endswith("cause unknown: torch_xla ran a graph before the watchdog")
    assert finding["step"] == step - 1, "reported when found, not after a window"


def test_a_run_that_ends_mid_capture_reports_what_it_has_and_turns_the_capture_off(monkeypatch, owned):
    runtime, telemetry = Runtime(monkeypatch, owned.path), Telemetry()
    w = watch(owned, telemetry)
    step = 0
    while w.figures.detected is not True:
        runtime.compile()
        w.observe(step)
        step += 1
    runtime.compile(line=42)  # one of the two wanted, then the run stops
    w.close()
    assert owned.path.is_symlink()
    assert w.figures.finding["line"] == 42 and w.figures.finding["compiles_explained"] == 1


def test_the_users_own_analysis_file_is_read_from_its_end_and_never_replaced(monkeypatch, tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text(report(7) * 3)  # the user's history, before the finding
    runtime, telemetry = Runtime(monkeypatch, path), Telemetry()
    w = watch(CompileAnalysis(path, owned=False, unavailable=None), telemetry)
    step = 0
    while w.figures.finding is None and step < 100:
        runtime.compile(line=88)
        w.observe(step)
        step += 1
    assert w.figures.finding["line"] == 88
    assert path.is_file() and not path.is_symlink()
    assert path.read_text().startswith(report(7) * 3)


def test_off_xla_nothing_is_watched(monkeypatch):
    monkeypatch.setattr(xla_stats, "compilations", lambda: None)
    w = watch(None)
    w.observe(5)
    assert w.figures.detected is None and w.figures.compilations is None
    assert list(w.figures.collect()) == [], "absent off XLA, never a made-up 0"


@pytest.fixture
def clean_env(monkeypatch):
    for name in (xla_stats.LEVEL_ENV, xla_stats.FILE_ENV, xla_stats.MAX_FRAME_ENV, xla_stats.OWNER_ENV):
        monkeypatch.setenv(name, "")  # recorded first: `_prepare` sets them, and undo must remove them
        monkeypatch.delenv(name)
    monkeypatch.setattr(xla_stats, "_graphs_already_run", lambda: False)
    return monkeypatch


def test_prepare_turns_level_1_on_into_a_link_to_dev_null(clean_env):
    analysis = xla_stats._prepare()
    assert analysis.owned and analysis.why_not() is None
    assert os.environ[xla_stats.LEVEL_ENV] == "1"
    assert os.environ[xla_stats.FILE_ENV] == str(analysis.path)
    assert os.readlink(analysis.path) == os.devnull
    assert os.environ[xla_stats.MAX_FRAME_ENV] == xla_stats.MAX_FRAMES
    assert os.environ[xla_stats.OWNER_ENV] == str(os.getpid())


def test_settings_inherited_from_a_parent_watchdog_are_replaced(clean_env):
    clean_env.setenv(xla_stats.LEVEL_ENV, "1")
    clean_env.setenv(xla_stats.FILE_ENV, "/parent/analysis")
    clean_env.setenv(xla_stats.OWNER_ENV, str(os.getpid() + 1))
    analysis = xla_stats._prepare()
    assert analysis.owned and os.environ[xla_stats.FILE_ENV] == str(analysis.path)


@pytest.mark.parametrize("level, file, why", [
    ("0", None, "keeps torch_xla's compile analysis off"),
    ("1", None, "writes its compile analysis to stderr"),
])
def test_a_users_own_setting_is_respected_and_said_when_unreadable(clean_env, level, file, why):
    clean_env.setenv(xla_stats.LEVEL_ENV, level)
    analysis = xla_stats._prepare()
    assert not analysis.owned and why in analysis.why_not()
    assert os.environ[xla_stats.LEVEL_ENV] == level and xla_stats.OWNER_ENV not in os.environ


def test_too_late_says_so(clean_env):
    clean_env.setattr(xla_stats, "_graphs_already_run", lambda: True)
    analysis = xla_stats._prepare()
    assert "before the watchdog was created" in analysis.why_not()
    assert xla_stats.LEVEL_ENV not in os.environ


def test_only_local_process_0_gets_reports(owned, monkeypatch):
    monkeypatch.setenv("PJRT_LOCAL_PROCESS_RANK", "3")
    assert "local process 3" in owned.why_not() and owned.open() is None


@pytest.mark.parametrize("line, code", [("self._sync()  # XLA: runs here\n", "self._sync()"),
                                        ('print("a#b")  # c\n', 'print("a#b")'), ("  # only\n", "")])
def test_code_is_shown_without_its_comment(line, code):
    assert xla_stats._without_comment(line) == code
