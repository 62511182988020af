"""Text from a file never acts on the terminal (issue 52's class): whatever a command prints of a
trace, a job file, a flight record or a path reaches stdout and stderr with its escape and control
characters written out (`core/printable.py`), never raw."""

import json

from watchdog.commands.cli import main
from watchdog.core.printable import PrintableStream, printable, printable_lines

HOSTILE = "\x1b]52;c;cHduZWQ=\x07\x1b[2J\x1bc"  # a clipboard write, a screen clear, a terminal reset


def test_printable_writes_every_control_character_as_its_escape_and_keeps_text():
    assert printable("plain text, ünïcode, ─ boxes") == "plain text, ünïcode, ─ boxes"
    assert printable(HOSTILE) == "\\x1b]52;c;cHduZWQ=\\x07\\x1b[2J\\x1bc"
    assert printable("a\nb\r\u2028c") == "a\\nb\\r\\u2028c"
    assert printable_lines("a\x1b\nb") == "a\\x1b\nb"


def test_a_printable_stream_keeps_line_breaks_and_tabs_and_hands_everything_else_through(capsys):
    import sys

    stream = PrintableStream(sys.stdout)
    stream.write(f"one\t{HOSTILE}\ntwo\n")
    out = capsys.readouterr().out
    assert out == "one\t\\x1b]52;c;cHduZWQ=\\x07\\x1b[2J\\x1bc\ntwo\n" and stream.buffer is sys.stdout.buffer


def test_analyze_goodput_and_an_error_line_print_a_files_text_inert(tmp_path, capsys):
    trace = tmp_path / f"run{HOSTILE}.csv"
    rows = "".join(f"{s},{1.7e9 + s},{(1 << 30) + s * (1 << 22)},{4 << 30},,{HOSTILE}eval\n" for s in range(200))
    trace.write_text("step,timestamp,bytes_used,bytes_limit,peak_bytes_used,phase\n" + rows)
    main(["analyze", str(trace)])
    job = tmp_path / "job.jsonl"
    records = [{"v": 1, "event": "job", "t": 0.0},
               {"v": 1, "event": "process", "t": 0.0, "pid": 11, "started": 0.0, "step": 0, "checkpoint_every": 0},
               {"v": 1, "event": "steps", "t": 10.0, "first": 0, "last": 100, "seconds": 10.0, "compile_seconds": 0.0},
               {"v": 1, "event": "action", "t": 10.0, "kind": HOSTILE, "step": 100, "projected_oom_step": 150},
               {"v": 1, "event": "end", "t": 11.0, "how": "done", "step": 100}]
    job.write_text("".join(json.dumps(r) + "\n" for r in records))
    main(["goodput", str(job)])
    main(["analyze", str(tmp_path / f"missing{HOSTILE}.csv")])
    captured = capsys.readouterr()
    assert "\x1b" not in captured.out + captured.err and "\x07" not in captured.out + captured.err
    assert "\\x1b]52;c;cHduZWQ=" in captured.out and "\\x1b]52" in captured.err
