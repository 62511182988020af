"""Leaks people write, and growth that is not a leak, as real torch_xla loops watched by the Watchdog.

    python tests/leak_scenarios.py NAME      ->  one JSON line on stdout

Each scenario is a small training loop on torch_xla (PJRT CPU) with the real `Watchdog` reading
this process's resident memory against a `--memory-limit` style budget: the resident memory when
the loop starts plus the scenario's headroom. A leak is sized to pass the budget about 600 steps
in. The loop runs until the watchdog asks for a checkpoint and a creation-site capture (armed at
the first WARN or action) has run, or until the step limit, and reports:

- `action_step`, `rss_at_action`, `peak_rss_before_action`, `budget`, `first_over_budget_step`:
  was it caught before the budget?
- `suspects`: the Watchdog's census at the end of the capture (`wd.suspects`): what holds it, where created;
- `actions`: every action the watchdog took (a non-leak must have none).

The public reports each scenario reproduces are cited in tests/test_leak_mechanisms.py.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import sys

import psutil
import torch
import torch_xla

from watchdog import Watchdog, WatchdogConfig
from watchdog.core.policy import PolicyConfig
from watchdog.runtime.compile_watch import CompileFigures
from watchdog.readers.host_memory import job_memory

MiB = 1 << 20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
WIDTH, BATCH = 512, 256  # one activation: 512 KiB; a step of this MLP saves about 1.5 MiB for backward


def mlp(device, width: int = WIDTH) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)).to(device)


class Loop:
    """A plain training loop; scenarios add their one mistake (or their harmless growth)."""

    headroom = 600 * MiB  # budget above the resident memory at the start
    steps = 800
    syncs = True

    def __init__(self, device):
        self.device = device
        torch.manual_seed(0)
        self.model = mlp(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.inputs = torch.randn(BATCH, WIDTH).to(device)

    def batch(self, step: int) -> torch.Tensor:
        return self.inputs * (1 + step % 7)  # the same graph every step: no recompilation

    def train_step(self, step: int) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(self.batch(step)).square().mean()
        loss.backward()
        self.optimizer.step()
        return loss

    def step(self, step: int) -> None:
        self.train_step(step)


# ---- leaks ------------------------------------------------------------------------------------

class RunningTotal(Loop):
    """`val_total += loss` with autograd on: every step's graph and saved activations stay."""

    def __init__(self, device):
        super().__init__(device)
        self.running_val_loss = torch.zeros((), device=device)

    def step(self, step):
        self.train_step(step)
        val_loss = self.model(self.batch(step + 1)).square().mean()  # forgot torch.no_grad()
        self.running_val_loss += val_loss


class KeptOutputs(Loop):
    """Outputs kept for an epoch-end metric with their graph, never backpropagated."""

    def __init__(self, device):
        super().__init__(device)
        self.outputs = []

    def step(self, step):
        self.train_step(step)
        self.outputs.append(self.model(self.batch(step + 1)))  # not .detach()


class HookActivations(Loop):
    """A forward hook that stores activations for inspection, and a list nobody clears (512 KiB a
    step: 600 MiB of headroom lasted to step 1,064 in a CI run, past the run's 800 steps, where the
    rest of the process grew little)."""

    headroom = 350 * MiB

    def __init__(self, device):
        super().__init__(device)
        activations = []

        def save_activation(module, inputs, output):
            activations.append(output.detach())

        self.model[1].register_forward_hook(save_activation)


class HookEveryStep(Loop):
    """A hook registered inside the loop and never removed: each one keeps what it closed over (512 KiB
    a step, counted once: 600 MiB of headroom would last past the run's 800 steps)."""

    headroom = 350 * MiB

    def step(self, step):
        expected = torch.full((BATCH, WIDTH), 1.0 + step, device=self.device)  # kept for the check

        def check_input(module, inputs):
            assert inputs[0].shape == expected.shape  # metadata only: the XLA graph stays the same

        self.model[0].register_forward_pre_hook(check_input)
        self.train_step(step)


