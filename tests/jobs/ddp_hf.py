"""A two-rank Hugging Face `Trainer` (DDP over gloo on the CPU) with the README's callback lines.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 2 \\
        ddp_hf.py OUT [--leak-rank R] [--steps N]

A tiny GPT-2 built from a config (nothing is downloaded). On the rank named by `--leak-rank` a
forward hook keeps every batch's logits, as a rank-0-only metric kept "for later" does: only its
memory grows. Each rank appends what it saw to OUT/rank<R>.jsonl: the step the callback acted at
(with the restart attempt), then how far `train` got and its peak resident memory against its budget.
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("USE_TORCH_XLA", "0")  # the CPU, even where torch_xla is installed

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from watchdog.readers.host_memory import job_memory
from watchdog import WatchdogConfig  # noqa: E402
from watchdog.integrations.huggingface import HbmWatchdogCallback  # noqa: E402
from watchdog.logs import configure_logging  # noqa: E402

VOCAB, SEQ, BATCH = 4096, 32, 8  # one batch's logits: 4 MiB
BUDGET = 1 << 30

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--leak-rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=300)
args = parser.parse_args()
configure_logging("json")
rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Tokens(Dataset):
    def __init__(self, n: int):
        self.tokens = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class Peak(TrainerCallback):
    def __init__(self):
        self.value = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.value = max(self.value, job_memory())


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=SEQ))
kept = []
if rank == args.leak_rank:
    model.lm_head.register_forward_hook(lambda module, inputs, output: kept.append(output.detach()))
limit = job_memory() + BUDGET
callback = HbmWatchdogCallback(WatchdogConfig(sample_every=2, memory_limit_bytes=limit, agreement_timeout_seconds=120,
                                              trace_file=args.out / f"trace-{rank}.csv"))
peak = Peak()
training = TrainingArguments(output_dir=str(args.out / "hf"), max_steps=args.steps, per_device_train_batch_size=BATCH,
                             save_strategy="no", logging_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True,
                             seed=0, dataloader_num_workers=0, ddp_backend="gloo")
trainer = Trainer(model=model, args=training, train_dataset=Tokens(4096), callbacks=[peak, callback])
resume = get_last_checkpoint(training.output_dir) if os.path.isdir(training.output_dir) else None
trainer.train(resume_from_checkpoint=resume)
with open(args.out / f"rank{rank}.jsonl", "a") as record:
    if callback.action_step is not None:
        record.write(json.dumps({"attempt": attempt, "step": callback.action_step,
                                 "action": callback.watchdog.last_action.action.value,
                                 "origin": callback.watchdog.last_action.origin}) + "\n")
    record.write(json.dumps({"attempt": attempt, "exit": callback.exit_code, "step": trainer.state.global_step,
                             "start": 0 if resume is None else "resumed", "peak": peak.value, "limit": limit}) + "\n")
sys.exit(callback.exit_code)  # 42 when the watchdog asked for a restart: torchrun starts the group again
