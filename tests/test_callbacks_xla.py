"""The Hugging Face and Lightning callbacks on torch_xla (PJRT CPU): transformers picks the XLA device
by itself, Lightning is told the PJRT device count, and neither callback adds a compilation or a
transfer (each run a fresh process, so the compile cache starts empty)."""

import json

import pytest
from conftest import REPO, hbm_watchdog_env, run_python_args


def run(mode: str, tmp_path) -> dict:
    env = hbm_watchdog_env(USE_TORCH_XLA="1")
    out = run_python_args([str(REPO / "tests" / "jobs" / "hf_xla.py"), mode, str(tmp_path / mode)], env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_callback_adds_no_compilation_to_a_trainer_on_xla(tmp_path):
    bare, watched = run("off", tmp_path), run("on", tmp_path)
    assert bare["device"] == watched["device"] == "xla:0" and watched["watched"] == "xla:0"
    assert watched["steps"] == 30 and watched["samples"] >= 2, "the watchdog sampled while the Trainer ran"
    assert bare["counters"].get("UncachedCompile", 0) > 0, "the probe must see compilations at all"
    assert watched["counters"] == bare["counters"]
    assert watched["loss"] == bare["loss"]


def run_lightning(mode: str, tmp_path) -> dict:
    out = run_python_args([str(REPO / "tests" / "jobs" / "lightning_xla.py"), mode, str(tmp_path / mode)])
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_lightning_callback_adds_no_compilation_to_a_fit_on_xla(tmp_path):
    bare, watched = run_lightning("off", tmp_path), run_lightning("on", tmp_path)
    # sampled while the Trainer ran (a reading of the job's memory takes about a millisecond: under the
    # suite's load the sidecar coalesces some of the 20 steps' requests into the newest, by design)
    assert watched["steps"] == 20 and watched["samples"] >= 10 and watched["watched"] == "xla:0"
    assert bare["counters"].get("UncachedCompile", 0) > 0, "the probe must see compilations at all"
    assert watched["counters"] == bare["counters"]
    assert watched["loss"] == bare["loss"]
