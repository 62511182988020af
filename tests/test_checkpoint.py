"""Checkpoints for real: files on disk, torch.load(weights_only=True), a child process SIGKILLed mid-write."""

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, run_python, without_hanging

from watchdog.actions.checkpoint import (
    CheckpointManager,
    capture_rng_state,
    restore_rng_state,
)
from watchdog.core.errors import ConfigError, InputError


def small_training_state(step):
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "step": step, "data_position": {"epoch": 0, "index": 17 * step}, "restarts_so_far": 1}


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_round_trip_of_a_training_state(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt")
    state = small_training_state(7)
    path = mgr.save(state, 7)
    assert path.name == "ckpt-00000007.pt"
    assert_same(mgr.load_latest(), state)
    assert mgr.latest_step() == 7


def test_keeps_only_the_last_k_and_loads_the_newest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40, 50):
        mgr.save({"step": step}, step)
    assert [p.name for p in mgr.list()] == ["ckpt-00000040.pt", "ckpt-00000050.pt"]
    assert mgr.load_latest()["step"] == 50


def test_pruning_touches_only_this_runs_own_checkpoints(tmp_path):
    first = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        first.save({"step": step}, step)
    second = CheckpointManager(tmp_path, keep_last=2)  # did not resume from them: not its timeline
    for step in (1, 2, 3):
        second.save({"step": step}, step)
    assert [p.name for p in second.list()] == ["ckpt-00000002.pt", "ckpt-00000003.pt",
                                               "ckpt-00000020.pt", "ckpt-00000030.pt"]


def test_empty_directory_has_nothing_to_load(tmp_path):
    mgr = CheckpointManager(tmp_path)
    assert mgr.load_latest() is None and mgr.latest_step() is None and mgr.list() == []


def test_truncated_newest_is_skipped_with_a_log_line_naming_it(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path)
    mgr.save(small_training_state(1), 1)
    newest = mgr.save(small_training_state(2), 2)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING, logger="watchdog.actions.checkpoint"):
        state = mgr.load_latest()
    assert state["step"] == 1
    assert "checkpoint_skipped" in caplog.text and newest.name in caplog.text


def test_garbage_and_non_dict_files_are_skipped(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path)
    mgr.save({"step": 1}, 1)
    (tmp_path / "ckpt-00000002.pt").write_bytes(os.urandom(4096))
    torch.save([1, 2, 3], tmp_path / "ckpt-00000003.pt")
    with caplog.at_level(logging.WARNING, logger="watchdog.actions.checkpoint"):
        assert mgr.load_latest() == {"step": 1}
    assert "ckpt-00000002.pt" in caplog.text and "ckpt-00000003.pt" in caplog.text
    assert "not a dict" in caplog.text


@dataclass
class ArbitraryObject:
    payload: str


def test_a_file_needing_arbitrary_unpickling_is_refused_and_skipped(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path)
    mgr.save({"step": 1}, 1)
    torch.save({"step": 2, "evil": ArbitraryObject("x")}, tmp_path / "ckpt-00000002.pt")
    with caplog.at_level(logging.WARNING, logger="watchdog.actions.checkpoint"):
        assert mgr.load_latest() == {"step": 1}
    assert "ckpt-00000002.pt" in caplog.text and "refused by the safe loader" in caplog.text
    assert "weights_only=False" not in caplog.text and "weights_only` set to `False`" not in caplog.text


