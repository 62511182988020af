"""Sharded checkpoints, the parts that need no XLA: the payload split, the metadata allow-list,
reading a DCP checkpoint back whole, and which steps are trusted (one slow test resumes on PJRT
CPU past an untrusted step). The SPMD save / load / SIGKILL scenarios are in test_spmd.py."""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import json_lines, run_python_args, without_hanging

from watchdog.actions.checkpoint import Timeline
from watchdog.actions.sharded_checkpoint import (
    HOST_FILE,
    UntrustedStep,
    is_real_directory,
    load_metadata,
    merge_trees,
    read_tensors,
    split_device_tensors,
    step_dir_name,
    step_of,
    trusted_host_values,
)
from watchdog.core.inputs import NotARegularFile


def test_step_directories_are_named_and_parsed_by_step():
    assert step_dir_name(300) == "step-00000300"
    assert step_of(Path("ckpt") / "step-00000300") == 300
    for foreign in (".tmp-step-00000300", "step-300", "ckpt-00000300.pt", "step-00000300.old"):
        assert step_of(Path(foreign)) is None, foreign


def test_device_tensors_go_to_dcp_and_everything_else_to_the_host_file():
    weight, moment = torch.empty(4, 2, device="meta"), torch.empty(4, 2, device="meta")
    rng = torch.arange(3)
    payload = {"step": 7, "model": {"w": weight},
               "optimizer": {"state": {0: {"exp_avg": moment, "step": 3}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
               "rng": {"torch": rng}}
    device, host = split_device_tensors(payload)
    assert device == {"model": {"w": weight}, "optimizer": {"state": {0: {"exp_avg": moment}}}}
    assert host == {"step": 7, "model": {}, "optimizer": {"state": {0: {"step": 3}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
                    "rng": {"torch": rng}}
    assert merge_trees(host, device) == payload


def test_device_tensors_hidden_in_a_list_are_refused_not_silently_pickled():
    with pytest.raises(TypeError, match="inside a list"):
        split_device_tensors({"buffers": [torch.empty(1, device="meta")]})


def write_cpu_checkpoint(directory) -> dict[str, torch.Tensor]:
    tensors = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4, dtype=torch.bfloat16)}}
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    return tensors


def test_a_checkpoint_reads_back_whole_on_the_cpu_by_flattened_name(tmp_path):
    saved = write_cpu_checkpoint(tmp_path)
    read = read_tensors(tmp_path)
    assert sorted(read) == ["model.b", "model.w"]
    assert torch.equal(read["model.w"], saved["model"]["w"]) and read["model.b"].dtype == torch.bfloat16


class RunsCode:
    """A pickle that would run a command when unpickled (what a hostile checkpoint directory holds)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_metadata_that_would_run_code_is_refused_and_never_runs(tmp_path):
    write_cpu_checkpoint(tmp_path)
    assert load_metadata(tmp_path).state_dict_metadata  # DCP's own metadata passes the allow-list
    marker = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        load_metadata(tmp_path)
    with pytest.raises(Exception):
        read_tensors(tmp_path)
    assert not marker.exists()


# ---- trust: a step is what its name says, and lives in the checkpoint directory ----------------------

def write_step(directory: Path, step: int) -> Path:
    """A committed step as the manager lays it out: DCP's files and host.pt (no XLA needed to write it)."""
    write_cpu_checkpoint(directory)
    torch.save({"step": step, "data_position": 0}, directory / HOST_FILE)
    return directory


def test_a_step_is_read_only_when_it_lives_in_the_directory_and_agrees_with_its_name(tmp_path):
    ckpt = tmp_path / "ckpt"
    good = write_step(ckpt / "step-00000020", 20)
    assert trusted_host_values(good) == {"step": 20, "data_position": 0}

    other = write_step(tmp_path / "other" / "step-00000015", 15)
    (ckpt / "step-00000099").symlink_to(other)  # another run's step under a newer name
    with pytest.raises(UntrustedStep, match="not a directory in .*: not trusted"):
        trusted_host_values(ckpt / "step-00000099")
    copied = ckpt / "step-00000030"
    shutil.copytree(other, copied)
    with pytest.raises(UntrustedStep, match="host.pt holds step 15, but its name says step 30: not trusted"):
        trusted_host_values(copied)


def test_a_step_with_anything_but_regular_files_in_it_is_refused_before_dcp_opens_them(tmp_path):
    step = write_step(tmp_path / "step-00000020", 20)
    shard = next(step.glob("*.distcp"))
    shard.unlink()
    os.mkfifo(shard)  # DCP's own open of it would wait for a writer for good
    error = without_hanging(lambda: trusted_host_values(step), fifo=shard)
    assert isinstance(error, NotARegularFile) and error.kind == "a FIFO (named pipe)"
    assert isinstance(without_hanging(lambda: read_tensors(step), fifo=shard), NotARegularFile)


def test_metadata_naming_a_file_outside_its_step_is_refused(tmp_path):
    write_cpu_checkpoint(tmp_path)
    metadata = load_metadata(tmp_path)
    for name in ("../other-run/__0_0.distcp", "/dev/zero"):
        metadata.storage_data = {index: dataclasses.replace(info, relative_path=name)
                                 for index, info in metadata.storage_data.items()}
        (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
        with pytest.raises(pickle.UnpicklingError, match="not a file of its directory"):
            load_metadata(tmp_path)


def test_pruning_never_counts_a_link_as_one_of_this_runs_steps(tmp_path):
    ckpt = tmp_path / "ckpt"
    for step in (10, 20):
        write_step(ckpt / step_dir_name(step), step)
    (ckpt / "step-00000005").symlink_to(write_step(tmp_path / "other" / "step-00000015", 15))
    removed = []
    timeline = Timeline(ckpt, 2, step_of, removed.append, is_real_directory)
    listing = sorted(ckpt.iterdir())
    timeline.resumed(listing, ckpt / "step-00000020", skipped=[])
    write_step(ckpt / "step-00000021", 21)
    timeline.written(ckpt / "step-00000021", sorted(ckpt.iterdir()))
    assert removed == [ckpt / "step-00000010"]  # keep-last 2 of this run's: 20 and 21; the link is not ours


SHARDED_RESUME = r"""
import sys
from pathlib import Path
import torch, torch_xla
import torch_xla.runtime as xr
from watchdog.actions.sharded_checkpoint import ShardedCheckpointManager
from watchdog.logs import configure_logging

configure_logging("json", "info")
xr.use_spmd()
root, device = Path(sys.argv[1]), torch_xla.device()

def payload(step):
    return {"step": step, "model": {"w": torch.full((4, 2), float(step), device=device)}}

ShardedCheckpointManager(root / "other").save(payload(15), 15)
first = ShardedCheckpointManager(root / "mine", keep_last=3)
for step in (10, 20):
    first.save(payload(step), step)
(root / "mine" / "step-00000099").symlink_to(root / "other" / "step-00000015")
(root / "mine" / "step-00000005").symlink_to(root / "other" / "step-00000015")
restarted = ShardedCheckpointManager(root / "mine", keep_last=3)
state = restarted.open_run(payload(0), resume=True)
print("resumed", state["step"], state["model"]["w"].cpu()[0, 0].item())
restarted.save(payload(21), 21)
print(" ".join(sorted(p.name for p in (root / "mine").iterdir())))
"""


@pytest.mark.slow
def test_a_sharded_run_resumes_from_its_own_newest_step_not_a_linked_newer_one(tmp_path):
    out = run_python_args(["-c", SHARDED_RESUME, str(tmp_path)], timeout=300)
    resumed, listing = out.stdout.strip().splitlines()[-2:]
    assert resumed == "resumed 20 20.0"
    assert listing.split() == ["step-00000005", "step-00000010", "step-00000020", "step-00000021",
                               "step-00000099.unreadable"]  # set aside; nothing of this run's pruned
    skipped = [r for r in json_lines(out.stderr) if r.get("event") == "checkpoint_skipped"]
    assert [Path(r["path"]).name for r in skipped] == ["step-00000099"]
    assert "not trusted" in skipped[0]["reason"]
