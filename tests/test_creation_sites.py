"""The creation-site capture: on for a bounded number of steps once armed, then gone.

While off nothing is installed (the torch function mode stack is empty), so tensor operations
pay nothing; `python -m watchdog.bench.capture_cost` prints the cost while on. On XLA it adds no
compilation and no transfer: the same loop with and without it has identical torch_xla counters.
"""

import json

import pytest
import torch
from conftest import run_python

from watchdog.forensics import census as forensics
from watchdog.forensics.creation_sites import CreationSites


def modes_installed() -> int:
    return torch._C._len_torch_function_stack()


def make_leak(kept: list) -> None:
    kept.append(torch.ones(16) * 3)  # the line the capture must name


LEAK_LINE = f"test_creation_sites.py:{make_leak.__code__.co_firstlineno + 1} in make_leak"


def test_it_captures_for_the_asked_steps_then_removes_itself():
    sites = CreationSites(steps=3)
    assert not sites.between_steps() and modes_installed() == 0  # idle: nothing, ever
    assert sites.arm() and not sites.arm()  # once
    ended = [sites.between_steps() for _ in range(6)]
    assert ended == [False, False, False, True, False, False]  # starts, 3 steps, ends once
    assert sites.state == "done" and modes_installed() == 0
    assert not sites.arm(), "one capture per suspected leak, until reset()"
    sites.reset()
    assert sites.arm()


def test_survivors_are_named_by_the_line_that_made_them():
    kept, temporary = [], []
    before = torch.zeros(16)
    sites = CreationSites(steps=2, depth=2)
    sites.arm()
    sites.between_steps()
    for _ in range(2):
        make_leak(kept)
        temporary.append(torch.zeros(4) + 1)
        before.add_(1)  # in place: not a new tensor, and created before the capture
        sites.between_steps()
    after = torch.ones(16) * 3
    [site_a, site_b] = {str(sites.site_of(t)) for t in kept} | {str(sites.site_of(t)) for t in temporary}
    assert any(s.startswith(f"{LEAK_LINE} (called from test_creation_sites.py:") for s in (site_a, site_b)), (
        site_a, site_b)
    assert sites.site_of(before) is None and sites.site_of(after) is None
    site, count = sites.commonest_site(kept)
    assert count == 2 and site.frames[0].function == "make_leak"


def test_notes_go_with_the_tensors_that_die_and_are_bounded():
    sites = CreationSites(steps=1, max_records=50)
    sites.arm()
    sites.between_steps()
    for _ in range(200):
        torch.ones(4) * 2  # dies at once
    assert len(sites._records) <= 2
    kept = [torch.ones(1) + i for i in range(100)]
    sites.between_steps()
    assert 48 <= len(sites._records) <= 50 and sites.dropped >= 50  # never more than asked for
    assert sum(sites.site_of(t) is not None for t in kept) >= 48


def test_a_reinit_keeps_a_capture_that_was_asked_for():
    sites = CreationSites(steps=2)
    sites.arm()
    sites.reset()  # the trainer rebuilds its state right after the action that armed it
    assert sites.state == "armed"
    sites.between_steps()
    assert sites.capturing
    sites.close()
    assert sites.state == "idle" and modes_installed() == 0


class Trainer:
    def __init__(self):
        self.buffers = []


def test_the_census_reads_the_sites_into_the_line():
    trainer = Trainer()
    baseline = forensics.census()
    sites = CreationSites(steps=4)
    sites.arm()
    for _ in range(5):
        sites.between_steps()
        make_leak(trainer.buffers)
    [line] = forensics.explain_leak(baseline, sites=sites)
    assert line.startswith(f"+5 tensors float32[16] on cpu (+320 B), created at {LEAK_LINE}")
    assert line.endswith("held by list of 5 (attribute 'buffers' of Trainer)")


LOOP = r"""
import json, sys
import torch, torch_xla
import torch_xla.debug.metrics as met
from watchdog.forensics.creation_sites import CreationSites

capture = sys.argv[1] == "on"
device = torch_xla.device()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True)
x, y = torch.randn(16, 32).to(device), torch.randn(16, 1).to(device)
torch_xla.sync()
met.clear_all()

sites = CreationSites(steps=25)
if capture:
    sites.arm()
kept = []
for step in range(30):
    sites.between_steps()
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    kept.append(loss.detach())
    torch_xla.sync()
noted = sum(sites.site_of(t) is not None for t in kept)
final_loss = loss.item()  # the one deliberate transfer, in both runs

counters = {name: met.counter_value(name) for name in met.counter_names()
            if "Compile" in name or "Transfer" in name or "ToCpu" in name or "_to_cpu" in name}
metrics = {name: met.metric_data(name)[0] for name in met.metric_names()
           if "Compile" in name or "Transfer" in name}
print(json.dumps({"counters": counters, "metrics": metrics, "noted": noted, "loss": final_loss,
                  "state": sites.state}))
"""


@pytest.mark.slow
def test_the_capture_adds_no_compilation_and_no_transfer_on_xla():
    bare, captured = (json.loads(run_python(LOOP, mode).strip().splitlines()[-1]) for mode in ("off", "on"))
    assert captured["state"] == "done" and captured["noted"] == 25, "the capture must really have noted tensors"
    assert bare["noted"] == 0
    assert bare["counters"].get("UncachedCompile", 0) > 0, "the probe must see compilations at all"
    assert "TransferFromDeviceTime" in bare["metrics"], "the probe must see the deliberate transfer"
    assert captured["counters"] == bare["counters"]
    assert captured["metrics"] == bare["metrics"]
    assert captured["loss"] == bare["loss"]