def test_unusable_directory_or_settings_are_input_errors(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(InputError, match="not writable"):
        CheckpointManager(a_file)
    with pytest.raises(InputError, match="not writable"):
        CheckpointManager(a_file / "below")
    with pytest.raises(ConfigError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(InputError):
        CheckpointManager(tmp_path).save({}, -1)


def test_stale_temporaries_are_not_checkpoints_and_go_at_the_next_save(tmp_path):
    mgr = CheckpointManager(tmp_path)
    stale = tmp_path / ".ckpt-00000005.12345.tmp"
    stale.write_bytes(b"half a checkpoint")
    assert mgr.list() == [] and mgr.load_latest() is None
    mgr.save({"step": 6}, 6)
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000006.pt"]


def draws():
    return (random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.randn()),
            torch.rand(3).tolist())


def test_rng_state_survives_a_weights_only_checkpoint(tmp_path):
    random.gauss(0, 1)  # leaves a cached gauss value in python's state
    np.random.randn()
    mgr = CheckpointManager(tmp_path)
    mgr.save({"rng": capture_rng_state()}, 1)
    expected = draws()
    draws()  # move every generator on
    restore_rng_state(mgr.load_latest()["rng"])
    assert draws() == expected


XLA_ROUND_TRIP = r"""
import json, sys
import torch, torch_xla
from watchdog.actions.checkpoint import CheckpointManager, capture_rng_state, restore_rng_state
device = torch_xla.device()
model = torch.nn.Linear(8, 8).to(device)
mgr = CheckpointManager(sys.argv[1])
mgr.save({"model": model.state_dict(), "rng": capture_rng_state(device)}, 3)
expected = torch.rand(4, device=device).cpu().tolist()
torch.rand(4, device=device).cpu()
state = mgr.load_latest()
restore_rng_state(state["rng"], device)
again = torch.rand(4, device=device).cpu().tolist()
print(json.dumps({"same_draws": expected == again,
                  "loaded_on": sorted({t.device.type for t in state["model"].values()}),
                  "weights_equal": all(torch.equal(state["model"][k], v.cpu()) for k, v in model.state_dict().items())}))
"""


@pytest.mark.slow
def test_xla_tensors_and_xla_rng_round_trip_on_pjrt_cpu(tmp_path):
    result = json.loads(run_python(XLA_ROUND_TRIP, str(tmp_path), timeout=240).strip().splitlines()[-1])
    assert result == {"same_draws": True, "loaded_on": ["cpu"], "weights_equal": True}


SAVE_FOREVER = r"""
import sys, torch
from watchdog.actions.checkpoint import CheckpointManager
mgr = CheckpointManager(sys.argv[1], keep_last=2)
payload = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB: a write takes long enough to be caught in
for step in range(1, 10_000):
    mgr.save({"step": step, "payload": payload + step}, step)
    print(step, flush=True)
"""


def kill_during_a_write(directory: Path) -> tuple[Path, int] | None:
    """Run the saver, SIGKILL it while a temp file is partly written; the torn temp and its size, or None if missed."""
    child = subprocess.Popen([sys.executable, "-c", SAVE_FOREVER, str(directory)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "1"  # one complete checkpoint exists
        full_size = (directory / "ckpt-00000001.pt").stat().st_size
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for temp in directory.glob(".ckpt-*.tmp"):
                try:
                    size = temp.stat().st_size
                except FileNotFoundError:
                    continue
                if 0 < size < full_size:
                    child.send_signal(signal.SIGKILL)
                    child.wait()
                    return (temp, full_size) if temp.exists() else None
            time.sleep(0.0005)
        raise AssertionError("never saw a checkpoint being written")
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


@pytest.mark.slow
def test_sigkill_in_the_middle_of_a_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    for attempt in range(5):  # the kill can race the rename; try again rather than prove nothing
        directory = tmp_path / f"attempt{attempt}"
        torn = kill_during_a_write(directory)
        if torn is not None:
            break
    assert torn is not None, "could not kill the saver mid-write in 5 attempts"
    temp, full_size = torn
    assert temp.stat().st_size < full_size  # really torn
    with pytest.raises(Exception):
        torch.load(temp, weights_only=True)

    mgr = CheckpointManager(directory, keep_last=2)
    assert all(not p.name.startswith(".") for p in mgr.list())
    newest = mgr.latest_step()
    state = mgr.load_latest()
    assert state["step"] == newest
    assert torch.equal(state["payload"], torch.arange(16 << 20, dtype=torch.float32) + newest)

    mgr.save({"step": newest + 1}, newest + 1)
    assert not temp.exists()
    assert not list(directory.glob(".ckpt-*"))


# --- trust: a checkpoint is what its name says, and lives in its directory --------------------------

def skipped_reasons(caplog):
    return {Path(r.msg["path"]).name: r.msg["reason"] for r in caplog.records
            if isinstance(r.msg, dict) and r.msg.get("event") == "checkpoint_skipped"}


def test_a_link_to_another_runs_checkpoint_named_as_a_newer_step_is_never_trusted(tmp_path, caplog):
    other = CheckpointManager(tmp_path / "other")
    foreign = other.save({"step": 15, "run": "other"}, 15)
    mine = tmp_path / "mine"
    first = CheckpointManager(mine, keep_last=3)
    for step in (10, 20):
        first.save({"step": step, "run": "mine"}, step)
    (mine / "ckpt-00000099.pt").symlink_to(foreign)  # the case: it won every resume
    (mine / "ckpt-00000005.pt").symlink_to(foreign)  # older than the resume point: never pruned as ours

    restarted = CheckpointManager(mine, keep_last=3)
    with caplog.at_level(logging.WARNING, logger="watchdog.actions.checkpoint"):
        state = without_hanging(lambda: restarted.open_run(resume=True))
    assert state == {"step": 20, "run": "mine"}  # this run's real newest
    assert "a symbolic link, not a regular file" in skipped_reasons(caplog)["ckpt-00000099.pt"]
    assert (mine / "ckpt-00000099.pt.unreadable").is_symlink()  # set aside, not deleted

    restarted.save({"step": 21, "run": "mine"}, 21)
    assert sorted(p.name for p in mine.glob("ckpt-*.pt")) == [
        "ckpt-00000005.pt", "ckpt-00000010.pt", "ckpt-00000020.pt", "ckpt-00000021.pt"]  # nothing of ours pruned
    assert (mine / "ckpt-00000005.pt").is_symlink()
    assert torch.load(foreign, weights_only=True) == {"step": 15, "run": "other"}  # the other run's, intact
    assert CheckpointManager(mine, keep_last=3).open_run(resume=True)["step"] == 21  # and again on the next start


def test_a_file_whose_step_inside_disagrees_with_its_name_or_that_is_no_file_is_skipped(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save({"step": 10}, 10)
    copied = tmp_path / "ckpt-00000030.pt"
    torch.save({"step": 15}, copied)  # another checkpoint under a name that is not its own
    os.mkfifo(tmp_path / "ckpt-00000040.pt")  # its open() would wait for a writer for good
    (tmp_path / "ckpt-00000050.pt").mkdir()

    restarted = CheckpointManager(tmp_path, keep_last=3)
    with caplog.at_level(logging.WARNING, logger="watchdog.actions.checkpoint"):
        assert without_hanging(lambda: restarted.open_run(resume=True)) == {"step": 10}
    reasons = skipped_reasons(caplog)
    assert reasons["ckpt-00000030.pt"] == "holds step 15, but its name says step 30: not trusted"
    assert "a FIFO (named pipe), not a regular file" in reasons["ckpt-00000040.pt"]
    assert "a directory, not a regular file" in reasons["ckpt-00000050.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [  # newer than the resume point: set aside, kept
        "ckpt-00000010.pt", "ckpt-00000030.pt.unreadable", "ckpt-00000040.pt.unreadable",
        "ckpt-00000050.pt.unreadable"]
