"""`hbm-watchdog report`: a real PNG and a self-contained HTML page; bad input exits 2 with one line."""

import base64
import re
import struct

import pytest

from watchdog.commands.cli import main
from watchdog.commands.report import draw_trace
from watchdog.core.sample import write_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def leak_trace(synthetic_corpus_0):
    return next(t for t in synthetic_corpus_0 if t.kind == "linear_large_leak" and len(t.samples) < 5000)


@pytest.fixture
def trace_file(tmp_path, leak_trace):
    path = tmp_path / "leak.csv"
    write_trace(path, leak_trace.samples)
    return path


def test_report_writes_a_png_picture(tmp_path, trace_file, capsys):
    out = tmp_path / "leak.png"
    assert main(["report", str(trace_file), "-o", str(out)]) == 0
    width, height = png_size(out.read_bytes())
    assert width >= 1000 and height >= 600
    assert out.stat().st_size > 20_000  # a drawn chart, not an empty canvas
    assert str(out) in capsys.readouterr().out


def test_report_writes_a_self_contained_html_page(tmp_path, trace_file):
    out = tmp_path / "leak.html"
    assert main(["report", str(trace_file), "-o", str(out), "--memory-limit", "12GiB"]) == 0
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>")
    match = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert match and png_size(base64.b64decode(match.group(1)))[0] >= 1000
    assert "<th>limit</th><td>12.00 GiB</td>" in page  # the budget overrides the larger device limit
    for field in ("first action", "decided on", "checkpoint actions", "projected OOM step", "floor slope", "at the end"):
        assert f"<th>{field}</th>" in page
    assert "http" not in page.replace("http-equiv", "")  # nothing fetched from elsewhere


def test_draw_trace_marks_the_true_oom_of_a_benchmark_trace(tmp_path, leak_trace):
    path = draw_trace(leak_trace.samples, tmp_path / "x.png", name=leak_trace.name,
                         memory_limit_bytes=leak_trace.limit_bytes, true_oom_step=leak_trace.oom_step)
    assert png_size(path.read_bytes())[0] >= 1000


@pytest.mark.parametrize("args, message", [
    (["-o", "out.pdf"], "must end in .png or .html"),
    (["-o", "out.png", "--memory-limit", "lots"], "--memory-limit"),
])
def test_bad_output_or_limit_exits_2_with_one_line(tmp_path, trace_file, capsys, args, message):
    args = [a if not a.startswith("out.") else str(tmp_path / a) for a in args]
    assert main(["report", str(trace_file), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not list(tmp_path.glob("out.*"))


def test_a_file_that_is_not_a_trace_exits_2_naming_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1,2.0,lots,,\n")
    assert main(["report", str(bad), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2:" in err and "Traceback" not in err


def test_missing_or_empty_trace_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "none.csv"), "-o", str(tmp_path / "x.png")]) == 2
    empty = tmp_path / "empty.csv"
    empty.write_text("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n")
    assert main(["report", str(empty), "-o", str(tmp_path / "x.html")]) == 2
    assert "no samples" in capsys.readouterr().err


def test_steps_beyond_the_bound_are_one_line_not_a_matplotlib_error(tmp_path, capsys):
    """Issue 24, item 11: steps near 10**25 reached matplotlib and failed there with a TypeError."""
    trace = tmp_path / "far.csv"
    rows = "".join(f"{10**25 + k},{1e9 + k},{(1 << 30) + k},,\n" for k in range(50))
    trace.write_text("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n" + rows)
    assert main(["report", str(trace), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{trace}:2: step" in err[0]
    assert not (tmp_path / "x.png").exists()


def test_a_trace_named_with_dollars_is_drawn_as_text_not_mathtext(tmp_path, leak_trace, capsys):
    """Issue 52: `report 'run_$5_$10.csv' -o x.png` raised matplotlib's ParseSyntaxException: the
    file name goes into the title, which matplotlib read as mathtext."""
    trace = tmp_path / "run_$5_$10 \\frac{1}{0}.csv"
    write_trace(trace, leak_trace.samples)
    out = tmp_path / "x.png"
    assert main(["report", str(trace), "-o", str(out)]) == 0
    png_size(out.read_bytes())


def test_after_a_reinit_the_floor_stays_below_the_samples_and_the_title_and_summary_tell_one_story(tmp_path):
    """Issue 53: after a reinit the green floor sat 0.55-0.6 GiB while the samples were 781-1,111 MiB;
    the title showed the first action's projection while the summary ended with another; a 2.75 GiB
    budget read 2.8 GiB."""
    import math
    import random

    from watchdog.commands.report import _title, collect, summary_rows
    from watchdog.core.sample import Sample

    rng, MiB = random.Random(1), 1 << 20
    samples, kept = [], 0
    for step in range(0, 900, 2):
        kept = 0 if step == 450 else kept + 4 * MiB  # a reinit at step 450, the leak still in the code
        samples.append(Sample(step, 1.7e9 + step, int(700 * MiB + kept + 64 * MiB * rng.random()), None))
    picture = collect(samples, memory_limit_bytes=int(2.75 * (1 << 30)))
    for index, floor in enumerate(picture.floor):
        if not math.isnan(floor):
            assert floor <= min(picture.used[max(0, index - 15):index + 1]) + 1e-12
    title, rows = _title("t.csv", picture), dict(summary_rows("t.csv", samples, picture))
    if picture.first_action_verdict is not None:
        assert rows["decided on"] in title
    assert rows["limit"] == "2.75 GiB"
