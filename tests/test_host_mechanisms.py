"""Leaks outside this process's tensors (issue 54), each a loop of one's own on plain CPU and on PJRT
CPU (`on`), watched by the real `Watchdog` on the job's memory against a host budget, with its
bounded twin, which must get no action.

- DataLoader workers that each keep what they load: with `num_workers > 0` the *workers'* memory
  grows (per-worker caches, pages copied by touching the parent's Python objects) while the
  trainer's own process stays flat. https://github.com/InternLM/InternEvo/issues/415,
  https://github.com/pytorch/pytorch/issues/13246. Before, the judged series was the trainer's own
  resident memory: it sat at 1.0 GiB while the tree read 2,424 MiB at the budget, unjudged, and
  the tree's figure counted the pages the forked workers share with the trainer twice.
- Python objects that pile up, no tensor and no buffer among them:
  https://github.com/pytorch/torchtitan/issues/3790 (fused AdamW with FSDP2 kept `DTensorSpec`
  objects, about 0.5 MB a step of host RAM, 57.6 GB over 102k steps). Before, the census said
  "no growing group of live tensors or Python buffers found"; then (issue 61) it named the
  commonest type's innermost holder, "+472,016 Python objects tuple; held by attribute
  'placements' of DTensorSpec". The loop keeps the cache's shape (a dict keyed by each step's
  scalar and the parameter, of tuples of frozen dataclasses holding tuples, an attribute of the
  optimizer), and a shape it was not built from (namedtuples in a module's deque) beside it.
- A staircase at every checkpoint save: https://github.com/marin-community/marin/issues/6774 (about
  26 GB of host RAM kept per save, an OOM after about 20 saves).
- A cache that fills ever more slowly is not a leak: a cache of 1 MiB records over 188 keys drawn at
  random fills as 1 - exp(-t/188) and stops at 188 MiB. Its twin caches a record under a key that
  never comes again, a leak at the cache's first rate. (Issue 54 saw a cache of 188 MiB acted on at
  step 301 with a 414.8 KiB/step projection to its limit, its plateau close under the limit: here it
  levels off 112 MiB and 32 MiB under it. tests/test_detector.py has that case's series, which the
  detector now tells from a leak by the slowdown of its whole ramp.)
- An evaluation that keeps more every time it runs: https://github.com/metatensor/metatrain/issues/1014
  (an eval loop OOMs after about 100k samples), https://github.com/karpathy/nanochat/pull/295 (29
  hours lost to an eval's OOM; it asks for a checkpoint before eval). The floor between runs
  stays flat and each run ends below the limit, but each peaks higher. Before, the eval-end peaks
  rose about 33 MiB a run until they crossed the budget, while the watchdog projected from the floor.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import hbm_watchdog_env, memory_cgroup

pytestmark = pytest.mark.slow

# Where the loop runs: plain CPU, or PJRT CPU (torch_xla's CPU device, whose memory the `auto`
# source reads as the process tree's too: torch_xla reports none on CPU).
WHERE = textwrap.dedent('''
    import os
    if os.environ.get("LOOP_DEVICE") == "xla":
        import torch_xla
        WHERE = dict(device=str(torch_xla.device()), source="auto")
    else:
        WHERE = dict(device="cpu", source="rss")

    def stepped(wd, step):
        """`wd.step(step)`, and on a sampling step a wait for its reading. A real step outlasts the
        sidecar's reading; these loops' 2 to 4 ms do not on a loaded machine, and in CI the sidecar
        fell that far behind (a save's staging copy, an evaluation's end-of-pass copy crossed before
        the verdict on the one before came). Each loop tests the decision, not the machine's load."""
        action = wd.step(step)
        if step % wd.config.sample_every == 0:
            wd.drain()
        return action
