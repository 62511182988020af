"""The Lightning callback with real Lightning on CPU, a real leak and the real RSS source."""

import os

import lightning as L
import pytest
import torch
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader, TensorDataset

from watchdog import WatchdogConfig
from watchdog.core.errors import ConfigError
from watchdog.core.sample import load_trace
from watchdog.integrations.lightning import HbmWatchdogCallback
from conftest import settled_job_memory

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


class TunableModule(LeakyModule):
    """What Lightning's tuner needs: an `lr` to find and a `batch_size` to scale."""

    def __init__(self, leak: bool):
        super().__init__(leak)
        self.lr, self.batch_size = 0.01, 8
        self.data = TensorDataset(torch.randn(64, 16), torch.randn(64, 1))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def fit(tmp_path, leak: bool, max_steps: int, budget_over_now: int, ckpt_path=None, tune: bool = False):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    limit = settled_job_memory() + budget_over_now
    config = WatchdogConfig(sample_every=2, source="rss", memory_limit_bytes=limit, trace_file=tmp_path / "trace.csv")
    callback = HbmWatchdogCallback(config, checkpoint_dir=tmp_path / "ckpt")
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                        default_root_dir=tmp_path)
    if tune:  # trial steps before fit, with the leak running in them too
        module = TunableModule(leak)
        tuner = Tuner(trainer)
        tuner.lr_find(module, num_training=20)
        tuner.scale_batch_size(module, mode="power", steps_per_trial=3, max_trials=2)
        module.kept.clear()  # what the trials leaked is not this fit's
        trainer.fit(module, ckpt_path=ckpt_path)
    else:
        module = LeakyModule(leak)
        trainer.fit(module, DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
    return trainer, callback, module


def test_a_leak_is_checkpointed_and_stopped_before_the_budget(tmp_path, events):
    budget = 1200 << 20  # 300 steps of leak at 4 MiB/step
    trainer, callback, module = fit(tmp_path, leak=True, max_steps=2000, budget_over_now=budget)
    assert callback.exit_code == 42
    assert callback.action_step is not None and callback.action_step < 300
    assert len(module.kept) * LEAK_BYTES < budget, "stopped before the budget was spent"
    suspects = events.named("leak_suspects")
    assert suspects and "attribute 'kept' of LeakyModule" in suspects[-1]["suspects"][0], suspects
    (acted,) = events.named("action_outcome")
    assert acted["checkpoint"] == str(callback.checkpoint_path) and "exit 42" in acted["outcome"]
    assert "LeakyModule" in acted["block"]
    assert trainer.global_step < 2000
    checkpoint = torch.load(callback.resume_path(), weights_only=True)
    assert checkpoint["global_step"] == trainer.global_step
    assert not list((tmp_path / "ckpt").glob("*.tmp"))

    resumed, callback2, _ = fit(tmp_path, leak=False, max_steps=trainer.global_step + 20,
                                budget_over_now=budget, ckpt_path=callback.resume_path())
    assert resumed.global_step == trainer.global_step + 20
    assert callback2.exit_code == 0


def test_no_leak_runs_to_the_end_without_action(tmp_path, events):
    trainer, callback, _ = fit(tmp_path, leak=False, max_steps=150, budget_over_now=1 << 30)
    assert trainer.global_step == 150
    assert callback.exit_code == 0 and callback.resume_path() is None
    assert callback.watchdog.telemetry.samples_total > 10
    for name in ("action_decided", "leak_detected", "leak_suspects", "action_outcome"):
        assert not events.named(name), name


def test_the_tuners_trial_steps_before_fit_never_reach_the_watchdog(tmp_path, events):
    """lr_find and scale_batch_size run trial steps (leaking too) before fit: the watchdog starts
    with the real training, its trace holds only that, and the leak is still caught in time."""
    budget = 1200 << 20
    trainer, callback, module = fit(tmp_path, leak=True, max_steps=2000, budget_over_now=budget, tune=True)
    assert callback.exit_code == 42
    samples = load_trace(tmp_path / "trace.csv")
    limit = callback.config.memory_limit_bytes
    assert max(s.bytes_used for s in samples if s.step <= callback.action_step) < limit, "acted on before the budget"
    steps = [s.step for s in samples]
    assert steps == sorted(set(steps)) and steps[0] <= 20, "one run in the trace, from the fit's first steps"
    assert len(events.named("watchdog_started")) == 1, "no watchdog was started for the trials"
    assert all(p.device.type == "cpu" for p in module.parameters())


class EvaluatingModule(LeakyModule):
    """Validation collects every batch's predictions (`batch_bytes` of them, written) for an
    epoch-end metric, then lets them go."""

    def __init__(self, batch_bytes: int = 1 << 20):
        super().__init__(leak=False)
        self.predictions = []
        self.batch_bytes = batch_bytes

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        self.predictions.append(self.layer(x).detach() + torch.zeros(self.batch_bytes // 4))

    def on_validation_epoch_end(self):
        self.predictions.clear()


def test_validation_runs_under_the_eval_phase_and_the_counter_keeps_rising_through_it(tmp_path):
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 16), torch.randn(64, 1)), batch_size=8)
    trace = tmp_path / "trace.csv"
    config = WatchdogConfig(sample_every=1, source="rss", trace_file=trace,
                            memory_limit_bytes=settled_job_memory() + (1 << 30))
    callback = HbmWatchdogCallback(config, checkpoint_dir=tmp_path / "ckpt")
    trainer = L.Trainer(max_steps=24, val_check_interval=8, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(EvaluatingModule(), data, data)
    assert callback.exit_code == 0 and trainer.global_step == 24
    samples = load_trace(trace)
    steps = [s.step for s in samples]
    assert steps == sorted(steps)  # global_step stands still in validation; the watchdog's counter does not
    again = [s.phase for a, s in zip(samples, samples[1:]) if a.step == s.step]
    assert again == ["eval/8"] * len(again) and again, "a step read twice: a validation's end, labelled with it"
    assert {s.phase for s in samples} == {"", "eval/8"}  # as many batches as Lightning planned
    assert callback._phase is None and callback.watchdog._phase == ""  # back to training after each validation
    # The job file beside the trace (issue 63: any loop's Watchdog keeps it): the fit's process, its 24
    # training steps, and each validation as an evaluation's span, not as steps.
    from watchdog.core import goodput

    account = goodput.account(goodput.read(f"{trace}{goodput.SUFFIX}"))
    assert (account.processes, account.steps_kept, account.ended) == (1, 24, "done"), account
    assert account.badput_seconds["eval"] > 0 and account.goodput > 0


def test_an_action_asked_for_during_validation_is_carried_out_once_when_validation_ends(tmp_path, events):
    """Lightning's validation cannot be stopped from a callback: the action handed over in it waits
    on its record (`ActionPath.waiting`) and is carried out, once, when validation ends. 80 batches
    of 4 MiB against 200 MiB of room."""
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 16), torch.randn(64, 1)), batch_size=8)
    validation = DataLoader(TensorDataset(torch.randn(640, 16), torch.randn(640, 1)), batch_size=8)
    config = WatchdogConfig(sample_every=1, source="rss", memory_limit_bytes=settled_job_memory() + (200 << 20))
    callback = HbmWatchdogCallback(config, checkpoint_dir=tmp_path / "ckpt")
    trainer = L.Trainer(max_steps=40, val_check_interval=8, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[callback])
    trainer.fit(EvaluatingModule(batch_bytes=4 << 20), data, validation)
    assert callback.exit_code == 42 and callback.action_step == 8 == trainer.global_step, "acted on as validation ended"
    (acted,) = events.named("action_outcome")
    assert "exit 42" in acted["outcome"] and acted["checkpoint"] == str(callback.checkpoint_path)
    assert torch.load(callback.resume_path(), weights_only=True)["global_step"] == 8
    assert callback.watchdog.actions.waiting is None, "carried out: nothing waits"


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


