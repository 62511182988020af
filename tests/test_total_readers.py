"""Every reader of a file from outside is total, and every `--json` is strict JSON (issue 40).

Readers: an OOM log (`core/oom_message.py`), a flight record (`records/flight_record.py`, checked
by `core/postmortem.py`), a job file (`core/goodput.py`), a cgroup's files
(`readers/host_memory.py`), and the command line's seconds and patterns (`watch`). Whatever they
are handed, the answer is a value or one line on stderr with exit status 2 naming the file (and
the line or the field), never a traceback, never the file's text, and never work that grows
faster than the input (checked by counting work, never by timing it).
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
from test_oom_message import COMPILE_HBM

from watchdog.commands.cli import build_parser, main
from watchdog.core import goodput, oom_message
from watchdog.core.errors import InputError
from watchdog.core.oom_message import parse
from watchdog.core.postmortem import diagnose
from watchdog.core.sample import Sample
from watchdog.records.flight_record import SUFFIX
from watchdog.readers.host_memory import MemoryCgroup, tightest_cgroup
from watchdog.records.job_ledger import JobLedger

GiB, MiB = 1 << 30, 1 << 20
HEADER = "step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n"


def dumps(value) -> str:
    from watchdog.core.strict_json import dumps as strict_dumps  # new with issue 40: imported where used

    return strict_dumps(value)


def strict(text: str):
    """JSON as a strict parser reads it: NaN and Infinity refused."""
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def lines_run(function, *args, where: str) -> int:
    """Python lines executed inside modules whose file ends with `where`: a count of work, not a time."""
    count = 0

    def tracer(frame, event, _arg):
        nonlocal count
        if not frame.f_code.co_filename.endswith(where):
            return None
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        function(*args)
    finally:
        sys.settrace(None)
    return count


# ---- an OOM log --------------------------------------------------------------------------------

@pytest.mark.parametrize("headline", [
    "Error allocating device buffer: Attempting to allocate " + "9" * 400 + "G. That was not possible.",
    "Error allocating device buffer: Attempting to allocate 100000000P. That was not possible.",
    "Out of memory while trying to allocate " + "7" * 4400 + " bytes.",
    "Failed to allocate request for 1.00MiB (" + "5" * 5000 + "B) on device ordinal 0",
    "Error allocating device buffer: Attempting to allocate -5.00G. That was not possible. There are -9G free.",
])
def test_a_size_out_of_range_is_unknown_never_an_error_nor_a_wrong_number(headline):
    message = parse("RESOURCE_EXHAUSTED: " + headline + "\n")
    assert message is None or message.requested_bytes is None \
        or 0 <= message.requested_bytes <= 2**63 - 1
    if message is not None:
        assert message.exceeded_bytes is None or 0 <= message.exceeded_bytes <= 2**63 - 1
        strict(dumps(message.to_json()))


def test_an_allocation_listed_with_a_size_out_of_range_is_left_out_and_counted():
    huge = COMPILE_HBM.replace("  1. Size: 4.00G", "  1. Size: " + "8" * 300 + "G", 1)
    assert huge != COMPILE_HBM
    message = parse(huge)
    assert len(message.allocations) == len(parse(COMPILE_HBM).allocations) - 1
    assert message.unreadable_sizes == 1
    assert all(0 <= a.size_bytes <= 2**63 - 1 for a in message.allocations)


def test_supervise_keeps_the_crash_post_mortem_of_a_log_with_a_400_digit_size():
    from watchdog.commands.postmortem import after_a_crash

    output = "step 1\nRESOURCE_EXHAUSTED: Attempting to allocate " + "9" * 400 + "G. That was not possible.\n"
    text = after_a_crash(None, output, "exit status 1")
    assert text.startswith("the job exited with exit status 1") and "out of memory" in text


def test_rank_prefixes_and_ansi_codes_are_dropped_before_the_message_is_read():
    plain = parse(COMPILE_HBM)
    prefixed = "".join(f"[rank0]:{line}\n" for line in COMPILE_HBM.splitlines())
    coloured = "".join(f"\x1b[31m[default3]: {line}\x1b[0m\n" for line in COMPILE_HBM.splitlines())
    for text in (prefixed, coloured):
        message = parse(text)
        assert message is not None and message.to_json() == plain.to_json()
        assert message.python_sites and message.python_sites[0].line == 212


def test_a_message_repeated_n_times_is_read_in_work_linear_in_n(monkeypatch):
    """Before: the fallback re-read everything before each earlier copy (20k copies: 170 s)."""
    read = []
    real = oom_message._allocations

    def counting(lines):
        read.append(len(lines))
        return real(lines)

    monkeypatch.setattr(oom_message, "_allocations", counting)
    headline = "RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 1.00G. That was not possible.\n"
    work = {}
    for n in (200, 800):
        read.clear()
        assert parse(headline * n).requested_bytes == GiB
        work[n] = sum(read)
    assert work[800] <= 4.5 * work[200], work


def test_a_long_run_of_spaces_in_a_size_line_is_read_at_once():
    """Before: "Size: 5" and 5,000 spaces took the item pattern 387 s to refuse (backtracking)."""
    text = COMPILE_HBM.replace("  1. Size: 4.00G", "  1. Size: 4.00G" + " " * 3000 + "x", 1)
    assert len(parse(text).allocations) == len(parse(COMPILE_HBM).allocations) - 1


# ---- a flight record ---------------------------------------------------------------------------

def trace_with_record(tmp_path: Path, **fields) -> Path:
    trace = tmp_path / "run.csv"
    trace.write_text(HEADER + "".join(f"{i},{1e9 + i},{GiB + i * MiB},{2 * GiB},\n" for i in range(30)))
    record = {"version": 1, "process": {"pid": 7}, "ended": None, "last_step": 29, **fields}
    Path(f"{trace}{SUFFIX}").write_text(json.dumps(record) if not isinstance(fields.get("raw"), str)
                                        else fields["raw"])
    return trace


@pytest.mark.parametrize("fields, named", [
    ({"verdict": [1]}, "verdict"),
    ({"last_step": "29"}, "last_step"),
    ({"host": "SECRET"}, "host"),
    ({"leak_reported_at": "SECRET"}, "leak_reported_at"),
    ({"verdict": {"limit_bytes": "SECRET"}}, "verdict.limit_bytes"),
    ({"verdict": {"limit_bytes": 1e300}}, "verdict.limit_bytes"),
    ({"host": {"bytes_limit": -1, "bytes_used": 1}}, "host.bytes_limit"),
    ({"suspects": "SECRET list"}, "suspects"),
    ({"oom_projected_at": 1.5}, "oom_projected_at"),
    ({"program_sites": [{"op_name": ["SECRET"]}]}, "program_sites[0].op_name"),
])
def test_a_flight_record_field_of_the_wrong_type_or_range_is_one_line_naming_the_file_and_field(
        tmp_path, capsys, fields, named):
    trace = trace_with_record(tmp_path, **fields)
    assert main(["postmortem", str(trace)]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{trace}{SUFFIX}" in err and repr(named) in err and "SECRET" not in err


@pytest.mark.parametrize("raw, says", [
    ('{"version": 1, "process": {}, "ended": null, "last_step": 3, "actions": ' + "[" * 2000 + "]" * 2000 + "}",
     "nested deeper than"),
    ('{"version": 1, "process": {}, "ended": null, "last_step": ' + "4" * 4000 + "}", "out of range"),
    ('{"version": 1, "process": {}, "ended": null,\n "last_step": SECRET}', ":2: not JSON"),
])
def test_a_flight_record_nested_too_deep_or_with_a_huge_number_is_one_line(tmp_path, capsys, raw, says):
    trace = trace_with_record(tmp_path, raw=raw)
    assert main(["postmortem", str(trace)]) == 2
    err = one_line(capsys.readouterr().err)
    assert says in err and str(trace) in err and "SECRET" not in err


def test_an_infinite_projection_in_a_flight_record_is_no_step_and_the_json_is_strict(tmp_path, capsys):
    raw = ('{"version": 1, "process": {}, "ended": null, "last_step": 29, "oom_projected_at": Infinity, '
           '"verdict": {"slope_bytes_per_step": Infinity, "limit_bytes": NaN}}')
    trace = trace_with_record(tmp_path, raw=raw)
    assert main(["postmortem", str(trace), "--json"]) == 0
    row = strict(capsys.readouterr().out)
    assert row["oom_projected_at"] is None and "step inf" not in row["explanation"]
    with pytest.raises(InputError, match="oom_projected_at"):
        diagnose([Sample(0, 0.0, GiB, 2 * GiB)], record={"oom_projected_at": math.inf})


def test_supervise_keeps_the_exit_and_the_message_when_the_flight_record_is_unusable(tmp_path):
    from watchdog.commands.postmortem import after_a_crash

    (tmp_path / "flight.json").write_text(json.dumps(
        {"version": 1, "process": {}, "ended": None, "last_step": 3, "verdict": [1]}))
    text = after_a_crash(tmp_path, COMPILE_HBM, "exit status 1")
    assert text.startswith("the job exited with exit status 1") and "out of memory" in text
    assert "'verdict'" in text


# ---- a job file --------------------------------------------------------------------------------

def job_line(**fields) -> str:
    return json.dumps({"v": 1, "t": 1.0, **fields}) + "\n"


GOOD_START = job_line(event="process", started=0.0, step=0, checkpoint_every=0)


@pytest.mark.parametrize("bad, says", [
    (job_line(event="span", cause=["startup"], seconds=1.0, step=0), "field 'cause'"),
    (job_line(event="steps", first="0", last=10, seconds=1.0), "field 'first'"),
    (job_line(event="span", cause="eval", seconds=1.0, step=0)[:-2] + ', "x": ' + "[" * 1900 + "]" * 1900 + "}\n",
     "nested deeper than"),
    ('{"v": 1, "event": "span", "cause": "eval", "seconds": ' + "9" * 4000 + "}\n", "out of range"),
    (job_line(event="span", cause="eval", seconds=1e300, step=0), "field 'seconds'"),
    (job_line(event="end", how="done", step=2**60), "field 'step'"),
])
def test_a_job_record_of_the_wrong_shape_is_one_line_naming_the_file_and_line(tmp_path, capsys, bad, says):
    path = tmp_path / "job.jsonl"
    path.write_text(GOOD_START + bad)
    assert main(["goodput", str(path)]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{path}:2:" in err and says in err
    with pytest.raises(InputError, match=":2:"):  # train's ledger, handed that file, refuses it at start
        JobLedger(path).begin(0)


def test_the_account_is_total_over_any_records_in_memory():
    records = [{"v": 1, "event": "process", "t": 0.0, "started": 0.0, "step": 0},
               {"v": 1, "event": "span", "t": 1.0, "cause": ["startup"], "seconds": 1.0},
               {"v": 1, "event": "span", "t": 1.0, "cause": "eval", "seconds": 10**4000},
               {"v": 1, "event": "steps", "t": 2.0, "first": 0, "last": 10, "seconds": 1e308,
                "compile_seconds": -math.inf},
               {"v": 1, "event": "action", "t": 2.0, "kind": ["x"], "step": "10", "projected_oom_step": 2**70}]
    account = goodput.account(records)
    strict(dumps(account.fields()))
    assert all(math.isfinite(s) for s in account.badput_seconds.values())


def test_processes_out_of_order_never_give_negative_badput():
    records = [
        {"v": 1, "event": "process", "t": 100.0, "started": 100.0, "step": 0},
        {"v": 1, "event": "steps", "t": 110.0, "first": 0, "last": 100, "seconds": 10.0},
        {"v": 1, "event": "process", "t": 20.0, "started": 0.0, "step": 0},  # a clock that went back
        {"v": 1, "event": "steps", "t": 60.0, "first": 0, "last": 100, "seconds": 60.0},
    ]
    account = goodput.account(records)
    assert all(s >= 0 for s in account.badput_seconds.values()), account.badput_seconds
    total = account.productive_seconds + sum(account.badput_seconds.values())
    assert total == pytest.approx(account.elapsed_seconds)


def many_processes(n: int) -> list[dict]:
    """n processes, each resumed from the previous one's checkpoint, with saves, an action and a reinit."""
    records, t = [], 0.0
    for p in range(n):
        step = 100 * p
        records += [
            {"v": 1, "event": "process", "t": t + 1, "started": t, "step": step, "checkpoint_every": 50},
            {"v": 1, "event": "span", "t": t + 1, "cause": "startup", "seconds": 1.0, "step": step},
            {"v": 1, "event": "steps", "t": t + 2, "first": step, "last": step + 50, "seconds": 1.0},
            {"v": 1, "event": "span", "t": t + 3, "cause": "checkpoint_save", "seconds": 0.5, "step": step + 50},
            {"v": 1, "event": "steps", "t": t + 4, "first": step + 50, "last": step + 120, "seconds": 1.0},
            {"v": 1, "event": "action", "t": t + 4, "kind": "checkpoint_reinit", "step": step + 120,
             "projected_oom_step": step + 400},
            {"v": 1, "event": "span", "t": t + 5, "cause": "checkpoint_save", "seconds": 0.5, "step": step + 120},
            {"v": 1, "event": "span", "t": t + 6, "cause": "reinit", "seconds": 0.5, "step": step + 120},
        ]
        t += 10
    return records


