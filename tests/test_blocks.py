"""The terminal's two blocks (station/blocks.py): an action's outcome, and how the run ended;
every number has its unit."""

from __future__ import annotations

import math
import re

import pytest

from watchdog.actions.record import ActionOutcome
from watchdog.core.verdict import Action, Status, Verdict
from watchdog.station.blocks import RunSummary

MiB, GiB = 1 << 20, 1 << 30


def leaking_verdict() -> Verdict:
    return Verdict(step=270, timestamp=0.0, status=Status.OOM_PROJECTED, floor_bytes=1.5 * GiB, excursion_bytes=0.2 * GiB,
                   limit_bytes=2 * GiB, slope_bytes_per_step=4 * MiB, projected_oom_step=271,
                   projected_oom_steps=1.0, projected_oom_seconds=8.2)


def test_the_action_block_says_what_was_seen_leaking_done_and_given_back():
    report = ActionOutcome(step=270, action=Action.CHECKPOINT_REINIT, verdict=leaking_verdict(),
                          suspects=["+301 tensors float32[1048576] (+1.2 GiB); held by list 'tensors'"],
                          checkpoint="ckpt/ckpt-00000270.pt", outcome="reinitialised in process",
                          recovered_bytes=1.2 * GiB, memory_after_bytes=780 * MiB)
    lines = report.block().splitlines()
    assert lines[0].startswith("── watchdog: checkpoint reinit at step 270 ")
    text = "\n".join(lines)
    assert "floor rising +4.0 MiB/step at 1.5 GiB; OOM in ~8 s (step 271)" in text
    assert re.search(r"leaking\s+\+301 tensors", text)
    assert "checkpoint ckpt/ckpt-00000270.pt, reinitialised in process" in text
    assert "1.20 GiB given back (memory now 780.00 MiB)" in text


def test_a_reinit_that_freed_nothing_says_what_comes_next():
    report = ActionOutcome(step=9, action=Action.CHECKPOINT_REINIT, verdict=None, recovered_bytes=-3 * MiB)
    text = report.block()
    assert "nothing given back" in text and "restart" in text
    assert "no growing group of live tensors or Python buffers found" in text


def test_the_summary_table_has_units_and_the_command_to_draw_the_trace():
    verdict = leaking_verdict()._replace(projected_oom_seconds=math.inf, projected_oom_steps=120.0)
    summary = RunSummary(command="train", outcome="done", steps_done=600, steps_total=600, steps_per_second=9.6,
                         reinits=1, peak_bytes=1.9 * GiB, limit_bytes=2 * GiB, verdict=verdict,
                         trace_file="runs/demo/trace.csv", checkpoint_dir="runs/demo/ckpt", newest_checkpoint_step=600)
    text = summary.block()
    assert text.splitlines()[0].startswith("── hbm-watchdog train: done ")
    assert "600 / 600, 9.6 steps/s" in text
    assert "1.90 GiB of 2.00 GiB budget (95%)" in text
    assert "OOM projected, floor +4.0 MiB/step; OOM in 120 steps (step 271)" in text
    assert "runs/demo/ckpt (newest: step 600)" in text
    assert "hbm-watchdog report runs/demo/trace.csv -o runs/demo/trace.png" in text


def test_the_title_names_what_was_done_a_reinit_carried_out_as_an_exit_is_a_restart():
    """Issue 63, item 8: a loop with no rebuild (`carry_out(action, save=save)`, then exit 42)
    restarts; the title says so, and a row says what the watchdog asked for."""
    exited = ActionOutcome(step=221, action=Action.CHECKPOINT_REINIT, verdict=leaking_verdict(),
                           checkpoint="ckpt.pt", outcome="exit 42: restart requested", exit_code=42)
    text = exited.block()
    assert text.splitlines()[0].startswith("── watchdog: checkpoint restart at step 221 "), text
    assert re.search(r"asked\s+checkpoint reinit; with no rebuild given, the loop saves and exits 42", text), text
    rebuilt = ActionOutcome(step=221, action=Action.CHECKPOINT_REINIT, verdict=None,
                            outcome="reinitialised in process")
    assert rebuilt.block().splitlines()[0].startswith("── watchdog: checkpoint reinit at step 221 ")
    assert "asked" not in rebuilt.block()
    unsaved = ActionOutcome(step=5, action=Action.CHECKPOINT_RESTART, verdict=None, exit_code=44,
                            outcome="the checkpoint failed: exit 44 to restart from the newest one")
    assert unsaved.block().splitlines()[0].startswith("── watchdog: checkpoint failed at step 5 ")
