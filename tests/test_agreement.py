"""Ranks agree on one action (`runtime/agreement.py`, driven by `Watchdog.step`): the single-process
paths in process, and real ranks (torch.multiprocessing, gloo over 127.0.0.1) for the rest: the
most severe offer wins at the same step, counters that disagree are an error on every rank, a
rank that dies or stalls makes the others exit 43 within the timeout instead of hanging, and a rank
that stalls outside an agreement ends itself (exit 43, its stacks recorded) within its bound."""

import json
import os
import socket
import time

import pytest
import torch.multiprocessing as mp

from watchdog import Watchdog, WatchdogConfig
from watchdog.actions.agreement import Agreement, PeerLost, RanksOutOfStep, severity
from watchdog.core.errors import EXIT_PEER_LOST, EXIT_RESTART_REQUESTED, ConfigError, InputError
from watchdog.core.restarts import restarts_so_far
from watchdog.core.verdict import Action
from watchdog.runtime.sidecar import FORCED, HANDED_OVER
from watchdog.runtime.unwatched import Unwatched

REINIT, RESTART, WARN = Action.CHECKPOINT_REINIT, Action.CHECKPOINT_RESTART, Action.WARN
QUIET = dict(host_memory=False, forensics=False, memory_limit_bytes=1 << 40)


def test_severity_order():
    assert [severity(a) for a in (None, Action.NONE, WARN, REINIT, RESTART)] == [0, 0, 1, 2, 3]


def test_a_forced_action_comes_at_its_step_alone_and_never_after_a_resume_past_it():
    wd = Watchdog(WatchdogConfig(sample_every=5, forced_actions=((7, REINIT), (3, RESTART)), **QUIET))
    handed = {step: wd.step(step) for step in range(10)}
    assert {s: a for s, a in handed.items() if a is not None} == {3: RESTART, 7: REINIT}
    assert wd.last_action.origin == FORCED and wd.last_action.step == 7
    resumed = Watchdog(WatchdogConfig(forced_actions=((3, RESTART),), **QUIET))
    assert [resumed.step(step) for step in range(5, 9)] == [None] * 4, "step 3 was this job's past"


def test_a_host_s_proposal_comes_back_at_the_next_step_and_the_most_severe_wins():
    wd = Watchdog(WatchdogConfig(sample_every=5, forced_actions=((2, REINIT),), **QUIET))
    assert wd.step(1) is None
    wd.propose(RESTART, "stop signal")
    assert wd.step(2) is RESTART and wd.last_action.origin == "stop signal"
    assert wd.step(3) is None, "the forced reinit went with the restart: one action"
    wd.propose(Action.WARN, "not a checkpoint")
    assert wd.step(4) is None


def test_forced_actions_and_the_timeout_are_checked_when_the_config_is_built():
    assert WatchdogConfig(forced_actions=((9, "checkpoint_restart"), (2, REINIT))).forced_actions == (
        (2, REINIT), (9, RESTART))
    for bad in (((1, "warn"),), ((-1, REINIT),), ((True, REINIT),), (("x",),), 5):
        with pytest.raises(ConfigError, match="forced_actions"):
            WatchdogConfig(forced_actions=bad)
    for bad in (0, -1, float("inf"), float("nan"), True, "10"):
        with pytest.raises(ConfigError, match="agreement_timeout_seconds"):
            WatchdogConfig(agreement_timeout_seconds=bad)


def test_the_run_s_end_is_the_watchdogs_state_unless_the_policy_already_names_one():
    from watchdog.core.policy import PolicyConfig

    wd = Watchdog(WatchdogConfig(**QUIET))
    assert wd.judge.policy.last_step is None
    wd.ends_at(500)
    assert wd.judge.policy.last_step == 500 and wd.config.policy.last_step is None, "state, not config"
    wd.ends_at(None)
    wd.ends_at(-1)
    assert wd.judge.policy.last_step == 500
    named = Watchdog(WatchdogConfig(policy=PolicyConfig(last_step=300), **QUIET))
    named.ends_at(900)
    assert named.judge.policy.last_step == 300, "the setting wins"