''')
ON = pytest.mark.parametrize("on", ["cpu", "xla"])

WORKER_CACHE = WHERE + textwrap.dedent('''
    import gc, json, sys, time
    import psutil, torch
    from torch.utils.data import DataLoader, Dataset
    from watchdog import Watchdog, WatchdogConfig
    from watchdog.readers.host_memory import job_memory
    from watchdog.readers.sources import release_host_memory

    MiB = 1 << 20
    bounded = sys.argv[1] == "bounded"

    class Items(Dataset):
        \"\"\"Items decoded up front, then memoised as each worker loads them (or, bounded, its newest 16).\"\"\"

        def __init__(self):
            self.decoded = [bytearray(b"d" * MiB) for _ in range(150)]  # shared with the workers it forks
            self.kept = {}

        def __len__(self):
            return 10 ** 6

        def __getitem__(self, index):
            self.kept[index] = bytearray(b"x" * MiB)
            if bounded and len(self.kept) > 16:
                self.kept.pop(next(iter(self.kept)))
            return torch.zeros(4)

    items = Items()
    budget = job_memory() + 500 * MiB
    config = WatchdogConfig(sample_every=5, **WHERE, host_memory_limit_bytes=budget)
    result = {"budget": budget}
    with Watchdog(config) as wd:
        # Persistent workers, started after the watchdog: they hold the decoded items, which the
        # trainer then lets go of. Those pages are shared by the two workers alone: in neither's
        # private memory and in no longer the trainer's resident set, yet the job's all the same.
        batches = iter(DataLoader(items, batch_size=1, num_workers=2, persistent_workers=True))
        next(batches)
        items.decoded = None
        gc.collect()
        release_host_memory()
        for step, batch in enumerate(batches):
            time.sleep(0.004)
            action = stepped(wd, step)
            used = job_memory()
            result["highest"] = max(result.get("highest", 0), used)
            if action is not None and action.needs_checkpoint:
                result.update(acted=step, used=used, suspects=list(wd.last_action.suspects))
                break
            if step >= 1200:
                break
        children = psutil.Process().children(recursive=True)
        own = psutil.Process().memory_full_info()
        result["resident_sum"] = own.rss + sum(child.memory_info().rss for child in children)
        # the old count: the trainer's resident memory less its file pages, plus each worker's private memory
        result["private_sum"] = own.rss - own.shared + sum(child.memory_full_info().uss for child in children)
        result["counted_once"] = job_memory()
    print(json.dumps(result))
''')


def run_loop(script: str, tmp_path, *args: str, on: str = "cpu", preexec_fn=None) -> dict:
    path = tmp_path / "loop.py"
    path.write_text(script)
    completed = subprocess.run([sys.executable, str(path), *args], cwd=tmp_path, capture_output=True, text=True,
                               timeout=240, env={**hbm_watchdog_env(), "LOOP_DEVICE": on}, preexec_fn=preexec_fn)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def acted_before_its_budget(script: str, tmp_path, *named: str, on: str = "cpu") -> dict:
    """The leaking loop of `script` was acted on before its memory reached its budget, and the
    action's block named each of `named`."""
    result = run_loop(script, tmp_path, "leaking", on=on)
    assert "acted" in result and result["highest"] < result["budget"], result
    said = " ".join(result["suspects"])
    assert all(words in said for words in named), said
    return result


HARNESS = WHERE + textwrap.dedent('''
    import json, sys, time
    from watchdog import Watchdog, WatchdogConfig
    from watchdog.readers.host_memory import job_memory

    MiB = 1 << 20
    bounded = sys.argv[1] == "bounded"
    result = {}

    def watched(headroom_mib, every=5):
        """A watchdog on this process tree's memory, its budget `headroom_mib` above it now."""
        result["budget"] = budget = job_memory() + headroom_mib * MiB
        return Watchdog(WatchdogConfig(sample_every=every, **WHERE, host_memory_limit_bytes=budget))

    def acted(wd, step):
        """The step's call, the highest memory so far; True when a checkpoint action came."""
        result["highest"] = max(result.get("highest", 0), job_memory())
        action = stepped(wd, step)
        if action is not None and action.needs_checkpoint:
            result.update(acted=step, suspects=list(wd.last_action.suspects))
            return True
        return False
