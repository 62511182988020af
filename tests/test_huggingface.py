"""The Hugging Face callback under a real `transformers.Trainer`: a tiny GPT-2 built from a config
(nothing is downloaded), real leaks of a Trainer user's own kind, the real resident-memory source.

tests/conftest.py sets `USE_TORCH_XLA=0`, which keeps transformers off torch_xla in the test
processes (it is installed here, and transformers would otherwise put the model on the XLA device
by itself); the XLA run is its own process in tests/test_callbacks_xla.py.
"""

import json
import os

import pytest
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from watchdog import WatchdogConfig
from watchdog.integrations.huggingface import EVAL_ACCUMULATION_FINDING, HbmWatchdogCallback
from conftest import settled_job_memory

# Each test trains a real Trainer for hundreds of steps (tens of seconds on 2 cores): the whole
# suite's lane, not the fast one.
pytestmark = pytest.mark.slow

VOCAB, SEQ, BATCH = 4096, 32, 8
LOGITS_BYTES = VOCAB * SEQ * BATCH * 4  # one batch's logits: 4 MiB


class Tokens(Dataset):
    def __init__(self, n: int):
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, VOCAB, (n, SEQ), generator=generator)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class LogitsForAMetric:
    """A forward hook left in from debugging: keeps every batch's logits for a metric "later"."""

    def __init__(self, model):
        self.kept = []
        model.lm_head.register_forward_hook(self.keep)

    def keep(self, module, inputs, output):
        if module.training:
            self.kept.append(output.detach())


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=SEQ))


def arguments(output_dir, max_steps: int, **extra) -> TrainingArguments:
    return TrainingArguments(output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=BATCH,
                             per_device_eval_batch_size=BATCH, save_strategy="no", logging_strategy="no",
                             report_to=[], disable_tqdm=True, use_cpu=True, seed=0, dataloader_num_workers=0,
                             **extra)


def callback(budget_over_now: int) -> HbmWatchdogCallback:
    limit = settled_job_memory() + budget_over_now
    return HbmWatchdogCallback(WatchdogConfig(sample_every=2, source="rss", memory_limit_bytes=limit))


def test_a_leaking_hook_is_checkpointed_by_the_trainer_before_the_budget_and_the_job_resumes(tmp_path, events):
    # 200 steps of the leak. The in-process sidecar reads only the newest step it was asked for, so on
    # a loaded machine it sees fewer samples and acts later: at 150 steps of room, CI saw step 151.
    budget = 800 << 20
    model, watch = tiny_gpt2(), callback(budget)
    hook = LogitsForAMetric(model)
    trainer = Trainer(model=model, args=arguments(tmp_path, max_steps=1000), train_dataset=Tokens(64),
                      callbacks=[watch])
    trainer.train()
    assert os.environ["USE_TORCH_XLA"] == "0" and next(model.parameters()).device.type == "cpu"
    assert watch.exit_code == 42 and watch.action_step is not None
    assert trainer.state.global_step == watch.action_step, "stopped at the action's step boundary"
    assert len(hook.kept) == watch.action_step, "the leak ran until the action, and not a step further"
    assert len(hook.kept) * LOGITS_BYTES < budget, "acted on before the leak alone had spent the budget"
    assert (tmp_path / f"checkpoint-{watch.action_step}").is_dir(), "the Trainer saved its own checkpoint"
    suspects = events.named("leak_suspects")
    assert suspects and "attribute 'kept' of LogitsForAMetric" in suspects[-1]["suspects"][0], suspects
    (acted,) = events.named("action_outcome")
    assert acted["checkpoint"] == str(tmp_path / f"checkpoint-{watch.action_step}")
    assert "exit 42" in acted["outcome"] and "LogitsForAMetric" in acted["block"]
    kept_at_stop = len(hook.kept)

    resumed_watch = callback(budget)
    resumed = Trainer(model=tiny_gpt2(), args=arguments(tmp_path, max_steps=watch.action_step + 10),
                      train_dataset=Tokens(64), callbacks=[resumed_watch])
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == watch.action_step + 10
    assert resumed_watch.exit_code == 0 and resumed_watch.action_step is None
    assert len(hook.kept) == kept_at_stop, "the resumed job runs without the old model's hook"