class StopsAfter(LeakyModule):
    """A user's module that ends its own fit after a few steps, so the README's Trainer (default
    epochs) runs as written."""

    def __init__(self, steps: int):
        super().__init__(leak=False)
        self.steps = steps

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 16), torch.randn(64, 1)), batch_size=8)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.global_step >= self.steps:
            self.trainer.should_stop = True


def test_the_readme_snippet_runs_as_written(tmp_path, monkeypatch):
    import re
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("\n### With PyTorch Lightning\n", 1)[1]
    snippet = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    monkeypatch.chdir(tmp_path)
    names = {"L": L, "model": StopsAfter(30), "WatchdogConfig": WatchdogConfig, "sys": sys}
    with pytest.raises(SystemExit) as stop:
        exec(compile(snippet, "README.md", "exec"), names)
    assert stop.value.code == 0 and names["trainer"].global_step == 30
    assert names["callback"].watchdog.telemetry.samples_total >= 2, "the watchdog sampled the fit"
    assert (tmp_path / "ckpt").exists() is False, "no action, so no checkpoint"


def test_exit_code_and_the_run_s_end_belong_to_one_fit(tmp_path):
    """A callback reused for a second `fit` (a resume in the same process) says what that fit asks
    for: after an action in the first, a clean second one is exit 0, not a stale 42 that would
    restart a finished job. And `max_steps` reaches the policy as the run's end."""
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 16), torch.randn(64, 1)), batch_size=8)
    config = WatchdogConfig(sample_every=2, source="rss", memory_limit_bytes=settled_job_memory() + (1 << 30),
                            forced_actions=((3, "checkpoint_restart"),))
    callback = HbmWatchdogCallback(config, checkpoint_dir=tmp_path / "ckpt")

    def trainer(max_steps):
        return L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                         default_root_dir=tmp_path, limit_val_batches=0)

    first = trainer(20)
    first.fit(LeakyModule(leak=False), data)
    assert callback.exit_code == 42 and callback.action_step == 3, "the drill, at its step"
    assert callback.watchdog.judge.policy.last_step == 20
    second = trainer(12)
    second.fit(LeakyModule(leak=False), data, ckpt_path=callback.resume_path())  # resumed past the drill
    assert second.global_step == 12
    assert callback.exit_code == 0 and callback.action_step is None
    assert callback.watchdog.judge.policy.last_step == 12