''')


@ON
def test_dataloader_workers_that_keep_what_they_load_are_acted_on_before_the_budget_and_named(tmp_path, on):
    result = run_loop(WORKER_CACHE, tmp_path, "leaking", on=on)
    assert "acted" in result, result
    assert result["highest"] < result["budget"], "acted on before the job's memory reached its budget"
    named = [line for line in result["suspects"] if line.startswith("DataLoader worker ")]
    assert named and " of its own since it started" in named[0], result["suspects"]
    # each page once: well under the resident sets' sum (shared pages counted twice there), and well
    # over the old count, which dropped the 150 MiB the two workers share and the trainer let go of
    assert result["counted_once"] < result["resident_sum"] - 100 * (1 << 20), result
    assert result["counted_once"] > result["private_sum"] + 100 * (1 << 20), result


@ON
def test_dataloader_workers_with_a_bounded_cache_are_left_alone(tmp_path, on):
    result = run_loop(WORKER_CACHE, tmp_path, "bounded", on=on)
    assert "acted" not in result, result


EVAL_PEAKS = WHERE + textwrap.dedent('''
    import json, sys, time
    from watchdog import Watchdog, WatchdogConfig
    from watchdog.readers.host_memory import job_memory

    MiB = 1 << 20
    bounded = sys.argv[1] == "bounded"
    plain = sys.argv[2:] == ["plain"]  # the README's plain form: wd.phase("eval") ... wd.phase("train")
    budget = job_memory() + 315 * MiB  # run 7 keeps 280 MiB, run 8 would keep 320
    config = WatchdogConfig(sample_every=2, **WHERE, host_memory_limit_bytes=budget)
    result, evaluations, step, action = {"budget": budget, "evaluations": []}, 0, 0, None

    def evaluate(predictions):
        """40 batches, their predictions kept to the evaluation's end."""
        global step, action
        for batch in range(40):
            size = 4 if bounded else evaluations + 1  # MiB a batch; bounded: the same every time
            predictions.append(bytearray(b"x" * (size * MiB)))
            time.sleep(0.002)
            step += 1
            action = stepped(wd, step)
            if action is not None:
                break  # the evaluation stops where the action comes, as the callbacks' do

    with Watchdog(config) as wd:
        while evaluations < 12 and action is None:
            step += 1
            time.sleep(0.002)
            action = stepped(wd, step)
            if action is None and step % 100 == 0:
                predictions = []
                if plain:
                    wd.phase("eval", steps=40)
                    evaluate(predictions)
                    wd.phase("train")
                else:
                    with wd.phase("eval", steps=40):
                        evaluate(predictions)
                result["evaluations"].append(step)
                result["highest"] = max(result.get("highest", 0), job_memory())
                del predictions
                evaluations += 1
        if action is not None and action.needs_checkpoint:
            result.update(acted=step, explanation=wd.last_action.verdict.explanation,
                          suspects=list(wd.last_action.suspects))
    print(json.dumps(result))
