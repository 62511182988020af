"""Sharded checkpoints, the parts that need no XLA: the payload split, the metadata allow-list, and
reading a DCP checkpoint back whole. The SPMD save / load / SIGKILL scenarios are in test_spmd.py."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from watchdog.actions.sharded_checkpoint import (
    load_metadata,
    merge_trees,
    read_tensors,
    split_device_tensors,
    step_dir_name,
    step_of,
)


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
