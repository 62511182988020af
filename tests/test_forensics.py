"""Forensics on real tensors: the growing group is found, its holder named, parameters ignored."""

import torch

from watchdog.runtime import forensics
from watchdog.runtime.forensics import Census, TensorGroup, growth


class TrainerState:
    def __init__(self):
        self.kept_losses = []


LEAKED_GLOBAL = []


def test_growth_is_pure_and_ranks_by_bytes():
    small, big = TensorGroup("cpu", "float32", (4,), False), TensorGroup("cpu", "float32", (1024,), False)
    before = Census()
    after = Census()
    after.count.update({small: 50, big: 3})
    after.nbytes.update({small: 50 * 16, big: 3 * 4096})
    ranked = growth(before, after)
    assert [g.group for g in ranked] == [big, small]
    assert ranked[0].added_bytes == 3 * 4096


def test_a_list_of_kept_tensors_is_named_with_its_owner():
    model = torch.nn.Linear(8, 8)
    state = TrainerState()
    baseline = forensics.census()
    for _ in range(40):
        loss = model(torch.randn(2, 8)).sum()
        state.kept_losses.append(loss)  # the classic: losses kept with their graphs
    lines = forensics.explain_leak(baseline)
    assert lines, "the leak must be found"
    kept = [line for line in lines if "+40 tensors float32[scalar] on cpu with autograd graph" in line]
    assert kept and "attribute 'kept_losses' of TrainerState" in kept[0]
    assert any("float32[2x8]" in line for line in lines), "inputs saved by the kept graphs grow too"


def test_a_module_level_leak_is_named_as_a_global():
    baseline = forensics.census()
    for _ in range(30):
        LEAKED_GLOBAL.append(torch.zeros(3, 5, dtype=torch.float16))
    lines = forensics.explain_leak(baseline)
    assert "float16[3x5]" in lines[0]
    assert "global 'LEAKED_GLOBAL' in module" in lines[0]
    LEAKED_GLOBAL.clear()


def test_parameters_are_not_counted():
    params = [torch.nn.Parameter(torch.zeros(7, 7)) for _ in range(10)]
    groups = forensics.census().count
    assert TensorGroup("cpu", "float32", (7, 7), False) not in groups
    assert len(params) == 10
