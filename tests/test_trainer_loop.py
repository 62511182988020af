"""The training loop's promises: exact continuation across a reinit and a restart, state back on the
training device, SIGTERM saved and exit 42, bad input exit 2."""

import shutil
import signal
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from conftest import REPO, hbm_watchdog_env, json_lines, python, run_python

from watchdog.commands.cli import main
from watchdog.core.config import WatchdogConfig
from watchdog.core.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_RESTART_REQUESTED
from watchdog.core.sample import load_trace
from watchdog.core.verdict import Action
from watchdog.trainer.loop import TrainConfig, Trainer, off_device_tensors, watch_step
from watchdog.trainer.model import ModelConfig

N = 6
# Dropout on, so the RNG matters: a continuation that lost the RNG state would diverge.
TINY = TrainConfig(steps=2 * N, model=ModelConfig(depth=2, width=32, heads=4, seq_len=16, dropout=0.1,
                                                  activation_checkpointing="full"),
                   batch_size=4, device="cpu", log_every=1, watchdog=None, progress_bar=False)


def finish(config):
    trainer = Trainer(config)
    try:
        return trainer.run(), trainer.state
    finally:
        trainer.close()


def test_a_restart_without_a_checkpoint_dir_keeps_its_checkpoints_and_says_where(events):
    """Without --checkpoint-dir the checkpoints live in a temporary directory, removed at the end:
    a run that ends asking for a restart keeps it (nothing lost) and logs how to resume from it."""
    trainer = Trainer(replace(TINY, forced_actions=((2, Action.CHECKPOINT_RESTART),)))
    kept = trainer.checkpointer.checkpoints.directory
    try:
        result = trainer.run()
    finally:
        trainer.close()
    assert result.exit_code == EXIT_RESTART_REQUESTED and result.step == 3
    (said,) = events.named("checkpoints_kept")
    assert said["checkpoint_dir"] == str(kept) and f"--checkpoint-dir {kept} --resume auto" in said["note"]
    assert [p.name for p in kept.iterdir()] == ["ckpt-00000003.pt"] and str(kept) in result.table
    clean = Trainer(replace(TINY, steps=2))
    try:
        assert clean.run().exit_code == EXIT_OK
    finally:
        clean.close()
    assert not clean.checkpointer.checkpoints.directory.exists(), "a run that needs nothing kept leaves nothing behind"
    shutil.rmtree(kept)


def assert_bitwise_equal(a, b):
    model_a, model_b = a.model.state_dict(), b.model.state_dict()
    assert model_a.keys() == model_b.keys()
    for key in model_a:
        assert torch.equal(model_a[key], model_b[key]), key
    opt_a, opt_b = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    for index in opt_a:
        for key in opt_a[index]:
            assert torch.equal(opt_a[index][key], opt_b[index][key]), (index, key)
    assert a.scheduler.state_dict()["last_epoch"] == b.scheduler.state_dict()["last_epoch"]


def test_reinit_and_restart_continue_bit_for_bit(tmp_path):
    straight, straight_state = finish(replace(TINY, checkpoint_dir=tmp_path / "straight"))

    reinit, reinit_state = finish(replace(TINY, checkpoint_dir=tmp_path / "reinit",
                                          forced_actions=((N - 1, Action.CHECKPOINT_REINIT),)))
    assert reinit.exit_code == EXIT_OK and reinit.reinits == 1 and reinit.step == 2 * N

    restart_config = replace(TINY, checkpoint_dir=tmp_path / "restart",
                             forced_actions=((N - 1, Action.CHECKPOINT_RESTART),))
    first, _ = finish(restart_config)
    assert first.exit_code == EXIT_RESTART_REQUESTED and first.step == N
    torch.manual_seed(1234)  # a new process would not share this one's generators
    resumed, resumed_state = finish(replace(restart_config, forced_actions=()))
    assert resumed.first_step == N and resumed.step == 2 * N and resumed.restarts == 1

    assert_bitwise_equal(straight_state, reinit_state)
    assert_bitwise_equal(straight_state, resumed_state)
    assert reinit.losses == straight.losses
    assert {**first.losses, **resumed.losses} == straight.losses
    assert straight.losses[2 * N - 1] < straight.losses[0]  # and it does learn


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path, capsys):
    finish(replace(TINY, steps=2, checkpoint_dir=tmp_path, model=replace(TINY.model, dropout=0.0)))
    code = main(["train", "--device", "cpu", "--steps", "4", "--checkpoint-dir", str(tmp_path),
                 "--depth", "2", "--width", "32", "--heads", "4", "--seq-len", "32", "--no-watchdog"])
    assert code == EXIT_BAD_INPUT
    assert "different model (seq_len differ)" in capsys.readouterr().err


