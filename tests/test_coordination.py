"""Rank agreement with real processes: two ranks spawned by torch.multiprocessing, gloo over 127.0.0.1."""

import json
import socket

import pytest
import torch.multiprocessing as mp

from watchdog.actions.coordination import ActionCoordinator, agree_on_action, most_severe, severity
from watchdog.core.errors import EXIT_RESTART_REQUESTED
from watchdog.core.verdict import Action

REINIT, RESTART, WARN = Action.CHECKPOINT_REINIT, Action.CHECKPOINT_RESTART, Action.WARN


def test_severity_order_and_most_severe():
    assert [severity(a) for a in (None, Action.NONE, WARN, REINIT, RESTART)] == [0, 0, 1, 2, 3]
    assert most_severe([None, WARN, RESTART, REINIT]) is RESTART
    assert most_severe([None, Action.NONE]) is None
    assert most_severe([]) is None


def test_single_process_is_the_identity_and_holds_nothing_back():
    coordinator = ActionCoordinator(every=4)
    for action in (None, Action.NONE, WARN, REINIT, RESTART):
        assert agree_on_action(action) is action
        assert coordinator.agree(action, step=3) is action  # off step, yet straight back: nobody to wait for
        assert agree_on_action(action, step=3, every=4) is action


# What each rank proposes, by scenario and step; everything else is None.
PROPOSALS = {
    "every_step": {1: {5: REINIT}},
    "max_wins": {0: {2: WARN}, 1: {2: RESTART}},
    "every_4": {1: {5: REINIT}, 0: {6: WARN}},
    "every_3_function": {0: {4: RESTART}},
}
STEPS = 10


def _rank_main(rank, port, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    try:
        for scenario, proposals in PROPOSALS.items():
            coordinator = ActionCoordinator(every=4) if scenario == "every_4" else None
            every = 3 if scenario == "every_3_function" else 1
            taken = {}
            for step in range(STEPS):
                proposal = proposals.get(rank, {}).get(step)
                agreed = (coordinator.agree(proposal, step) if coordinator
                          else agree_on_action(proposal, step=step, every=every))
                if agreed is not None:
                    taken[step] = agreed.value
            results[scenario] = taken
    finally:
        dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.json", "w") as handle:
        json.dump(results, handle)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_real_ranks_take_the_same_action_at_the_same_step(tmp_path):
    mp.spawn(_rank_main, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    taken = ranks[0]
    assert taken["every_step"] == {"5": "checkpoint_reinit"}  # rank 1 alone proposed it; both act at step 5
    assert taken["max_wins"] == {"2": "checkpoint_restart"}
    assert taken["every_4"] == {"8": "checkpoint_reinit"}  # held from steps 5 and 6, agreed at the next multiple of 4
    assert taken["every_3_function"] == {"6": "checkpoint_restart"}


def _trainer_rank(rank, port, out_dir):
    """One of two real trainer processes (plain CPU, gloo). Only rank 1 is asked to reinit (at step 7),
    then, in a second run, only rank 1 is preempted (SIGTERM at step 7)."""
    import os
    import signal

    import torch.distributed as dist

    from watchdog.core.config import WatchdogConfig
    from watchdog.trainer.loop import Replica, TrainConfig, Trainer
    from watchdog.trainer.model import ModelConfig

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    talks = []
    all_reduce = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        talks.append(trainer.state.step - 1)  # the step just done, whose agreement this is
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted
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
        finally:
            trainer.close()
        outcomes[run] = {"reinits": result.reinits, "step": result.step, "exit": result.exit_code,
                         "talks": list(talks)}
    dist.destroy_process_group()
    with open(f"{out_dir}/trainer{rank}.json", "w") as handle:
        json.dump(outcomes, handle)


@pytest.mark.slow
def test_two_trainer_processes_agree_once_per_sampling_step_and_act_together(tmp_path):
    mp.spawn(_trainer_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"trainer{r}.json").read_text()) for r in (0, 1)]
    for outcome in ranks:
        reinit, preempted = outcome["reinit"], outcome["preempted"]
        assert reinit["step"] == 17 and reinit["reinits"] == 1 and reinit["exit"] == 0  # rank 0 reinitialised too
        # One all_reduce per sampling step, none in between; and one after each save (at the reinit of
        # step 10 and the final one), so that every rank learns whether every rank's save landed.
        assert reinit["talks"] == [0, 5, 10, 10, 15, 16]
        # one host preempted at step 7: both save at the next sampling step and exit 42 together
        assert preempted["step"] == 11 and preempted["exit"] == EXIT_RESTART_REQUESTED
        assert preempted["talks"] == [0, 5, 10, 10]
    assert "ckpt-00000011.pt" in {p.name for p in (tmp_path / "reinit").iterdir()}  # the reinit came at step 10
    assert "ckpt-00000011.pt" in {p.name for p in (tmp_path / "preempted").iterdir()}
