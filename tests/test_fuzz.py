"""Hypothesis fuzz of what users feed in: trace files and command-line options.

The promise under test: anything either works or is one `InputError` (one line, exit 2); never a
traceback. Plus the torn-write promise of the trace: a trace cut at any byte loads as the rows
that were complete, and a writer resuming after the cut appends cleanly.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from watchdog.commands.cli import build_parser
from watchdog.core.errors import InputError, TraceFormatError
from watchdog.core.numbers import MAX_SIZE, MAX_STEP, PID_MAX, SEED_MAX
from watchdog.core.sample import (
    TRACE_HEADER,
    Sample,
    TraceWriter,
    load_trace,
    write_trace,
)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

sizes = st.integers(min_value=0, max_value=1 << 50)
samples = st.builds(Sample, step=st.integers(min_value=0, max_value=10**7),
                    timestamp=st.floats(min_value=0, max_value=4e9, allow_nan=False).map(lambda t: round(t, 6)),
                    bytes_used=sizes, bytes_limit=st.none() | sizes, peak_bytes_used=st.none() | sizes)
NOT_ASCII_DIGITS = "\u00b2\u0661\uff15\u0967"  # '²' '١' '５' '१': isdigit() passes them, int() reads some
field = st.one_of(st.text(alphabet="0123456789.-+eE naif\"\r\n\t\x00\u00e9" + NOT_ASCII_DIGITS, max_size=14),
                  st.integers(0, 10**30).map(str), st.integers(1, 600).map(lambda n: "9" * n))
header = ",".join(TRACE_HEADER)


def trace_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "trace.csv"


def complete_rows(data: bytes) -> int:
    """Rows whose line ending was written (csv ends them with \\r\\n; a cut after the \\r keeps the row whole)."""
    return data.count(b"\n") + data.endswith(b"\r") - 1


def cut_somewhere(path: Path, cut: int) -> bytes:
    """Cut the file at some byte after its header, as a writer killed mid-row leaves it."""
    data = path.read_bytes()
    body = data.index(b"\n") + 1
    kept = data[:body + cut % (len(data) - body + 1)]
    path.write_bytes(kept)
    return kept


def load_or_refuse(path: Path) -> list[Sample] | None:
    try:
        return load_trace(path)
    except TraceFormatError as exc:
        assert str(exc).startswith(str(path))  # names the file (and the line)
        return None


@FUZZ
@given(st.binary(max_size=3000))
def test_any_bytes_load_or_are_one_trace_format_error(tmp_path_factory, data):
    path = trace_path(tmp_path_factory)
    path.write_bytes(data)
    load_or_refuse(path)


@FUZZ
@given(st.lists(st.lists(field, max_size=7), max_size=12), st.booleans())
def test_any_rows_under_the_header_load_or_are_one_trace_format_error(tmp_path_factory, rows, final_newline):
    path = trace_path(tmp_path_factory)
    text = "\n".join([header, *(",".join(row) for row in rows)])
    path.write_text(text + ("\n" if final_newline else ""), encoding="utf-8")
    loaded = load_or_refuse(path)
    if loaded is not None:  # every number in bounds: steps exact as floats, sizes in 64 bits
        assert all(0 <= s.step < MAX_STEP and 0 <= s.bytes_used < MAX_SIZE and math.isfinite(s.timestamp)
                   and all(b is None or 0 <= b < MAX_SIZE for b in (s.bytes_limit, s.peak_bytes_used))
                   for s in loaded)


@FUZZ
@given(st.lists(samples, min_size=1, max_size=15), st.integers(min_value=0))
def test_a_trace_cut_at_any_byte_loads_as_its_complete_rows(tmp_path_factory, trace, cut):
    path = trace_path(tmp_path_factory)
    write_trace(path, trace)
    kept = cut_somewhere(path, cut)
    assert load_trace(path) == trace[:complete_rows(kept)]


@FUZZ
@given(st.lists(samples, min_size=1, max_size=15), st.integers(min_value=0), st.lists(samples, min_size=1, max_size=5))
def test_a_writer_resuming_after_a_cut_appends_cleanly(tmp_path_factory, trace, cut, more):
    path = trace_path(tmp_path_factory)
    write_trace(path, trace)
    kept = cut_somewhere(path, cut)
    with TraceWriter(path) as writer:
        for sample in more:
            writer.write(sample)
    assert load_trace(path) == trace[:complete_rows(kept)] + more


# ---- command-line options -----------------------------------------------------------------------------
# Values a person might type (argv cannot carry a NUL byte, so none here).

values = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "NaN", "1e309", "-1", "0", "1", "2", "3", "7", "64", "65536", "99999999999",
                     "1e-300", "0.5", "", " ", "abc", "2GiB", "-5MiB", "0x10", "1_000", "tensors:4MiB/step",
                     "graph:2/step@10", "recompile:0", "reinit@3", "restart@x", "auto", "never", "cpu", "xla", "full",
                     "::", "0.0.0.0", "localhost", "no-such-host.invalid", "/", "/dev/null", "/proc", "a/b/c",
                     "9" * 400, "9" * 400 + "GiB", f"tensors:{'9' * 400}/step", f"graph:{'9' * 400}/step",
                     f"tensors:1MiB/step@{'9' * 30}", "tensors:1MiB/step@\u0661", "reinit@\u0661", "\u00b2", "\u0661",
                     "\uff15", str(2**32), str(2**52), str(2**63), "4194304"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12),
)
TRAIN_OPTIONS = ["--steps", "--num-devices", "--seed", "--batch-size", "--lr", "--log-every", "--depth", "--width",
                 "--heads", "--seq-len", "--activation-checkpointing", "--checkpoint-every", "--resume", "--device",
                 "--inject-leak", "--memory-limit", "--sample-every", "--metrics-port", "--metrics-address",
                 "--checkpoint-margin-steps", "--action-cooldown-steps", "--force-action", "--trace-file",
                 "--checkpoint-dir", "--text-file"]


def parsed(argv: list[str]):
    """A refusal by the parser (argparse's own, or an option's `type=`): exit 2, in one line."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exit:
        assert exit.code == 2
        return None