def test_the_restart_count_comes_from_the_engine_that_restarted_the_job(monkeypatch):
    assert restarts_so_far({}) == 0
    assert restarts_so_far({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert restarts_so_far({"HBMWATCH_RESTART_COUNT": "1", "TORCHELASTIC_RESTART_COUNT": "2"}) == 1
    assert restarts_so_far({"HBMWATCH_RESTART_COUNT": " ", "TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    for bad in ("-1", "١", "1e3", "9" * 30):
        with pytest.raises(InputError, match="TORCHELASTIC_RESTART_COUNT"):
            restarts_so_far({"TORCHELASTIC_RESTART_COUNT": bad})
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    monkeypatch.delenv("HBMWATCH_RESTART_COUNT", raising=False)
    wd = Watchdog(WatchdogConfig(**QUIET))
    assert wd.state_dict()["restarts_so_far"] == 3 and wd.telemetry.restarts_total == 3
    assert wd.state_dict()["watchdog_restarts"] == 3, "the restart budget counts them (no host told it the watchdog's own)"
    wd.load_state_dict({"restarts_so_far": 5, "watchdog_restarts": 1})
    assert wd.telemetry.restarts_total == 5, "a checkpoint's larger count wins"
    assert wd.state_dict()["watchdog_restarts"] == 1, "the budget counts the watchdog's own, where the checkpoint kept them"


# ---- real ranks --------------------------------------------------------------------------------

def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(function, tmp_path, ranks: int = 2, timeout: float = 120) -> list[dict]:
    """Run `function(rank, port, out_dir)` on `ranks` real processes; each writes rank<N>.json. A
    process still running after `timeout` seconds is killed and fails the test, never the suite."""
    context = mp.start_processes(function, args=(free_port(), str(tmp_path)), nprocs=ranks, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"ranks still running after {timeout:g} s")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]


def ranks_ending(function, tmp_path, bound: float) -> list[int | None]:
    """Two real ranks of `function(rank, port, out_dir)`, left to end by themselves within `bound`
    seconds (then killed: a hang fails its test, never the suite); their exit statuses."""
    context = mp.start_processes(function, args=(free_port(), str(tmp_path)), nprocs=2, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + bound
    while any(p.is_alive() for p in context.processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    for process in context.processes:
        process.kill()
    return [p.exitcode for p in context.processes]


def _join(rank, port, ranks=2):
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)


def _write(out_dir, rank, result):
    with open(f"{out_dir}/rank{rank}.json", "w") as handle:
        json.dump(result, handle)


def _agreements(rank, port, out_dir):
    """Offers by rank and step, through a bare Agreement and through two Watchdogs."""
    _join(rank, port, ranks=3)
    result = {}
    agreement = Agreement(timeout_seconds=60)
    offers = {0: {2: WARN, 4: REINIT}, 1: {4: RESTART}, 2: {4: RESTART, 6: REINIT}}
    result["offers"] = {}
    for step in range(8):
        agreed = agreement.decide(step, offers[rank].get(step))
        if agreed is not None:
            result["offers"][step] = [agreed.action.value, agreed.asked_by, agreed.ranks]
    # whose offer: a loop's proposal (a preemption) is no restart of the watchdog's, on any rank
    preempted = agreement.decide(8, RESTART if rank == 1 else None, own=rank != 1)
    both = agreement.decide(9, RESTART if rank < 2 else None, own=rank != 1)
    result["own"] = [preempted.own, preempted.asked_by, both.own, both.asked_by]
    try:
        agreement.decide(10 + 2 * rank, None)  # counters that disagree
    except RanksOutOfStep as exc:
        result["out_of_step"] = str(exc)
    config = WatchdogConfig(sample_every=5, device="cpu", source="rss", agreement_timeout_seconds=60,
                            forced_actions=((7, REINIT),) if rank == 1 else (), **QUIET)
    handed = {}
    with Watchdog(config) as wd:
        for step in range(17):
            action = wd.step(step)
            if action is not None:
                handed[step] = [action.value, wd.last_action.origin]
        # its loop said nothing of it: its block was logged at the next step, not left for stop()
        result["outcome_next_step"] = wd.last_action.outcome if wd.last_action is not None else None
        result["ranks"] = wd.ranks
    result["watchdog"] = handed
    # the unwatched run's stand-in: agreed every step; a drill more severe than the loop's own
    # proposal at its step is the one offered (rank 0), as with a Watchdog
    drills = {0: ((5, RESTART),), 1: ((5, REINIT),), 2: ((3, RESTART),)}[rank]
    stand_in, handed = Unwatched(drills, agreement=Agreement(timeout_seconds=60)), {}
    for step in range(8):
        if rank == 0 and step == 5:
            stand_in.propose(REINIT, "the loop's own")
        action = stand_in.step(step)
        if action is not None:
            handed[step] = [action.value, stand_in.last_action.origin]
    result["unwatched"] = handed
    _write(out_dir, rank, result)
    # No interpreter teardown with gloo groups alive: once in about fifteen runs of this three-rank
    # test a rank died of SIGABRT there ("terminate called without an active exception"), after
    # its results were written, in gloo's teardown, not in anything under test.
    os._exit(0)


@pytest.mark.slow
def test_ranks_take_the_most_severe_offer_at_the_same_step_and_disagreeing_counters_are_an_error(tmp_path):
    ranks = spawn(_agreements, tmp_path, ranks=3)
    assert ranks[0]["offers"] == ranks[1]["offers"] == ranks[2]["offers"]
    # step 2: one rank's warning; step 4: the restart, from the lowest rank that offered it; step 6: rank 2's reinit
    assert ranks[0]["offers"] == {"2": ["warn", 0, 3], "4": ["checkpoint_restart", 1, 3], "6": ["checkpoint_reinit", 2, 3]}
    for index, rank in enumerate(ranks):
        assert rank["own"] == [False, 1, True, 0], "whose offer the agreed action was travels with it"
        assert "different steps (from 10 to 14)" in rank["out_of_step"]
        assert rank["ranks"] == 3
        # forced on rank 1 at step 7, held, offered at the next sampling step (10), carried out by every
        # rank at the one after (15)
        origin = "asked by rank 1, agreed by all 3 ranks"
        assert rank["watchdog"] == {"15": ["checkpoint_reinit", f"{FORCED}; {origin}" if index == 1 else origin]}
        assert rank["outcome_next_step"] == HANDED_OVER
        by_2, by_0 = "asked by rank 2, agreed by all 3 ranks", "asked by rank 0, agreed by all 3 ranks"
        assert rank["unwatched"] == {"3": ["checkpoint_restart", f"{FORCED}; {by_2}" if index == 2 else by_2],
                                     "5": ["checkpoint_restart", f"{FORCED}; {by_0}" if index == 0 else by_0]}


def _trainer_rank(rank, port, out_dir):
    """One of two real trainer processes (plain CPU, gloo). Only rank 1 is asked to reinit (at step 7),
    then, in a second run, only rank 1 is preempted (SIGTERM at step 7)."""
    import os
    import signal

    import torch.distributed as dist

    from watchdog.core.config import WatchdogConfig
    from watchdog.trainer.loop import Replica, TrainConfig, Trainer
    from watchdog.trainer.model import ModelConfig

    from watchdog.actions.agreement import Agreement

    _join(rank, port)
    talks = []
    offer = Agreement._ask

    def counted(self, *args):
        talks.append(trainer.state.step - 1)  # the step just done, whose offer this is
        return offer(self, *args)

    Agreement._ask = counted
    outcomes = {}
    for run in ("reinit", "preempted"):
        config = TrainConfig(steps=17, model=ModelConfig(depth=1, width=16, heads=2, seq_len=8), batch_size=2,
                             device="cpu", checkpoint_dir=f"{out_dir}/{run}", resume="never", log_every=100,
                             progress_bar=False,
                             forced_actions=((7, REINIT),) if rank == 1 and run == "reinit" else (),
                             watchdog=WatchdogConfig(sample_every=5, memory_limit_bytes=1 << 40))
        trainer = Trainer(config, replica=Replica(rank=rank, world=2))
        if rank == 1 and run == "preempted":
            ask = trainer._ask
            trainer._ask = lambda step: (os.kill(os.getpid(), signal.SIGTERM) if step == 7 else None, ask(step))[1]
        talks.clear()
        try:
            result = trainer.run()
            restarts = trainer.watchdog.state_dict()["watchdog_restarts"]
        finally:
            trainer.close()
        outcomes[run] = {"reinits": result.reinits, "step": result.step, "exit": result.exit_code,
                         "talks": list(talks), "watchdog_restarts": restarts}
    dist.destroy_process_group()
    _write(out_dir, rank, outcomes)
    os._exit(0)  # no interpreter teardown with gloo's threads about (see _agreements)


@pytest.mark.slow
def test_two_trainer_processes_agree_once_per_sampling_step_and_act_together(tmp_path):
    ranks = spawn(_trainer_rank, tmp_path)
    for outcome in ranks:
        reinit, preempted = outcome["reinit"], outcome["preempted"]
        assert reinit["step"] == 17 and reinit["reinits"] == 1 and reinit["exit"] == 0  # rank 0 reinitialised too
        # One offer per sampling step, none in between; and one after each save (at the reinit of
        # step 15 and the final one), so that every rank learns whether every rank's save landed.
        # Rank 1's reinit, forced at step 7, is offered at step 10 and carried out at 15.
        assert reinit["talks"] == [0, 5, 10, 15, 15, 16]
        # one host preempted at step 7: offered at the next sampling step, both save at the one after
        # and exit 42 together
        assert preempted["step"] == 16 and preempted["exit"] == EXIT_RESTART_REQUESTED
        assert preempted["talks"] == [0, 5, 10, 15, 15]
        # a preemption of rank 1 alone is no restart of the watchdog's, on either rank (rank 0 used to count 1)
        assert preempted["watchdog_restarts"] == 0 and reinit["watchdog_restarts"] == 0
    assert "ckpt-00000016.pt" in {p.name for p in (tmp_path / "reinit").iterdir()}  # the reinit came at step 15
    assert "ckpt-00000016.pt" in {p.name for p in (tmp_path / "preempted").iterdir()}


def _one_rank_goes(rank, port, out_dir):
    """Rank 1 dies after the first agreement, or stalls; rank 0 must not wait for it forever."""
    _join(rank, port)
    agreement = Agreement(timeout_seconds=3)
    agreement.decide(0, None)
    if rank == 1:
        if os.path.basename(out_dir).startswith("test_a_rank_that_stalls"):
            time.sleep(40)
        os._exit(1)  # died: no goodbye to the group
    started = time.monotonic()
    try:
        agreement.decide(1, REINIT)
        outcome = {"returned": True}
    except PeerLost as exc:
        outcome = {"code": exc.code, "reason": exc.reason}
    outcome["seconds"] = time.monotonic() - started
    _write(out_dir, rank, outcome)
    os._exit(0)  # the group's other member is gone: no teardown to wait for


def _outcome_of_rank_0(tmp_path):
    context = mp.start_processes(_one_rank_goes, args=(free_port(), str(tmp_path)), nprocs=2, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + 90
    while context.processes[0].is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    for process in context.processes:
        process.kill()
    assert (tmp_path / "rank0.json").exists(), "rank 0 never came back from the agreement"
    return json.loads((tmp_path / "rank0.json").read_text())


@pytest.mark.slow
def test_a_rank_that_dies_makes_the_other_exit_43_rather_than_hang(tmp_path):
    outcome = _outcome_of_rank_0(tmp_path)
    assert outcome.get("code") == EXIT_PEER_LOST == 43, outcome
    assert "a rank died or stalled" in outcome["reason"] and "step 1" in outcome["reason"]


@pytest.mark.slow
def test_a_rank_that_stalls_makes_the_other_exit_43_after_the_timeout(tmp_path):
    outcome = _outcome_of_rank_0(tmp_path)
    assert outcome.get("code") == EXIT_PEER_LOST, outcome
    assert 2 <= outcome["seconds"] < 30, "bounded by the group's timeout (3 s), not the stalled rank's 40 s"


def _waiting_on_a_stuck_read(seconds):
    time.sleep(seconds)  # a hung input pipeline: the stall under test, outside any agreement


def _a_rank_stalls_in_a_ddp_loop(rank, port, out_dir):
    """Two ranks, an all_reduce per step on the default group (DDP's), the watchdog sampling every 5
    steps; rank 1 stalls at step 12, outside any agreement. Rank 0 waits in the all_reduce."""
    import torch
    import torch.distributed as dist

    _join(rank, port)
    config = WatchdogConfig(sample_every=5, device="cpu", source="rss", stall_after_seconds=1,
                            stall_check_seconds=0.2, agreement_timeout_seconds=60,
                            # rank 0 ends first: ended by the stalled rank's exit, its all_reduce would fail (exit 1)
                            # before its own bound, as it may in a job (any restarter restarts on either)
                            stall_exit_after_seconds=3 if rank == 0 else 5,
                            trace_file=f"{out_dir}/rank{rank}.csv", **QUIET)
    with Watchdog(config) as wd:
        for step in range(40):
            if rank == 1 and step == 12:
                _waiting_on_a_stuck_read(60)
            dist.all_reduce(torch.ones(4))
            wd.step(step)
    os._exit(0)  # never reached: both ranks stop at step 12


@pytest.mark.slow
def test_a_rank_that_stalls_outside_an_agreement_ends_the_job_within_its_bound(tmp_path):
    """Issue 50: a rank stalled in its input pipeline hung the others in DDP's all_reduce for gloo's
    30 minutes. Each rank's watchdog bounds it: after `stall_exit_after_seconds` (3 and 5 s here) the
    stalled rank and the one waiting for it in the all_reduce both record their stacks and exit 43,
    and `postmortem` names the line the stalled rank was stuck at, and the other as waiting."""
    from watchdog.core.postmortem import diagnose
    from watchdog.records import flight_record

    codes = ranks_ending(_a_rank_stalls_in_a_ddp_loop, tmp_path, bound=120)
    assert codes == [EXIT_PEER_LOST, EXIT_PEER_LOST], codes  # rank 0 waited in the all_reduce: bounded too
    stalled = diagnose([], record=flight_record.read(tmp_path / f"rank1.csv{flight_record.SUFFIX}"))
    assert stalled.diagnosis == "stalled" and "rank 1 stalled in" in stalled.explanation
    assert "test_agreement.py" in stalled.explanation and "_waiting_on_a_stuck_read" in stalled.explanation
    waited = diagnose([], record=flight_record.read(tmp_path / f"rank0.csv{flight_record.SUFFIX}"))
    assert "rank 0 waited in a collective for another rank" in waited.explanation, waited.explanation
    assert "all_reduce" in waited.explanation
    for rank in (0, 1):
        record = flight_record.read(tmp_path / f"rank{rank}.csv{flight_record.SUFFIX}")
        assert record["stall"]["step"] == 11 and 3 <= record["stall"]["seconds"] < 30, record["stall"]


@pytest.mark.parametrize("environ, backend, said", [
    ({"TORCHELASTIC_RUN_ID": "x"}, "gloo", True),
    ({"TORCHELASTIC_RUN_ID": "x", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, "gloo", False),
    ({"TORCHELASTIC_RUN_ID": "x"}, "nccl", False),
    ({}, "gloo", False),  # not under torchrun: its store is not shared
])
def test_a_restart_that_may_hang_is_said_at_start(environ, backend, said):
    """Under torchrun with gloo, torch 2.9's shared rendezvous store left a Hugging Face job's agreed
    restart hanging for over ten minutes, with nothing said, unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1."""
    from watchdog.actions.agreement import restart_hang_risk

    risk = restart_hang_risk(environ, backend)
    assert (risk is not None) is said
    if said:
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in risk


def _log_to(path):
    """Every log line of this process, its message only, into `path` (a spawned rank's own log)."""
    import logging

    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)


def _out_of_step_in_a_ddp_loop(rank, port, out_dir):
    """Two ranks, an all_reduce per step on the default group (DDP's), the watchdog sampling every 5
    steps; rank 1 calls `step()` out of step with rank 0, as the test's name says."""
    import torch
    import torch.distributed as dist

    with open(f"{out_dir}/case") as handle:
        case = handle.read()
    _log_to(f"{out_dir}/rank{rank}.log")
    _join(rank, port)
    config = WatchdogConfig(sample_every=5, device="cpu", source="rss", agreement_timeout_seconds=60,
                            stall_exit_after_seconds=60, **QUIET)
    started, outcome, counter = time.monotonic(), {}, 0
    try:
        with Watchdog(config) as wd:
            for step in range(60):
                dist.all_reduce(torch.ones(4))
                if rank == 1 and case == "off_by_one":
                    wd.step(step + 1)
                elif rank == 1 and case == "skipped" and step == 10:
                    pass  # a sampling step's call skipped
                elif case == "extra":  # a per-rank counter, and one call more on rank 1 (an evaluation's)
                    wd.step(counter)
                    counter += 1
                    if rank == 1 and step == 7:
                        wd.step(counter)
                        counter += 1
                else:
                    wd.step(step)
            outcome["finished"] = True
    except RanksOutOfStep as exc:
        outcome["raised"] = str(exc)
    except RuntimeError as exc:  # the all_reduce, when the other rank left first
        outcome["collective_failed"] = str(exc)[:200]
    outcome["seconds"] = time.monotonic() - started
    _write(out_dir, rank, outcome)
    time.sleep(1)  # the other rank reads its own answer before this one's connections close
    os._exit(0)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["off_by_one", "skipped"])
def test_counters_that_disagree_at_any_offset_are_named_on_every_rank_within_seconds(tmp_path, case):
    """Issue 50: an off-by-one or a skipped sampling call on one rank left that rank in the
    agreement's all_gather while the other waited in DDP's all_reduce, for the whole 600 s timeout,
    then "lost peer". Now every rank logs `ranks_out_of_step` as soon as the offers meet, a rank
    raises `RanksOutOfStep` at its next `step()`, and the job ends within seconds. (An extra call
    that keeps the step numbers alike is told only by the count of collectives, on NCCL: below.)"""
    (tmp_path / "case").write_text(case)
    ranks_ending(_out_of_step_in_a_ddp_loop, tmp_path, bound=90)
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert not any(o.get("finished") for o in outcomes), outcomes
    named = {"off_by_one": "different steps (from 0 to 5)", "skipped": "different steps (from 10 to 15)"}[case]
    assert any(named in o.get("raised", "") for o in outcomes), outcomes
    for rank, outcome in enumerate(outcomes):
        assert outcome["seconds"] < 20, outcome  # not the agreement's 60 s timeout here, nor 600 by default
        said = [line for line in (tmp_path / f"rank{rank}.log").read_text().splitlines()
                if line.startswith("ranks_out_of_step")]
        assert said and "every rank must call it with the same step numbers" in said[0], rank


def _a_group_that_never_forms(rank, port, out_dir):
    """Rank 0 starts its watchdog; rank 1 never joins the agreement's group (its making hangs)."""
    import torch.distributed as dist

    _log_to(f"{out_dir}/rank{rank}.log")
    _join(rank, port)
    if rank == 1:
        dist.new_group = lambda **_: time.sleep(120)  # a rendezvous that never answers
    started = time.monotonic()
    try:
        Watchdog(WatchdogConfig(device="cpu", source="rss", agreement_timeout_seconds=2, **QUIET)).start()
    finally:
        _write(out_dir, rank, {"seconds": time.monotonic() - started})


@pytest.mark.slow
def test_a_group_that_cannot_form_ends_the_process_within_its_bound_with_one_line(tmp_path):
    """Issue 50: a restarted Hugging Face job hung over ten minutes while its groups formed. The
    watchdog's own group is bounded: a peer that never comes fails it after the timeout (rank 0,
    PeerLost, exit 43), and a making that never returns ends the process past the timeout and a
    grace (rank 1, exit 43), each with one line saying why."""
    assert ranks_ending(_a_group_that_never_forms, tmp_path, bound=90) == [EXIT_PEER_LOST, EXIT_PEER_LOST]
    for rank in (0, 1):
        said = [line for line in (tmp_path / f"rank{rank}.log").read_text().splitlines()
                if line.startswith("agreement_unformed")]
        assert len(said) == 1 and "could not form the watchdog's agreement group" in said[0], said
    assert not (tmp_path / "rank1.json").exists(), "rank 1 never came back from making the group: ended from outside"
    assert json.loads((tmp_path / "rank0.json").read_text())["seconds"] < 30


@pytest.mark.slow
def test_an_extra_call_with_the_same_numbers_is_not_judged_by_a_count_that_moves_with_point_to_point(tmp_path):
    """Issue 64: the count of collectives told an extra `step()` call on one rank (step numbers
    alike) from ranks in step, but gloo's count moves with every send and receive too, so one send
    read as ranks out of step. On gloo the check is off, and said when the agreement is joined
    (`collectives_counted=False`): such an extra call goes unnamed there (docs/many-ranks.md)."""
    (tmp_path / "case").write_text("extra")
    ranks_ending(_out_of_step_in_a_ddp_loop, tmp_path, bound=90)
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(o.get("finished") for o in outcomes), outcomes
    for rank in (0, 1):
        [joined] = [line for line in (tmp_path / f"rank{rank}.log").read_text().splitlines()
                    if line.startswith("agreement_joined")]
        assert "collectives_counted" in joined and "False" in joined, joined


def _a_send_among_ranks_in_step(rank, port, out_dir):
    """Three ranks in step, an all_reduce per step on the default group; at step 12 rank 0 sends one
    tensor to rank 1 on the default group (a pipeline's stages do so every step)."""
    import torch
    import torch.distributed as dist

    _join(rank, port, ranks=3)
    config = WatchdogConfig(sample_every=5, device="cpu", source="rss", agreement_timeout_seconds=60,
                            stall_exit_after_seconds=60, **QUIET)
    outcome = {}
    try:
        with Watchdog(config) as wd:
            for step in range(40):
                dist.all_reduce(torch.ones(4))
                if step == 12 and rank == 0:
                    dist.send(torch.ones(4), 1)
                elif step == 12 and rank == 1:
                    dist.recv(torch.ones(4), 0)
                wd.step(step)
            outcome["finished"] = step
    except RanksOutOfStep as exc:
        outcome["raised"] = str(exc)
    _write(out_dir, rank, outcome)
    os._exit(0)


@pytest.mark.slow
def test_a_point_to_point_send_is_never_read_as_ranks_out_of_step(tmp_path):
    """Issue 64: 3 ranks in step, rank 0 sends once to rank 1 at step 12: the count of collectives
    read it as "rank 2 had issued 1 fewer" and every rank stopped at about step 22."""
    ranks = spawn(_a_send_among_ranks_in_step, tmp_path, ranks=3)
    assert ranks == [{"finished": 39}] * 3, ranks


def _counts_after_point_to_point(rank, port, out_dir):
    import torch
    import torch.distributed as dist

    from watchdog.actions.agreement import collective_counter

    _join(rank, port)
    read, counted = collective_counter()
    before = read()
    if rank == 0:
        dist.send(torch.ones(2), 1)
    else:
        dist.recv(torch.ones(2), 0)
    _write(out_dir, rank, {"counted": counted, "moved": read() != before})
    dist.barrier()
    os._exit(0)


@pytest.mark.slow
def test_a_count_of_collectives_is_read_only_where_point_to_point_leaves_it_alone(tmp_path):
    """The class: whatever backend runs here, the count the agreement reads (if it reads one) does not
    move with a send or a receive."""
    for rank in spawn(_counts_after_point_to_point, tmp_path):
        assert not (rank["counted"] and rank["moved"]), rank


def _sample_every_differs(rank, port, out_dir):
    _log_to(f"{out_dir}/rank{rank}.log")
    _join(rank, port)
    config = WatchdogConfig(sample_every=5 if rank == 0 else 10, device="cpu", source="rss",
                            agreement_timeout_seconds=60, stall_exit_after_seconds=60, **QUIET)
    outcome = {}
    try:
        with Watchdog(config) as wd:
            for step in range(40):
                wd.step(step)
            outcome["finished"] = True
    except RanksOutOfStep as exc:
        outcome["raised"] = str(exc)
    _write(out_dir, rank, outcome)
    time.sleep(1)
    os._exit(0)


@pytest.mark.slow
def test_a_sampling_period_that_differs_between_ranks_is_named_as_such(tmp_path):
    """Issue 64: sample_every 5 on rank 0 and 10 on rank 1, the same step numbers, was reported as
    ranks calling step() "at different steps". The setting that differs is named, on every rank."""
    from watchdog.actions.agreement import SHARED_SETTINGS

    assert SHARED_SETTINGS == ("sample_every",)
    ranks_ending(_sample_every_differs, tmp_path, bound=90)
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for outcome in outcomes:
        assert "sample_every is 5 on rank 0 and 10 on rank 1" in outcome.get("raised", ""), outcome
        assert "different steps" not in outcome["raised"]


def _started_and_stopped_many_times(rank, port, out_dir):
    """A watchdog per fit, as the Lightning and Hugging Face callbacks make: 40 on each of 2 ranks."""
    _join(rank, port)
    config = WatchdogConfig(sample_every=5, device="cpu", source="rss", agreement_timeout_seconds=60, **QUIET)
    fds = []
    for _ in range(40):
        with Watchdog(config) as wd:
            for step in range(11):
                wd.step(step)
        fds.append(len(os.listdir("/proc/self/fd")))
    _write(out_dir, rank, {"fds": fds})
    os._exit(0)


@pytest.mark.slow
def test_a_watchdog_started_and_stopped_forty_times_leaves_no_descriptors_behind(tmp_path):
    """Issue 64: 40 watchdogs started and stopped on 2 ranks grew open descriptors from 26 to 221: the
    agreement's gloo group was never destroyed. Closing the agreement destroys it."""
    for rank in spawn(_started_and_stopped_many_times, tmp_path, timeout=240):
        fds = rank["fds"]
        assert fds[-1] - fds[4] <= 4, fds


def _watched_on_rank_0_only(rank, port, out_dir):
    """The watchdog on rank 0 only; then both ranks make the job's own group, as a job does."""
    import torch.distributed as dist

    _log_to(f"{out_dir}/rank{rank}.log")
    _join(rank, port)
    started = time.monotonic()
    outcome = {}
    if rank == 0:
        try:
            Watchdog(WatchdogConfig(device="cpu", source="rss", agreement_timeout_seconds=5, **QUIET)).start()
            outcome["started"] = True
        except PeerLost as exc:
            outcome["lost"] = exc.code
    outcome["seconds"] = time.monotonic() - started
    _write(out_dir, rank, outcome)
    if rank == 1:
        dist.new_group(backend="gloo", timeout=__import__("datetime").timedelta(seconds=60))
    os._exit(0)


@pytest.mark.slow
def test_a_rank_that_forms_the_agreement_alone_is_told_within_the_timeout(tmp_path):
    """Issue 64: with the watchdog on rank 0 only, its group formed with rank 1's next `new_group`,
    the job's own, and both ranks hung past 30 s with nothing said. Rank 0 now waits for every rank
    to say it forms the agreement, and is told within its 5 s: `agreement_unformed`, exit 43; its
    `new_group` was never made, so the job's own groups pair as the job made them."""
    ranks_ending(_watched_on_rank_0_only, tmp_path, bound=60)
    outcome = json.loads((tmp_path / "rank0.json").read_text())
    assert outcome.get("lost") == EXIT_PEER_LOST and outcome["seconds"] < 15, outcome
    said = [line for line in (tmp_path / "rank0.log").read_text().splitlines() if line.startswith("agreement_unformed")]
    assert len(said) == 1 and "every rank must, at the same point" in said[0], said


def _rank_1_is_stopped(rank, port, out_dir):
    """Rank 1 is SIGSTOPped at step 12; rank 0 goes on to wait for its offer in the agreement, and its
    stall watch (4 s) ends it long before the agreement's timeout (30 s)."""
    import signal

    _join(rank, port)
    config = WatchdogConfig(sample_every=5, device="cpu", source="rss", stall_after_seconds=1,
                            stall_check_seconds=0.2, agreement_timeout_seconds=30, stall_exit_after_seconds=4,
                            trace_file=f"{out_dir}/rank{rank}.csv", **QUIET)
    with Watchdog(config) as wd:
        for step in range(40):
            if rank == 1 and step == 12:
                # Stopped after its thread's exchange of step 10 is over: on a loaded machine a stop at
                # once caught that exchange midway, and rank 0 then waited for step 10 with every offer made.
                time.sleep(1.0)
                os.kill(os.getpid(), signal.SIGSTOP)
            wd.step(step)
            time.sleep(0.01)
    os._exit(0)


@pytest.mark.slow
def test_a_rank_waiting_for_a_stopped_rank_says_so_and_names_it(tmp_path):
    """Issue 64: rank 1 SIGSTOPped, stall_exit_after_seconds (4) below agreement_timeout_seconds (30):
    rank 0's post-mortem said "rank 0 stalled in rank.py:20", its own step() line, though it waited
    in the agreement for rank 1. Its record now says what it waited for, and whom."""
    from watchdog.core.postmortem import diagnose
    from watchdog.records import flight_record

    context = mp.start_processes(_rank_1_is_stopped, args=(free_port(), str(tmp_path)), nprocs=2, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + 60
    while context.processes[0].is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    for process in context.processes:
        process.kill()  # rank 1 is stopped: only SIGKILL ends it
    assert context.processes[0].exitcode == EXIT_PEER_LOST, context.processes[0].exitcode
    record = flight_record.read(tmp_path / f"rank0.csv{flight_record.SUFFIX}")
    assert record["stall"]["waiting"] == {"step": 15, "ranks": [1]}, record["stall"]
    post = diagnose([], record=record)
    assert "rank 0 was not stalled itself: it waited in the watchdog's agreement for rank 1" in post.explanation
    assert "test_agreement.py" in post.explanation, post.explanation
