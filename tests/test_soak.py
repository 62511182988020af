"""The soak and scrape-storm benchmarks run and print their figures (short runs; the figures are not judged)."""

from __future__ import annotations

import re

import pytest
from conftest import run_python_args


def run_module(*argv: str) -> str:
    return run_python_args(["-m", *argv], timeout=600).stdout


@pytest.mark.slow
def test_soak_prints_threads_fds_and_rss_at_intervals_and_compares_first_with_last():
    out = run_module("watchdog.bench.soak", "--steps", "300", "--report-every", "100", "--checkpoint-every", "150")
    rows = [line for line in out.splitlines() if re.match(r"^\s+\d[\d,]* ", line)]
    assert len(rows) >= 2, out
    assert re.search(r"first row \(step [\d,]+\) -> last row \(step [\d,]+\): RSS [\d.]+ -> [\d.]+ MiB "
                     r"\([+-][\d.]+\), threads \d+ -> \d+, fds \d+ -> \d+", out), out
    assert "train: done: steps 300/300" in out


@pytest.mark.slow
def test_scrape_storm_prints_steps_per_second_for_each_phase():
    out = run_module("watchdog.bench.scrape_storm", "--clients", "20", "--phase-seconds", "1")
    for phase in ("quiet", "scrapers", "half-open", "quiet again"):
        assert re.search(rf"^{phase} +[\d.]+ steps/s +threads <= +\d+ +fds <= +\d+", out, re.M), out
    assert re.search(r"^scrapers: [\d.]+ steps/s against [\d.]+ quiet \([\d.]+% of it\) with 20 clients", out, re.M)