XLA_STATE = r"""
import sys, torch, torch_xla
from dataclasses import replace
from watchdog.trainer.loop import TrainConfig, Trainer, off_device_tensors
from watchdog.trainer.model import ModelConfig
from watchdog.core.verdict import Action

config = TrainConfig(steps=6, model=ModelConfig(depth=1, width=32, heads=2, seq_len=16), batch_size=2,
                     device="xla", log_every=1, watchdog=None, progress_bar=False, checkpoint_dir=sys.argv[1],
                     forced_actions=((2, Action.CHECKPOINT_REINIT),))
device = torch_xla.device()
marker = torch.arange(4.0, device=device) * 2  # lives across everything: a second runtime would orphan it
torch_xla.sync()

trainer = Trainer(config)
result = trainer.run()
assert result.reinits == 1 and result.step == 6, result
assert trainer.device == device
state_tensors = [v for s in trainer.state.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
assert len(state_tensors) >= 3 * len(list(trainer.state.model.parameters())), len(state_tensors)
assert off_device_tensors(trainer.state, device) == [], off_device_tensors(trainer.state, device)

resumed = Trainer(replace(config, steps=8, forced_actions=()))
result = resumed.run()
assert result.first_step == 6 and result.step == 8, result
assert resumed.device == device
assert off_device_tensors(resumed.state, device) == [], off_device_tensors(resumed.state, device)
assert marker.cpu().tolist() == [0.0, 2.0, 4.0, 6.0]
assert torch_xla.runtime.global_runtime_device_count() == 1
print("ok")
"""


@pytest.mark.slow
def test_xla_optimizer_state_is_on_the_device_after_reinit_and_after_resume(tmp_path):
    assert run_python(XLA_STATE, str(tmp_path)).strip().endswith("ok")


def test_off_device_tensors_names_what_is_elsewhere():
    trainer = Trainer(replace(TINY, steps=1))
    try:
        trainer.run()
        state = trainer.state
        assert off_device_tensors(state, torch.device("cpu")) == []
        state.optimizer.state[state.model.head.weight]["exp_avg"] = torch.zeros(1, device="meta")
        assert any(name.endswith(".exp_avg") for name in off_device_tensors(state, torch.device("cpu")))
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.long
def test_sigterm_saves_at_the_step_boundary_exits_42_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [sys.executable, "-m", "watchdog", "--log-format", "json", "train", "--device", "cpu",
            "--steps", "400", "--log-every", "1", "--no-watchdog", "--checkpoint-dir", str(ckpt),
            "--depth", "1", "--width", "32"]
    child = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
                             env=hbm_watchdog_env())
    seen = []
    for line in child.stderr:  # wait until it really trains
        seen.append(line)
        if '"train_progress"' in line and '"step": 5,' in line:
            break
    child.send_signal(signal.SIGTERM)
    stdout, stderr = child.communicate(timeout=120)
    assert child.returncode == EXIT_RESTART_REQUESTED, "".join(seen) + stderr
    records = json_lines("".join(seen) + stderr)
    preempted = [r for r in records if r["event"] == "preempted"]
    saved = [r for r in records if r["event"] == "checkpoint_saved"]
    assert len(preempted) == 1 and preempted[0]["signal"] == "SIGTERM"
    assert saved and saved[-1]["step"] == preempted[0]["step"] + 1
    assert "restart requested (exit 42)" in stdout

    again = python(args[1:], timeout=300)
    assert again.returncode == EXIT_OK, again.stderr[-3000:]
    assert f"steps 400/400 (this run from {saved[-1]['step']})" in again.stdout


