"""The trace CSV contract (watchdog/ARCHITECTURE.md): round trip, append, and clear errors naming file and line."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from watchdog.core.errors import TraceFormatError
from watchdog.core.sample import TRACE_HEADER, TRACE_HEADER_WITH_PHASE, Sample, TraceWriter, load_trace, write_trace

sizes = st.integers(min_value=0, max_value=1 << 50)
samples = st.builds(
    Sample,
    step=st.integers(min_value=0, max_value=10**7),
    timestamp=st.floats(min_value=0, max_value=4e9, allow_nan=False).map(lambda t: round(t, 6)),
    bytes_used=sizes,
    bytes_limit=st.none() | sizes,
    peak_bytes_used=st.none() | sizes,
    phase=st.sampled_from(["", "train", "eval", "eval/300", "checkpoint"]),
)


@given(st.lists(samples, max_size=50))
def test_round_trip_preserves_every_field(tmp_path_factory, trace):
    path = tmp_path_factory.mktemp("t") / "trace.csv"
    write_trace(path, trace)
    assert load_trace(path) == trace


def test_writer_appends_to_an_existing_trace_without_a_second_header(tmp_path):
    path = tmp_path / "trace.csv"
    write_trace(path, [Sample(0, 1.0, 10, 100, 12)])
    with TraceWriter(path) as writer:
        writer.write(Sample(1, 2.0, 11))
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(TRACE_HEADER_WITH_PHASE)
    assert lines.count(",".join(TRACE_HEADER_WITH_PHASE)) == 1
    assert [s.step for s in load_trace(path)] == [0, 1]
    assert load_trace(path)[1].bytes_limit is None


def test_a_trace_without_the_phase_column_reads_and_is_appended_to_in_its_own_five_columns(tmp_path):
    path = tmp_path / "old.csv"
    path.write_text(",".join(TRACE_HEADER) + "\n0,1.0,10,100,12\n")
    with TraceWriter(path) as writer:
        writer.write(Sample(1, 2.0, 11, phase="eval/300"))  # the phase cannot go into an old trace
    assert path.read_text().splitlines()[-1] == "1,2.000000,11,,"
    assert load_trace(path) == [Sample(0, 1.0, 10, 100, 12), Sample(1, 2.0, 11)]


def test_the_phase_column_round_trips_and_may_be_empty(tmp_path):
    path = tmp_path / "new.csv"
    path.write_text(",".join(TRACE_HEADER_WITH_PHASE) + "\n0,1.0,10,,,\n1,2.0,11,,,eval/300\n")
    assert [s.phase for s in load_trace(path)] == ["", "eval/300"]


@pytest.mark.parametrize(
    "content, line, fragment",
    [
        ("", 1, "empty file"),
        ("a,b,c\n", 1, "expected header"),
        ("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1,2.0,abc,,\n", 2, "bytes_used is not a number"),
        ("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1,2.0,5,,\n2,x,5,,\n", 3, "timestamp"),
        ("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1,2.0,5\n", 2, "expected 5 fields"),
        ("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1,2.0,-5,,\n", 2, "negative"),
        ("step,timestamp,bytes_used,bytes_limit,peak_bytes_used,phase\n1,2.0,5,,,eval\n2,3.0,5,,\n", 3,
         "expected 6 fields"),
        ("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1,2.0,5,,,eval\n", 2, "expected 5 fields"),
        ("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1,2.0,5.5,,\n", 2, "whole number"),
        # numbers are ASCII digits and bounded: steps below 2**52, byte counts below 2**63
        (f"step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1,2.0,5,,\n{2**60},3.0,5,,\n", 3, "step"),
        (f"step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n{10**25},2.0,5,,\n", 2, "a step from 0"),
        ("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1e20,2.0,5,,\n", 2, "a step from 0"),
        (f"step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1,2.0,{'9' * 400},,\n", 2, "bytes_used"),
        (f"step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1,2.0,5,{2**63},\n", 2, "bytes_limit"),
        ("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1,2.0,5,,1e400\n", 2, "peak_bytes_used"),
        ("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n\u0661,2.0,5,,\n", 2, "digits 0-9"),  # '١'
        ("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1,2.0,\uff15,,\n", 2, "digits 0-9"),  # '５'
        ("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n\u00b2,2.0,5,,\n", 2, "digits 0-9"),  # '²'
        ("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1,\u0661.5,5,,\n", 2, "timestamp"),
        ("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1_000,2.0,5,,\n", 2, "digits 0-9"),
    ],
)
def test_bad_traces_name_the_file_and_line(tmp_path, content, line, fragment):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(TraceFormatError) as err:
        load_trace(path)
    assert err.value.line == line
    assert str(err.value).startswith(f"{path}:{line}:")
    assert fragment in str(err.value)


def test_missing_and_binary_files_are_input_errors(tmp_path):
    with pytest.raises(TraceFormatError, match="cannot read"):
        load_trace(tmp_path / "nope.csv")
    binary = tmp_path / "bin.csv"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceFormatError):
        load_trace(binary)


def test_writer_refuses_to_append_to_a_file_that_is_not_a_trace(tmp_path):
    path = tmp_path / "notes.csv"
    path.write_text("hello,world\n")
    with pytest.raises(TraceFormatError, match="refusing to append"):
        TraceWriter(path)
    assert path.read_text() == "hello,world\n"


def test_the_largest_numbers_in_bounds_round_trip(tmp_path):
    """Steps up to 2**52 - 1 and byte counts up to 2**63 - 1 load as written; one more is refused."""
    path = tmp_path / "edge.csv"
    edge = [Sample(0, 1.0, 0), Sample(2**52 - 1, 2.0, 2**63 - 1, 2**63 - 1, 2**63 - 1)]
    write_trace(path, edge)
    assert load_trace(path) == edge
    path.write_text(",".join(TRACE_HEADER) + "\n1,2.0,1.5e9,,\n2,3.0,1073741824.0,,\n")  # a spreadsheet's way
    assert [s.bytes_used for s in load_trace(path)] == [1_500_000_000, 1 << 30]


def test_a_trace_saved_by_a_spreadsheet_with_a_byte_order_mark_is_read(tmp_path):
    """Issue 53: a trace with a UTF-8 BOM (an Excel export) was refused as a bad header."""
    path = tmp_path / "excel.csv"
    path.write_bytes("\ufeffstep,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1,2.0,3,4,\n".encode("utf-8"))
    [sample] = load_trace(path)
    assert (sample.step, sample.bytes_used, sample.bytes_limit) == (1, 3, 4)


def test_a_timestamp_in_pythons_digit_group_syntax_is_refused_like_a_step_would_be(tmp_path):
    """The probe: `1_700_000_000.5` was accepted as a timestamp while `1_0` is refused in the other columns."""
    from watchdog.core.errors import TraceFormatError

    path = tmp_path / "t.csv"
    path.write_text("step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1,1_700_000_000.5,3,4,\n")
    with pytest.raises(TraceFormatError, match="timestamp is not a number"):
        load_trace(path)