def test_the_watchdogs_restarts_in_a_row_reach_the_next_process_through_lightnings_checkpoint(tmp_path, monkeypatch):
    """A restart the watchdog asked for is counted in the checkpoint Lightning saves (the callback's
    `state_dict`); a new callback, as in the restarted process, resumes with it, so the restart
    budget counts the watchdog's own restarts across processes, not every restart of the job."""
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 16), torch.randn(64, 1)), batch_size=8)
    limit = settled_job_memory() + (1 << 30)
    monkeypatch.setenv("HBMWATCH_RESTART_COUNT", "4")  # what the restart engine says: every restart so far

    def fit(forced, max_steps, ckpt_path=None):
        config = WatchdogConfig(sample_every=2, source="rss", memory_limit_bytes=limit, forced_actions=forced)
        callback = HbmWatchdogCallback(config, checkpoint_dir=tmp_path / "ckpt")
        trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                            default_root_dir=tmp_path, limit_val_batches=0)
        trainer.fit(LeakyModule(leak=False), data, ckpt_path=ckpt_path)
        return callback

    first = fit(((3, "checkpoint_restart"),), 20)
    assert first.exit_code == 42
    assert first.watchdog.state_dict() == {"restarts_so_far": 5, "watchdog_restarts": 5, "watchdog_restart_step": 3, "cycles": []}
    second = fit((), 10, ckpt_path=first.resume_path())  # a new process: a new callback
    assert second.watchdog.state_dict() == {"restarts_so_far": 5, "watchdog_restarts": 5, "watchdog_restart_step": 3, "cycles": []}


def test_a_checkpoint_dir_that_is_a_file_is_refused_when_the_callback_is_made(tmp_path):
    """Said at once, not at the first action an hour in (whose save would fail)."""
    not_a_folder = tmp_path / "ckpt"
    not_a_folder.write_text("someone's file")
    with pytest.raises(ConfigError, match="checkpoint_dir"):
        HbmWatchdogCallback(WatchdogConfig(), checkpoint_dir=not_a_folder)
    assert not_a_folder.read_text() == "someone's file"


class FailingModule(LeakyModule):
    def training_step(self, batch, batch_idx):
        if self.global_step == 12:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")  # as torch.OutOfMemoryError says
        return super().training_step(batch, batch_idx)


def test_an_exception_out_of_fit_is_no_clean_end_for_the_flight_record(tmp_path):
    from watchdog.records import flight_record

    trace = tmp_path / "trace.csv"
    callback = HbmWatchdogCallback(WatchdogConfig(sample_every=1, source="rss", trace_file=trace),
                                   checkpoint_dir=tmp_path / "ckpt")
    trainer = L.Trainer(max_steps=40, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                        default_root_dir=tmp_path)
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        trainer.fit(FailingModule(leak=False), DataLoader(data, batch_size=8))
    record = flight_record.read(f"{trace}{flight_record.SUFFIX}")
    assert record["ended"] == "unclean" and record["last_step"] == 12, record  # as reported after the 12th batch


@pytest.mark.parametrize("state", [{"watchdog_restarts": -1}, {"watchdog_restarts": True},
                                   {"watchdog_restarts": 2**70}, ["not", "a", "dict"]])
def test_a_bad_saved_state_is_logged_and_training_goes_on(tmp_path, state, events):
    """Issue 52: `fit(ckpt_path=...)` from a checkpoint whose watchdog state held `watchdog_restarts: -1`
    stopped the fit with ConfigError at on_train_start, while Hugging Face's callback logged it and
    carried on. One rule for both (`Watchdog.saved_state`): logged, left out, never a stop."""
    callback = HbmWatchdogCallback(WatchdogConfig(sample_every=10), checkpoint_dir=tmp_path / "ckpt")
    callback.load_state_dict(state)
    assert callback._resumed is None
    [said] = events.named("watchdog_state_unread")
    assert "restart budget counts every restart" in said["note"]
    assert callback.state_dict() == {}, "nothing of it is saved again"
    callback.load_state_dict({"watchdog_restarts": 2, "watchdog_restart_step": 400})
    assert callback._resumed == {"watchdog_restarts": 2, "watchdog_restart_step": 400}
