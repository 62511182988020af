"""A two-rank Lightning `fit` (`strategy="ddp"` on the CPU) with the README's callback lines.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 2 \\
        ddp_lightning.py OUT [--leak-rank R] [--steps N]
    hbm-watchdog supervise --max-restarts 2 -- python ddp_lightning.py OUT ...   (Lightning's own launcher)

The rank named by `--leak-rank` keeps every batch's output in a callback, as a rank-0-only table
of samples does: only its memory grows. Each rank appends what it saw to OUT/rank<R>.jsonl: the
step the callback acted at (with the restart attempt), then how far `fit` got and its peak
resident memory against its budget.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from watchdog.readers.host_memory import job_memory
from watchdog import WatchdogConfig
from watchdog.integrations.lightning import HbmWatchdogCallback
from watchdog.logs import configure_logging

LEAK_BYTES = 4 << 20
BUDGET = 1 << 30  # Lightning's DDP set-up takes about 190 MB of it before the first step

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--leak-rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=300)
args = parser.parse_args()
configure_logging("json")
# One node: the local rank is the rank, under torchrun and under Lightning's own launcher (whose main
# process is rank 0 with no rank in its environment). The attempt: torchrun's count, or supervise's.
rank = int(os.environ.get("LOCAL_RANK", "0"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("HBMWATCH_RESTART_COUNT") or "0")


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SampleTable(L.Callback):
    """Rank 0's table of samples: every batch's output kept (the leak), and the peak memory seen."""

    def __init__(self):
        self.rows, self.peak = [], 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == args.leak_rank:
            self.rows.append(torch.ones(LEAK_BYTES // 4))
        self.peak = max(self.peak, job_memory())


torch.manual_seed(0)
data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
limit = job_memory() + BUDGET
config = WatchdogConfig(sample_every=2, memory_limit_bytes=limit, trace_file=args.out / f"trace-{rank}.csv",
                        agreement_timeout_seconds=120)
callback = HbmWatchdogCallback(config, checkpoint_dir=args.out / "ckpt")
table = SampleTable()
trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[table, callback], default_root_dir=args.out)
resume = callback.resume_path()
trainer.fit(Model(), DataLoader(data, batch_size=8), ckpt_path=resume)
with open(args.out / f"rank{rank}.jsonl", "a") as record:
    if callback.action_step is not None:
        record.write(json.dumps({"attempt": attempt, "step": callback.action_step,
                                 "action": callback.watchdog.last_action.action.value,
                                 "origin": callback.watchdog.last_action.origin}) + "\n")
    record.write(json.dumps({"attempt": attempt, "exit": callback.exit_code, "step": trainer.global_step,
                             "start": 0 if resume is None else "resumed", "peak": table.peak, "limit": limit}) + "\n")
sys.exit(callback.exit_code)  # 42 when the watchdog asked for a restart: torchrun starts the group again