def test_goodput_work_is_linear_in_the_number_of_processes():
    """Before: each process scanned every kept stretch (40k processes: 46 s)."""
    small, large = (lines_run(goodput.account, many_processes(n), where="core/goodput.py") for n in (250, 1000))
    assert large <= 5 * small, (small, large)


# ---- the command line: seconds, patterns, options that would be ignored -----------------------

@pytest.mark.parametrize("flag, value", [("--grace-seconds", "1e308"), ("--checkpoint-seconds", "1e308"),
                                         ("--interval", "5e-324"), ("--wait-seconds", "inf"),
                                         ("--warmup-seconds", "١٢")])
def test_watch_refuses_seconds_out_of_range_in_one_line(capsys, flag, value):
    assert main(["watch", "--pid", "4194303", "--no-act", "--wait-seconds", "0", flag, value]) == 2
    assert flag in one_line(capsys.readouterr().err)


@pytest.mark.parametrize("field, value", [("interval_seconds", 5e-324), ("grace_seconds", 1e308),
                                          ("checkpoint_seconds", 1e308)])
def test_the_time_axis_refuses_settings_whose_sample_counts_are_not_finite(field, value):
    from watchdog.daemon.timeaxis import TimeAxis

    with pytest.raises(InputError, match="--" + field.removesuffix("_seconds").replace("_", "-")):
        TimeAxis(**{field: value}).policy_config()


