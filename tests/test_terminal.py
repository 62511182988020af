"""The terminal a person watches: the trainer under a real pseudo-terminal, read as a screen.

The child runs on a pty (so it takes the console path: progress bar, console logs, blocks), its
bytes are replayed through a terminal emulator (pyte), and the test reads the final screen as a
person would: the progress bar is one line at the bottom, no log line is glued into it, and every
number a person reads carries its unit.
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow

COLUMNS, ROWS = 160, 400  # the pseudo-terminal's size (tests/conftest.py run_on_a_pty)
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")
BAR = re.compile(r"\d+%\|.*\| \d+/\d+ \[")
SIZE = r"\d+\.\d+ (?:B|KiB|MiB|GiB)"


def screen_lines(output: bytes) -> list[str]:
    import pyte

    screen = pyte.Screen(COLUMNS, ROWS)
    stream = pyte.ByteStream(screen)
    stream.feed(output.replace(b"\n", b"\r\n"))  # as the terminal's onlcr would
    return [line.rstrip() for line in screen.display if line.strip()]


@pytest.mark.long  # the first to ask runs the shared scenario (about a minute)
def test_a_leak_caught_reads_well_on_a_terminal(leak_caught_on_a_terminal):
    folder, run = leak_caught_on_a_terminal
    code, output = run["exit_status"], run["output"].encode()
    lines = screen_lines(output)
    text = "\n".join(lines)
    assert code == 0, text[-4000:]
    bars = [i for i, line in enumerate(lines) if BAR.search(line)]
    assert len(bars) == 1, text  # the bar is one line, redrawn in place, not repeated under each event
    bar = lines[bars[0]]
    assert not TIMESTAMP.search(bar) and "──" not in bar  # no log line or block glued into it
    assert re.search(rf"{SIZE} / 2\.25 GiB", bar), bar
    assert all(not TIMESTAMP.search(line) or TIMESTAMP.match(line) for line in lines), text  # logs start lines
    block = text[text.index("── watchdog: checkpoint reinit at step"):]
    assert re.search(r"seen\s+floor rising \+\d+\.\d MiB/step at \d+\.\d GiB; OOM in ~\d+ s \(step [\d,]+\)", block)
    assert re.search(r"leaking\s+\+\d+ tensors float32\[1048576\]", block)
    assert re.search(rf"recovered\s+{SIZE} given back \(memory now {SIZE}\)", block)
    summary = text[text.index("── hbm-watchdog train: done"):]
    assert "600 / 600" in summary and re.search(rf"peak memory\s+{SIZE} of 2\.25 GiB budget", summary)
    assert f"hbm-watchdog report {folder / 'trace.csv'}" in summary
    assert "memory_source_selected" not in text  # routine start-up detail: debug on a terminal
