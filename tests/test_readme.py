"""The README's quick start is the contract with new users: CI must run its test command verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = ci[ci.index("# README test command:") + 1]
    readme = (ROOT / "README.md").read_text()
    assert f"\n{command}\n" in readme


def test_quick_start_is_exactly_two_commands():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", section, flags=re.S)
    commands = [line for block in blocks for line in block.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 2, commands
    assert "hbm-watchdog train" in commands[0] and "--inject-leak" in commands[0]
    assert "pytest" in commands[1]


def test_ci_lists_the_twenty_slowest_tests():
    assert "--durations=20" in (ROOT / ".ci" / "run").read_text()
