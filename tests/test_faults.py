"""Fault injection: nothing lost to bad resumes, full disks, signals, a killed supervisor or hostile clients.

Each test injects one fault for real and checks what survives. A full disk comes in two kinds:
RLIMIT_FSIZE in a child process (writes past the limit fail with EFBIG; works anywhere, so CI always
runs it) and a small tmpfs (a true ENOSPC; needs permission to mount, skipped with the reason
where there is none).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch
from conftest import REPO, hbm_watchdog_env, json_lines, logged, run_python

from watchdog.actions.checkpoint import CheckpointManager, DiskSpace
from watchdog.commands.cli import main
from watchdog.core.config import WatchdogConfig
from watchdog.core.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_RESTART_REQUESTED,
    EXIT_UNSAVED,
    InputError,
)
from watchdog.core.sample import (
    TRACE_HEADER,
    Sample,
    TraceWriter,
    load_trace,
    write_trace,
)
from watchdog.station.endpoint import MAX_CONNECTIONS, REQUEST_DEADLINE_SECONDS
from watchdog.runtime.checkpoint_figures import CheckpointFigures
from watchdog.station.exporter import serve_metrics
from watchdog.runtime.sidecar import Watchdog
from watchdog.station.telemetry import Telemetry
from watchdog.trainer.loop import TrainConfig, Trainer
from watchdog.trainer.model import ModelConfig

TINY = ["--device", "cpu", "--depth", "1", "--width", "16", "--heads", "1", "--seq-len", "8", "--batch-size", "1",
        "--activation-checkpointing", "none", "--log-every", "1"]
TINY_CONFIG = TrainConfig(steps=4, model=ModelConfig(depth=1, width=16, heads=1, seq_len=8), batch_size=1,
                          device="cpu", log_every=1, progress_bar=False, watchdog=None)
MiB = 1 << 20


# ---- faults ----------------------------------------------------------------------------------------

def file_size_limit(limit: int):
    """A preexec function: every file this child writes stops at `limit` bytes with EFBIG (not SIGXFSZ)."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    return apply