''')


@ON
@pytest.mark.parametrize("form", ["with", "plain"])
def test_an_evaluation_that_keeps_more_each_run_is_acted_on_between_runs_before_the_one_that_would_cross(
        tmp_path, on, form):
    """Both forms of a phase are one mechanism (issue 64: the plain form never counted a run's end,
    and its action named nothing where the `with` form named 'predictions')."""
    result = run_loop(EVAL_PEAKS, tmp_path, "leaking", form, on=on)
    assert "acted" in result, result
    assert result["highest"] < result["budget"], "every evaluation that ran stayed under the budget"
    assert len(result["evaluations"]) >= 4, result
    # what the run holds is named: counted at the newest run's end (between runs nothing of it is
    # alive), or live, where the action came inside a run
    assert "held by list of" in " ".join(result["suspects"]) and "'predictions'" in " ".join(result["suspects"]), result
    if on == "cpu":
        assert "eval runs peak higher each time" in result["explanation"], result
        assert result["acted"] > result["evaluations"][-1], "between runs"
    # On PJRT CPU the process's memory drifts up beside the runs' peaks: its 7th run peaked 9 MiB
    # under the budget (measured, three runs: twice the peaks' projection after it, at step 745; once
    # the limit rule inside it, at step 735). On CPU, 24-27 MiB under it, the projection at 745 each time.


@ON
def test_an_evaluation_that_keeps_the_same_each_run_is_left_alone(tmp_path, on):
    result = run_loop(EVAL_PEAKS, tmp_path, "bounded", on=on)
    assert "acted" not in result and len(result["evaluations"]) == 12, result


PYTHON_OBJECTS = HARNESS + textwrap.dedent('''
    from collections import deque, namedtuple
    from dataclasses import dataclass
    import torch

    @dataclass(frozen=True)
    class Shard:
        dim: int

    @dataclass(frozen=True)
    class TensorMeta:
        shape: tuple
        stride: tuple
        dtype: str

    class DeviceMesh:
        pass

    @dataclass(frozen=True)
    class DTensorSpec:
        mesh: DeviceMesh
        placements: tuple
        tensor_meta: TensorMeta

    class FusedAdamW(torch.optim.AdamW):
        """pytorch/torchtitan#3790's shape: each step's sharding specs kept in a dict keyed by the step's
        scalar and the parameter, a pair of frozen dataclasses (holding tuples) per parameter."""

        def __init__(self, params, shards):
            super().__init__(params, lr=1e-3)
            self.mesh, self.shards, self._sharding_cache, self.scalars = DeviceMesh(), shards, {}, deque()

        def step(self, closure=None):
            super().step(closure)
            scalar = len(self.scalars) * 1e-3 + 1.0
            self.scalars.append(scalar)
            for i, shape in enumerate(self.shards):
                meta = TensorMeta(shape, (shape[1], 1), "float32")
                self._sharding_cache[(scalar, i)] = (DTensorSpec(self.mesh, (Shard(0), Shard(i % 2)), meta),
                                                     DTensorSpec(self.mesh, (Shard(1),), meta))
            if bounded and len(self.scalars) > 20:  # the newest 20 steps' specs only
                oldest = self.scalars[-21]
                for i in range(len(self.shards)):
                    del self._sharding_cache[(oldest, i)]

    Sample = namedtuple("Sample", "step loss tags")
    RECENT = deque(maxlen=40_000 if bounded else None)  # a metrics logger's newest records

    shape = sys.argv[2]
    model = torch.nn.Linear(16, 16).to(WHERE["device"])
    optimizer = (FusedAdamW(model.parameters(), [(64, 64 + i) for i in range(600)]) if shape == "sharding"
                 else torch.optim.SGD(model.parameters(), lr=1e-3))
    batch = torch.randn(8, 16).to(WHERE["device"])
    with watched(250) as wd:
        for step in range(1, 1000):
            optimizer.zero_grad(set_to_none=True)
            model(batch).square().mean().backward()
            optimizer.step()
            if WHERE["device"] != "cpu":
                torch_xla.sync()
            if shape == "deque":
                RECENT.extend(Sample(step, 0.5, [step, i]) for i in range(2000))
            if acted(wd, step):
                break
    print(json.dumps(result))
