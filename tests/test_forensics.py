"""Forensics on real tensors: what grew is found, its holder named, parameters ignored, and the
mechanisms people write (graphs kept alive, hooks, caches, .grad graphs) told apart, on CPU."""

import functools
import gc
import types
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from watchdog.forensics import census as forensics
from watchdog.forensics.autograd_graphs import GraphWalker, buffer_key
from watchdog.forensics.census import Census, TensorGroup, growth
from watchdog.forensics.holders import Namer


class TrainerState:
    def __init__(self):
        self.kept_losses = []


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


def fresh_module(name: str, source: str) -> types.ModuleType:
    """A module run from `source` now, as a training script is: its globals are made by this test, so
    a census can climb to them (tests/conftest.py freezes what collection imported, and a frozen
    container is invisible to `gc.get_referrers`)."""
    module = types.ModuleType(name)
    exec(source, module.__dict__)
    return module


def test_a_module_level_leak_is_named_as_a_global():
    script = fresh_module("train_script", "LEAKED_GLOBAL = []")
    baseline = forensics.census()
    for _ in range(30):
        script.LEAKED_GLOBAL.append(torch.zeros(3, 5, dtype=torch.float16))
    lines = forensics.explain_leak(baseline)
    assert "float16[3x5]" in lines[0]
    assert "global 'LEAKED_GLOBAL' in module train_script" in lines[0]


def test_parameters_are_not_counted():
    params = [torch.nn.Parameter(torch.zeros(7, 7)) for _ in range(10)]
    groups = forensics.census().count
    assert TensorGroup("cpu", "float32", (7, 7), False) not in groups
    assert len(params) == 10


# ---- the mechanisms people write, on CPU (tests/test_leak_mechanisms.py runs them on XLA) -------


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))


class Validation:
    def __init__(self):
        self.running_loss = 0


def test_a_running_total_is_named_with_the_graph_and_saved_bytes_it_keeps():
    model, x, state = mlp(), torch.randn(64, 32), Validation()
    baseline = forensics.census()
    for _ in range(20):
        state.running_loss += model(x).square().mean()  # autograd on, never backpropagated
    [line] = [line for line in forensics.explain_leak(baseline) if "running_loss" in line]
    assert "held by attribute 'running_loss' of Validation" in line
    assert "reachable from a float32[scalar] on cpu tensor (AddBackward0)" in line
    # each step saves the 64x256 ReLU output (64 KiB) and the 64x256 Linear input of the head;
    # the 64x32 input is the same tensor every step: one buffer
    saved = GraphWalker(excluded={buffer_key(p)[0] for p in model.parameters()}).walk(state.running_loss.grad_fn)
    assert saved.saved_bytes >= 20 * 64 * 256 * 4
    assert f"{saved.nodes:,} nodes" in line


def test_the_graph_walk_never_runs_a_checkpoint_recompute():
    model, x = mlp(), torch.randn(8, 32, requires_grad=True)
    calls = []

    def block(inputs):
        calls.append(1)
        return model(inputs)

    out = checkpoint(block, x, use_reentrant=False).sum()
    size = GraphWalker().walk(out.grad_fn)
    assert len(calls) == 1, "reading the saved tensors must not re-run the checkpointed forward"
    assert size.packed > 0 and size.nodes > 0
    out.backward()  # and the graph still works
    assert len(calls) == 2 and x.grad is not None


def test_parameters_are_left_out_of_the_saved_bytes():
    model = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB of weight, saved for the input's gradient
    out = model(torch.randn(2, 1024, requires_grad=True))
    with_weight = GraphWalker().walk(out.grad_fn).saved_bytes
    without = GraphWalker(excluded={buffer_key(p)[0] for p in model.parameters()}).walk(out.grad_fn).saved_bytes
    assert with_weight >= 4 << 20 and without < 64 << 10


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_grads_with_a_graph_from_create_graph_are_named_per_parameter():
    model, x = mlp(), torch.randn(256, 32)  # each step keeps 256 KiB of ReLU output and more
    loss = model(x).square().mean()
    loss.backward(create_graph=True)  # the first step: .grad now has a graph
    baseline = forensics.census()
    for _ in range(10):
        for p in model.parameters():
            p.grad.data.zero_()  # old-style zeroing: .grad keeps its graph and grows it
        model(x).square().mean().backward(create_graph=True)
    [line] = [line for line in forensics.explain_leak(baseline) if ".grad" in line]
    assert line.startswith("the .grad of 4 parameters carries an autograd graph")
    assert "Sequential.0.weight" in line or "Sequential.0.bias" in line
    for p in model.parameters():
        p.grad = None  # break the cycle the warning talks about


