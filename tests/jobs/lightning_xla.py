"""A Lightning fit on torch_xla (PJRT CPU), with or without the watchdog's callback.

    python lightning_xla.py on|off CHECKPOINT_DIR  ->  one JSON line: loss, XLA compile and transfer counters

Lightning asks the TPU metadata server how many devices there are; on PJRT CPU, PJRT knows.
"""

import json
import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
from lightning.fabric.accelerators.xla import XLAAccelerator  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from watchdog import WatchdogConfig  # noqa: E402
from watchdog.integrations.lightning import HbmWatchdogCallback  # noqa: E402

XLAAccelerator.auto_device_count = staticmethod(xr.global_runtime_device_count)
XLAAccelerator.is_available = staticmethod(lambda: xr.global_runtime_device_count() > 0)


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)
        self.last_loss = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.last_loss = loss.detach()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


mode, checkpoint_dir = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
data = TensorDataset(torch.randn(160, 16), torch.randn(160, 1))
callbacks = ([HbmWatchdogCallback(WatchdogConfig(sample_every=1, memory_limit_bytes=8 << 30),
                                  checkpoint_dir=checkpoint_dir)] if mode == "on" else [])
trainer = L.Trainer(max_steps=20, accelerator="tpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
module = Regression()
trainer.fit(module, DataLoader(data, batch_size=8))
loss = module.last_loss.item()  # the one deliberate transfer, in both runs
counters = {name: met.counter_value(name) for name in met.counter_names()
            if "Compile" in name or "Transfer" in name or "ToCpu" in name or "_to_cpu" in name}
watchdog = callbacks[0].watchdog if callbacks else None
print(json.dumps({"loss": loss, "counters": counters, "steps": trainer.global_step,
                  "samples": watchdog.telemetry.samples_total if watchdog else 0,
                  "watched": watchdog.telemetry.device if watchdog else None}), flush=True)
