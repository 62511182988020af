"""A user's own loop with nothing but `Watchdog(config)` and `wd.step(n)` gets what the trainer gets:
a baseline census, the leak named with its holder (and, after a capture, the line that made it),
and the action's block; `carry_out` does the checkpoint, the rebuild and the recovery measure.

Real torch on the CPU and the real resident-memory source, as in tests/test_lightning.py."""

import torch

from watchdog import Action, Watchdog, WatchdogConfig
from watchdog.runtime.sidecar import HANDED_OVER, REINITIALISED, RESTART_REQUESTED
from conftest import settled_job_memory

LEAK_BYTES = 4 << 20
BUDGET = 800 << 20  # 200 steps of leak above the resident memory at the start
LEAK_LINE = "test_bare_loop.py"


class Metrics:
    """A metrics helper that keeps every step's tensor (the leak)."""

    def __init__(self):
        self.kept = []

    def update(self, value: torch.Tensor) -> None:
        self.kept.append(value)


class Job:
    def __init__(self, leak: bool):
        torch.manual_seed(0)
        self.leak = leak
        self.model = torch.nn.Linear(16, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.data = torch.randn(8, 16), torch.randn(8, 1)
        self.metrics = Metrics()
        self.saved_at: list[int] = []

    def train_step(self, step: int) -> None:
        x, y = self.data
        self.optimizer.zero_grad()
        torch.nn.functional.mse_loss(self.model(x), y).backward()
        self.optimizer.step()
        if self.leak:
            self.metrics.update(torch.ones(LEAK_BYTES // 4))  # written, so resident

    def save(self, step: int) -> str:
        self.saved_at.append(step)
        return f"ckpt-{step}.pt"

    def rebuild(self) -> None:
        self.metrics = Metrics()  # the leaked tensors go with the old state


def config(**overrides) -> WatchdogConfig:
    limit = settled_job_memory() + BUDGET
    return WatchdogConfig(sample_every=2, source="rss", memory_limit_bytes=limit, **overrides)


def test_the_plain_form_gets_the_leak_named_with_its_holder_and_the_actions_block(events):
    job = Job(leak=True)
    with Watchdog(config()) as wd:
        for step in range(1000):
            job.train_step(step)
            action = wd.step(step)
            if action is Action.CHECKPOINT_REINIT or action is Action.CHECKPOINT_RESTART:
                job.save(step)
                break  # the user's own handling: here, exit for a restart
    assert job.saved_at and len(job.metrics.kept) * LEAK_BYTES < BUDGET, "acted on before the budget"
    (baseline,) = events.named("leak_baseline_taken")
    assert baseline["step"] == 0 and baseline["census_seconds"] >= 0
    suspects = events.named("leak_suspects")
    assert suspects and "attribute 'kept' of Metrics" in suspects[-1]["suspects"][0], suspects
    assert wd.suspects.lines == suspects[-1]["suspects"]
    assert wd.last_action.action is action and wd.last_action.verdict.oom_projected
    (acted,) = events.named("action_outcome")
    assert acted["outcome"] == HANDED_OVER and acted["step"] == job.saved_at[0]
    assert "attribute 'kept' of Metrics" in acted["block"] and HANDED_OVER in acted["block"]


def test_carry_out_rebuilds_measures_what_came_back_and_names_the_creation_line(events):
    job = Job(leak=True)
    with Watchdog(config()) as wd:
        for step in range(600):
            job.train_step(step)
            action = wd.step(step)
            if action is not None:
                assert wd.carry_out(action, save=lambda: job.save(step), rebuild=job.rebuild)
            if events.named("action_outcome") and any(e["creation_sites"] for e in events.named("leak_suspects")):
                break
    (acted, *_) = events.named("action_outcome")
    assert acted["outcome"] == REINITIALISED and acted["checkpoint"] == f"ckpt-{job.saved_at[0]}.pt"
    assert acted["recovered_bytes"] > 100 << 20, "the rebuild gave the leaked tensors back"
    assert "recovered" in acted["block"]
    located = [e for e in events.named("leak_suspects") if e["creation_sites"]]
    assert located, "after the rebuild, a capture ran and a census named where the tensors are made"
    line = located[0]["suspects"][0]
    assert "created at" in line and LEAK_LINE in line and "attribute 'kept' of Metrics" in line, line
    assert len(events.named("leak_baseline_taken")) == 2, "a new baseline after the rebuild"


def test_carry_out_without_a_rebuild_asks_for_a_restart_and_a_warn_needs_nothing(events):
    job = Job(leak=False)
    wd = Watchdog(config())
    assert wd.carry_out(None, save=lambda: job.save(0)) and wd.carry_out(Action.WARN, save=lambda: job.save(0))
    assert not job.saved_at, "nothing to carry out: no save"
    assert not wd.carry_out(Action.CHECKPOINT_REINIT, save=lambda: job.save(3))
    assert not wd.carry_out(Action.CHECKPOINT_RESTART, save=lambda: job.save(4))
    assert job.saved_at == [3, 4]
    assert wd.checkpoint_figures.saves == 2, "both saves were timed"
    assert not events.named("action_outcome"), "no action was handed over, so there is no block to log"
    wd.log_outcome(RESTART_REQUESTED)  # nothing handed over: no outcome to log


def test_a_clean_loop_gets_one_baseline_census_and_nothing_else(events):
    job = Job(leak=False)
    with Watchdog(config()) as wd:
        for step in range(300):
            job.train_step(step)
            assert wd.step(step) is None
    assert len(events.named("leak_baseline_taken")) == 1
    for name in ("leak_suspects", "action_outcome", "leak_detected", "action_decided", "creation_capture_started"):
        assert not events.named(name), name
    assert not wd._chores, "after the baseline, step() does only its O(1) work"


def test_forensics_off_takes_no_census_even_when_acting(events):
    job = Job(leak=True)
    with Watchdog(config(forensics=False)) as wd:
        for step in range(1000):
            job.train_step(step)
            if wd.step(step) is not None:
                break
    assert wd.last_action is not None and wd.last_action.suspects == []
    assert not events.named("leak_baseline_taken") and not events.named("leak_suspects")
    assert events.named("action_outcome"), "the action's block is still logged"


def test_a_leak_that_refills_after_every_rebuild_is_acted_on_before_the_budget_in_every_cycle(events, tmp_path):
    """The README's loop (`sample_every=10`, `carry_out(save, rebuild)`) with the leak still in its
    code: it refills after every rebuild, in 20 samples. A fixed cooldown after the first action let
    the second cycle run 250 MiB over the budget for 120 steps; now every cycle gets its action
    before the budget, and the job's memory, read at every step, never reaches it."""
    from watchdog.readers.host_memory import job_memory

    job = Job(leak=True)
    conf = config()
    conf = WatchdogConfig(sample_every=10, source="rss", memory_limit_bytes=conf.memory_limit_bytes,
                          trace_file=tmp_path / "trace.csv")
    highest = 0
    with Watchdog(conf) as wd:
        for step in range(760):
            job.train_step(step)
            highest = max(highest, job_memory())
            action = wd.step(step)
            if action is not None:
                assert wd.carry_out(action, save=lambda: job.save(step), rebuild=job.rebuild)
    outcomes = events.named("action_outcome")
    assert len(outcomes) >= 3, f"one action per cycle: {[o['step'] for o in outcomes]}"
    assert all(o["outcome"] == REINITIALISED for o in outcomes)
    assert highest < conf.memory_limit_bytes, \
        f"{(highest - conf.memory_limit_bytes) / 2**20:.0f} MiB over the budget (actions at {job.saved_at})"
    from watchdog.records import flight_record

    record = flight_record.read(tmp_path / f"trace.csv{flight_record.SUFFIX}")
    at_action = record["action_suspects"]  # what leaked before the newest reinit, kept beside the newest census
    assert at_action["step"] == outcomes[-1]["step"] and "attribute 'kept' of Metrics" in at_action["lines"][0]


def test_one_record_per_action_carries_its_outcome_and_the_exit_status(tmp_path, events):
    """Issue 49: an action's record is built once, when it is handed over (`last_action`), and
    `carry_out` completes that same record: its outcome, its checkpoint and the status the process
    ends with. A save that returns False is no checkpoint: exit 44, said in the block, not timed."""
    from watchdog.core.errors import EXIT_RESTART_REQUESTED, EXIT_UNSAVED
    from watchdog.actions.action_path import UNSAVED

    drills = ((3, Action.CHECKPOINT_RESTART), (6, Action.CHECKPOINT_REINIT), (9, Action.CHECKPOINT_RESTART))
    wd = Watchdog(WatchdogConfig(sample_every=100, source="rss", memory_limit_bytes=1 << 40, host_memory=False,
                                 forensics=False, forced_actions=drills))
    outcomes = []
    with wd:
        for step in range(10):
            action = wd.step(step)
            if action is None:
                continue
            record = wd.last_action
            saves = {3: lambda: tmp_path / "ckpt-3.pt", 6: lambda: False, 9: lambda: None}[step]
            went_on = wd.carry_out(action, save=saves)
            assert wd.last_action is record, "the record handed over is the one carried out"
            outcomes.append((step, went_on, record.outcome, record.exit_code, record.checkpoint))
    assert outcomes == [(3, False, RESTART_REQUESTED, EXIT_RESTART_REQUESTED, str(tmp_path / "ckpt-3.pt")),
                        (6, False, UNSAVED, EXIT_UNSAVED, None),
                        (9, False, RESTART_REQUESTED, EXIT_RESTART_REQUESTED, None)]
    blocks = events.named("action_outcome")
    assert [b["exit_code"] for b in blocks] == [42, 44, 42], "one block per action"
    assert "the checkpoint failed: exit 44" in blocks[1]["block"]
    assert wd.checkpoint_figures.saves == 2, "the failed save is not timed as a checkpoint"


def test_a_framework_that_saves_by_itself_names_the_checkpoint_without_a_save(events):
    """Hugging Face's Trainer saves after the step ends: `carry_out(action, checkpoint=...)` logs the
    block with the folder the Trainer writes, and asks for the restart; nothing is timed as a save."""
    wd = Watchdog(WatchdogConfig(sample_every=100, source="rss", memory_limit_bytes=1 << 40, host_memory=False,
                                 forensics=False, forced_actions=((2, Action.CHECKPOINT_REINIT),)))
    with wd:
        actions = [wd.step(step) for step in range(3)]
        assert actions[2] is Action.CHECKPOINT_REINIT
        assert not wd.carry_out(Action.CHECKPOINT_REINIT, checkpoint="out/checkpoint-2")
    [block] = events.named("action_outcome")
    assert block["checkpoint"] == "out/checkpoint-2" and block["exit_code"] == 42
    assert wd.checkpoint_figures.saves == 0


class _Refuses:
    """A value whose truth cannot be read (as a NumPy array of several elements)."""

    def __bool__(self):
        raise ValueError("the truth value of an array with more than one element is ambiguous")


class _PathThatRaises:
    def __fspath__(self):
        raise OSError("no path")


def test_every_kind_of_value_a_save_returns_is_judged_as_the_docs_say(tmp_path, events):
    """Issue 64: a save() returning numpy's False_ was taken for a checkpoint named 'False' (exit 42,
    "restart requested") where 44 was due. Every kind of value is read by `save_result`: a path is a
    checkpoint there; None and true truth values a checkpoint with no path; anything false (numpy's
    False_ included) no checkpoint, exit 44; anything else by its truth, said, and never its text
    taken for a path."""
    import numpy as np

    from watchdog.core.errors import EXIT_RESTART_REQUESTED, EXIT_UNSAVED
    from watchdog.actions.action_path import save_result

    cases = [  # (what save() returns, whether it saved, the checkpoint named, whether it is said to be unclear)
        (tmp_path / "ckpt-3.pt", True, str(tmp_path / "ckpt-3.pt"), False), ("ckpt-3.pt", True, "ckpt-3.pt", False),
        (None, True, None, False), (True, True, None, False), (np.True_, True, None, False),
        (False, False, None, False), (np.False_, False, None, False), ("", False, None, False),
        (0, False, None, True), ([], False, None, True), (np.int64(0), False, None, True),
        (7, True, None, True), ({"step": 3}, True, None, True), (object(), True, None, True),
        (_Refuses(), False, None, True), (np.array([True, False]), False, None, True),
        (_PathThatRaises(), False, None, False),
    ]
    for returned, landed, checkpoint, unclear in cases:
        said = len(events.named("save_result_unclear"))
        assert save_result(returned) == (landed, checkpoint), returned
        assert len(events.named("save_result_unclear")) - said == unclear, returned
    for returned, landed, checkpoint, _ in cases:  # and through carry_out, each its own action
        wd = Watchdog(WatchdogConfig(sample_every=100, source="rss", memory_limit_bytes=1 << 40, host_memory=False,
                                     forensics=False, forced_actions=((1, Action.CHECKPOINT_RESTART),)))
        with wd:
            wd.step(0)
            assert not wd.carry_out(wd.step(1), save=lambda: returned)
        expected = EXIT_RESTART_REQUESTED if landed else EXIT_UNSAVED
        assert (wd.last_action.exit_code, wd.last_action.checkpoint) == (expected, checkpoint), returned


class _HostileDict(dict):
    def get(self, *args):
        raise KeyError("get")

    def __getitem__(self, key):
        raise KeyError(key)

    def keys(self):
        raise RuntimeError("keys")

    def __iter__(self):
        raise RuntimeError("iter")


class _HostileKey:
    """A key that collides with every name the state keeps, and whose comparison raises."""

    def __init__(self, name):
        self.name = name

    def __hash__(self):
        return hash(self.name)

    def __eq__(self, other):
        raise TypeError("no comparing")


class _HostileValue(int):
    def __repr__(self):
        raise RuntimeError("no repr")


def test_a_saved_state_never_stops_training_whatever_it_does_when_read(events):
    """Issue 64: `Watchdog.saved_state` with a dict subclass whose `.get` raises let the KeyError out,
    though a bad saved state never stops training. Whatever the object does when read, it is logged
    (`watchdog_state_unread`) and left out; a good one comes back as a plain dict of what it keeps."""
    assert Watchdog.saved_state(_HostileDict(watchdog_restarts=1), "checkpoint") == {"watchdog_restarts": 1}, \
        "read as the dict it is, never through the subclass's own get"
    hostile = [_HostileDict(watchdog_restarts=-1), {_HostileKey("watchdog_restarts"): 1},
               {"watchdog_restarts": _HostileValue(-1)}, {"watchdog_restarts": 2**80}, {"restarts_so_far": "2"},
               ["not", "a", "dict"], 5]
    for state in hostile:
        assert Watchdog.saved_state(state, "checkpoint") is None, state.__class__
    assert len(events.named("watchdog_state_unread")) == len(hostile)
    kept = Watchdog.saved_state(_GoodButSubclassed(watchdog_restarts=2, other="x"), "checkpoint")
    assert kept == {"watchdog_restarts": 2} and type(kept) is dict


class _GoodButSubclassed(dict):
    pass
