"""The flight record and the post-mortem: what the live watchdog knew, on disk, whole; and how a
run ended, read back from it, the trace and the job's output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ONE_BLOCK, REPO, hbm_watchdog_env, watchdog_cli
from test_oom_message import COMPILE_HBM, CUDA_2_5

from watchdog import Watchdog, WatchdogConfig
from watchdog.actions.agreement import PeerLost
from watchdog.commands.cli import main
from watchdog.core.postmortem import diagnose
from watchdog.core.sample import Sample
from watchdog.readers.sources import MemoryReading
from watchdog.records import flight_record

MiB, GiB = 1 << 20, 1 << 30


class Leaking:
    """A device whose memory grows 1 MiB a step over a sawtooth, against a 2 GiB limit."""

    name = "scripted"

    def __init__(self):
        self.step = 0

    def read(self) -> MemoryReading:
        return MemoryReading((1 << 30) + self.step * MiB + (self.step % 8) * 4 * MiB, 2 << 30, None)


def run_leak(trace, steps: int, *, stop: bool = True) -> Watchdog:
    source = Leaking()
    wd = Watchdog(WatchdogConfig(sample_every=1, trace_file=trace), source=source).start()
    for step in range(steps):
        source.step = step
        wd.step(step)
        wd.drain()
        record = flight_record.read(f"{trace}{flight_record.SUFFIX}")
        assert record is not None and record["ended"] is None, "whole at every read, while the run goes on"
    if stop:
        wd.stop()
    return wd


def test_the_flight_record_holds_the_signals_the_actions_and_a_clean_end(tmp_path):
    trace = tmp_path / "trace.csv"
    run_leak(trace, 900)
    record = flight_record.read(f"{trace}{flight_record.SUFFIX}")
    assert record["ended"] == "clean" and record["last_step"] == 899
    assert record["process"]["pid"] == os.getpid() and record["process"]["rank"] == 0
    assert record["leak_reported_at"] is not None and record["oom_projected_at"] is not None
    assert record["verdict"]["oom_projected"] and record["actions"].get("checkpoint_reinit", 0) >= 1
    assert record["trace_file"] == str(trace)
    assert not list(tmp_path.glob(".*.tmp")), "no temporary left behind"


def undeclared(record: dict, fields: dict, where: str = "") -> list[str]:
    """The fields of `record` its table does not name, nested tables included (`{}`: not checked)."""
    if not fields:
        return []
    found = []
    for name, value in record.items():
        label = f"{where}.{name}" if where else name
        expected = fields.get(name)
        if name not in fields:
            found.append(label)
        elif isinstance(expected, dict) and isinstance(value, dict):
            found += undeclared(value, expected, label)
        elif isinstance(expected, list) and isinstance(value, list):
            found += [f for i, item in enumerate(value) for f in undeclared(item, expected[0], f"{label}[{i}]")]
    return found


def test_the_writer_writes_every_field_the_readers_table_names_and_no_other(tmp_path):
    """Issue 59: the flight record's fields were listed twice, the writer's dict and the reader's
    `RECORD_FIELDS`, and the host's reading wrote two that no reader's table named."""
    from watchdog.core.postmortem import RECORD_FIELDS

    trace = tmp_path / "trace.csv"
    wd = run_leak(trace, 400, stop=False)
    wd.record_program([])  # whatever the host records, through the same recorder
    wd.stop()
    record = flight_record.read(f"{trace}{flight_record.SUFFIX}")
    assert set(record) == set(RECORD_FIELDS)
    assert record["host"] is not None and record["verdict"] is not None, "the nested tables were written"
    assert undeclared(record, RECORD_FIELDS) == []
    recorder = flight_record.FlightRecorder(tmp_path / "other.json", min_interval_seconds=0)
    recorder.observe_device_oom(0, 2 * GiB, 80 * GiB, GiB)
    recorder.observe_action(7, ["+3 tensors float32[1024]"])
    assert undeclared(json.loads((tmp_path / "other.json").read_text()), RECORD_FIELDS) == []


def test_a_run_that_stops_without_a_shutdown_is_unclean_and_its_leak_named(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    wd = run_leak(trace, 900, stop=False)  # as if killed: the watchdog never stopped in order
    try:
        assert main(["postmortem", str(tmp_path), "--json"]) == 0
        row = json.loads(capsys.readouterr().out)
    finally:
        wd.stop()
    assert list(row) == ["ended", "last_step", "exit", "floor_slope_bytes_per_step", "peak_bytes", "limit_bytes",
                         "leak_reported_at", "oom_projected_at", "suspects", "diagnosis", "explanation",
                         "oom_message"]
    assert row["ended"] == "unclean" and 890 <= row["last_step"] <= 899 and row["exit"] is None
    assert row["diagnosis"] == "leak" and row["limit_bytes"] == 2 * GiB
    assert row["floor_slope_bytes_per_step"] == pytest.approx(MiB, rel=0.1)
    assert row["oom_projected_at"] < 899 and row["oom_message"] is None


def test_a_sudden_step_and_a_program_too_large_from_the_start_are_told_apart():
    flat = [Sample(s, 1e9 + s, GiB + (s % 4) * MiB, 2 * GiB) for s in range(200)]
    jump = diagnose(flat + [Sample(200, 1e9 + 200, GiB + 700 * MiB, 2 * GiB)])
    assert jump.diagnosis == "sudden_step" and "step 200" in jump.explanation
    from watchdog.core.oom_message import parse

    first = diagnose(flat[:2], oom=parse(COMPILE_HBM))
    assert first.diagnosis == "too_large_from_start" and "compile" in first.explanation
    clean = diagnose(flat, record={"ended": "clean"})
    assert clean.ended == "clean" and clean.diagnosis == "unknown" and "ended cleanly" in clean.explanation
    assert diagnose(flat).diagnosis == "unknown"


def test_postmortem_reads_the_message_in_the_jobs_output_beside_the_trace(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    run_leak(trace, 50)
    log = tmp_path / "job.log"
    log.write_text("training...\n" + COMPILE_HBM)
    assert main(["postmortem", str(trace), "--log", str(log)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{trace}: ended cleanly, last step 49")
    assert "out of memory: the program does not fit in hbm" in out and "/home/me/model/attention.py:212" in out


@pytest.mark.parametrize("leaving, clean", [(RuntimeError("CUDA out of memory."), False), (SystemExit(42), True),
                                            (PeerLost("rank 1 died"), False), (None, True)])
def test_an_exception_leaving_the_loop_is_no_clean_end(tmp_path, leaving, clean):
    """`with Watchdog(...)`: an OutOfMemoryError on its way out leaves the record unclean, and so does
    `PeerLost` (exit 43: another rank died, nothing saved), though it is a SystemExit; sys.exit(42)
    (a restart asked for) and the loop's end are the loop's own ways out."""
    trace = tmp_path / "trace.csv"
    try:
        with Watchdog(WatchdogConfig(sample_every=1, trace_file=trace), source=Leaking()) as wd:
            for step in range(5):
                wd.step(step)
            wd.drain()
            if leaving is not None:
                raise leaving
    except (RuntimeError, SystemExit):
        pass
    record = flight_record.read(f"{trace}{flight_record.SUFFIX}")
    assert record["ended"] == ("clean" if clean else "unclean") and record["last_step"] == 4
    assert diagnose([], record=record).ended == ("clean" if clean else "unclean")


def test_the_cuda_allocators_oom_is_written_at_once_and_explained_without_a_log(tmp_path, capsys):
    """What torch's OOM observer hands the flight record (device, bytes asked, the allocator's limit,
    free: made up here, there is no GPU) is on disk before the OutOfMemoryError is raised, and `postmortem` reads
    it as the out-of-memory message when no log is given."""
    trace = tmp_path / "trace.csv"
    wd = run_leak(trace, 60, stop=False)
    try:
        wd._running.flight.observe_device_oom(1, 2 * GiB, 40 * GiB, 512 * MiB)  # the observer's four arguments
        record = flight_record.read(f"{trace}{flight_record.SUFFIX}")
        assert record["device_oom"] == {"device": "cuda:1", "requested_bytes": 2 * GiB, "limit_bytes": 40 * GiB,
                                        "free_bytes": 512 * MiB, "step": record["last_step"]}
        assert main(["postmortem", str(tmp_path), "--json"]) == 0
        oom = json.loads(capsys.readouterr().out)["oom_message"]
        assert (oom["kind"], oom["memory_space"], oom["requested_bytes"]) == ("allocation", "device", 2 * GiB)
        assert (oom["capacity_bytes"], oom["free_bytes"], oom["allocated_bytes"]) == (40 * GiB, 512 * MiB, None)
        assert main(["postmortem", str(tmp_path)]) == 0
        assert ("out of memory: a buffer could not be allocated in device; capacity 40.0 GiB, requested 2.0 GiB, "
                "free 512.0 MiB") in capsys.readouterr().out
    finally:
        wd.stop()
    with pytest.raises(Exception, match="device_oom.requested_bytes"):
        diagnose([], record={"device_oom": {"requested_bytes": -1}})


def test_with_torchs_message_the_observers_limit_names_the_share_the_message_leaves_out():
    """Under set_per_process_memory_fraction PyTorch's message states the device's capacity only;
    the observer was handed the process's share."""
    from watchdog.core.oom_message import parse

    share = {"device": "cuda:0", "requested_bytes": 2 * GiB, "limit_bytes": 20 * GiB, "free_bytes": GiB, "step": 9}
    told = diagnose([], record={"device_oom": share}, oom=parse(CUDA_2_5)).explanation
    assert told.endswith("; the allocator's limit was 20.0 GiB, its share of the device's 79.2 GiB "
                         "(set_per_process_memory_fraction)"), told
    whole = dict(share, limit_bytes=parse(CUDA_2_5).capacity_bytes)
    assert "limit was" not in diagnose([], record={"device_oom": whole}, oom=parse(CUDA_2_5)).explanation
    assert "limit was" not in diagnose([], record={"device_oom": share}).explanation, "the observer's alone"