def test_exit_code_findings_and_the_run_s_end_belong_to_one_train(tmp_path):
    """A callback reused for a second `train()` (a resume in the same process) says what that run
    asks for: a clean second run is exit 0, not the first one's stale 42. And `max_steps` reaches
    the policy as the run's end when nothing evaluates."""
    watch = HbmWatchdogCallback(WatchdogConfig(sample_every=2, source="rss",
                                               memory_limit_bytes=settled_job_memory() + (1 << 30),
                                               forced_actions=((3, "checkpoint_restart"),)))
    first = Trainer(model=tiny_gpt2(), args=arguments(tmp_path, max_steps=20), train_dataset=Tokens(64),
                    callbacks=[watch])
    first.train()
    assert watch.exit_code == 42 and watch.action_step == 3
    assert watch.watchdog.judge.policy.last_step == 20
    second = Trainer(model=tiny_gpt2(), args=arguments(tmp_path, max_steps=12), train_dataset=Tokens(64),
                     callbacks=[watch])
    second.train(resume_from_checkpoint=True)  # from checkpoint-3: past the drill
    assert second.state.global_step == 12
    assert watch.exit_code == 0 and watch.action_step is None and watch.findings == []
    assert watch.watchdog.judge.policy.last_step == 12


def test_the_watchdogs_restarts_in_a_row_reach_the_next_process_beside_the_trainers_checkpoint(tmp_path, monkeypatch):
    """A restart the watchdog asked for is counted beside the checkpoint the Trainer saves for it;
    a new callback, as in the restarted process, resumes with it: the restart budget counts the
    watchdog's own restarts across processes, not every restart of the job."""
    monkeypatch.setenv("HBMWATCH_RESTART_COUNT", "4")  # what the restart engine says: every restart so far

    def run(forced, max_steps, resume):
        watch = HbmWatchdogCallback(WatchdogConfig(sample_every=2, source="rss",
                                                   memory_limit_bytes=settled_job_memory() + (1 << 30), forced_actions=forced))
        trainer = Trainer(model=tiny_gpt2(), args=arguments(tmp_path, max_steps=max_steps), train_dataset=Tokens(64),
                          callbacks=[watch])
        trainer.train(resume_from_checkpoint=resume)
        return watch

    first = run(((3, "checkpoint_restart"),), 20, None)
    assert first.exit_code == 42
    saved = json.loads((tmp_path / "checkpoint-3" / "hbm-watchdog.json").read_text())
    assert saved == {"restarts_so_far": 5, "watchdog_restarts": 5, "watchdog_restart_step": 3, "cycles": []}
    second = run((), 10, True)  # a new process: a new callback
    assert second.watchdog.state_dict()["watchdog_restarts"] == 5


def test_a_clean_run_gets_no_action_and_no_leak_report(tmp_path, events, monkeypatch):
    job_file = tmp_path / "job.jsonl"
    monkeypatch.setenv("HBMWATCH_JOB_FILE", str(job_file))  # as supervise --job-file sets it
    watch = callback(1 << 30)
    trainer = Trainer(model=tiny_gpt2(), args=arguments(tmp_path, max_steps=160), train_dataset=Tokens(64),
                      callbacks=[watch])
    trainer.train()
    assert trainer.state.global_step == 160 and watch.exit_code == 0
    assert watch.watchdog.telemetry.samples_total >= 60
    for name in ("action_decided", "leak_detected", "leak_suspects", "action_outcome"):
        assert not events.named(name), name
    from watchdog.core import goodput  # issue 63: its Watchdog keeps the fit's share of the job file

    account = goodput.account(goodput.read(job_file))
    assert (account.processes, account.steps_kept, account.ended) == (1, 160, "done") and account.goodput > 0


def test_predictions_kept_through_an_evaluation_are_named_with_eval_accumulation_steps(tmp_path, events):
    """The prediction loop keeps every batch's logits until the evaluation ends (no
    eval_accumulation_steps): 4 MiB a batch, 80 batches, against 200 MiB of room."""
    watch = callback(200 << 20)
    args = arguments(tmp_path, max_steps=40, eval_strategy="steps", eval_steps=20)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(64), eval_dataset=Tokens(80 * BATCH),
                      compute_metrics=lambda predictions: {}, callbacks=[watch])  # a metric: logits are kept
    trainer.train()
    assert watch.exit_code == 42 and watch.action_step == 20, "acted on when the first evaluation ended"
    assert trainer.state.global_step == 20 and (tmp_path / "checkpoint-20").is_dir()
    assert watch.findings == [EVAL_ACCUMULATION_FINDING]
    (acted,) = events.named("action_outcome")
    assert "eval_accumulation_steps" in acted["block"]
    phases = {s.phase for s in watch.watchdog.history}
    assert phases == {"", "eval/80"}, "evaluation batches were sampled under the eval phase"