@contextlib.contextmanager
def tmpfs(path: Path, size: str, *, read_only: bool = False):
    """A small file system of its own, or a skip saying why there cannot be one here."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    try:
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                             capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no mount command here; the RLIMIT_FSIZE variant covers this path")
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({out.stderr.strip() or out.returncode}); "
                    "the RLIMIT_FSIZE variant covers this path")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def fill(directory: Path) -> None:
    """Fill the file system under `directory` to the last byte."""
    with contextlib.suppress(OSError), open(directory / "filler", "wb", buffering=0) as handle:
        while True:
            handle.write(b"\0" * 65536)  # a partial write fills the rest, the next one fails


def hbm_watchdog(*args: str, limit: int | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "watchdog", "--log-format", "json", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=hbm_watchdog_env(),
                          preexec_fn=file_size_limit(limit) if limit else None)


def one_error_line(err: str, *fragments: str) -> None:
    lines = [line for line in err.splitlines() if not line.startswith("{")]  # log records aside
    assert len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def trace_of_size(path: Path, size: int) -> None:
    """A valid trace of about `size` bytes."""
    header = ",".join(TRACE_HEADER) + "\n"
    row = "1,1700000000.000000,1000000,8589934592,\n"
    path.write_text(header + row * ((size - len(header)) // len(row)))


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


# ---- 1. old checkpoints are never deleted ----------------------------------------------------------

def test_resume_auto_over_only_unreadable_checkpoints_refuses_and_deletes_nothing(tmp_path, capsys):
    (tmp_path / "ckpt-00000005.pt").write_bytes(b"garbage" * 100)
    (tmp_path / "ckpt-00000009.pt").write_bytes(b"")
    before = snapshot(tmp_path)
    assert main(["train", *TINY, "--no-watchdog", "--steps", "3", "--checkpoint-dir", str(tmp_path)]) == EXIT_BAD_INPUT
    one_error_line(capsys.readouterr().err, str(tmp_path), "none of its 2 checkpoint(s) loads",
                   "--overwrite-checkpoints", "fresh --checkpoint-dir")
    assert snapshot(tmp_path) == before


def test_resume_never_refuses_to_start_over_another_runs_checkpoints(tmp_path, capsys):
    assert main(["train", *TINY, "--no-watchdog", "--steps", "3", "--checkpoint-dir", str(tmp_path)]) == EXIT_OK
    before = snapshot(tmp_path)
    assert main(["train", *TINY, "--no-watchdog", "--steps", "2", "--resume", "never",
                 "--checkpoint-dir", str(tmp_path)]) == EXIT_BAD_INPUT
    one_error_line(capsys.readouterr().err, str(tmp_path), "another run", "ckpt-00000003.pt", "--overwrite-checkpoints")
    assert snapshot(tmp_path) == before


def test_overwrite_checkpoints_replaces_the_old_run_only_after_the_first_save(tmp_path, capsys):
    assert main(["train", *TINY, "--no-watchdog", "--steps", "6", "--checkpoint-dir", str(tmp_path)]) == EXIT_OK
    assert main(["train", *TINY, "--no-watchdog", "--steps", "3", "--resume", "never", "--overwrite-checkpoints",
                 "--checkpoint-dir", str(tmp_path)]) == EXIT_OK
    assert [p.name for p in tmp_path.glob("ckpt-*")] == ["ckpt-00000003.pt"]  # nothing left to jump back into
    capsys.readouterr()
    assert main(["train", *TINY, "--no-watchdog", "--steps", "4", "--checkpoint-dir", str(tmp_path)]) == EXIT_OK
    assert "(this run from 3)" in capsys.readouterr().out


def test_a_torn_newest_checkpoint_is_set_aside_not_overwritten(tmp_path, capsys):
    assert main(["train", *TINY, "--no-watchdog", "--steps", "6", "--checkpoint-every", "2",
                 "--checkpoint-dir", str(tmp_path)]) == EXIT_OK
    newest = tmp_path / "ckpt-00000006.pt"
    torn = newest.read_bytes()[:1000]
    newest.write_bytes(torn)
    assert main(["train", *TINY, "--no-watchdog", "--steps", "8", "--checkpoint-every", "2",
                 "--checkpoint-dir", str(tmp_path)]) == EXIT_OK
    out = capsys.readouterr()
    assert "(this run from 4)" in out.out
    assert (tmp_path / "ckpt-00000006.pt.unreadable").read_bytes() == torn  # kept for a person to look at
    assert torch.load(newest, weights_only=True)["step"] == 6  # this run's own step 6, a good one
    assert logged(out.err, "checkpoint_set_aside")


@pytest.mark.parametrize("damage, reason", [
    (lambda state: state.pop("model"), "no 'model' in it"),
    (lambda state: state.update(format=99), "format 99, expected format 1"),
    (lambda state: state.pop("format"), "no format field"),
])
def test_a_checkpoint_without_model_or_of_another_format_falls_back_to_the_one_before(tmp_path, capsys, damage,
                                                                                      reason):
    assert main(["train", *TINY, "--no-watchdog", "--steps", "4", "--checkpoint-every", "2",
                 "--checkpoint-dir", str(tmp_path)]) == EXIT_OK
    newest = tmp_path / "ckpt-00000004.pt"
    state = torch.load(newest, weights_only=True)
    damage(state)
    torch.save(state, newest)
    capsys.readouterr()
    assert main(["train", *TINY, "--no-watchdog", "--steps", "5", "--checkpoint-dir", str(tmp_path)]) == EXIT_OK
    out = capsys.readouterr()
    assert "(this run from 2)" in out.out
    assert any(reason in r["reason"] for r in logged(out.err, "checkpoint_skipped"))


def test_an_unreadable_checkpoint_is_logged_without_torchs_weights_only_false_advice(tmp_path, caplog):
    manager = CheckpointManager(tmp_path)
    manager.save({"step": 1}, 1)
    (tmp_path / "ckpt-00000002.pt").write_bytes(b"garbage, not a pickle at all" * 10)
    with open(tmp_path / "ckpt-00000003.pt", "wb") as handle:  # a pickle that would run code
        handle.write(b"cos\nsystem\n(S'echo pwned'\ntR.")
    with caplog.at_level(logging.WARNING, logger="watchdog.actions.checkpoint"):
        assert manager.load_latest() == {"step": 1}
    skipped = [r.msg for r in caplog.records if isinstance(r.msg, dict) and r.msg["event"] == "checkpoint_skipped"]
    assert len(skipped) == 2
    for record in skipped:
        assert "weights_only" not in record["reason"].replace("(weights_only=True)", ""), record["reason"]


# ---- 2. trace I/O errors never change the outcome ----------------------------------------------------

@pytest.fixture(params=["file-size-limit", "full-tmpfs"])
def full_trace(request, tmp_path):
    """(trace path, preexec limit): a trace that takes a few hundred bytes more, then fails."""
    if request.param == "file-size-limit":
        trace = tmp_path / "trace.csv"
        trace_of_size(trace, MiB - 300)
        yield trace, MiB  # checkpoints (about 180 kB) are far below the limit
    else:
        with tmpfs(tmp_path / "small", "256k") as mount:
            trace = mount / "trace.csv"
            trace_of_size(trace, 4096)
            fill(mount)
            yield trace, None


@pytest.mark.slow
@pytest.mark.parametrize("how_it_ends, flags, status, said", [
    ("a restart action", ["--steps", "60", "--force-action", "restart@39"], EXIT_RESTART_REQUESTED,
     "restart requested (exit 42)"),
    ("the last step", ["--steps", "150"], EXIT_OK, "train: done"),
])
def test_a_full_disk_under_the_trace_never_changes_the_exit_status(tmp_path, full_trace, how_it_ends, flags, status,
                                                                   said):
    trace, limit = full_trace
    out = hbm_watchdog("train", *TINY, "--sample-every", "1", "--memory-limit", "8GiB", "--trace-file", str(trace),
                       "--checkpoint-dir", str(tmp_path / "ckpt"), *flags, limit=limit)
    assert out.returncode == status, out.stderr[-3000:]
    assert said in out.stdout
    failures = logged(out, "trace_write_failed")
    assert failures and len({(f["kind"], f["error"]) for f in failures}) == len(failures)  # each kind once
    (stopped,) = logged(out, "watchdog_stopped")
    assert stopped["trace_errors"] >= 1
    assert logged(out, "checkpoint_saved")[-1]["step"] == (40 if status == EXIT_RESTART_REQUESTED else 150)
    load_trace(trace)  # still a trace: a row cut short by the full disk is skipped, not fatal


TRACE_DISK_FILLS_AND_EMPTIES = r"""
import resource, signal, sys
from pathlib import Path
from watchdog.core.config import WatchdogConfig
from watchdog.core.sample import load_trace
from watchdog.runtime.sidecar import Watchdog

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not death
trace = Path(sys.argv[1])
watchdog = Watchdog(WatchdogConfig(sample_every=1, trace_file=trace, source="rss", memory_limit_bytes=8 << 30))
watchdog.trace_retry_seconds = 0.0
watchdog.start()

