"""The Hugging Face callback on torch_xla (PJRT CPU): transformers picks the XLA device by itself,
and the callback adds no compilation and no transfer (each run a fresh process, so the compile
cache starts empty)."""

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
    assert watched["steps"] == 12 and watched["samples"] >= 10, "the watchdog sampled while the Trainer ran"
    assert bare["counters"].get("UncachedCompile", 0) > 0, "the probe must see compilations at all"
    assert watched["counters"] == bare["counters"]
    assert watched["loss"] == bare["loss"]
