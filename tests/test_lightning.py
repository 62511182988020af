"""The Lightning callback with real Lightning on CPU, a real leak and the real RSS source."""

import os

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from watchdog import WatchdogConfig
from watchdog.core.sample import load_trace
from watchdog.integrations.lightning import HbmWatchdogCallback
from watchdog.runtime.sources import RssSource

LEAK_BYTES = 4 << 20


class LeakyModule(L.LightningModule):
    def __init__(self, leak: bool):
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)
        self.leak = leak
        self.kept = []

    def training_step(self, batch, batch_idx):
        if self.leak:
            self.kept.append(torch.ones(LEAK_BYTES // 4))  # written, so resident
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(tmp_path, leak: bool, max_steps: int, budget_over_now: int, ckpt_path=None):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    limit = RssSource().read().bytes_used + budget_over_now
    config = WatchdogConfig(sample_every=2, source="rss", memory_limit_bytes=limit)
    callback = HbmWatchdogCallback(config, checkpoint_dir=tmp_path / "ckpt")
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    module = LeakyModule(leak)
    trainer.fit(module, DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
    return trainer, callback, module


def test_a_leak_is_checkpointed_and_stopped_before_the_budget(tmp_path):
    budget = 1200 << 20  # 300 steps of leak at 4 MiB/step
    trainer, callback, module = fit(tmp_path, leak=True, max_steps=2000, budget_over_now=budget)
    assert callback.exit_code == 42
    assert callback.action_step is not None and callback.action_step < 300
    assert len(module.kept) * LEAK_BYTES < budget, "stopped before the budget was spent"
    assert trainer.global_step < 2000
    checkpoint = torch.load(callback.resume_path(), weights_only=True)
    assert checkpoint["global_step"] == trainer.global_step
    assert not list((tmp_path / "ckpt").glob("*.tmp"))

    resumed, callback2, _ = fit(tmp_path, leak=False, max_steps=trainer.global_step + 20,
                                budget_over_now=budget, ckpt_path=callback.resume_path())
    assert resumed.global_step == trainer.global_step + 20
    assert callback2.exit_code == 0


def test_no_leak_runs_to_the_end_without_action(tmp_path):
    trainer, callback, _ = fit(tmp_path, leak=False, max_steps=150, budget_over_now=1 << 30)
    assert trainer.global_step == 150
    assert callback.exit_code == 0 and callback.resume_path() is None
    assert callback.watchdog.telemetry.samples_total > 10


class EvaluatingModule(LeakyModule):
    """Validation collects every batch's predictions for an epoch-end metric, then lets them go."""

    def __init__(self):
        super().__init__(leak=False)
        self.predictions = []

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        self.predictions.append(self.layer(x).detach() + torch.zeros(1 << 18))  # 1 MiB a batch, written

    def on_validation_epoch_end(self):
        self.predictions.clear()


def test_validation_runs_under_the_eval_phase_and_the_counter_keeps_rising_through_it(tmp_path):
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 16), torch.randn(64, 1)), batch_size=8)
    trace = tmp_path / "trace.csv"
    config = WatchdogConfig(sample_every=1, source="rss", trace_file=trace,
                            memory_limit_bytes=RssSource().read().bytes_used + (1 << 30))
    callback = HbmWatchdogCallback(config, checkpoint_dir=tmp_path / "ckpt")
    trainer = L.Trainer(max_steps=24, val_check_interval=8, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(EvaluatingModule(), data, data)
    assert callback.exit_code == 0 and trainer.global_step == 24
    samples = load_trace(trace)
    steps = [s.step for s in samples]
    assert steps == sorted(set(steps))  # global_step stands still in validation; the watchdog's counter does not
    assert {s.phase for s in samples} == {"", "eval/8"}  # as many batches as Lightning planned
    assert callback._phase is None and callback.watchdog._phase == ""  # back to training after each validation


def test_a_resume_checkpoint_that_is_a_link_or_no_file_is_not_resumed_from_and_is_kept(tmp_path):
    callback = HbmWatchdogCallback(checkpoint_dir=tmp_path / "ckpt")
    callback.checkpoint_dir.mkdir()
    foreign = tmp_path / "other-run.ckpt"
    foreign.write_bytes(b"another run's checkpoint")
    callback.checkpoint_path.symlink_to(foreign)
    assert callback.resume_path() is None
    aside = callback.checkpoint_dir / f"{callback.checkpoint_path.name}.unreadable"
    assert aside.is_symlink() and foreign.read_bytes() == b"another run's checkpoint"  # set aside, nothing deleted
    os.mkfifo(callback.checkpoint_path)
    assert callback.resume_path() is None and not callback.checkpoint_path.exists()
    callback.checkpoint_path.write_bytes(b"this run's")
    assert callback.resume_path() == str(callback.checkpoint_path)
