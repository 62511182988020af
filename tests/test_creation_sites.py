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
from watchdog.forensics.allocator_history import AllocatorHistory, live_blocks
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


# ---- CUDA: the allocator's own history, on only during the window ---------------------------------

TORCH_FILE = torch.nn.modules.linear.__file__  # a framework frame: skipped, as in the Python capture


def snapshot(*blocks: dict) -> dict:
    """A `torch.cuda.memory._snapshot()` in the documented shape (torch/cuda/memory.py): a stand-in
    for a GPU's, which cannot exist here."""
    return {"segments": [{"address": 1 << 40, "total_size": 20 << 20, "stream": 0, "segment_type": "large",
                          "allocated_size": 8 << 20, "active_size": 8 << 20, "blocks": list(blocks)}],
            "device_traces": [[]]}


def block(address: int, size: int, state: str = "active_allocated", frames=None, history: bool = False) -> dict:
    frames = [{"filename": f, "line": n, "name": fn} for f, n, fn in (frames or [])]
    shown = {"history": [{"addr": address, "real_size": size, "frames": frames}]} if history else {"frames": frames}
    return {"address": address, "size": size, "requested_size": size, "state": state, **shown}


LEAKY_STACK = [(TORCH_FILE, 125, "forward"), ("/job/train.py", 40, "keep"), ("/job/train.py", 90, "main")]
SNAPSHOT = snapshot(
    block(0x1000, 4 << 20, frames=LEAKY_STACK),
    block(0x2000, 4 << 20, frames=LEAKY_STACK, history=True),  # torch 2.0's shape
    block(0x3000, 2 << 20, frames=[("/job/model.py", 7, "grads")]),
    block(0x4000, 6 << 20, state="inactive", frames=LEAKY_STACK),  # cached, free: nobody's
    block(0x5000, 1 << 20, frames=[]),  # allocated before recording began
)


class AllocatorMemory:
    """Stands in for torch.cuda.memory on a GPU: the two private functions the history uses."""

    def __init__(self, recorded: dict):
        self.calls: list = []
        self.recorded = recorded

    def _record_memory_history(self, **kwargs):
        self.calls.append(("record", kwargs))

    def _snapshot(self):
        self.calls.append(("snapshot", {}))
        return self.recorded


class CudaTensor:
    """A CUDA tensor's two attributes the lookup reads (a storage is one allocator block)."""

    def __init__(self, address: int):
        self.device = torch.device("cuda", 0)
        self._address = address

    def untyped_storage(self):
        return type("Storage", (), {"data_ptr": lambda _: self._address})()


def test_live_blocks_are_the_allocated_ones_in_both_snapshot_shapes():
    blocks = live_blocks(SNAPSHOT)
    assert [(b.address, b.size) for b in blocks] == [(0x1000, 4 << 20), (0x2000, 4 << 20), (0x3000, 2 << 20),
                                                     (0x5000, 1 << 20)]
    assert blocks[0].frames == blocks[1].frames == tuple(LEAKY_STACK) and blocks[3].frames == ()
    assert live_blocks({}) == []


def test_on_cuda_the_window_records_the_allocators_stacks_and_names_the_blocks():
    memory = AllocatorMemory(SNAPSHOT)
    sites = CreationSites(steps=2, allocator=lambda: AllocatorHistory(memory, lambda: False, max_entries=5000))
    sites.arm()
    sites.between_steps()
    assert memory.calls == [("record", {"enabled": "state", "context": "state", "stacks": "python",
                                        "max_entries": 5000})]
    sites.between_steps()
    assert sites.between_steps() and modes_installed() == 0
    assert memory.calls[1:] == [("snapshot", {}), ("record", {"enabled": None})], "read once, then off"
    site, count = sites.commonest_site([CudaTensor(0x1000), CudaTensor(0x2000), CudaTensor(0x3000)])
    assert count == 2 and str(site) == "train.py:40 in keep (called from train.py:90 in main)"
    assert sites.site_of(CudaTensor(0x4000)) is None, "a cached, free block is no tensor's"
    assert sites.site_of(CudaTensor(0x5000)) is None, "made before the window: unknown"
    assert sites.site_of(CudaTensor(0x9000)) is None
    sites.reset()
    assert sites.site_of(CudaTensor(0x1000)) is None, "a rebuild forgets the old blocks"


def test_a_programs_own_recording_is_read_and_left_on():
    memory = AllocatorMemory(SNAPSHOT)
    sites = CreationSites(steps=1, allocator=lambda: AllocatorHistory(memory, lambda: True))
    sites.arm()
    sites.between_steps()
    assert sites.between_steps()
    assert memory.calls == [("snapshot", {})]
    assert sites.site_of(CudaTensor(0x3000)).frames[0].function == "grads"


def test_a_failing_snapshot_leaves_the_python_sites_and_turns_recording_off():
    class Broken(AllocatorMemory):
        def _snapshot(self):
            raise RuntimeError("snapshot failed")

    memory = Broken({})
    kept = []
    sites = CreationSites(steps=1, allocator=lambda: AllocatorHistory(memory, lambda: False))
    sites.arm()
    sites.between_steps()
    make_leak(kept)
    assert sites.between_steps()
    assert memory.calls[-1] == ("record", {"enabled": None})
    assert str(sites.site_of(kept[0])).startswith(LEAK_LINE)


def test_without_cuda_in_use_the_allocator_is_never_asked():
    assert not torch.cuda.is_initialized()
    assert AllocatorHistory.of_this_process() is None, "asking would create a CUDA context"
    sites = CreationSites(steps=1)
    sites.arm()
    sites.between_steps()
    assert sites.between_steps() and not torch.cuda.is_initialized()


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
