"""A tiny Lightning or Hugging Face fit with the watchdog's callback and nothing else: no logging set
up by this script, a drill (a forced restart at step 6) so that an action is taken. For tests of the
lines a newcomer sees from those hosts (tests/test_logs.py). Argument: lightning or huggingface."""

import sys

import torch

from watchdog import Action, WatchdogConfig

framework, folder = sys.argv[1], sys.argv[2]
config = WatchdogConfig(sample_every=2, source="rss", memory_limit_bytes=1 << 40, forensics=False,
                        forced_actions=((6, Action.CHECKPOINT_RESTART),))
torch.manual_seed(0)

if framework == "lightning":
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from watchdog.integrations.lightning import HbmWatchdogCallback

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=4)
    callback = HbmWatchdogCallback(config, checkpoint_dir=f"{folder}/ckpt")
    trainer = L.Trainer(max_steps=12, accelerator="cpu", devices=1, callbacks=[callback], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=folder)
    trainer.fit(Tiny(), data)
    sys.exit(callback.exit_code)

from transformers import Trainer, TrainingArguments

from watchdog.integrations.huggingface import HbmWatchdogCallback


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.layer(x), labels)}


rows = [{"x": torch.randn(8), "labels": torch.randn(1)} for _ in range(64)]
callback = HbmWatchdogCallback(config)
args = TrainingArguments(output_dir=folder, max_steps=12, per_device_train_batch_size=4, report_to=[],
                         disable_tqdm=True, use_cpu=True, save_strategy="no", logging_strategy="no")
Trainer(model=Tiny(), args=args, train_dataset=rows, callbacks=[callback]).train()
sys.exit(callback.exit_code)
