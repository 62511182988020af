"""A user's own data-parallel loop (DDP over gloo on the CPU) with the README's lines, for torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 2 \\
        ddp_bare.py OUT [--leak-rank R] [--steps N]

The rank named by `--leak-rank` keeps a tensor every step, as a rank-0-only logging helper does
(a table of samples): only its memory grows. Each rank resumes from OUT/ckpt.pt when there is one,
and appends what it saw to OUT/rank<R>.jsonl: the actions `wd.step()` handed it (with the step and
the restart attempt), then how far it got and its peak resident memory against its budget.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from watchdog.readers.host_memory import job_memory
from watchdog import Watchdog, WatchdogConfig
from watchdog.logs import configure_logging

LEAK_BYTES = 4 << 20
BUDGET = 800 << 20  # 200 steps of the leak above the resident memory at the start

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--leak-rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=300)
args = parser.parse_args()

configure_logging("json")
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
checkpoint = args.out / "ckpt.pt"
start = 0
if checkpoint.exists():
    state = torch.load(checkpoint, weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    start = state["step"]
samples = []  # rank-0-only logging: every step's output kept for a table (the leak)
record = open(args.out / f"rank{rank}.jsonl", "a")


def note(**fields) -> None:
    record.write(json.dumps({"attempt": attempt, **fields}) + "\n")
    record.flush()


def save() -> str:
    if rank == 0:
        temporary = checkpoint.with_suffix(".tmp")
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1},
                   temporary)
        os.replace(temporary, checkpoint)
    dist.barrier()  # every rank waits for the checkpoint: the collective that hung when one rank acted alone
    return str(checkpoint)


limit = job_memory() + BUDGET
peak = 0
config = WatchdogConfig(sample_every=2, memory_limit_bytes=limit, trace_file=args.out / f"trace-{rank}.csv",
                        agreement_timeout_seconds=120)
wd = Watchdog(config)
wd.ends_at(args.steps)
with wd:
    for step in range(start, args.steps):
        x = torch.randn(8, 16)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()  # DDP's gradient all_reduce
        optimizer.step()
        if rank == args.leak_rank:
            samples.append(torch.ones(LEAK_BYTES // 4))
        peak = max(peak, job_memory())
        action = wd.step(step)
        if action is not None:
            note(step=step, action=action.value, origin=wd.last_action.origin)
        if action is not None and not wd.carry_out(action, save=save):
            note(exit=42, step=step, peak=peak, limit=limit)
            sys.exit(42)  # torchrun --max-restarts starts the group again
note(finished=args.steps, start=start, peak=peak, limit=limit)
dist.destroy_process_group()