''')


@ON
@pytest.mark.parametrize("shape, named", [
    ("sharding", "entries of (DTensorSpec, DTensorSpec) in dict '_sharding_cache' of FusedAdamW"),
    ("deque", "entries of Sample in deque 'RECENT' in module __main__"),
])
def test_python_objects_that_pile_up_are_acted_on_before_the_budget_and_named_by_the_container_that_grows(
        tmp_path, on, shape, named):
    """Issue 61, item 5: the sharding cache was named "+472,016 Python objects tuple; held by attribute
    'placements' of DTensorSpec", its commonest type's innermost holder. The deque of namedtuples is a
    shape the mechanism was not designed from."""
    result = run_loop(PYTHON_OBJECTS, tmp_path, "leaking", shape, on=on)
    assert "acted" in result and result["highest"] < result["budget"], result
    said = " ".join(result["suspects"])
    assert named in said and "Python objects among them: about +" in said, said


@ON
@pytest.mark.parametrize("shape", ["sharding", "deque"])
def test_python_objects_kept_to_a_bound_are_left_alone(tmp_path, on, shape):
    assert "acted" not in run_loop(PYTHON_OBJECTS, tmp_path, "bounded", shape, on=on)


SAVE_STAIRCASE = HARNESS + textwrap.dedent('''
    class Checkpointer:
        def __init__(self):
            self.staged = []  # each save's host copy, never let go of (the leak)

        def save(self, state):
            staged = bytearray(state)  # a host copy of the state on its way to disk
            if not bounded:
                self.staged.append(staged)

    checkpointer, state = Checkpointer(), b"w" * (30 * MiB)
    result["saves"] = 0
    with watched(400) as wd:
        for step in range(1, 1600):
            time.sleep(0.002)
            if step % 50 == 0:
                checkpointer.save(state)
                result["saves"] += 1
            if acted(wd, step):
                break
    print(json.dumps(result))
''')


@ON
def test_a_staircase_at_every_save_is_acted_on_before_the_budget_with_the_staged_copies_named(tmp_path, on):
    acted_before_its_budget(SAVE_STAIRCASE, tmp_path, "Python buffers bytearray", "attribute 'staged' of Checkpointer",
                            on=on)


@ON
def test_saves_that_let_their_copies_go_are_left_alone(tmp_path, on):
    result = run_loop(SAVE_STAIRCASE, tmp_path, "bounded", on=on)
    assert "acted" not in result and result["saves"] == 31, result


FILLING_CACHE = HARNESS + textwrap.dedent('''
    import pickle, random

    cache, draw = {}, random.Random(0)
    saves = len(sys.argv) > 3 and sys.argv[3] == "saves"  # the loop saves every 100 steps, and times it
    with watched(int(sys.argv[2]) if len(sys.argv) > 2 else 300) as wd:  # MiB of headroom
        for step in range(1, 1500):
            time.sleep(0.002)
            key = draw.randrange(188) if bounded else step  # 188 keys: the cache fills ever more slowly
            if key not in cache:
                cache[key] = bytearray(b"r" * MiB)
            if saves and step % 100 == 0:
                started = time.perf_counter()
                with wd.phase("save"), open("state.pkl", "wb") as out:
                    pickle.dump({"step": step, "weights": bytes(MiB)}, out)
                wd.observe_checkpoint(time.perf_counter() - started)
            if acted(wd, step):
                break
    result["records"] = len(cache)
    print(json.dumps(result))
