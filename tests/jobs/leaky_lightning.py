"""A plain PyTorch Lightning `fit` on CPU that leaks and knows nothing of hbm-watchdog.

Lightning handles SIGTERM itself (2.x): its signal connector sets `trainer.received_sigterm`, and
the training loop raises `SIGTERMException` (a `SystemExit` with no code, so status 0) at the next
batch boundary, calling every callback's `on_exception` first. Exit status 0 would tell a
supervisor the job finished, so this script does what a preemptible Lightning job must: its
`on_exception` saves a checkpoint, and the `SIGTERMException` becomes exit 42 (at once, without
Python's shutdown: `gone`). Started again it resumes from that checkpoint
(`fit(ckpt_path=...)`).

A SIGTERM that comes once `fit` has returned (after the last step, while the job tears down)
is handled the same way: the job saves, says it was preempted and exits 42, so its supervisor
never sees a finished job killed by a signal; started again, it resumes at its last step and ends.

Lines on stdout: `started step=K pid=P`, `preempted step=K`, `finished step=N`.
"""

import argparse
import os
import signal
import sys
import time

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint", required=True, help="the checkpoint file to save to and resume from")
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--leak-mib", type=float, default=0.0)
parser.add_argument("--step-seconds", type=float, default=0.02)
args = parser.parse_args()


class LeakyModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)
        self.kept = []

    def training_step(self, batch, batch_idx):
        if args.leak_mib:
            self.kept.append(torch.ones(int(args.leak_mib * (1 << 20)) // 4))  # written, so resident: the leak
        time.sleep(args.step_seconds)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def save_and_say_preempted(trainer) -> None:
    trainer.save_checkpoint(args.checkpoint + ".tmp")
    os.replace(args.checkpoint + ".tmp", args.checkpoint)  # a torn checkpoint is never the one resumed
    print(f"preempted step={trainer.global_step}", flush=True)


class SaveOnPreemption(L.Callback):
    def on_exception(self, trainer, pl_module, exception):
        if isinstance(exception, SIGTERMException):
            save_and_say_preempted(trainer)


sigterm_seen = []
# Lightning composes its own SIGTERM handler with this one during `fit` and puts this one back after.
signal.signal(signal.SIGTERM, lambda signum, _frame: sigterm_seen.append(signum))


torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 32), torch.randn(256, 1))
trainer = L.Trainer(max_steps=args.steps, max_epochs=-1, accelerator="cpu", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, callbacks=[SaveOnPreemption()])
resume = args.checkpoint if os.path.exists(args.checkpoint) else None
start = torch.load(resume, weights_only=False)["global_step"] if resume else 0
print(f"started step={start} pid={os.getpid()}", flush=True)


def gone(status: int) -> None:
    """Exit at once: the checkpoint is on disk (or the job is done) and nothing is left to do.
    Python's own shutdown of this process, holding its leaked tensors, took 1.3 s and raised its
    resident memory by 120 MiB for a moment (measured here at 800 MiB held, in the 20 ms before it
    ended); a watchdog that signalled 170 MiB below the budget saw the job pass it after the signal.
    A SIGTERM during that shutdown meets the default handler again and kills the job."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


try:
    trainer.fit(LeakyModule(), DataLoader(data, batch_size=8), ckpt_path=resume)
except SIGTERMException:
    gone(42)
if sigterm_seen:  # after the last batch, or while fit tore down: saved at the last step all the same
    save_and_say_preempted(trainer)
    gone(42)
print(f"finished step={trainer.global_step}", flush=True)
gone(0)  # a SIGTERM in Python's shutdown would find the default handler back, and kill a finished job
