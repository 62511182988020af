"""Files the tool did not make (issue 40): a job file or a flight record path that holds someone
else's file, a link or no file at all is refused in one line (exit status 2) before anything is
written, cut or followed; an empty file or one already in our format is adopted. An unwritable
flight record is said once and never changes an exit status. No error line quotes another
file's contents."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import ONE_BLOCK, hbm_watchdog_env, watchdog_cli

from watchdog.commands.cli import main
from watchdog.core import goodput
from watchdog.core.errors import InputError
from watchdog.core.verdict import Status, Verdict
from watchdog.records import flight_record
from watchdog.records.flight_record import FlightRecorder
from watchdog.records.job_ledger import JobLedger, start_job

FOREIGN = b"SECRET first line\nSECRET tail without its newline"
CHECKPOINT = bytes(range(256)) * 8  # binary, with newlines in it and none at its end


def planted(tmp_path: Path, name: str, kind: str) -> tuple[Path, Path]:
    """`name` in tmp_path as `kind` (a foreign file, or a link to a checkpoint), and the file whose
    bytes must not change."""
    path = tmp_path / name
    if kind == "foreign":
        path.write_bytes(FOREIGN)
        return path, path
    target = tmp_path / "model.ckpt"
    target.write_bytes(CHECKPOINT)
    path.symlink_to(target)
    return path, target


def untouched(path: Path, original: bytes) -> bool:
    return path.read_bytes() == original


def one_line_without_contents(message: str) -> None:
    assert message.count("\n") <= 1 and "SECRET" not in message


def verdict(step: int) -> Verdict:
    return Verdict(step=step, timestamp=float(step), status=Status.HEALTHY, explanation="fine")


def record(event: str, **fields) -> str:
    return json.dumps({"v": goodput.VERSION, "event": event, "t": 1.0, **fields}) + "\n"


# ---- the job file -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["foreign", "link"])
def test_the_job_ledger_never_cuts_or_follows_a_file_that_is_not_a_job_file(tmp_path, kind):
    path, watched = planted(tmp_path, "run.csv.job.jsonl", kind)
    before = watched.read_bytes()
    with pytest.raises(InputError) as refused:
        JobLedger(path)
    one_line_without_contents(str(refused.value))
    assert str(path) in str(refused.value)
    with pytest.raises(InputError):
        start_job(path)
    assert untouched(watched, before) and path.is_symlink() == (kind == "link")


def test_the_job_ledger_refuses_a_fifo_at_once(tmp_path):
    path = tmp_path / "job.jsonl"
    os.mkfifo(path)
    with pytest.raises(InputError, match="FIFO"):
        JobLedger(path)
    with pytest.raises(InputError, match="FIFO"):
        start_job(path)


def test_an_empty_file_is_adopted_and_a_job_file_of_ours_continued_with_its_torn_line_cut(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    start_job(empty)
    assert [r["event"] for r in goodput.read(empty)] == ["job"]
    older = tmp_path / "older.jsonl"  # what this project wrote before, killed mid-line
    older.write_text(record("job") + record("process", pid=1, started=0.0, step=0, checkpoint_every=0)
                     + '{"v": 1, "event": "steps", "fi')
    ledger = JobLedger(older, flush_seconds=3600)
    ledger.begin(0)
    ledger.end("done", 0)
    assert [r["event"] for r in goodput.read(older)] == ["job", "process", "process", "span", "end"]
    torn_alone = tmp_path / "torn.jsonl"  # killed while writing its first line
    torn_alone.write_text('{"v": 1, "ev')
    start_job(torn_alone)
    assert [r["event"] for r in goodput.read(torn_alone)] == ["job"]


def test_a_record_too_long_in_the_middle_of_a_job_file_is_an_error_naming_its_line(tmp_path, capsys):
    path = tmp_path / "job.jsonl"
    long = json.dumps({"v": 1, "event": "span", "t": 2.0, "note": "x" * goodput.MAX_LINE_CHARS}) + "\n"
    path.write_text(record("process", pid=1, started=0.0, step=0) + long
                    + record("steps", first=0, last=10_000, seconds=9.0))
    with pytest.raises(InputError, match=r"job\.jsonl:2: a line longer than 4096 characters"):
        goodput.read(path)
    assert main(["goodput", str(path)]) == 2
    err = capsys.readouterr().err
    assert ":2: a line longer than" in err and err.count("\n") == 1


# ---- the flight record ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["foreign", "link", "directory"])
def test_a_flight_record_never_replaces_or_follows_a_file_it_did_not_make(tmp_path, kind):
    if kind == "directory":
        path = watched = tmp_path / "run.csv.flight.json"
        path.mkdir()
        before = None
    else:
        path, watched = planted(tmp_path, "run.csv.flight.json", kind)
        before = watched.read_bytes()
    with pytest.raises(InputError) as refused:
        FlightRecorder(path)
    one_line_without_contents(str(refused.value))
    assert str(path) in str(refused.value)
    assert before is None or untouched(watched, before)


def test_a_flight_record_of_ours_from_before_or_an_empty_file_is_rewritten(tmp_path):
    older = tmp_path / "older.flight.json"  # an early record: no host, no program sites
    older.write_text(json.dumps({
        "version": 1, "process": {"pid": 1, "start_time": None, "command": [], "rank": 0}, "trace_file": None,
        "written_at": 1.0, "ended": None, "last_step": 7, "verdict": None, "leak_reported_at": None,
        "oom_projected_at": None, "actions": {}, "suspects": [], "suspects_step": None, "creation_sites": False,
        "compilations": None, "recompilation": None}))
    empty = tmp_path / "empty.flight.json"
    empty.write_text("")
    for path in (older, empty):
        recorder = FlightRecorder(path, min_interval_seconds=0)
        recorder.observe(12, verdict(12), actions={})
        assert flight_record.read(path)["last_step"] == 12


def test_an_unwritable_flight_record_is_said_once_and_never_reaches_the_run(tmp_path, events):
    blocked = tmp_path / "file"
    blocked.write_text("")
    recorder = FlightRecorder(blocked / "flight.json", min_interval_seconds=0)  # its folder is a file
    for step in range(3):
        recorder.observe(step, verdict(step), actions={})
    recorder.ended()
    assert recorder.errors == 4
    (said,) = events.named("flight_record_write_failed")
    assert said["path"] == str(blocked / "flight.json")


# ---- error lines ------------------------------------------------------------------------------

def test_postmortem_never_quotes_the_file_a_flight_record_names(tmp_path, capsys):
    secret = tmp_path / "shadow"
    secret.write_text("root:SECRET-HASH:19000:0:99999:7:::\n")
    folder = tmp_path / "pm"
    folder.mkdir()
    (folder / "flight.json").write_text(json.dumps({
        "version": 1, "process": {}, "trace_file": str(secret), "ended": None, "last_step": 3}))
    (folder / "exits.jsonl").write_text(json.dumps({"time": 1.0, "run": 0, "exit": "1", "returncode": 1}) + "\n")
    assert main(["postmortem", str(folder)]) == 2
    err = capsys.readouterr().err
    one_line_without_contents(err)
    assert str(secret) in err
    trace = tmp_path / "run.csv"  # a trace named directly: the same
    trace.write_text("root:SECRET-HASH\n1,2,3,4,5\n")
    assert main(["postmortem", str(trace)]) == 2
    err = capsys.readouterr().err
    one_line_without_contents(err)
    assert str(trace) in err


# ---- the commands, as users run them ----------------------------------------------------------

def run_watchdog(*argv: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return watchdog_cli(*argv, json_logs=False, env=env, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["foreign", "link"])
@pytest.mark.parametrize("refused", [[], ["--backoff", "-1"]])
def test_supervise_never_touches_a_foreign_job_file_even_when_it_refuses_its_arguments(tmp_path, kind, refused):
    path, watched = planted(tmp_path, "job.jsonl", kind)
    before = watched.read_bytes()
    out = run_watchdog("supervise", "--job-file", str(path), *refused, "--", "true")
    assert out.returncode == 2, out.stderr
    one_line_without_contents(out.stderr)
    assert untouched(watched, before) and path.is_symlink() == (kind == "link")


@pytest.mark.slow
def test_supervise_writes_nothing_before_every_input_is_valid(tmp_path):
    job, folder = tmp_path / "job.jsonl", tmp_path / "pm"
    out = run_watchdog("supervise", "--job-file", str(job), "--postmortem-dir", str(folder), "--backoff", "-1",
                       "--", "true")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert not job.exists() and not folder.exists()
    out = run_watchdog("supervise", "--job-file", str(job), "--postmortem-dir", str(folder))  # no command
    assert out.returncode == 2 and not job.exists() and not folder.exists()
    job.write_bytes(b"")  # an empty file is adopted
    assert run_watchdog("supervise", "--job-file", str(job), "--", "true").returncode == 0
    assert [r["event"] for r in goodput.read(job)] == ["job"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["flight.json", "exits.jsonl", "output.log"])
def test_supervise_refuses_a_postmortem_dir_holding_a_file_it_did_not_make(tmp_path, name):
    folder = tmp_path / "pm"
    folder.mkdir()
    (folder / name).write_bytes(FOREIGN)
    out = run_watchdog("supervise", "--postmortem-dir", str(folder), "--", "sh", "-c", "exit 1")
    assert out.returncode == 2, out.stderr
    one_line_without_contents(out.stderr)
    assert name in out.stderr
    assert sorted(p.name for p in folder.iterdir()) == [name] and untouched(folder / name, FOREIGN)


@pytest.mark.slow
def test_train_never_cuts_a_job_file_it_did_not_make_nor_follows_a_link_beside_its_trace(tmp_path):
    """HBMWATCH_JOB_FILE naming someone's file, and `TRACE.job.jsonl` a link to a checkpoint."""
    foreign = tmp_path / "notes.txt"
    foreign.write_bytes(FOREIGN)
    out = run_watchdog("train", *ONE_BLOCK, "--steps", "3", "--trace-file", str(tmp_path / "a.csv"),
                       env=hbm_watchdog_env(HBMWATCH_JOB_FILE=str(foreign)), timeout=180)
    assert out.returncode == 2, out.stderr[-2000:]
    assert untouched(foreign, FOREIGN) and "SECRET" not in out.stderr
    assert not (tmp_path / "a.csv").exists(), "refused before the run wrote anything, its trace included"
    trace = tmp_path / "b.csv"
    link, checkpoint = planted(tmp_path, f"b.csv{goodput.SUFFIX}", "link")
    out = run_watchdog("train", *ONE_BLOCK, "--steps", "3", "--trace-file", str(trace), timeout=180)
    assert out.returncode == 2, out.stderr[-2000:]
    assert untouched(checkpoint, CHECKPOINT) and link.is_symlink()