def test_a_hook_registered_every_step_is_counted_and_its_closure_named():
    model, x = mlp(), torch.randn(4, 32)
    model(x)
    baseline = forensics.census()
    for step in range(12):
        expected = torch.full((256, 64), float(step))

        def check(module, inputs, output, expected=expected):
            assert output.shape[0] == 4 and expected.numel()

        model[0].register_forward_hook(check)
        model(x)
    lines = forensics.explain_leak(baseline)
    assert any(line.startswith("+12 forward hooks on Sequential.0 since the baseline (12 now)") for line in lines)
    [kept] = [line for line in lines if "float32[256x64]" in line]
    assert "default argument 'expected' of " in kept and "(forward hook on Sequential.0)" in kept


def test_activations_stored_by_a_hook_are_named_through_its_closure():
    model, x = mlp(), torch.randn(64, 32)
    stored = []

    def store(module, inputs, output):
        stored.append(output.detach())

    model[1].register_forward_hook(store)
    baseline = forensics.census()
    for _ in range(10):
        model(x)
    [line] = [line for line in forensics.explain_leak(baseline) if "float32[64x256]" in line]
    assert "held by list of 10 (closure variable 'stored' of " in line
    assert "(forward hook on Sequential.1)" in line


POSITION_TABLE = """
import functools, torch

@functools.lru_cache(maxsize=None)
def position_table(offset: int) -> torch.Tensor:
    return torch.full((128, 128), float(offset))
"""


def test_an_unbounded_cache_is_named():
    script = fresh_module("train_script", POSITION_TABLE)
    baseline = forensics.census()
    tables = [script.position_table(step) for step in range(15)]
    del tables
    [line] = forensics.explain_leak(baseline)
    assert line.startswith("+15 tensors float32[128x128] on cpu")
    assert "held by cache of functools.lru_cache 'position_table' (15 entries)" in line
    script.position_table.cache_clear()


class Evaluator:
    def __init__(self):
        self.predictions = torch.zeros(0, 256)


def test_a_tensor_grown_by_concatenation_is_named():
    evaluator = Evaluator()
    baseline = forensics.census()
    for _ in range(40):
        evaluator.predictions = torch.cat([evaluator.predictions, torch.randn(64, 256)])
    lines = forensics.explain_leak(baseline)
    assert any("1 tensor float32[2560x256] on cpu of 2.5 MiB" in line and "grown by concatenation" in line
               and "held by attribute 'predictions' of Evaluator" in line for line in lines), lines


def test_a_local_variable_is_named_and_the_frame_keeps_nothing_afterwards():
    def train_loop():
        total = torch.zeros(())
        for _ in range(3):
            total = total + torch.ones((), requires_grad=True) * 2
        named = Namer().holder_of(total)
        probe = weakref.ref(total)
        total = None  # the frame's locals snapshot must not keep the old value alive
        gc.collect()
        return named, probe()

    named, survivor = train_loop()
    assert named.startswith("local variable 'total' of train_loop (test_forensics.py:")
    assert survivor is None


def test_a_partial_bound_argument_is_named():
    kept = torch.zeros(3)
    bound = functools.partial(torch.add, kept)
    assert Namer().holder_of(kept).startswith("argument 0 bound by functools.partial(")
    del bound


@pytest.mark.parametrize("count", [1, 30])
def test_holders_report_the_container_not_the_forensics_own_lists(count):
    tensors = [torch.zeros(2) for _ in range(count)]
    named = Namer().holders_of(tensors)
    assert not any("tuple of" in n or n.startswith("list of") and "(" not in n for n in named), named


class _Undefined(torch.Tensor):
    """Stands in for what Python cannot make: a tensor object with no tensor behind it (one turned
    up among gc's objects in a CI run of two gloo trainers), on which autograd attributes raise."""

    @property
    def grad_fn(self):
        raise RuntimeError("cannot call get_autograd_meta() on undefined tensor")


def test_a_tensor_object_with_no_tensor_behind_it_is_skipped_not_raised():
    baseline = forensics.census()
    undefined = _Undefined()
    kept = [torch.ones(256, 1024) for _ in range(40)]
    lines = forensics.explain_leak(baseline)
    assert any("+40 tensors float32[256x1024]" in line for line in lines), lines
    forensics.census()  # the census of a baseline reads the same objects
    del undefined, kept


def test_a_leak_of_python_objects_names_their_type_their_size_and_their_holder():
    """Issue 54: a leak of small frozen dataclasses in a dict (no tensors, no buffers; pytorch/torchtitan#3790
    kept `DTensorSpec`s, 0.5 MB a step) was acted on, and the census said "no growing group of live
    tensors or Python buffers found". The types whose instances grew are named, with the container
    that grows with them and its owner."""
    script = fresh_module("spec_script", """
from dataclasses import dataclass

@dataclass(frozen=True)
class DTensorSpec:
    shape: tuple
    placements: tuple

class Optimizer:
    def __init__(self):
        self.specs = {}

optimizer = Optimizer()
""")
    baseline = forensics.census()
    for step in range(20_000):
        script.optimizer.specs[step] = script.DTensorSpec((step, 4), ("shard", step))
    [line] = forensics.explain_leak(baseline)
    assert " entries of DTensorSpec in dict 'specs' of Optimizer (20,000 now), about +" in line, line
    assert "Python objects among them: about +" in line and " spec_script.DTensorSpec" in line, line


