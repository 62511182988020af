"""Leaks outside this process's tensors (issue 54), each a loop of one's own on plain CPU, watched
by the real `Watchdog` on the job's memory against a host budget, with its bounded twin, which must
get no action.

- DataLoader workers that each keep what they load: with `num_workers > 0` the *workers'* memory
  grows (per-worker caches, pages copied by touching the parent's Python objects) while the
  trainer's own process stays flat. https://github.com/InternLM/InternEvo/issues/415,
  https://github.com/pytorch/pytorch/issues/13246. Before, the judged series was the trainer's own
  resident memory: it sat at 1.0 GiB while the tree read 2,424 MiB at the budget, unjudged, and
  the tree's figure counted the pages the forked workers share with the trainer twice.
- An evaluation that keeps more every time it runs: https://github.com/metatensor/metatrain/issues/1014
  (an eval loop OOMs after about 100k samples), https://github.com/karpathy/nanochat/pull/295 (29
  hours lost to an eval's OOM; it asks for a checkpoint before eval). The floor between runs
  stays flat and each run ends below the limit, but each peaks higher. Before, the eval-end peaks
  rose about 33 MiB a run until they crossed the budget, while the watchdog projected from the floor.
"""

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import hbm_watchdog_env

pytestmark = pytest.mark.slow

WORKER_CACHE = textwrap.dedent('''
    import json, sys, time
    import psutil, torch
    from torch.utils.data import DataLoader, Dataset
    from watchdog import Watchdog, WatchdogConfig
    from watchdog.runtime import host_memory

    host_memory.RESCAN_SECONDS, host_memory.PRIVATE_EVERY_SECONDS = 0.2, 0.1  # a short loop's cadence
    MiB = 1 << 20
    bounded = sys.argv[1] == "bounded"

    class Items(Dataset):
        """Each worker keeps every item it loads (or, bounded, its newest 16)."""

        def __init__(self):
            self.kept = {}

        def __len__(self):
            return 10 ** 6

        def __getitem__(self, index):
            self.kept[index] = bytearray(b"x" * MiB)
            if bounded and len(self.kept) > 16:
                self.kept.pop(next(iter(self.kept)))
            return torch.zeros(4)

    budget = psutil.Process().memory_info().rss + 500 * MiB
    config = WatchdogConfig(sample_every=5, device="cpu", source="rss", host_memory_limit_bytes=budget)
    batches = iter(DataLoader(Items(), batch_size=1, num_workers=2))  # kept: its workers live to the end
    result = {"budget": budget}
    with Watchdog(config) as wd:
        for step, batch in enumerate(batches):
            time.sleep(0.004)
            action = wd.step(step)
            tree = wd._source.tree
            used = tree.bytes_used()
            result["highest"] = max(result.get("highest", 0), used)
            if action is not None and action.needs_checkpoint:
                result.update(acted=step, used=used, suspects=list(wd.last_action.suspects))
                break
            if step >= 1200:
                break
        children = psutil.Process().children(recursive=True)
        own = psutil.Process().memory_info().rss
        result["resident_sum"] = own + sum(child.memory_info().rss for child in children)
        result["counted_once"] = wd._source.tree.bytes_used(own)
    print(json.dumps(result))
''')


def run_loop(script: str, tmp_path, *args: str) -> dict:
    path = tmp_path / "loop.py"
    path.write_text(script)
    completed = subprocess.run([sys.executable, str(path), *args], cwd=tmp_path, capture_output=True, text=True,
                               timeout=240, env=hbm_watchdog_env())
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_dataloader_workers_that_keep_what_they_load_are_acted_on_before_the_budget_and_named(tmp_path):
    result = run_loop(WORKER_CACHE, tmp_path, "leaking")
    assert "acted" in result, result
    assert result["highest"] < result["budget"], "acted on before the job's memory reached its budget"
    named = [line for line in result["suspects"] if line.startswith("DataLoader worker ")]
    assert named and " of its own since it started" in named[0], result["suspects"]
    # the workers' shared pages are the trainer's: counted once, well under the resident sets' sum
    assert result["counted_once"] < result["resident_sum"] - 100 * (1 << 20), result


def test_dataloader_workers_with_a_bounded_cache_are_left_alone(tmp_path):
    result = run_loop(WORKER_CACHE, tmp_path, "bounded")
    assert "acted" not in result, result


EVAL_PEAKS = textwrap.dedent('''
    import json, sys, time
    import psutil
    from watchdog import Watchdog, WatchdogConfig

    MiB = 1 << 20
    bounded = sys.argv[1] == "bounded"
    budget = psutil.Process().memory_info().rss + 300 * MiB
    config = WatchdogConfig(sample_every=2, device="cpu", source="rss", host_memory_limit_bytes=budget)
    result, evaluations, step, action = {"budget": budget, "evaluations": []}, 0, 0, None
    with Watchdog(config) as wd:
        while evaluations < 12 and action is None:
            step += 1
            time.sleep(0.002)
            action = wd.step(step)
            if action is None and step % 100 == 0:  # an evaluation of 40 batches, its predictions kept to its end
                predictions = []
                with wd.phase("eval", steps=40):
                    for batch in range(40):
                        size = 4 if bounded else evaluations + 1  # MiB a batch; bounded: the same every time
                        predictions.append(bytearray(b"x" * (size * MiB)))
                        time.sleep(0.002)
                        step += 1
                        action = wd.step(step)
                        if action is not None:
                            break  # the evaluation stops where the action comes, as the callbacks' do
                result["evaluations"].append(step)
                result["highest"] = max(result.get("highest", 0), psutil.Process().memory_info().rss)
                del predictions
                evaluations += 1
        if action is not None and action.needs_checkpoint:
            result.update(acted=step, explanation=wd.last_action.verdict.explanation)
    print(json.dumps(result))
''')


def test_an_evaluation_that_keeps_more_each_run_is_acted_on_between_runs_before_the_one_that_would_cross(tmp_path):
    result = run_loop(EVAL_PEAKS, tmp_path, "leaking")
    assert "acted" in result, result
    assert "eval runs peak higher each time" in result["explanation"], result
    assert result["highest"] < result["budget"], "every evaluation that ran stayed under the budget"
    assert len(result["evaluations"]) >= 4 and result["acted"] > result["evaluations"][-1], "between runs"


def test_an_evaluation_that_keeps_the_same_each_run_is_left_alone(tmp_path):
    result = run_loop(EVAL_PEAKS, tmp_path, "bounded")
    assert "acted" not in result and len(result["evaluations"]) == 12, result