@pytest.mark.slow
def test_train_refuses_a_foreign_flight_record_and_says_once_that_it_cannot_write_one(tmp_path):
    """HBMWATCH_FLIGHT_RECORD naming someone's file: exit 2, the file as it was. Naming a folder that
    does not exist: the run ends as it would have (0), and says so in one line, once."""
    foreign = tmp_path / "notes.json"
    foreign.write_bytes(FOREIGN)
    out = run_watchdog("train", *ONE_BLOCK, "--steps", "3", "--trace-file", str(tmp_path / "refused.csv"),
                       env=hbm_watchdog_env(HBMWATCH_FLIGHT_RECORD=str(foreign)), timeout=180)
    assert out.returncode == 2, out.stderr[-2000:]
    assert not (tmp_path / "refused.csv").exists(), "refused before the watchdog opened its trace"
    assert untouched(foreign, FOREIGN) and "SECRET" not in out.stderr and str(foreign) in out.stderr
    unwritable = tmp_path / "no such folder" / "flight.json"
    out = run_watchdog("--log-format", "json", "train", *ONE_BLOCK, "--steps", "3", "--trace-file",
                       str(tmp_path / "run.csv"), env=hbm_watchdog_env(HBMWATCH_FLIGHT_RECORD=str(unwritable)),
                       timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (out.stdout + out.stderr).count('"flight_record_write_failed"') == 1


def test_a_loops_watchdog_refuses_a_job_file_it_did_not_make_before_it_writes_anything(tmp_path, monkeypatch):
    """Every loop's Watchdog keeps its share of the job file now (issue 63): one named by
    HBMWATCH_JOB_FILE that is someone's file is refused at start(), as the trainer refuses it."""
    from watchdog.core.config import WatchdogConfig
    from watchdog.runtime.sidecar import Watchdog

    foreign = tmp_path / "notes.txt"
    foreign.write_bytes(FOREIGN)
    monkeypatch.setenv("HBMWATCH_JOB_FILE", str(foreign))
    watchdog = Watchdog(WatchdogConfig(source="rss", memory_limit_bytes=1 << 40, host_memory=False, forensics=False,
                                       trace_file=tmp_path / "trace.csv"))
    with pytest.raises(InputError, match="not a job file"):
        watchdog.start()
    assert untouched(foreign, FOREIGN) and not (tmp_path / "trace.csv").exists()
