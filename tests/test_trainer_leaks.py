"""Leak specs: parsing is pure and strict; injection puts each leak where its kind says."""

import pytest
import torch
from conftest import run_python

from watchdog.core.errors import InputError
from watchdog.trainer import leaks
from watchdog.trainer.leaks import LeakSpec, inject, new_sinks, parse_leak_spec


@pytest.mark.parametrize("text, expected", [
    ("tensors:4MiB/step", LeakSpec("tensors", 4 << 20, 0)),
    ("tensors:2MiB/step@100", LeakSpec("tensors", 2 << 20, 100)),
    ("global:1048576/step", LeakSpec("global", 1 << 20, 0)),
    ("graph:2/step", LeakSpec("graph", 2, 0)),
    ("graph:1/step@7", LeakSpec("graph", 1, 7)),
    ("recompile:50", LeakSpec("recompile", 50, 0)),
    ("recompile:10@20", LeakSpec("recompile", 10, 20)),
    ("total:3/step", LeakSpec("total", 3, 0)),
    ("hook:1MiB/step@5", LeakSpec("hook", 1 << 20, 5)),
    ("cache:64KiB/step", LeakSpec("cache", 64 << 10, 0)),
])
def test_valid_specs(text, expected):
    assert parse_leak_spec(text) == expected


@pytest.mark.parametrize("text, fragment", [
    ("bogus:1MiB/step", "unknown kind 'bogus'"),
    ("tensors:4MiB", "tensors:AMOUNT/step"),
    ("recompile:5/step", "recompile:K"),
    ("tensors:4XB/step", "unknown size unit"),
    ("graph:1.5/step", "whole number"),
    ("total:2MiB/step", "whole number"),
    ("hook:3X/step", "unknown size unit"),
    ("graph:0/step", "positive"),
    ("tensors:0/step", "positive"),
    ("tensors:-1MiB/step", "not a size"),
    ("tensors", "expected"),
    ("tensors:1MiB/step@x", "expected"),
])
def test_bad_specs_are_input_errors_naming_the_spec(text, fragment):
    with pytest.raises(InputError) as info:
        parse_leak_spec(text)
    message = str(info.value)
    assert text in message and fragment in message and "\n" not in message


def test_tensors_leak_grows_the_state_list_by_the_asked_size_from_its_start_step():
    sinks = new_sinks()
    spec = parse_leak_spec("tensors:64KiB/step@3")
    for step in range(6):
        inject([spec], step, sinks, torch.device("cpu"), forward_loss=None)
    assert len(sinks.tensors) == 3  # steps 3, 4, 5
    assert all(t.numel() * t.element_size() == 64 << 10 for t in sinks.tensors)
    assert all(bool((t == 1).all()) for t in sinks.tensors)  # written, so the pages are resident


def test_global_leak_lives_outside_the_state_and_survives_new_sinks():
    before = leaks.global_leak_bytes()
    inject([parse_leak_spec("global:32KiB/step")], 0, new_sinks(), torch.device("cpu"), forward_loss=None)
    fresh = new_sinks()  # what a reinit builds
    assert fresh.tensors == [] and leaks.global_leak_bytes() == before + (32 << 10)
    leaks._GLOBAL_LEAK.clear()


def test_graph_leak_keeps_losses_with_their_autograd_graph():
    weight = torch.ones(3, requires_grad=True)
    sinks = new_sinks()
    inject([parse_leak_spec("graph:2/step")], 0, sinks, torch.device("cpu"),
           forward_loss=lambda: (weight * torch.arange(3.0)).square().sum())
    assert len(sinks.graphs) == 2
    assert all(loss.grad_fn is not None for loss in sinks.graphs)
    sinks.graphs[0].backward()  # the graph (and its saved tensors) is still there
    assert weight.grad is not None


def test_recompile_leak_changes_shape_every_k_steps():
    sinks = new_sinks()
    spec = parse_leak_spec("recompile:3")
    sizes = []
    for step in range(7):
        inject([spec], step, sinks, torch.device("cpu"), forward_loss=None)
        sizes.append(int(sinks.shape_probe.item()))  # sum of ones = its length
    assert sizes == [1, 1, 1, 2, 2, 2, 3]


XLA_RECOMPILE = r"""
import torch, torch_xla
import torch_xla.debug.metrics as met
from watchdog.trainer.leaks import inject, new_sinks, parse_leak_spec

device = torch_xla.device()
weights = torch.ones(8, device=device)
torch_xla.sync()
compiles = {}
for text in ("recompile:1000", "recompile:3"):
    met.clear_all()
    sinks = new_sinks()
    for step in range(9):
        weights = weights * 0.5 + 1  # the "training step": the same graph every step
        inject([parse_leak_spec(text)], step, sinks, device, forward_loss=None)
        torch_xla.sync()
    compiles[text] = met.counter_value("UncachedCompile") or 0
print(compiles["recompile:1000"], compiles["recompile:3"])
"""


@pytest.mark.slow
def test_recompile_leak_really_recompiles_on_xla():
    steady, leaking = map(int, run_python(XLA_RECOMPILE).split())
    assert steady == 1  # one shape, one graph
    # shapes 1, 2, 3 over 9 steps: a new graph every 3 steps (shape 1's was compiled just before)
    assert leaking == 2


def tiny_model():
    from watchdog.trainer.model import ModelConfig, TransformerLM

    return TransformerLM(ModelConfig(depth=1, width=16, heads=2, seq_len=8, activation_checkpointing="none"))


def test_total_leak_sums_losses_with_their_graphs_into_the_state():
    weight = torch.ones(3, requires_grad=True)
    sinks = new_sinks()
    for step in range(4):
        inject([parse_leak_spec("total:2/step")], step, sinks, torch.device("cpu"),
               forward_loss=lambda: (weight * torch.arange(3.0)).square().sum())
    assert float(sinks.running_total.detach()) == 8 * 5.0  # 2 losses of 0+1+4 per step, 4 steps
    assert sinks.running_total.grad_fn is not None  # the graph of all eight is still attached


def test_hook_leak_registers_a_hook_per_step_on_the_first_block_each_keeping_its_tensor():
    model = tiny_model()
    spec = parse_leak_spec("hook:4KiB/step@1")
    for step in range(4):
        inject([spec], step, new_sinks(), torch.device("cpu"), forward_loss=None, model=model)
    hooks = list(model.blocks[0]._forward_hooks.values())
    assert len(hooks) == 3  # steps 1, 2, 3
    kept = [cell.cell_contents for hook in hooks for cell in hook.__closure__]
    assert all(t.numel() * t.element_size() == 4 << 10 for t in kept)
    model(torch.zeros(1, 8, dtype=torch.long))  # the hooks run and change nothing


def test_cache_leak_lives_at_module_level_and_survives_new_sinks():
    before = leaks._step_table.cache_info().currsize
    for step in range(3):
        inject([parse_leak_spec("cache:8KiB/step")], 1000 + step, new_sinks(), torch.device("cpu"), forward_loss=None)
    assert leaks._step_table.cache_info().currsize == before + 3  # a reinit's new state does not free it
    leaks._step_table.cache_clear()
