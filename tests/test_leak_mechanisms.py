"""The leaks PyTorch and PyTorch/XLA users report most, and growth that is not a leak, for real.

Each scenario in tests/leak_scenarios.py is a torch_xla training loop on PJRT CPU, in a fresh
process, watched by the real `Watchdog` on resident memory against a `--memory-limit` style budget
(the loop's starting memory plus ~600 MiB). For every leak the watchdog must ask for a checkpoint
before memory passes the budget, and `forensics.explain_leak`, after the creation-site capture the
first WARN or action armed, must name what holds it and where Python created it. Growth that is
not a leak must get no action at all, not even a warning.

Where each leak comes from (public reports of the same mistake):

- running_total: `total_loss += loss` with autograd on keeps every step's graph.
  https://github.com/google/brax/pull/152 (quoting the PyTorch FAQ),
  https://github.com/BatsResearch/labelmodels/issues/4, https://github.com/ray-project/ray/pull/40940,
  https://github.com/pytorch/pytorch/issues/64586
- kept_outputs: outputs kept for the epoch end with their graph.
  https://github.com/TRI-ML/packnet-sfm/pull/51, https://github.com/Lightning-AI/pytorch-lightning/issues/1510,
  https://github.com/Lightning-AI/pytorch-lightning/pull/16520 (Lightning removed the epoch-end outputs for it)
- hook_activations: a forward hook storing activations, never cleared.
  https://github.com/meta-pytorch/opacus/issues/176, https://github.com/chr5tphr/zennit/issues/11
- hook_every_step: a hook registered on every call and never removed.
  https://github.com/huggingface/peft/pull/2761, https://github.com/fffasttime/MRFI/pull/5
- create_graph: `backward(create_graph=True)` leaves `.grad` with a graph that grows.
  https://github.com/pytorch/pytorch/issues/4661, https://github.com/pytorch/pytorch/issues/7343,
  https://github.com/pytorch/pytorch/issues/78622
- no_sync: no `mark_step`/`torch_xla.sync()`: the pending graph grows on the host.
  https://github.com/pytorch/xla/issues/2502, https://github.com/pytorch/xla/issues/1155
- recurrent_state: a state carried across steps without `detach()`.
  https://github.com/pytorch/pytorch/issues/2198, https://github.com/fastai/fastbook/pull/469
- eval_concat: predictions concatenated on the device through a whole evaluation.
  https://github.com/huggingface/transformers/issues/7232, https://github.com/huggingface/transformers/pull/7767,
  https://github.com/hiyouga/LlamaFactory/issues/1595
- unbounded_cache: `lru_cache(maxsize=None)` holding tensors.
  https://github.com/MoonshotAI/Kimi-Audio/issues/117, https://github.com/deepchecks/deepchecks/pull/1341
- metric_never_reset: torchmetrics list states that are never reset.
  https://github.com/Lightning-AI/torchmetrics/issues/2492, https://github.com/Lightning-AI/torchmetrics/issues/1949,
  https://github.com/NRCan/geo-deep-learning/issues/582

Growth that is not a leak: compilation warm-up with shape buckets (https://github.com/pytorch/xla/issues/2713),
optimizer state at the first step (and for a group unfrozen later), evaluation spikes, gradient
accumulation (https://github.com/pytorch/xla/issues/3593), a bounded cache that fills and stops.
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import REPO, run_python

RUN = "import runpy, sys; sys.argv = ['leak_scenarios.py', sys.argv[1]]; " \
      "runpy.run_path('tests/leak_scenarios.py', run_name='__main__')"
SITE = r"created at leak_scenarios\.py:\d+ in \w+"

# scenario -> (the lines the explanation must have, each as phrases it contains;
#              whether Python created the leaked tensors in the loop, so a creation site is due)
LEAKS = {
    "running_total": ([["an autograd graph of", "saved tensors", "reachable from a float32[scalar] on xla:0",
                        "held by attribute 'running_val_loss' of RunningTotal"]], True),
    "kept_outputs": ([["with autograd graph", "keeping an autograd graph of", "held by list of",
                       "(attribute 'outputs' of KeptOutputs)"]], True),
    "hook_activations": ([["float32[256x512] on xla:0", "held by list of", "closure variable 'activations' of",
                           "(forward hook on Sequential.1)"]], True),
    "hook_every_step": ([["closure variable 'expected' of HookEveryStep.step.<locals>.check_input",
                          "(forward pre-hook on Sequential.0)"],
                         ["forward pre-hooks on Sequential.0 since the baseline", "never removed"]], True),
    "create_graph": ([["the .grad of 4 parameters carries an autograd graph", "backward(create_graph=True)",
                       "Sequential.0.weight"]], True),
    "no_sync": ([["no torch_xla.sync() since the baseline", "IR nodes traced since then",
                  "pending in Sequential."]], False),
    "recurrent_state": ([["reachable from a float32[256x512] on xla:0 tensor (TanhBackward0)",
                          "held by attribute 'state' of RecurrentState"]], True),
    "eval_concat": ([["grown by concatenation", "held by attribute 'predictions' of EvalConcat"]], True),
    "unbounded_cache": ([["held by cache of functools.lru_cache 'position_bias'"]], True),
    "metric_never_reset": ([["held by list of", "(attribute 'value' of CatMetric)"]], True),
}
NOT_LEAKS = ["compile_warmup", "optimizer_state", "eval_spikes", "grad_accumulation", "bounded_cache"]
MiB = 1 << 20


def scenario(name: str) -> dict:
    return json.loads(run_python(RUN, name, timeout=600).strip().splitlines()[-1])


def test_the_scenarios_file_lists_every_mechanism_tested_here():
    text = (REPO / "tests" / "leak_scenarios.py").read_text()
    for name in [*LEAKS, *NOT_LEAKS]:
        assert f'"{name}"' in text


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LEAKS))
def test_each_leak_is_caught_before_the_budget_and_its_holder_named(name):
    result = scenario(name)
    budget = result["budget"]
    assert result["action_step"] is not None, f"{name}: no action in {result['steps_run']} steps: {result['verdict']}"
    assert result["first_over_budget_step"] is None or result["first_over_budget_step"] > result["action_step"]
    assert result["peak_rss_before_action"] < budget, "memory passed the budget before the action"
    assert result["rss_at_action"] < budget

    lines, created_by_python = LEAKS[name]
    suspects = result["suspects"]
    for phrases in lines:
        assert any(all(p in s for p in phrases) for s in suspects), f"{name}: no line says {phrases}: {suspects}"
    if created_by_python:
        assert any(re.search(SITE, s) for s in suspects), f"{name}: no creation site in {suspects}"


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("name", NOT_LEAKS)
def test_growth_that_is_not_a_leak_gets_no_action(name):
    result = scenario(name)
    samples = result["rss_samples"]
    # one sample per step asked; a busy sidecar reads only the newest step it was asked for
    assert result["steps_run"] >= 600 and len(samples) >= 0.8 * result["steps_run"], (
        f"the whole run was watched; {name} stopped at step {result['steps_run']}: actions {result['actions']}, "
        f"over the budget from step {result['first_over_budget_step']}; acted on {result['action_verdict']}; "
        f"now {result['verdict']}")
    assert result["actions"] == {}, f"{name}: {result['actions']} on {result['action_verdict']}"
    assert max(samples) - min(samples) >= 24 * MiB, "the scenario must really make memory move"
    assert max(samples) < result["budget"]