@pytest.mark.parametrize("pattern", ["", ".*", "x?", "^"])
def test_a_command_pattern_that_matches_every_process_is_refused(pattern):
    from watchdog.daemon.targets import PatternFinder

    with pytest.raises(InputError, match="--cmd-pattern"):
        PatternFinder(pattern)


def test_an_option_that_would_be_ignored_is_refused(tmp_path, capsys):
    from watchdog.commands.cli import ignored_option

    args = build_parser().parse_args(["train", "--replay-trace", "run.csv"])
    assert "--memory-source replay" in ignored_option(args)
    args = build_parser().parse_args(["train", "--replay-trace", "run.csv", "--memory-source", "replay"])
    assert ignored_option(args) is None
    log = tmp_path / "job.log"
    log.write_text(COMPILE_HBM)
    trace = trace_with_record(tmp_path)
    assert main(["postmortem", str(trace), "--oom-log", str(log)]) == 2
    assert "PATH" in one_line(capsys.readouterr().err)


# ---- a cgroup's files --------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["-1", "١٢٣", "+5", "1_000", "1 2", "9" * 5000])
def test_a_cgroup_limit_that_is_not_plain_digits_is_no_limit_or_unreadable(tmp_path, text):
    (tmp_path / "memory.max").write_text(text + "\n")
    (tmp_path / "memory.current").write_text("١٢٣\n")
    assert tightest_cgroup([MemoryCgroup(tmp_path, 2)], machine_bytes=16 * GiB) is None
    with pytest.raises(ValueError):
        MemoryCgroup(tmp_path, 2).working_set()