def train(steps):
    for step in steps:
        watchdog.step(step)
        watchdog.drain()  # every step sampled

train(range(0, 70))  # 64 rows flushed
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (trace.stat().st_size + 10, hard))  # the disk fills up
train(range(70, 140))
errors = watchdog.telemetry.trace_errors_total
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # and has room again
train(range(140, 150))
watchdog.stop()
steps = [s.step for s in load_trace(trace)]
print(errors, watchdog.telemetry.sample_errors_total, steps[:64] == list(range(64)), steps[-10:] == list(range(140, 150)))
"""


@pytest.mark.slow
def test_trace_errors_are_counted_not_sampling_errors_and_the_trace_resumes_when_the_disk_does(tmp_path):
    out = run_python(TRACE_DISK_FILLS_AND_EMPTIES, str(tmp_path / "trace.csv"))
    trace_errors, sample_errors, kept, resumed = out.split()[-4:]
    assert int(trace_errors) >= 1 and sample_errors == "0"
    assert kept == resumed == "True"  # rows before the fault intact; rows after it appended cleanly


def test_a_trace_path_that_cannot_be_a_trace_is_an_input_error_at_start(tmp_path):
    with pytest.raises(InputError, match="cannot append"):
        Watchdog(WatchdogConfig(trace_file=tmp_path, memory_limit_bytes=1 << 30, source="rss")).start()


# ---- 3. a full disk during a checkpoint save --------------------------------------------------------

SAVE_ON_A_FULL_DISK = r"""
import sys, torch
from pathlib import Path
from watchdog.actions.checkpoint import CheckpointManager, CheckpointSaveError