class CreateGraphGrads(Loop):
    """A gradient penalty through backward(create_graph=True), zeroing .grad in place (old style)
    instead of setting it to None: every .grad stays the sum of all steps' graphs."""

    def train_step(self, step):
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.data.zero_()
        loss = self.model(self.batch(step)).square().mean()
        loss.backward(create_graph=True)
        self.optimizer.step()
        return loss


class NoSync(Loop):
    """torch_xla.sync() forgotten: the loop only traces, and the pending graph, with every batch it
    reads, grows on the host.

    Resident memory grows 0.6 to 1.0 MiB a step from run to run (the batch and its IR nodes, and
    what the allocator keeps). With the usual 600 MiB of headroom the slowest growth reaches the
    budget near step 1,020, after the run's 800 steps: one CI run ended with the OOM still 228
    steps off, further than the action horizon, so it got a warning and no action. With 450 MiB
    the budget falls near step 765 at 0.6 MiB a step; two runs here at 0.7 and 1.0 were acted on
    at steps 404 and 250, 139 and 149 MiB below it."""

    headroom = 450 * MiB
    syncs = False

    def batch(self, step):
        return torch.randn(BATCH, WIDTH).to(self.device)  # a fresh batch from the host, as a loader gives


class RecurrentState(Loop):
    """A streaming state carried across steps with autograd on and never detached."""

    def __init__(self, device):
        super().__init__(device)
        self.state = torch.zeros(BATCH, WIDTH, device=device)

    def step(self, step):
        self.train_step(step)
        features = self.model[1](self.model[0](self.batch(step)))
        self.state = torch.tanh(features + 0.5 * self.state)  # not self.state.detach()


class EvalConcat(Loop):
    """Predictions concatenated on the device every step, as a trainer's eval loop does without
    accumulation steps: one tensor that keeps growing (and a new shape to compile each step)."""

    def __init__(self, device):
        super().__init__(device)
        self.predictions = None

    def step(self, step):
        self.train_step(step)
        torch_xla.sync()
        with torch.no_grad():
            logits = self.model[1](self.model[0](self.batch(step)))
        torch_xla.sync()  # the eval step ends as a loader's would: the concatenation is a graph of its own
        self.predictions = logits if self.predictions is None else torch.cat([self.predictions, logits])


@functools.lru_cache(maxsize=None)
def position_bias(offset: int, device: str) -> torch.Tensor:
    return torch.full((BATCH, WIDTH), offset / 1000, device=device)


class UnboundedCache(Loop):
    """An lru_cache(maxsize=None) of device tensors keyed by a value that keeps changing.

    Each new key holds 512 KiB, and resident memory grows by about that much a step. With the usual
    600 MiB of headroom the budget fell near step 1,170, after the run's 800 steps: a fresh-clone
    run grew at 514 KiB a step and ended with the OOM 224 steps off, warned and never acted on.
    With 350 MiB the budget falls near step 700."""

    headroom = 350 * MiB

    def step(self, step):
        self.train_step(step)
        self.bias = position_bias(step, str(self.device))  # a streaming offset: a new key every step


class MetricNeverReset(Loop):
    """A torchmetrics CatMetric updated every step and never reset: its list state grows.

    Each update keeps a float32[256x512] (512 KiB), and memory grows by about that much a step. With
    the usual 600 MiB of headroom the budget fell near step 1,060, after the run's 800 steps: a
    fresh-clone CI run grew at 515 KiB a step and ended with the OOM 283 steps off, warned and never
    acted on. With 350 MiB the budget falls near step 700, as for `UnboundedCache`."""

    headroom = 350 * MiB

    def __init__(self, device):
        super().__init__(device)
        from torchmetrics.aggregation import CatMetric

        self.metric = CatMetric(nan_strategy="disable").to(device)

    def step(self, step):
        loss = self.train_step(step)
        with torch.no_grad():
            self.metric.update(self.model[1](self.model[0](self.batch(step))))
        del loss