def test_postmortem_refuses_what_it_cannot_read_in_one_line(tmp_path, capsys):
    assert main(["postmortem"]) == 2
    assert "needs a trace" in capsys.readouterr().err
    assert main(["postmortem", str(tmp_path)]) == 2
    assert "no trace CSV" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.long
def test_a_trainer_killed_by_sigkill_gets_a_post_mortem_with_its_trend_and_suspects(tmp_path):
    """SIGKILL mid-run, as the kernel's OOM killer sends it: no shutdown, no traceback. The flight
    record on disk is whole, and the post-mortem names the stop, the trend and the suspects."""
    trace = tmp_path / "run" / "trace.csv"
    command = [sys.executable, "-m", "watchdog", "--log-format", "json", "train", *ONE_BLOCK, "--steps", "5000",
               "--inject-leak", "tensors:1MiB/step", "--memory-limit", "16GiB", "--sample-every", "5",
               "--trace-file", str(trace), "--checkpoint-dir", str(tmp_path / "ckpt")]
    job = subprocess.Popen(command, cwd=REPO, env=hbm_watchdog_env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    record_path = f"{trace}{flight_record.SUFFIX}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # until a leak report's census named the suspects
            record = flight_record.read(record_path)
            if record is not None and record["suspects"] and record["leak_reported_at"] is not None:
                break
            assert job.poll() is None, job.stderr.read()[-3000:]
            time.sleep(0.5)
        else:
            pytest.fail("the leak was not reported with its suspects in time")
        job.send_signal(signal.SIGKILL)
        job.wait(timeout=60)
    finally:
        job.kill()
    out = watchdog_cli("postmortem", str(trace.parent), "--json", json_logs=False)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert row["ended"] == "unclean" and row["last_step"] > 0
    assert row["floor_slope_bytes_per_step"] == pytest.approx(MiB, rel=0.25)
    assert row["leak_reported_at"] is not None
    assert any("attribute 'tensors' of LeakSinks" in s for s in row["suspects"]), row["suspects"]


CRASHES_WITH_XLA_OOM = (
    "import sys\n"
    "from test_oom_message import COMPILE_HBM\n"
    "print('step 1', flush=True)\n"
    "sys.stderr.write(COMPILE_HBM)\n"
    "sys.exit(1)\n")

LEAKS_THEN_IS_KILLED = (
    "import os, signal\n"
    "from pathlib import Path\n"
    "from test_postmortem import Leaking\n"
    "from watchdog import Watchdog, WatchdogConfig\n"
    "source = Leaking()\n"
    "wd = Watchdog(WatchdogConfig(sample_every=1, trace_file=Path(os.environ['TRACE'])), source=source).start()\n"
    "for step in range(900):\n"
    "    source.step = step\n"
    "    wd.step(step)\n"
    "    wd.drain()\n"
    "os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would\n")


def supervise(tmp_path, script: str, *options: str) -> subprocess.CompletedProcess:
    child = [sys.executable, "-c", script]
    env = hbm_watchdog_env(PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}", TRACE=str(tmp_path / "trace.csv"))
    return watchdog_cli("supervise", "--max-restarts", "0", *options, "--", *child, env=env)


@pytest.mark.slow
def test_supervise_prints_the_post_mortem_of_a_crash_with_xlas_message(tmp_path):
    out = supervise(tmp_path, CRASHES_WITH_XLA_OOM)
    assert out.returncode == 1
    (event,) = [json.loads(line) for line in out.stderr.splitlines()
                if line.startswith("{") and '"postmortem"' in line]
    assert event["child_status"] == "exit 1"
    assert "out of memory: the program does not fit in hbm" in event["block"]
    assert "/home/me/model/attention.py:212" in event["block"]


@pytest.mark.slow
def test_supervise_records_each_exit_and_postmortem_reads_the_folder(tmp_path):
    folder = tmp_path / "postmortem"
    out = supervise(tmp_path, LEAKS_THEN_IS_KILLED, "--postmortem-dir", str(folder))
    assert out.returncode == 1, out.stderr[-2000:]  # killed by a signal: a restart was due, and the budget is 0
    (event,) = [json.loads(line) for line in out.stderr.splitlines()
                if line.startswith("{") and '"postmortem"' in line]
    assert "stopped sampling with no shutdown recorded" in event["block"] and "exit SIGKILL" in event["block"]
    assert "cause   leak:" in event["block"]
    (exit_line,) = (folder / "exits.jsonl").read_text().splitlines()
    recorded = json.loads(exit_line)
    assert recorded["exit"] == "SIGKILL" and recorded["returncode"] == -signal.SIGKILL
    assert recorded["last_step"] is not None, "the flight record's newest step, as it stood at the kill"
    row = watchdog_cli("postmortem", str(folder), "--json", json_logs=False, timeout=120)
    assert row.returncode == 0, row.stderr
    found = json.loads(row.stdout)
    assert (found["ended"], found["exit"], found["diagnosis"]) == ("unclean", "SIGKILL", "leak")
    assert found["limit_bytes"] == 2 * GiB and found["last_step"] >= 800


HLO_OF_A_TRAINER_STEP = r"""
import json, sys
from watchdog.trainer.cli import HLO_SOURCE_LINES_ENV
import os
if sys.argv[1] == "on":
    for name in HLO_SOURCE_LINES_ENV:
        os.environ[name] = "1"
import torch, torch_xla
from watchdog.trainer.loop import TrainConfig, build_state
from watchdog.trainer.model import ModelConfig
device = torch_xla.device()
config = TrainConfig(steps=1, device="xla", watchdog=None, model=ModelConfig(depth=1, width=32, heads=2, seq_len=16))
state = build_state(config, device)
tokens = torch.randint(0, config.model.vocab_size, (2, 16)).to(device)
logits, loss = state.model(tokens, tokens)
hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss])
print(json.dumps({"files": sorted(set(__import__("re").findall(r'source_file="([^"]+)"', hlo)))}))
"""


@pytest.mark.slow
def test_with_hlo_source_lines_the_trainers_program_names_its_model_files_lines():
    """`train --hlo-source-lines` sets XLA_IR_DEBUG and XLA_HLO_DEBUG before torch_xla starts: the
    traced program then carries Python files and lines, the model's own among them; without it, none."""
    from conftest import run_python

    on = json.loads(run_python(HLO_OF_A_TRAINER_STEP, "on").strip().splitlines()[-1])["files"]
    off = json.loads(run_python(HLO_OF_A_TRAINER_STEP, "off").strip().splitlines()[-1])["files"]
    assert off == []
    assert any(f.endswith("watchdog/trainer/model.py") for f in on), on


def test_matching_the_messages_allocations_to_the_programs_lines_is_linear_and_names_a_few():
    """Issue 52: 4,000 allocations against 4,000 program sites sharing one op took 7 s (every
    allocation sorted and joined every line); counted by the sorts done, not timed."""
    from watchdog.core import postmortem as module
    from watchdog.core.oom_message import Allocation, OomMessage

    sorts = []
    real = module._lines_text
    program = [{"op_name": "add", "shape": "f32[8]", "user": f"train.py:{n} in step"} for n in range(4_000)]
    oom = OomMessage("compile", "hbm", allocations=[Allocation(1024, "add", None, None, "f32[8]")] * 4_000)
    try:
        module._lines_text = lambda users: sorts.append(len(users)) or real(users)
        [line] = module.user_lines(oom, program)
    finally:
        module._lines_text = real
    assert sorts == [4_000, 4_000], "each key's lines joined once per table (op, frame), not once per allocation"
    assert line.allocations == 4_000 and line.where.endswith("or 3,997 other lines"), line.where


def test_text_from_a_flight_record_reaches_the_terminal_as_text_never_as_escapes(tmp_path):
    """Issue 52: `postmortem DIR` printed the record's `suspects` raw: ESC ]52 (a clipboard write on
    many terminals) and ESC [2J (clear the screen) reached the terminal. Every line is made printable."""
    from watchdog.commands.postmortem import report

    hostile = {"suspects": ["+3 tensors \x1b]52;c;ZWNobyBwd25lZA==\x07 held by \x1b[2J a list"],
               "ended": None, "last_step": 9,
               "stall": {"step": 9, "seconds": 1.0, "rank": 0, "where": "x.py:1 in \x1b[31mf", "user": None,
                         "threads": [{"name": "main", "training": True, "frames": ["x.py:1 in \x1b]0;title\x07f"]}]}}
    text = report(tmp_path / "t\x1b[2J.csv", diagnose([], record=hostile), hostile)
    assert "\x1b" not in text and "\x07" not in text
    assert "\\x1b]52;c;ZWNobyBwd25lZA==\\x07" in text and "\\x1b[2J" in text  # still readable, inert


def test_a_run_that_ended_cleanly_after_going_over_its_limit_says_so():
    """Issue 53: a loop of one's own whose memory went 250 MiB over its limit and then ended in order
    got "cause unknown: the run ended cleanly"."""
    GiB = 1 << 30
    samples = [Sample(s, 1e9 + s, int(GiB + s * (4 << 20)), 2 * GiB) for s in range(0, 400, 2)]
    post = diagnose(samples, record={"ended": "clean", "last_step": 398})
    assert post.ended == "clean"
    assert "the run ended cleanly, but its memory went over the 2.0 GiB limit" in post.explanation
    assert "from step 256" in post.explanation


def test_a_device_oom_in_the_flight_record_is_always_explained():
    """Issue 53: "no trend, jump or message explains the end" right above a `device_oom` message."""
    record = {"last_step": 30, "device_oom": {"device": "cuda:0", "requested_bytes": 16 << 20,
                                              "limit_bytes": 8 << 30, "free_bytes": 2 << 20, "step": 30}}
    post = diagnose([], record=record)
    assert post.oom_message is not None
    assert "PyTorch's CUDA allocator ran out, asked for 16.0 MiB, 2.0 MiB free, of its 8.0 GiB limit" in post.explanation
    assert "no trend, jump or message" not in post.explanation


def test_after_a_reinit_the_post_mortem_shows_what_leaked_before_it_too(tmp_path):
    """Issue 53: after a reinit the newest census counts only what grew since (18 MiB), while 600 MiB
    had leaked; the flight record keeps what was leaking at the action, and `postmortem` shows both."""
    from watchdog.commands.postmortem import report

    record = {"last_step": 900, "suspects": ["+4 tensors float32[1048576] (+18.0 MiB); held by list (attribute 'kept')"],
              "action_suspects": {"step": 351, "lines": ["+150 tensors float32[1048576] (+600.0 MiB); held by list"]}}
    text = report(tmp_path / "t.csv", diagnose([], record=record), record)
    assert "+18.0 MiB" in text and "at the action of step 351 (before its reinit):" in text and "+600.0 MiB" in text
    assert "field" not in (str(diagnose([], record={"action_suspects": {"step": 1, "lines": ["a"]}}).explanation))
    with pytest.raises(Exception, match="action_suspects"):
        diagnose([], record={"action_suspects": {"step": -1, "lines": "nope"}})


# ---- stalls the watch could not record itself, and ranks that only waited (issue 64) ------------

_DUMP = """some output of the job
Thread 0x00007f00000000aa (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/job/site-packages/apscheduler/x.py", line 10 in run

Current thread 0x00007f00000000bb (most recent call first):
  File "/usr/lib/python3.11/re/__init__.py", line 166 in match
  File "/job/train.py", line 42 in tokenize
  File "/job/train.py", line 90 in <module>
"""


def test_a_process_ended_from_c_while_holding_the_gil_is_named_from_its_armed_record_and_its_output():
    """Issue 64: a loop stuck holding the GIL was never ended; now the stall watch's deadline in C
    ends it (exit 43) and writes nothing of ours, so the record says beforehand that it was armed and
    which thread trains, and `postmortem` finds that thread's stack in faulthandler's dump."""
    from watchdog.core.postmortem import diagnose, dumped_stack

    armed = {"armed": True, "rank": 1, "step": 0, "seconds": 5.0, "exit_code": 43,
             "training_thread": "0x7f00000000bb", "stacks": "stderr"}
    record = {"ended": None, "last_step": 20, "stall": armed}
    assert dumped_stack(_DUMP, "0x7f00000000bb") == ["/job/train.py:90 in <module>", "/job/train.py:42 in tokenize",
                                                     "/usr/lib/python3.11/re/__init__.py:166 in match"]
    post = diagnose([], record=record, exit_description="exit 43", output=_DUMP)
    assert post.diagnosis == "stalled", post.explanation
    assert "rank 1 made no step for 5 s after step 20 while something held the GIL" in post.explanation
    assert "its training thread was in /job/train.py:42 in tokenize" in post.explanation
    assert "innermost: /usr/lib/python3.11/re/__init__.py:166 in match" in post.explanation
    unseen = diagnose([], record=record, exit_description="exit 43")
    assert unseen.diagnosis == "stalled" and "faulthandler wrote every thread's stack" in unseen.explanation
    for ended, exit_description in (("clean", "exit 43"), (None, None), (None, "exit 1"), (None, "SIGKILL")):
        post = diagnose([], record={**record, "ended": ended}, exit_description=exit_description, output=_DUMP)
        assert post.diagnosis != "stalled", (ended, exit_description)  # armed, never fired: nothing stalled


def test_a_rank_that_only_waited_in_the_agreement_names_the_rank_it_waited_for():
    """Issue 64: rank 1 SIGSTOPped; rank 0, waiting for its offer, was ended by its stall watch and
    its post-mortem said "rank 0 stalled in rank.py:20", its own step() line."""
    from watchdog.core.postmortem import diagnose

    stall = {"step": 20, "seconds": 4.2, "rank": 0, "where": "/usr/lib/python3.11/threading.py:331 in wait",
             "user": "/job/rank.py:20 in <module>", "collective": False, "waiting": {"step": 15, "ranks": [1]},
             "threads": []}
    post = diagnose([], record={"last_step": 20, "stall": stall})
    assert post.diagnosis == "stalled"
    assert ("rank 0 was not stalled itself: it waited in the watchdog's agreement for rank 1 (whose offer of step 15 "
            "never came), called from /job/rank.py:20") in post.explanation
    unknown = diagnose([], record={"last_step": 20, "stall": {**stall, "waiting": {"step": 15, "ranks": None}}})
    assert "for another rank" in unknown.explanation
    from watchdog.core.errors import InputError

    with pytest.raises(InputError, match="stall.waiting.ranks"):
        diagnose([], record={"stall": {**stall, "waiting": {"step": 15, "ranks": ["one"]}}})


STUCK_HOLDING_THE_GIL = (
    "import os, re\n"
    "from pathlib import Path\n"
    "from watchdog import Watchdog, WatchdogConfig\n"
    "def _tokenize(text):\n"
    "    return re.match(r'(a+)+$', text)  # backtracks for ages, never releasing the GIL\n"
    "config = WatchdogConfig(sample_every=1, source='rss', memory_limit_bytes=1 << 40, host_memory=False,\n"
    "                        forensics=False, stall_after_seconds=1, stall_check_seconds=0.2,\n"
    "                        stall_exit_after_seconds=2, trace_file=Path(os.environ['TRACE']))\n"
    "with Watchdog(config) as wd:\n"
    "    for step in range(5):\n"
    "        wd.step(step)\n"
    "    wd.drain()\n"
    "    _tokenize('a' * 64 + 'b')\n"
    "print('never')\n")


@pytest.mark.slow
def test_a_loop_stuck_holding_the_gil_is_ended_from_c_with_exit_43_and_named_after_the_fact(tmp_path):
    """Issue 64: with stall_exit_after_seconds=2, a loop stuck in a regex that holds the GIL was never
    ended (killed from outside at 15 s, no stall record): the stall watch's thread could not run. Its
    deadline in C ends it (exit 43, every thread's stack on stderr), and `postmortem` of supervise's
    folder names the line from the armed record and the dump in the job's output."""
    folder, script = tmp_path / "postmortem", tmp_path / "rank.py"
    script.write_text(STUCK_HOLDING_THE_GIL)
    env = hbm_watchdog_env(TRACE=str(tmp_path / "trace.csv"))
    started = time.monotonic()
    out = watchdog_cli("supervise", "--max-restarts", "0", "--postmortem-dir", str(folder), "--",
                       sys.executable, str(script), env=env, timeout=120)
    assert out.returncode == 1 and "never" not in out.stdout, out.stderr[-2000:]  # 43, and no restart left
    assert time.monotonic() - started < 60
    (recorded,) = [json.loads(line) for line in (folder / "exits.jsonl").read_text().splitlines()]
    assert recorded["exit"] == "exit 43", recorded
    assert "most recent call first" in (folder / "output.log").read_text()
    row = watchdog_cli("postmortem", str(folder), "--json", json_logs=False, timeout=120)
    found = json.loads(row.stdout)
    assert found["diagnosis"] == "stalled" and "held the GIL" in found["explanation"], found
    assert "rank.py:5 in _tokenize" in found["explanation"], found["explanation"]


LEAVES_WITH_43_IN_ORDER = (
    "import os, sys\n"
    "from pathlib import Path\n"
    "from watchdog import Watchdog, WatchdogConfig\n"
    "wd = Watchdog(WatchdogConfig(sample_every=1, source='rss', memory_limit_bytes=1 << 40, host_memory=False,\n"
    "                             forensics=False, stall_exit_after_seconds=60,\n"
    "                             trace_file=Path(os.environ['TRACE']))).start()\n"
    "for step in range(5):\n"
    "    wd.step(step)\n"
    "wd.drain()\n"
    "sys.exit(43)  # as PeerLost does when nothing catches it: never stopped, but leaving in order\n")


@pytest.mark.slow
def test_an_exit_43_in_order_takes_the_armed_record_back_so_it_is_never_read_as_a_stall_in_c(tmp_path):
    """An armed record beside exit 43 is read as the deadline in C; a process leaving with 43 in order
    (PeerLost's SystemExit, never caught, its watchdog never stopped) runs its atexit handlers, which
    take the armed record back: its post-mortem names no stall."""
    from conftest import python
    from watchdog.core.postmortem import diagnose
    from watchdog.records import flight_record

    env = hbm_watchdog_env(TRACE=str(tmp_path / "trace.csv"))
    out = python(["-c", LEAVES_WITH_43_IN_ORDER], timeout=120, env=env)
    assert out.returncode == 43, out.stderr[-2000:]
    record = flight_record.read(tmp_path / f"trace.csv{flight_record.SUFFIX}")
    # atexit cannot see the status: a bare sys.exit is a clean end to it (a PeerLost the watchdog itself
    # raised is not: runtime/exit_watch.py's `failed`), and the armed record is taken back either way
    assert record["stall"] is None and record["ended"] == "clean", record
    assert diagnose([], record=record, exit_description="exit 43").diagnosis != "stalled"