directory = Path(sys.argv[1])
manager = CheckpointManager(directory)
manager.save({"step": 1, "w": torch.zeros(1000)}, 1)
try:
    manager.save({"step": 2, "w": torch.zeros(4 << 20)}, 2)  # 16 MB
except CheckpointSaveError as exc:
    print(exc)
    print(exc.bytes_needed, exc.bytes_free)
else:
    raise SystemExit("the save did not fail")
assert manager.load_latest()["step"] == 1
assert sorted(p.name for p in directory.iterdir() if p.name != "filler") == ["ckpt-00000001.pt"], list(directory.iterdir())
print("ok")
"""


@pytest.mark.slow
def test_a_save_past_the_file_size_limit_says_path_bytes_needed_and_free_and_keeps_the_old_one(tmp_path):
    out = subprocess.run([sys.executable, "-c", SAVE_ON_A_FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                         timeout=300, cwd=REPO, env=hbm_watchdog_env(), preexec_fn=file_size_limit(MiB))
    assert out.returncode == 0, out.stderr[-3000:]
    message, figures, ok = out.stdout.strip().splitlines()[-3:]
    assert f"cannot save {tmp_path / 'ckpt-00000002.pt'}: File too large (needs about" in message
    assert int(figures.split()[0]) >= 16 << 20 and ok == "ok"


@pytest.mark.slow
def test_a_save_on_a_full_tmpfs_says_no_space_and_keeps_the_old_one(tmp_path):
    with tmpfs(tmp_path / "small", "2m") as mount:
        out = run_python(SAVE_ON_A_FULL_DISK, str(mount))
    message, figures, _ = out.strip().splitlines()[-3:]
    assert "No space left on device" in message
    needed, free = map(int, figures.split())
    assert free < 2 * MiB < needed


@pytest.mark.slow
@pytest.mark.parametrize("action, status", [("reinit@14", EXIT_UNSAVED), ("restart@14", EXIT_UNSAVED),
                                            (None, EXIT_UNSAVED)])
def test_training_goes_on_past_a_failed_save_and_an_action_still_gets_its_restart(tmp_path, action, status):
    forced = ["--force-action", action] if action else []
    out = hbm_watchdog("train", *TINY, "--no-watchdog", "--steps", "20", "--checkpoint-every", "10",
                       "--checkpoint-dir", str(tmp_path), *forced, limit=64 * 1024)  # a checkpoint is ~180 kB
    assert out.returncode == status, out.stderr[-3000:]
    failed = logged(out, "checkpoint_save_failed")
    assert failed[0]["step"] == 10 and failed[0]["bytes_needed"] > 64 * 1024 and failed[0]["bytes_free"] > 0
    assert failed[0]["path"] == str(tmp_path / "ckpt-00000010.pt") and failed[0]["error"] == "File too large"
    last_step = 15 if action else 20  # trained past the failure at 10, up to the action or the end
    assert failed[-1]["step"] == last_step
    assert f"steps {last_step}/20" in out.stdout and "restart requested (exit 44)" in out.stdout
    assert list(tmp_path.glob("ckpt-*")) == [] and list(tmp_path.glob(".ckpt-*")) == []  # no debris


def test_free_space_and_checkpoint_size_are_exported(tmp_path):
    telemetry = Telemetry()
    trainer = Trainer(replace(TINY_CONFIG, checkpoint_dir=tmp_path), telemetry=telemetry)
    try:
        trainer.run()
    finally:
        trainer.close()
    (newest,) = tmp_path.glob("ckpt-*.pt")
    figures = telemetry.part(CheckpointFigures)
    assert figures.size_bytes == newest.stat().st_size
    assert 0 < figures.disk_free_bytes <= shutil.disk_usage(tmp_path).total
    with serve_metrics(telemetry, 0) as server:
        text = urllib.request.urlopen(server.url, timeout=10).read().decode()
    assert f"hbmwatch_checkpoint_size_bytes{{device=\"unknown\",rank=\"0\"}} {float(newest.stat().st_size)}" in text
    assert "hbmwatch_checkpoint_disk_free_bytes{" in text


@pytest.mark.slow
def test_free_space_below_one_checkpoint_is_a_warning_at_start_and_after_each_save(tmp_path, caplog):
    assert DiskSpace(free_bytes=100, checkpoint_bytes=200).short
    assert not DiskSpace(free_bytes=300, checkpoint_bytes=200).short and not DiskSpace(100, None).short
    with tmpfs(tmp_path / "small", "320k") as mount:  # room for one ~180 kB checkpoint, not two
        telemetry = Telemetry()
        trainer = Trainer(replace(TINY_CONFIG, checkpoint_dir=mount, keep_checkpoints=1), telemetry=telemetry)
        with caplog.at_level(logging.WARNING, logger="watchdog.actions.checkpoint"):
            try:
                trainer.run()
            finally:
                trainer.close()
        figures = telemetry.part(CheckpointFigures)
        assert figures.disk_free_bytes < figures.size_bytes
    assert any(isinstance(r.msg, dict) and r.msg["event"] == "checkpoint_disk_low" for r in caplog.records)


# ---- 4. a torn trace and a resume ------------------------------------------------------------------

def test_a_resumed_writer_cuts_off_a_torn_last_row_instead_of_gluing_onto_it(tmp_path):
    trace = tmp_path / "trace.csv"
    first = [Sample(step, 1795449890.0 + step, 9000 + step) for step in range(3)]
    write_trace(trace, first)
    with open(trace, "a") as handle:
        handle.write("99,1795449890.52,12")  # SIGKILL mid-row
    with TraceWriter(trace) as writer:
        writer.write(Sample(100, 1795449999.0, 9100))
    assert load_trace(trace) == [*first, Sample(100, 1795449999.0, 9100)]


def test_a_reader_skips_a_torn_last_row_even_one_with_five_fields(tmp_path, caplog):
    trace = tmp_path / "trace.csv"
    trace.write_text(",".join(TRACE_HEADER) + "\n1,1.0,100,1000,\n2,2.0,200,1000,\n3,3.0,300,1000,45")
    with caplog.at_level(logging.WARNING, logger="watchdog.core.sample"):
        assert [s.step for s in load_trace(trace)] == [1, 2]  # peak "45" may be "451" cut short
    assert "torn last line" in caplog.text and ":4:" in caplog.text


@pytest.mark.slow
def test_analyze_dev_zero_is_one_line_not_a_memory_error():
    def small_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    out = subprocess.run([sys.executable, "-m", "watchdog", "analyze", "/dev/zero"], capture_output=True, text=True,
                         timeout=120, cwd=REPO, env=hbm_watchdog_env(), preexec_fn=small_memory)
    assert out.returncode == EXIT_BAD_INPUT, out.stderr[-2000:]
    one_error_line(out.stderr, "/dev/zero: a character device, not a regular file")  # refused before any read


def test_an_endless_line_is_one_line(tmp_path, capsys):
    endless = tmp_path / "endless.csv"
    endless.write_text(",".join(TRACE_HEADER) + "\n" + "7" * (8 << 20))
    assert main(["analyze", str(endless)]) == EXIT_BAD_INPUT
    one_error_line(capsys.readouterr().err, f"{endless}:2: line longer than")


# ---- 5. SIGINT saves --------------------------------------------------------------------------------

def start_training(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "watchdog", "--log-format", "json", "train", *TINY, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=hbm_watchdog_env())


def wait_for_step(lines, step: int) -> list[str]:
    seen = []
    for line in lines:
        seen.append(line)
        if '"train_progress"' in line and json.loads(line)["step"] >= step:
            return seen
    raise AssertionError("never got to step %d:\n%s" % (step, "".join(seen[-30:])))


@pytest.mark.slow
def test_ctrl_c_saves_at_the_step_boundary_exits_130_and_resumes(tmp_path):
    child = start_training("--no-watchdog", "--steps", "100000", "--checkpoint-dir", str(tmp_path))
    try:
        seen = wait_for_step(child.stderr, 5)
        child.send_signal(signal.SIGINT)
        stdout, stderr = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == EXIT_INTERRUPTED, stderr[-3000:]
    records = json_lines("".join(seen) + stderr)
    (interrupted,) = [r for r in records if r["event"] == "interrupted"]
    saved = [r for r in records if r["event"] == "checkpoint_saved"]
    assert interrupted["signal"] == "SIGINT" and saved[-1]["step"] == interrupted["step"] + 1
    assert "interrupted (exit 130)" in stdout
    again = hbm_watchdog("train", *TINY, "--no-watchdog", "--steps", str(saved[-1]["step"] + 2),
                         "--checkpoint-dir", str(tmp_path))
    assert again.returncode == EXIT_OK and f"(this run from {saved[-1]['step']})" in again.stdout


# ---- 6. a killed supervisor takes its child with it --------------------------------------------------

def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_sigkill_on_supervise_stops_the_trainer_which_saves_first(tmp_path):
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "watchdog", "--log-format", "json", "supervise", "--max-restarts", "0", "--",
         sys.executable, "-m", "watchdog", "--log-format", "json", "train", *TINY, "--no-watchdog",
         "--steps", "100000", "--checkpoint-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=hbm_watchdog_env())
    pid = None
    try:
        seen = wait_for_step(supervisor.stderr, 3)
        (started,) = [r for r in json_lines("".join(seen)) if r["event"] == "child_started"]
        pid = started["pid"]
        supervisor.kill()
        supervisor.wait(timeout=30)
        deadline = time.monotonic() + 120
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert gone(pid), "the trainer outlived its supervisor"
    finally:
        supervisor.kill()
        if pid is not None and not gone(pid):
            os.kill(pid, signal.SIGKILL)
    assert list(tmp_path.glob("ckpt-*.pt"))  # it saved on the way out (SIGTERM from the kernel)


# ---- tracebacks that are one line and exit 2 ---------------------------------------------------------

@pytest.mark.parametrize("where, fragment", [
    (lambda tmp: tmp, "is a directory"),
    (lambda tmp: (tmp / "a-file").write_text("") or tmp / "a-file" / "trace.csv", "is not a directory"),
])
def test_an_impossible_trace_file_is_one_line(tmp_path, capsys, where, fragment):
    path = where(tmp_path)
    assert main(["train", *TINY, "--trace-file", str(path), "--memory-limit", "1GiB"]) == EXIT_BAD_INPUT
    one_error_line(capsys.readouterr().err, f"--trace-file {path}", fragment)


@pytest.mark.slow
def test_a_trace_file_on_a_read_only_mount_is_one_line(tmp_path, capsys):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as mount:
        assert main(["train", *TINY, "--trace-file", str(mount / "trace.csv")]) == EXIT_BAD_INPUT
    one_error_line(capsys.readouterr().err, "read-only file system or no permission")


@pytest.fixture
def small_trace(tmp_path) -> Path:
    trace = tmp_path / "trace.csv"
    write_trace(trace, [Sample(step, 1.0 + step, 1000 + step, 1 << 20) for step in range(50)])
    return trace


@pytest.mark.parametrize("output, fragment", [
    (lambda tmp: tmp / "missing" / "report.png", "does not exist"),
    (lambda tmp: (tmp / "a-dir.png").mkdir() or tmp / "a-dir.png", "is a directory"),
    (lambda tmp: (tmp / "a-file").write_text("") or tmp / "a-file" / "report.png", "is not a folder"),
])
def test_report_to_an_impossible_output_is_one_line(tmp_path, capsys, small_trace, output, fragment):
    path = output(tmp_path)
    assert main(["report", str(small_trace), "-o", str(path)]) == EXIT_BAD_INPUT
    one_error_line(capsys.readouterr().err, str(path), fragment)


@pytest.mark.slow
def test_report_to_a_read_only_mount_is_one_line(tmp_path, capsys, small_trace):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as mount:
        assert main(["report", str(small_trace), "-o", str(mount / "report.png")]) == EXIT_BAD_INPUT
    one_error_line(capsys.readouterr().err, "not writable")


@pytest.mark.slow
def test_report_that_cannot_be_written_is_one_line_and_the_old_one_stays(tmp_path, small_trace):
    old = tmp_path / "report.png"
    old.write_bytes(b"the previous report")
    out = hbm_watchdog("report", str(small_trace), "-o", str(old), limit=4096)  # a drawn chart is ~50 kB
    assert out.returncode == EXIT_BAD_INPUT, out.stderr[-2000:]
    one_error_line(out.stderr, f"{old}: cannot write it: File too large")
    assert old.read_bytes() == b"the previous report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.png", "trace.csv"]  # no temporary left


@pytest.mark.parametrize("argv, fragment", [
    (["train", "--lr", "inf"], "--lr must be a positive finite number"),
    (["train", "--lr", "nan"], "--lr must be a positive finite number"),
    (["supervise", "--backoff", "nan", "--", "true"], "--backoff must be a finite number"),
    (["supervise", "--backoff", "inf", "--", "true"], "--backoff must be a finite number"),
    (["supervise", "--max-backoff", "nan", "--", "true"], "--max-backoff must be a finite number"),
])
def test_non_finite_numbers_are_refused(capsys, argv, fragment):
    assert main(argv) == EXIT_BAD_INPUT
    one_error_line(capsys.readouterr().err, fragment)


# ---- the metrics endpoint ---------------------------------------------------------------------------

def test_the_endpoint_listens_on_loopback_unless_told_and_says_where_it_really_is():
    with serve_metrics(Telemetry(), 0) as local:
        assert local.addr == "127.0.0.1" and local.url == f"http://127.0.0.1:{local.port}/metrics"
    with serve_metrics(Telemetry(), 0, addr="0.0.0.0") as everywhere:
        assert everywhere.url == f"http://0.0.0.0:{everywhere.port}/metrics"
        urllib.request.urlopen(f"http://127.0.0.1:{everywhere.port}/metrics", timeout=10).read()
    with pytest.raises(InputError, match="cannot serve metrics on no-such-host.invalid"):
        serve_metrics(Telemetry(), 0, addr="no-such-host.invalid")


@pytest.mark.parametrize("command", [["train"], ["watch", "--pid", str(os.getpid())]])
def test_train_and_watch_take_a_listen_address_and_default_to_loopback(command):
    from watchdog.commands.cli import build_parser

    assert build_parser().parse_args(command).metrics_address == "127.0.0.1"
    assert build_parser().parse_args([*command, "--metrics-address", "0.0.0.0"]).metrics_address == "0.0.0.0"


def test_a_silent_client_is_dropped_at_its_request_deadline():
    with serve_metrics(Telemetry(), 0) as server, socket.create_connection((server.addr, server.port)) as client:
        client.settimeout(REQUEST_DEADLINE_SECONDS + 15)
        assert client.recv(1) == b""  # closed by the server, not by our timeout


HALF_OPEN_CLIENTS = r"""
import socket, sys, time
port, count = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(count):
    try:
        held.append(socket.create_connection(("127.0.0.1", port), timeout=0.2))
    except OSError:
        pass  # the kernel's backlog is full: the storm is as big as it gets