# ---- growth that is not a leak ----------------------------------------------------------------

class CompileWarmup(Loop):
    """Sequence lengths from a few buckets, each first seen later in the run: a new graph to compile
    and a position table to build for each, then nothing new."""

    steps = 600
    buckets = (WIDTH, 2 * WIDTH, 3 * WIDTH, 4 * WIDTH)

    def __init__(self, device):
        super().__init__(device)
        self.wide = torch.randn(BATCH, 4 * WIDTH).to(device)
        self.tables = {}  # per bucket, built the first time it is seen: 8 to 32 MiB

    def batch(self, step):
        seen = min(len(self.buckets), 1 + step // 60)  # bucket k first appears at step 60 k
        width = self.buckets[step % seen]
        if width not in self.tables:
            self.tables[width] = torch.randn(4 * width, 1024, device=self.device)
        return self.wide[:, :width].reshape(-1, WIDTH)[:BATCH] + self.tables[width][0, :WIDTH]


class OptimizerStateAtFirstStep(Loop):
    """Adam allocates its state at the first step, and again for a second group unfrozen later.

    glibc's allocator is held to its default mmap threshold here (`mallopt(M_MMAP_THRESHOLD)`, which
    also stops its dynamic adjustment, mallopt(3)): with the adjustment, the first 16 MiB buffer
    freed raises the threshold, every later one comes from the heap, and the heap grew by another
    300 MiB over the next 100 steps before it levelled off (through the suite's harness: 516 to 830
    MiB, peaks at 85% of the budget; held to the default, 499 to about 590 MiB, peak 643 of 1,060
    MiB). That growth stops too, but it is the allocator's,
    not the optimizer's, and how far it goes depends on the process's history and the machine's
    load: a stall of the sidecar during it was acted on in CI."""

    steps = 600

    def __init__(self, device):
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # glibc's default, fixed
        super().__init__(device)
        self.head = torch.nn.Linear(WIDTH, 16 * WIDTH).to(device)  # 16 MiB, frozen until step 200
        self.head.requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3, capturable=True)

    def train_step(self, step):
        if step == 200:
            self.head.requires_grad_(True)
            self.optimizer.add_param_group({"params": list(self.head.parameters())})
        self.optimizer.zero_grad(set_to_none=True)
        # The head sees a few rows only: its state (48 MiB from step 200) is the growth under test,
        # and a full batch through a 512x8192 layer was three quarters of the suite's slowest run.
        loss = self.model(self.batch(step)).square().mean() + self.head(self.batch(step)[:8]).square().mean()
        loss.backward()
        self.optimizer.step()
        return loss


class EvalSpikes(Loop):
    """An evaluation of 5 steps every 50: its outputs pile up until it ends (+160 MiB), then go."""

    steps = 600

    def __init__(self, device):
        super().__init__(device)
        self.eval_inputs = torch.randn(64 * BATCH, WIDTH).to(device)  # 32 MiB a batch of outputs
        self.eval_outputs = []

    def step(self, step):
        if step % 50 < 45:
            self.train_step(step)
            return
        with torch.no_grad():
            self.eval_outputs.append(torch.sigmoid(self.eval_inputs * (step % 50)))
        if step % 50 == 49:
            self.score = torch.stack([o.mean() for o in self.eval_outputs]).mean()
            self.eval_outputs.clear()


class GradientAccumulation(Loop):
    """Eight micro-batches per optimizer step: the gradients (32 MiB) live from the first
    micro-batch to the optimizer step and are freed by zero_grad(set_to_none=True), a sawtooth."""

    steps = 640

    def __init__(self, device):
        super().__init__(device)
        self.embedding = torch.nn.Parameter(torch.zeros(64 * BATCH, WIDTH, device=device))  # 32 MiB
        self.optimizer.add_param_group({"params": [self.embedding]})

    def step(self, step):
        loss = (self.model(self.batch(step)).square().mean() + self.embedding.square().mean()) / 8
        loss.backward()
        if step % 8 == 7:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