''')


@ON
def test_a_cache_that_keeps_every_record_is_acted_on_before_the_budget(tmp_path, on):
    acted_before_its_budget(FILLING_CACHE, tmp_path, "Python buffers bytearray[1048576]",
                            "global 'cache' in module __main__", on=on)


@ON
@pytest.mark.parametrize("headroom_mib", [300, 220])
def test_a_cache_that_fills_ever_more_slowly_and_levels_off_is_left_alone(tmp_path, on, headroom_mib):
    """Its plateau 112 MiB under the budget, and 32 MiB under it (issue 54's case, where a reinit came)."""
    result = run_loop(FILLING_CACHE, tmp_path, "bounded", str(headroom_mib), on=on)
    assert "acted" not in result and result["records"] == 188, result


@ON
def test_a_cache_levelling_off_at_90_to_94_percent_of_its_headroom_is_left_alone_once_a_save_is_timed(tmp_path, on):
    """Issue 62: its plateau 12 MiB under the budget (on PJRT CPU, whose memory moves a dozen MiB by
    itself, 22 MiB: at 12 the bounded loop reached the budget with no leak at all). The loop saves every
    100 steps and says what each save took: an action is then due only when what is left would not
    cover the save, a gap between readings and the hand-over, twice over (the latest safe moment), and
    the fill is seen to level off first. Without the saves timed, the same loop on CPU was acted on at
    step 517 (169 of its 188 records). Its twin, which keeps every record, is acted on before the budget
    all the same."""
    headroom = "200" if on == "cpu" else "210"
    result = run_loop(FILLING_CACHE, tmp_path, "bounded", headroom, "saves", on=on)
    assert "acted" not in result and result["records"] == 188, result
    twin = run_loop(FILLING_CACHE, tmp_path, "leaking", headroom, "saves", on=on)
    assert "acted" in twin and twin["highest"] < twin["budget"], twin


def test_another_rank_started_by_this_one_is_not_counted_in_its_tree_and_a_worker_is():
    """Lightning's own DDP launcher starts rank 1 from rank 0: rank 1 has its own watchdog and
    budget, and counted in rank 0's tree it made rank 0 act on a resumed leak (tests/test_ranks_e2e.py)."""
    import os

    import psutil

    from watchdog.readers.host_memory import ProcessTree

    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    worker = subprocess.Popen(sleep, env={**environ, **{k: os.environ[k] for k in ("RANK", "LOCAL_RANK") if k in os.environ}})
    rank = subprocess.Popen(sleep, env={**environ, "LOCAL_RANK": "7", "RANK": "7"})
    try:
        members = ProcessTree(psutil.Process()).pids()
        assert worker.pid in members and rank.pid not in members
    finally:
        for process in (worker, rank):
            process.kill()
            process.wait()


EVAL_CONCAT = WHERE + textwrap.dedent("""
    import json, sys, time
    from watchdog import Watchdog, WatchdogConfig
    from watchdog.readers.host_memory import job_memory

    MiB = 1 << 20
    bounded = sys.argv[1] == "bounded"
    budget = job_memory() + 420 * MiB  # the 5th pass's end would cross it; the floor, not for 1,400 steps
    config = WatchdogConfig(sample_every=5, **WHERE, host_memory_limit_bytes=budget)
    result, predictions, step, action = {"budget": budget, "evaluations": []}, [], 0, None

    with Watchdog(config) as wd:
        while len(result["evaluations"]) < 9 and action is None:
            step += 1
            time.sleep(0.002)
            action = stepped(wd, step)
            if action is None and step % 100 == 0:  # an evaluation, as Hugging Face's Trainer runs one
                if bounded:
                    predictions = []  # each pass keeps its own predictions only
                with wd.phase("eval"):
                    for batch in range(30):
                        predictions.append(bytearray(b"p" * MiB))
                        time.sleep(0.002)
                        step += 1
                        action = stepped(wd, step)
                        if action is not None:
                            break
                    else:  # compute_metrics: every prediction kept, concatenated at the pass's end, scored
                        everything = b"".join(predictions)
                        scores = bytearray(everything)
                        result["highest"] = max(result.get("highest", 0), job_memory())
                        del everything, scores
                result["evaluations"].append(step)
        if action is not None and action.needs_checkpoint:
            result.update(acted=step, explanation=wd.last_action.verdict.explanation,
                          suspects=list(wd.last_action.suspects))
    print(json.dumps(result))
""")


@ON
def test_an_evaluation_whose_end_of_pass_copy_climbs_is_acted_on_before_the_copy_that_would_cross(tmp_path, on):
    """Issue 61: every pass adds to the predictions kept, and at its end the metric concatenates all of
    them, between two readings, then scores the copy. The floor rises 0.3 MiB a step, far from the
    budget; the pass's end, 90 MiB higher each pass, crosses it at the 5th (on main at 4ee56fa this
    loop got no action before its 6th ("OOM too far ahead to call")). The
    phase's end now takes a reading whose peak (the kernel's high-water mark since the previous one)
    holds the copy: the runs' peaks climb, and the action comes before the pass that would cross."""
    result = run_loop(EVAL_CONCAT, tmp_path, "leaking", on=on)
    assert "acted" in result, result
    assert result["highest"] < result["budget"], f"every end-of-pass copy that ran stayed under the budget: {result}"
    assert len(result["evaluations"]) >= 4, result


@ON
def test_an_evaluation_whose_end_of_pass_copy_stays_the_same_is_left_alone(tmp_path, on):
    result = run_loop(EVAL_CONCAT, tmp_path, "bounded", on=on)
    assert "acted" not in result and len(result["evaluations"]) == 9, result


SAVE_STAGING = HARNESS + textwrap.dedent("""
    result["saves"], result["peaks"] = 0, []
    with watched(270) as wd:  # the 10th save peaks 15 MiB under the budget, the 11th would cross it
        for step in range(1, 801):
            time.sleep(0.002)
            if step % 50 == 0:
                with wd.phase("save"):  # a host copy of the state on its way to disk, let go once written
                    staged = bytearray((30 if bounded else 30 + 25 * result["saves"]) * MiB)
                    staged[::4096] = b"s" * len(staged[::4096])  # written, so resident (and no copy made)
                    result["peaks"].append(job_memory())
                    result["highest"] = max(result.get("highest", 0), result["peaks"][-1])
                    del staged
                result["saves"] += 1
            if acted(wd, step):
                break
    print(json.dumps(result))
""")


@ON
def test_a_save_whose_staging_copy_climbs_save_after_save_is_acted_on_before_the_save_that_would_cross(tmp_path, on):
    """A checkpointer whose staging copy grows at every save (orbax#1640: three times an array's size
    in host RAM) and is let go once written: made and freed between two readings, seen by the save
    phase's end reading, its climb projected before the next save."""
    result = run_loop(SAVE_STAGING, tmp_path, "leaking", on=on)
    assert "acted" in result and result["highest"] < result["budget"], result
    assert result["saves"] >= 4, result


@ON
def test_saves_whose_staging_copy_stays_the_same_are_left_alone(tmp_path, on):
    result = run_loop(SAVE_STAGING, tmp_path, "bounded", on=on)
    assert "acted" not in result and result["saves"] == 16, result


CGROUP_BUDGET = WHERE + textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from watchdog import Watchdog, WatchdogConfig
    from watchdog.readers.host_memory import job_memory, memory_cgroups

    MiB = 1 << 20
    bounded = sys.argv[1] == "bounded"
    group = memory_cgroups()[0]  # the test's own, made for this run: set its limit as a pod's would be
    usage = int((group.path / "memory.usage_in_bytes").read_text())
    limit = usage + 260 * MiB
    (group.path / "memory.limit_in_bytes").write_text(str(limit))
    budget = job_memory() + 800 * MiB  # the loop's own budget: looser than its pod's limit
    result, kept = {"budget": budget, "cgroup_limit": limit}, []
    with Watchdog(WatchdogConfig(sample_every=5, **WHERE, host_memory_limit_bytes=budget)) as wd:
        for step in range(1, 700):
            time.sleep(0.002)
            kept.append(bytearray(b"k" * (2 * MiB)))
            if bounded and len(kept) > 20:
                kept.pop(0)
            result["highest"] = max(result.get("highest", 0), group.working_set())
            action = stepped(wd, step)
            if action is not None and action.needs_checkpoint:
                result.update(acted=step, domain=wd.last_action.verdict.explanation)
                break
    print(json.dumps(result))
""")


def _in_group(procs):
    return lambda: procs.write_text(str(os.getpid()))


@ON
def test_a_budget_given_inside_a_tighter_memory_cgroup_is_acted_on_before_the_cgroups_limit(tmp_path, on, events):
    """Issue 61: a budget given by the loop hid its pod's tighter limit, and the kernel killed it at
    that limit. Both are watched now; the one with less room left acts."""
    with memory_cgroup(8 << 30) as procs:
        result = run_loop(CGROUP_BUDGET, tmp_path, "leaking", on=on, preexec_fn=_in_group(procs))
    assert "acted" in result, result  # alive to say so: the kernel's OOM killer never came
    assert result["highest"] < result["cgroup_limit"] < result["budget"], result


@ON
def test_a_bounded_loop_inside_a_tighter_memory_cgroup_is_left_alone(tmp_path, on):
    with memory_cgroup(8 << 30) as procs:
        result = run_loop(CGROUP_BUDGET, tmp_path, "bounded", on=on, preexec_fn=_in_group(procs))
    assert "acted" not in result, result


ADDRESS_SPACE = WHERE + textwrap.dedent("""
    import json, resource, sys, time
    from watchdog import Watchdog, WatchdogConfig

    MiB = 1 << 20
    bounded = sys.argv[1] == "bounded"
    size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
    limit = size + 700 * MiB  # ulimit -v: the watchdog's own threads take some of it
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    result, kept = {"limit": limit}, []
    try:
        with Watchdog(WatchdogConfig(sample_every=5, **WHERE)) as wd:
            for step in range(1, 700):
                time.sleep(0.002)
                kept.append(bytearray(b"a" * (2 * MiB)))
                if bounded and len(kept) > 20:
                    kept.pop(0)
                action = stepped(wd, step)
                if action is not None and action.needs_checkpoint:
                    result.update(acted=step, explanation=wd.last_action.verdict.explanation)
                    break
    except MemoryError:
        result["memory_error"] = step
    print(json.dumps(result))
""")


@ON
def test_a_leak_under_an_address_space_limit_is_acted_on_before_it(tmp_path, on):
    """Issue 61: under `ulimit -v` a watched script died earlier than an unwatched one (its threads
    take address space), with no word from the watchdog: RLIMIT_AS was no limit it read."""
    result = run_loop(ADDRESS_SPACE, tmp_path, "leaking", on=on)
    assert "acted" in result and "memory_error" not in result, result


@ON
def test_a_bounded_loop_under_an_address_space_limit_is_left_alone(tmp_path, on):
    result = run_loop(ADDRESS_SPACE, tmp_path, "bounded", on=on)
    assert "acted" not in result and "memory_error" not in result, result


def test_a_child_started_after_the_watch_is_in_the_next_reading_and_its_growth_counted_from_its_start():
    """Issue 61: the workers of a loop were found only every 10 s (about 240 steps), and then named
    with their growth counted from when they were found. One already running is said to be so."""
    import psutil

    from watchdog.readers.host_memory import ProcessTree

    grow = [sys.executable, "-c", "import sys, time\nkept = bytearray(48 << 20)\nkept[::4096] = b'k' * len(kept[::4096])\n"
            "print('ready', flush=True)\ntime.sleep(30)"]
    early = subprocess.Popen(grow, stdout=subprocess.PIPE, text=True)
    try:
        early.stdout.readline()
        tree = ProcessTree(psutil.Process(), reset_high_water=False)
        before = tree.read().bytes_used
        late = subprocess.Popen(grow, stdout=subprocess.PIPE, text=True)
        try:
            late.stdout.readline()
            after = tree.read()
            assert after.bytes_used > before + (40 << 20), "counted at the very next reading"
            named = {d.pid: d for d in tree.descendants}
            assert named[late.pid].since_start and not named[early.pid].since_start
            assert "since the watch began" in named[early.pid].line()
        finally:
            late.kill()
            late.wait()
    finally:
        early.kill()
        early.wait()


def test_the_tree_cost_bench_prints_its_table():
    out = subprocess.run([sys.executable, "-m", "watchdog.bench.tree_cost", "--descendants", "1", "--descendants", "2", "--json"],
                         capture_output=True, text=True, timeout=120, env=hbm_watchdog_env())
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert [row["descendants"] for row in rows] == [1, 2]
    assert all(row["count_ms"] > row["status_ms"] > 0 for row in rows)