print(len(held), flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_200_half_open_clients_add_no_thread_and_hold_a_bounded_number_of_connections():
    me = psutil.Process()

    def accepted(port: int) -> int:  # connections this process holds open on the endpoint's side
        return sum(1 for c in me.net_connections("tcp") if c.laddr and c.laddr.port == port and c.raddr)

    with serve_metrics(Telemetry(), 0) as server:
        threads = me.num_threads()
        storm = subprocess.Popen([sys.executable, "-c", HALF_OPEN_CLIENTS, str(server.port), "200"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert int(storm.stdout.readline()) > 0
            most_threads, most_open = threads, 0
            for _ in range(30):  # for a while: the server keeps accepting as idle clients are dropped
                most_threads, most_open = max(most_threads, me.num_threads()), max(most_open, accepted(server.port))
                time.sleep(0.1)
            with urllib.request.urlopen(server.url, timeout=60) as response:  # a scrape gets through the storm
                assert response.status == 200
        finally:
            storm.communicate("", timeout=30)
        assert most_threads == threads
        assert 0 < most_open <= MAX_CONNECTIONS
        with urllib.request.urlopen(server.url, timeout=60) as response:  # the storm gone, scrapes served again
            assert response.status == 200


def test_a_memory_source_the_device_cannot_give_is_one_line(tmp_path, capsys):
    """Issue 52: `train --device cpu --memory-source tpu` (or cuda, xla) on a host without it was a
    SourceUnavailable traceback, exit 1. A source the user named that cannot read is bad input."""
    for source in ("tpu", "cuda"):
        code = main(["train", *TINY, "--memory-source", source, "--steps", "2",
                     "--checkpoint-dir", str(tmp_path / source)])
        assert code == EXIT_BAD_INPUT
        one_error_line(capsys.readouterr().err, f"memory source {source!r} cannot read device 'cpu'",
                       "choose one that can, or auto")


@pytest.mark.slow
def test_a_pjrt_device_that_names_no_plugin_is_one_line(tmp_path):
    """Issue 52: `PJRT_DEVICE=NOSUCHDEVICE train`: torch_xla's RuntimeError traceback, exit 1."""
    out = subprocess.run([sys.executable, "-m", "watchdog", "--log-format", "json", "train", *TINY, "--device", "xla",
                          "--steps", "2",
                          "--checkpoint-dir", str(tmp_path)], capture_output=True, text=True, timeout=180, cwd=REPO,
                         env={**hbm_watchdog_env(), "PJRT_DEVICE": "NOSUCHDEVICE"})
    assert out.returncode == EXIT_BAD_INPUT, out.stderr[-2000:]
    one_error_line(out.stderr, "PJRT_DEVICE='NOSUCHDEVICE'", "No PjRtPlugin registered for: NOSUCHDEVICE")