# ---- strict JSON out ---------------------------------------------------------------------------

def test_every_command_prints_json_through_the_one_strict_helper():
    root = Path(__file__).resolve().parents[1] / "watchdog"
    printing = [root / "bench" / "cli.py", *sorted((root / "commands").glob("*.py"))]
    raw = [str(p.relative_to(root)) for p in printing
           if re.search(r"print\([^\n]*(?<!strict_)json\.dumps\(", p.read_text())]
    assert raw == []
    assert strict(dumps({"a": math.inf, "b": [math.nan, (1, -math.inf)], "c": 2.5})) == \
        {"a": None, "b": [None, [1, None]], "c": 2.5}


HOSTILE_VALUES = [None, "", "zz", "0x", "0x" + "f" * 40, "\x1b[31m", "9" * 5000, -1, 2**70, 1.5, True, [], {},
                  ["x"], [{"frames": ["x"]}], {"step": "x"}, {"ranks": [-1]}, {"step": 2, "ranks": [1, 2**70]}]


@pytest.mark.parametrize("armed", [False, True], ids=["recorded by the watch", "armed in C"])
def test_every_field_of_a_stall_record_whatever_it_holds_is_read_or_refused_in_one_line(armed):
    """Issue 64's probe: an armed record whose `training_thread` was no hexadecimal id let a ValueError
    out of `postmortem`. Every field of a stall record, given any value JSON can hold, is read, or
    refused with the InputError naming it, whether the record says the watch ended the process or
    that its deadline in C was armed; with the exit that deadline gives and a dump in the output."""
    from watchdog.core.postmortem import _STALL

    base = ({"armed": True, "rank": 1, "step": 3, "seconds": 5.0, "exit_code": 43, "training_thread": "0x7f01",
             "stacks": "stderr"} if armed else
            {"step": 3, "seconds": 5.0, "rank": 1, "where": "a.py:1 in f", "user": "a.py:1 in f", "collective": False,
             "waiting": {"step": 3, "ranks": [0]}, "threads": [{"name": "t", "training": True, "frames": ["a.py:1 in f"]}]})
    dump = 'Current thread 0x00007f01 (most recent call first):\n  File "a.py", line 1 in f\n'
    for name in _STALL:
        for value in HOSTILE_VALUES:
            try:
                post = diagnose([], record={"last_step": 3, "stall": {**base, name: value}}, exit_description="exit 43",
                                output=dump)
            except InputError as exc:
                assert name in str(exc) and "\n" not in str(exc), (name, value, exc)
            else:
                assert isinstance(post.explanation, str), (name, value)