@FUZZ
@given(options=st.lists(st.tuples(st.sampled_from(TRAIN_OPTIONS), values), max_size=6))
def test_train_options_are_taken_or_refused_as_input_errors(options, capsys):
    from watchdog.trainer.cli import build_config

    args = parsed(["train", *(part for option in options for part in option)])
    capsys.readouterr()
    if args is None:
        return
    try:
        config = build_config(args)
    except InputError:
        return  # the router prints it as one line, exit 2 (test_an_input_error_is_always_one_line)
    assert math.isfinite(config.learning_rate) and config.learning_rate > 0
    assert 0 <= config.seed <= SEED_MAX and 0 <= config.steps < MAX_STEP
    assert all(0 < leak.amount < MAX_SIZE and 0 <= leak.start_step < MAX_STEP for leak in config.leaks)
    limit = config.watchdog.memory_limit_bytes if config.watchdog else None
    assert limit is None or 0 < limit < MAX_SIZE


@FUZZ
@given(options=st.lists(st.tuples(st.sampled_from(["--max-restarts", "--backoff", "--max-backoff"]), values),
                        max_size=4))
def test_supervise_options_are_taken_or_refused_as_input_errors(options, capsys):
    from watchdog.actions.supervisor import backoff_seconds, check_options

    args = parsed(["supervise", *(part for option in options for part in option), "--", "true"])
    capsys.readouterr()
    if args is None:
        return
    try:
        check_options(args.max_restarts, args.backoff, args.max_backoff)
    except InputError:
        return  # the router prints it as one line, exit 2 (test_an_input_error_is_always_one_line)
    assert all(0 <= backoff_seconds(n, args.backoff, args.max_backoff) < math.inf for n in range(5))


# The number options of every command but train, and what they may come back as once taken.
NUMBER_OPTIONS = {
    "analyze": {"--memory-limit": (1, MAX_SIZE - 1)},
    "report": {"--memory-limit": (1, MAX_SIZE - 1)},
    "watch": {"--pid": (2, PID_MAX - 1), "--memory-limit": (1, MAX_SIZE - 1), "--metrics-port": (0, 65535)},
    "bench": {"--seed": (0, SEED_MAX), "--repeat": (1, MAX_STEP - 1)},
    "supervise": {"--max-restarts": (0, MAX_STEP - 1)},
}
REQUIRED = {"analyze": ["t.csv"], "report": ["t.csv", "-o", "t.png"], "supervise": ["--", "true"]}


@FUZZ
@given(data=st.data(), command=st.sampled_from(sorted(NUMBER_OPTIONS)), text=values)
def test_number_options_are_bounded_ints_or_one_line_refusals(data, command, text, capsys):
    """Sizes, PIDs, seeds and counts go through watchdog.core.numbers: taken as an int in bounds,
    or refused by the parser in one line with status 2; never a traceback, never a float overflow."""
    option = data.draw(st.sampled_from(sorted(NUMBER_OPTIONS[command])))
    args = parsed([command, option, text, *REQUIRED.get(command, [])])
    err = capsys.readouterr().err
    if args is None:
        assert err.count("\n") == 1 and option in err
        return
    value = getattr(args, option.lstrip("-").replace("-", "_"))
    low, high = NUMBER_OPTIONS[command][option]
    assert type(value) is int and low <= value <= high


@pytest.mark.parametrize("argv", [["train", "--memory-limit", "9" * 400], ["analyze", "t.csv", "--memory-limit", "9" * 400],
                                  ["watch", "--pid", "4242", "--memory-limit", "9" * 400],
                                  ["report", "t.csv", "-o", "t.png", "--memory-limit", "9" * 400 + "GiB"]])
def test_a_400_digit_size_is_refused_in_one_line_not_an_overflow(argv, capsys):
    """Issue 24, item 12: a 400-digit size was an OverflowError (float arithmetic) in every command."""
    assert parsed(argv) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "too large" in err and "--memory-limit" in err


@pytest.mark.parametrize("spec", [f"tensors:{'9' * 400}/step", f"global:{'9' * 400}MiB/step", f"graph:{'9' * 400}/step",
                                  f"tensors:1MiB/step@{'9' * 400}", "tensors:1MiB/step@\u0661"])
def test_a_400_digit_leak_is_refused_as_an_input_error(spec):
    from watchdog.trainer.cli import build_config

    with pytest.raises(InputError, match="--inject-leak"):
        build_config(parsed(["train", "--inject-leak", spec]))


@FUZZ
@given(values)
def test_report_outputs_are_taken_or_refused_as_input_errors(text):
    from watchdog.commands.report import check_output

    try:
        check_output(Path(text))
    except InputError:
        pass


def test_an_input_error_is_always_one_line(capsys):
    from watchdog.commands.cli import main

    assert main(["report", "trace.csv", "-o", "two\nlines.txt"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "two\\nlines.txt" in err