def entries_added(line: str) -> int:
    """N in "about +N entries of ...": estimated from the types counted on every 17th object."""
    return int(line.removeprefix("about +").split(" ")[0].replace(",", ""))


SHARDING_CACHE = """
from dataclasses import dataclass
import torch

@dataclass(frozen=True)
class Shard:
    dim: int

@dataclass(frozen=True)
class TensorMeta:
    shape: torch.Size
    stride: tuple
    dtype: torch.dtype

class DeviceMesh:
    pass

@dataclass(frozen=True)
class DTensorSpec:
    mesh: DeviceMesh
    placements: tuple
    tensor_meta: TensorMeta

class FusedAdamW:
    def __init__(self, shapes):
        self.mesh, self.shapes, self._sharding_cache = DeviceMesh(), shapes, {}

    def step(self, scalar):  # pytorch/torchtitan#3790: a spec pair per parameter, keyed by the step's scalar
        for i, shape in enumerate(self.shapes):
            meta = TensorMeta(torch.Size(shape), (shape[1], 1), torch.float32)
            self._sharding_cache[(scalar, i)] = (DTensorSpec(self.mesh, (Shard(0), Shard(i % 2)), meta),
                                                 DTensorSpec(self.mesh, (Shard(1),), meta))

optimizer = FusedAdamW([(64, 64 + i) for i in range(300)])
"""


def test_records_of_many_small_types_are_named_as_one_record_in_the_container_that_grows():
    """Issue 61, item 5: a fused optimizer's sharding cache (a dict keyed by each step's scalar, whose
    values are tuples of frozen dataclasses holding tuples) was named by its commonest type's innermost
    holder: "+472,016 Python objects tuple; held by attribute 'placements' of DTensorSpec". The dict
    that grows, and the optimizer's attribute that holds it, are what a person changes."""
    script = fresh_module("train", SHARDING_CACHE)
    baseline = forensics.census()
    for step in range(100):
        script.optimizer.step(step * 1e-3)
    [line] = forensics.explain_leak(baseline)
    assert " entries of (DTensorSpec, DTensorSpec) in dict '_sharding_cache' of FusedAdamW (30,000 now), about +" in line
    assert 27_000 <= entries_added(line) <= 30_000, line
    for kind in ("tuple", "train.DTensorSpec", "train.Shard"):
        assert f" {kind}" in line.split("Python objects among them: ")[1], line
    assert "placements" not in line


SHAPES = """
from collections import deque, namedtuple
from dataclasses import dataclass

Sample = namedtuple("Sample", "step loss tags")
RECENT = deque()  # a module's deque of namedtuples, never trimmed

@dataclass
class Event:
    step: int
    where: list

class Log:
    __slots__ = ("events", "name")

    def __init__(self):
        self.events, self.name = [], "log"

log = Log()
per_step = []
"""


@pytest.mark.parametrize("shape, named", [
    ("deque", " entries of Sample in deque 'RECENT' in module shapes (20,000 now)"),
    ("slots", " entries of Event in list 'events' of Log (20,000 now)"),
    ("per_step", " entries of list of 100 Event in list 'per_step' in module shapes (200 now)"),
    ("globals", " entries of Event in the globals of module shapes ("),
])
def test_records_are_named_by_their_container_whatever_its_shape(shape, named):
    """Shapes the sharding cache was not: namedtuples in a deque held by a module global, dataclasses
    in a list held through `__slots__`, a list of each step's lists, and a module's globals."""
    script = fresh_module("shapes", SHAPES)
    baseline = forensics.census()
    for step in range(20_000):
        if shape == "deque":
            script.RECENT.append(script.Sample(step, float(step), [step]))
        elif shape == "slots":
            script.log.events.append(script.Event(step, [step, "x"]))
        elif shape == "per_step":
            if step % 100 == 0:
                script.per_step.append([])
            script.per_step[-1].append(script.Event(step, [step]))
        else:
            setattr(script, f"event_{step}", script.Event(step, [step]))
    lines = forensics.explain_leak(baseline)
    assert len(lines) == 1 and named in lines[0], lines


class Chain:
    def __init__(self, before):
        self.before, self.payload = before, [0]


def test_objects_that_grow_in_no_container_are_named_by_type_and_holder():
    """A linked chain grows with no list or dict: the type and its newest ones' holder, as before."""
    baseline = forensics.census()
    head = None
    for _ in range(20_000):
        head = Chain(head)
    lines = forensics.explain_leak(baseline)
    assert any(" Python objects test_forensics.Chain (+" in line and "held by" in line for line in lines), lines
    del head


def test_objects_that_come_and_go_name_nothing():
    class Thing:
        pass

    baseline = forensics.census()
    churn = [Thing() for _ in range(50_000)]  # tracked by the collector, then gone
    assert any("Thing" in line for line in forensics.explain_leak(baseline)), "while they live, they are named"
    del churn
    assert forensics.explain_leak(baseline) == []