class BoundedCache(Loop):
    """An lru_cache(maxsize=64) of per-offset masks, offsets seen two steps each: it fills for 128
    steps, then every lookup hits."""

    steps = 600

    def step(self, step):
        self.train_step(step)
        self.mask = bounded_mask(step // 2 % 64, str(self.device))


@functools.lru_cache(maxsize=64)
def bounded_mask(offset: int, device: str) -> torch.Tensor:
    return torch.full((BATCH, WIDTH), offset / 1000, device=device)


LEAKS = {
    "running_total": RunningTotal, "kept_outputs": KeptOutputs, "hook_activations": HookActivations,
    "hook_every_step": HookEveryStep, "create_graph": CreateGraphGrads, "no_sync": NoSync,
    "recurrent_state": RecurrentState, "eval_concat": EvalConcat, "unbounded_cache": UnboundedCache,
    "metric_never_reset": MetricNeverReset,
}
NOT_LEAKS = {
    "compile_warmup": CompileWarmup, "optimizer_state": OptimizerStateAtFirstStep, "eval_spikes": EvalSpikes,
    "grad_accumulation": GradientAccumulation, "bounded_cache": BoundedCache,
}


def rss() -> int:
    """The job's memory, each page once, as the watchdog judges it (and the kernel counts it)."""
    return job_memory()


def run(name: str) -> dict:
    device = torch_xla.device()
    loop = {**LEAKS, **NOT_LEAKS}[name](device)
    torch_xla.sync()
    budget = rss() + loop.headroom
    policy = PolicyConfig(checkpoint_margin_steps=50, cooldown_steps=150)  # the trainer's defaults
    watchdog = Watchdog(WatchdogConfig(sample_every=1, source="rss", memory_limit_bytes=budget, policy=policy))
    watchdog.start()
    result = {"name": name, "budget": budget, "action_step": None, "first_suspect_step": None,
              "first_over_budget_step": None, "suspects": [], "rss_at_action": None,
              "action_verdict": None}
    peak_before_action = 0
    for step in range(loop.steps):
        loop.step(step)
        if loop.syncs:
            torch_xla.sync()
        action = watchdog.step(step)  # the bare loop: the Watchdog takes its censuses and capture itself
        now = rss()
        if result["action_step"] is None:
            peak_before_action = max(peak_before_action, now)
        if now > budget and result["first_over_budget_step"] is None:
            result["first_over_budget_step"] = step
        named = watchdog.suspects
        if named is not None and named.creation_sites and not result["suspects"]:
            result["suspects"], result["suspects_step"] = named.lines, named.step
        if watchdog.telemetry.actions_total and result["first_suspect_step"] is None:
            result["first_suspect_step"] = step
        if action is not None and action.needs_checkpoint and result["action_step"] is None:
            result["action_step"], result["rss_at_action"] = step, now
            decided = watchdog.last_action.verdict
            result["action_verdict"] = decided.explanation if decided is not None else None
        if result["action_step"] is not None and result["suspects"]:
            break
        if now > budget + 256 * MiB:
            break  # missed: far past the budget, stop before the machine suffers
    watchdog.drain()
    result["steps_run"] = step + 1
    result["rss_start"], result["rss_end"] = budget - loop.headroom, rss()
    result["rss_samples"] = [s.bytes_used for s in watchdog.history]
    result["compilations"] = watchdog.telemetry.part(CompileFigures).compilations
    result["peak_rss_before_action"] = peak_before_action
    result["actions"] = {a.value: n for a, n in watchdog.telemetry.actions_snapshot().items() if n}
    result["verdict"] = watchdog.verdict.explanation if watchdog.verdict else None
    watchdog.stop()
    return result


if __name__ == "__main__":
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    print(json.dumps(run(sys.argv[1])), flush=True)
    sys.stdout.flush()
    os._exit(0)  # a never-synced pending graph would be compiled at exit: nobody needs it