@pytest.mark.parametrize("argv, fragment", [
    (["--steps", "-1"], "--steps: expected a whole number"),
    (["--inject-leak", "bogus:1/step"], "unknown kind 'bogus'"),
    (["--inject-leak", "tensors:4MiB"], "tensors:AMOUNT/step"),
    (["--memory-limit", "lots"], "--memory-limit"),
    (["--sample-every", "0"], "--sample-every: expected a positive whole number"),
    (["--force-action", "explode@3"], "reinit@STEP or restart@STEP"),
    (["--eval-every", "-5"], "--eval-every: expected a whole number"),
    (["--eval-steps", "0"], "--eval-steps: expected a positive whole number"),
    (["--steps", "\u0661"], "digits 0-9"),  # int() would read the Arabic-Indic one as 1
    (["--seed", "-1"], "--seed: expected a seed"),
    (["--memory-limit", "9" * 400], "too large"),
    (["--force-action", "reinit@\u00b2"], "--force-action"),
    (["--force-action", "restart@5"], "give --checkpoint-dir"),  # a restart could not resume from a temporary one
])
def test_bad_input_is_one_line_and_exit_2(argv, fragment, capsys):
    assert main(["train", *argv]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and "Traceback" not in err


def test_checkpoint_dir_that_cannot_be_a_directory_is_exit_2(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert main(["train", "--checkpoint-dir", str(blocker / "ckpt")]) == EXIT_BAD_INPUT
    assert "is not a directory" in capsys.readouterr().err


@pytest.mark.slow
def test_train_flags_are_parsed_without_importing_torch():
    code = ("import sys; from watchdog.commands.cli import build_parser; "
            "build_parser().parse_args(['train', '--inject-leak', 'tensors:1MiB/step']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=hbm_watchdog_env(), timeout=60)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_periodic_checkpoints_every_n_steps(tmp_path):
    result, _ = finish(replace(TINY, steps=10, checkpoint_every=3, keep_checkpoints=10, checkpoint_dir=tmp_path))
    assert result.exit_code == EXIT_OK
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.pt")) == [
        "ckpt-00000003.pt", "ckpt-00000006.pt", "ckpt-00000009.pt", "ckpt-00000010.pt"]  # and the final one


def test_the_watchdogs_counter_counts_evaluation_batches_and_depends_on_the_step_alone():
    config = replace(TINY, eval_every=4, eval_steps=3)
    assert [watch_step(config, s) for s in range(9)] == [0, 1, 2, 3, 7, 8, 9, 10, 14]
    assert watch_step(replace(TINY, eval_every=0), 8) == 8


def test_an_evaluation_runs_under_the_eval_phase_keeps_its_outputs_until_it_ends_and_changes_no_step(tmp_path):
    trace = tmp_path / "trace.csv"
    watched = WatchdogConfig(sample_every=1, source="rss", memory_limit_bytes=1 << 40, trace_file=trace)
    with_eval, with_eval_state = finish(replace(TINY, watchdog=watched, eval_every=4, eval_steps=3,
                                                eval_keep_outputs=True, checkpoint_dir=tmp_path / "a"))
    plain, plain_state = finish(replace(TINY, checkpoint_dir=tmp_path / "b"))
    assert with_eval.losses == plain.losses  # an evaluation reads the model and draws no random number
    assert_bitwise_equal(with_eval_state, plain_state)
    samples = load_trace(trace)
    steps = [s.step for s in samples]
    # One counter through 12 training steps and three evaluations of 3 batches (after training
    # steps 3, 7 and 11: counts 4-6, 11-13, 18-20). The sidecar reads the newest step it was asked
    # for, labelled with an evaluation the loop was in when it asked or is in when it reads (a step
    # asked just before an evaluation may be read, and labelled, inside it); each evaluation's end
    # takes one more reading at its last step, labelled with it (the only step read twice).
    assert steps == sorted(steps) and steps[-1] <= 20
    again = [s.phase for a, s in zip(samples, samples[1:]) if a.step == s.step]
    assert again.count("eval/3") == 3 and set(again) <= {"eval/3", "save"}  # the last step's save: a phase too
    evaluating = {s.step for s in samples if s.phase == "eval/3"}
    assert evaluating and evaluating <= {3, 4, 5, 6, 10, 11, 12, 13, 17, 18, 19, 20}
    assert {s.phase for s in samples} == {"", "eval/3", "save"}


def test_a_census_that_raises_is_logged_and_the_action_still_saves_and_reinits(tmp_path, monkeypatch):
    """What is leaking is a diagnosis: when it fails (a CI run met a tensor the census could not
    read), the checkpoint and the rebuild the action asked for still happen."""
    from watchdog.forensics import census as forensics

    def broken(*args, **kwargs):
        raise RuntimeError("cannot call get_autograd_meta() on undefined tensor")

    monkeypatch.setattr(forensics, "explain_leak", broken)
    result, _ = finish(replace(TINY, checkpoint_dir=tmp_path, forced_actions=((N - 1, Action.CHECKPOINT_REINIT),)))
    assert result.exit_code == EXIT_OK and result.reinits == 1 and result.step == 2 * N


@pytest.mark.parametrize("flag", ["--trace-file", "--checkpoint-dir"])
def test_a_path_too_long_to_look_up_is_one_line_not_a_traceback(flag, capsys):
    # Found by tests/test_fuzz.py: a 400-character name made Path.is_dir() raise ENAMETOOLONG.
    from watchdog.commands.cli import main

    assert main(["train", flag, "9" * 400]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "File name too long" in err


def test_the_watchdogs_restarts_in_a_row_start_over_after_the_window():
    from watchdog.core.restarts import restarts_in_a_row

    assert restarts_in_a_row(0, None, 9_842, window=2_000) == 1
    assert restarts_in_a_row(1, 9_842, 19_807, window=2_000) == 1  # 10k steps of progress: not a loop
    assert restarts_in_a_row(1, 1_000, 1_300, window=2_000) == 2  # the leak refilled at once: a loop
    assert restarts_in_a_row(3, 1_000, 90_000, window=0) == 4  # no window: every restart counts


def test_the_trainers_run_is_the_story_of_a_step_and_never_tests_for_a_missing_watchdog():
    """Issue 49: `run()` decided saves, evaluations, reinits, restarts and exit codes itself, with 26
    `watchdog is None` branches. Its components now decide their own parts (the checkpointer, the
    evaluator, the stop signals, the watchdog's one action path), and an unwatched run gets a
    stand-in that does nothing (`Unwatched`)."""
    import inspect

    from watchdog.trainer import loop

    source = inspect.getsource(loop)
    assert "self.watchdog is None" not in source and "self.watchdog is not None" not in source
    assert len(inspect.getsource(loop.Trainer.run).splitlines()) <= 40
