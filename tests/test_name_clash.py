"""The file-events package `watchdog` shares our import name; the command line says so in one line.

The other package is really installed (from PyPI, into a scratch target folder) and merged with
ours the way pip merges two distributions that own the same folder of a site-packages.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def other_watchdog(tmp_path_factory) -> Path:
    """The file-events package installed alone into a target folder (skipped without a registry)."""
    target = tmp_path_factory.mktemp("other") / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                           "watchdog>=2"], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.skip(f"cannot install the file-events package 'watchdog': {done.stderr.strip()[-200:]}")
    assert (target / "watchdog" / "events.py").exists()
    return target


def merged_site(other: Path, tmp_path: Path, ours_last: bool) -> Path:
    """A site-packages where both distributions wrote into one `watchdog/` folder."""
    site = tmp_path / "site"
    shutil.copytree(other, site)
    ours = REPO / "watchdog"
    ignore = shutil.ignore_patterns("__pycache__", "*.csv.gz", *(() if ours_last else ("__init__.py",)))
    shutil.copytree(ours, site / "watchdog", ignore=ignore, dirs_exist_ok=True)
    if not ours_last:  # the other package came second: its __init__.py replaced ours
        shutil.copy2(other / "watchdog" / "__init__.py", site / "watchdog" / "__init__.py")
    return site


def run_cli(site: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "watchdog.commands.cli", *args], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, cwd=site)


@pytest.mark.parametrize("ours_last", [True, False], ids=["hbm-watchdog-installed-last", "watchdog-installed-last"])
def test_a_shared_watchdog_folder_is_one_line_and_exit_2(other_watchdog, tmp_path, ours_last):
    out = run_cli(merged_site(other_watchdog, tmp_path, ours_last), "analyze", "trace.csv")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert "file-events package 'watchdog'" in lines[0] and "virtual environment of its own" in lines[0]


def test_our_package_alone_passes_the_check(tmp_path):
    site = tmp_path / "site"
    shutil.copytree(REPO / "watchdog", site / "watchdog", ignore=shutil.ignore_patterns("__pycache__", "*.csv.gz"))
    out = run_cli(site, "analyze", str(tmp_path / "missing.csv"))
    assert out.returncode == 2 and "file-events" not in out.stderr and "missing.csv" in out.stderr
