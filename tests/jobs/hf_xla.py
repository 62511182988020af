"""A Hugging Face `Trainer` on torch_xla (PJRT CPU), with or without the watchdog's callback.

    python hf_xla.py on|off OUTPUT_DIR   ->  one JSON line: device, loss, XLA compile and transfer counters

"on" runs the README's Hugging Face snippet as written (this model and data; the run's length
added to its TrainingArguments); "off" the same Trainer without the callback.

transformers puts the model on the XLA device by itself when torch_xla is installed; the one
setting a TPU user needs is an optimizer torch_xla can run (the default is a fused AdamW it cannot).
"""

import builtins
import functools
import json
import os
import re
import sys
import types
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from watchdog import WatchdogConfig  # noqa: E402,F401 (the snippet imports it)
from watchdog.integrations.huggingface import HbmWatchdogCallback  # noqa: E402,F401 (the snippet imports it)


class Tokens(Dataset):
    def __init__(self, n: int, seq: int = 16, vocab: int = 256):
        self.tokens = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def readme_snippet() -> str:
    """The README's Hugging Face snippet, verbatim."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("\n### With Hugging Face Transformers\n", 1)[1]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]


mode, output_dir = sys.argv[1], sys.argv[2]
os.makedirs(output_dir, exist_ok=True)
os.chdir(output_dir)  # the snippet's output_dir="out" lands here
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=256, n_positions=16))
# The run's length and quiet output, around the snippet's own arguments:
arguments = functools.partial(TrainingArguments, max_steps=30, per_device_train_batch_size=8, save_strategy="no",
                              logging_strategy="no", report_to=[], disable_tqdm=True, seed=0,
                              dataloader_num_workers=0)
if mode == "on":  # the README's snippet, as written, with this model and data
    def snippet_import(name, *args, **kwargs):  # the snippet's own `from transformers import ...` gets this run's length
        if name == "transformers":
            return types.SimpleNamespace(Trainer=Trainer, TrainingArguments=arguments)
        return builtins.__import__(name, *args, **kwargs)

    names = {"model": model, "data": Tokens(64), "__builtins__": {**vars(builtins), "__import__": snippet_import}}
    snippet = readme_snippet()
    try:
        exec(compile(snippet, "README.md", "exec"), names)
    except SystemExit as stop:
        assert stop.code == 0, f"the snippet exited {stop.code}"
    trainer, callbacks = names["trainer"], [names["callback"]]
else:
    trainer = Trainer(model=model, args=arguments(output_dir="out", optim="adamw_torch_xla"),
                      train_dataset=Tokens(64))
    trainer.train()
    callbacks = []
loss = trainer.state.log_history[-1]["train_loss"]
counters = {name: met.counter_value(name) for name in met.counter_names()
            if "Compile" in name or "Transfer" in name or "ToCpu" in name or "_to_cpu" in name}
watchdog = callbacks[0].watchdog if callbacks else None
print(json.dumps({"device": str(next(model.parameters()).device), "loss": loss, "counters": counters,
                  "steps": trainer.state.global_step,
                  "samples": watchdog.telemetry.samples_total if watchdog else 0,
                  "watched": watchdog.telemetry.device if watchdog else None}), flush=True)
