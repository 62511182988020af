"""Every cycle, before the limit (issue 49), for the hosts whose action is a restart: Lightning and
the Hugging Face `Trainer`. A leak lives in the code, so it refills after every restart; each
attempt is a new process (as torchrun or `supervise` would start it) resuming from the checkpoint
the previous one saved. Every attempt must be stopped with exit 42 before its memory reaches its
limit, three times running. On an H100 the second cycle of a refilling leak hit a real
`OutOfMemoryError` at step 797, four steps before a fixed cooldown ended (the bare loop, the trainer
and `watch` have their own three-cycle tests: tests/test_bare_loop.py, tests/test_trainer_e2e.py,
tests/test_watch_e2e.py).
"""

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import hbm_watchdog_env

pytestmark = pytest.mark.slow

CYCLES = 3
PREAMBLE = textwrap.dedent('''
    import json, sys, time
    import psutil, torch
    from watchdog import WatchdogConfig
    from watchdog.readers.host_memory import job_memory

    MiB = 1 << 20
    out, resume = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
    torch.manual_seed(0)
    highest = [0]

    def configured():
        """Once everything is imported: 75 steps of the leak under the limit, about 37 samples."""
        global limit
        limit = job_memory() + 300 * MiB
        return WatchdogConfig(sample_every=2, source="rss", memory_limit_bytes=limit)

    def note():
        highest[0] = max(highest[0], job_memory())
''')

LIGHTNING = PREAMBLE + textwrap.dedent('''
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    from watchdog.integrations.lightning import HbmWatchdogCallback

    class Leaky(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer, self.kept = torch.nn.Linear(16, 1), []

        def training_step(self, batch, batch_idx):
            self.kept.append(torch.ones(MiB))  # 4 MiB a step, written: resident
            note()
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callback = HbmWatchdogCallback(configured(), checkpoint_dir=f"{out}/ckpt")
    trainer = L.Trainer(max_steps=5000, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                        default_root_dir=out)
    data = DataLoader(TensorDataset(torch.randn(64, 16), torch.randn(64, 1)), batch_size=8)
    trainer.fit(Leaky(), data, ckpt_path=resume)
    print(json.dumps({"exit": callback.exit_code, "step": trainer.global_step, "highest": highest[0], "limit": limit,
                      "resume": callback.resume_path()}))
''')

HUGGING_FACE = PREAMBLE + textwrap.dedent('''
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from watchdog.integrations.huggingface import HbmWatchdogCallback

    class Tokens(Dataset):
        def __init__(self):
            self.tokens = torch.randint(0, 512, (64, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.tokens)

        def __getitem__(self, index):
            return {"input_ids": self.tokens[index], "labels": self.tokens[index]}

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=512, n_positions=16))
    kept = []

    def keep(module, inputs, output):  # a hook left in from debugging: a batch's worth kept each step
        if module.training:
            kept.append(torch.ones(MiB))
            note()

    model.lm_head.register_forward_hook(keep)
    callback = HbmWatchdogCallback(configured())
    args = TrainingArguments(output_dir=out, max_steps=5000, per_device_train_batch_size=8, save_strategy="no",
                             logging_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True, seed=0,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    trainer.train(resume_from_checkpoint=bool(resume))
    print(json.dumps({"exit": callback.exit_code, "step": trainer.state.global_step, "highest": highest[0],
                      "limit": limit, "resume": "yes" if callback.exit_code == 42 else None}))
''')


def cycles(script: str, tmp_path) -> list[dict]:
    """Each attempt in a new process, resuming from the previous one's checkpoint, as a restarter would."""
    (tmp_path / "job.py").write_text(script)
    attempts, resume = [], None
    for _ in range(CYCLES):
        command = [sys.executable, str(tmp_path / "job.py"), str(tmp_path), *([resume] if resume else [])]
        completed = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                                   env=hbm_watchdog_env(USE_TORCH_XLA="0"))
        assert completed.returncode == 0, completed.stderr[-3000:]
        attempts.append(json.loads(completed.stdout.strip().splitlines()[-1]))
        resume = attempts[-1]["resume"]
    return attempts


@pytest.mark.parametrize("host", ["lightning", "huggingface"])
def test_a_leak_that_refills_after_every_restart_is_stopped_before_the_limit_in_every_cycle(host, tmp_path):
    attempts = cycles({"lightning": LIGHTNING, "huggingface": HUGGING_FACE}[host], tmp_path)
    for cycle, attempt in enumerate(attempts, 1):
        assert attempt["exit"] == 42, (cycle, attempts)
        assert attempt["highest"] < attempt["limit"], f"cycle {cycle} passed its limit: {attempts}"
    assert attempts[0]["step"] < attempts[1]["step"] < attempts[2]["step"], "each attempt resumed and went on"
