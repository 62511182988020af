"""The training thread's work between steps (`runtime/chores.py`): what `step()` finds in its one
deque, and which action leaves when several wait."""

import pytest

from watchdog.actions.action_path import DEVICE, FORCED, ActionPath
from watchdog.actions.agreement import PeerLost
from watchdog.core.verdict import Action, Decided, Status, Verdict
from watchdog.runtime.chores import NEVER, Chores
from watchdog.runtime.host_watch import HOST
from watchdog.runtime.sampler import Sampler

MiB = 1 << 20


def projected(step: int) -> Verdict:
    return Verdict(step=step, timestamp=float(step), status=Status.OOM_PROJECTED, floor_bytes=900 * MiB,
                   slope_bytes_per_step=MiB, projected_oom_step=step + 40, projected_oom_steps=40.0)


def sidecar_for(chores: Chores) -> Sampler:
    """The sidecar's part that queues actions, over these chores (nothing else of it is used)."""
    return Sampler(mailbox=None, asked=None, source=None, station=None, host_watch=None, telemetry=None,
                   history=None, run_state=None, follower=None, chores=chores.queue, account=None, flight=None,
                   compile_watch=None, phase_now=lambda: "", count_error=lambda kind, exc: None)


def test_when_both_memories_ask_at_one_reading_the_more_severe_action_is_handed_over():
    """The device's judge asks for a reinit and the host's, at the same reading, for a restart (its
    memory wants a new process). The sidecar used to queue only the first ("one waits at most"), so
    the loop rebuilt in process while the host's leak, which a rebuild cannot free, went on."""
    actions = ActionPath(logs_outcomes=True)
    chores = Chores(actions, follower=None)
    sidecar = sidecar_for(chores)
    sidecar._queue(DEVICE, Action.CHECKPOINT_REINIT, projected(100))
    sidecar._queue(HOST, Action.CHECKPOINT_RESTART, projected(100))
    assert chores.do(101) is Action.CHECKPOINT_RESTART
    assert actions.last.memory == HOST and actions.last.action is Action.CHECKPOINT_RESTART
    assert not chores.queue and chores.do(102) is None, "one action leaves; the other is not handed over later"


def test_a_drill_comes_at_its_step_and_one_a_resumed_process_ran_past_is_dropped():
    actions = ActionPath(logs_outcomes=True)
    chores = Chores(actions, None, forced=((5, Action.CHECKPOINT_REINIT), (20, Action.CHECKPOINT_RESTART)))
    assert chores.next_forced == 5
    assert chores.force(12, None) == 20, "resumed at step 12: the drill of step 5 never happened here"
    assert not chores.queue
    assert chores.force(20, projected(19)) == NEVER
    assert chores.do(20) is Action.CHECKPOINT_RESTART
    assert actions.last.origin == FORCED and actions.last.verdict.step == 19


def test_a_lost_peer_is_raised_into_the_loop_and_marks_the_way_out_failed():
    failed = []
    chores = Chores(ActionPath(logs_outcomes=True), None)
    chores.failed = lambda: failed.append(True)
    chores.queue.append(PeerLost("rank 1 left the agreement"))
    with pytest.raises(PeerLost):
        chores.do(7)
    assert failed == [True]


def test_a_loops_proposal_waits_with_the_watchdogs_actions_and_is_no_restart_of_the_watchdogs():
    """`propose` (the Watchdog's and the stand-in's, one rule): a checkpoint action joins the queue and
    the most severe waiting leaves; a preemption's restart counts as the job's, not the watchdog's."""
    actions = ActionPath(logs_outcomes=True)
    chores = Chores(actions, None)
    chores.propose(Action.WARN, None, "not a checkpoint")
    assert not chores.queue
    chores.propose(Action.CHECKPOINT_RESTART, projected(10), "preempted")
    chores.queue.append(Decided(Action.CHECKPOINT_REINIT, projected(10), DEVICE))
    assert chores.do(11) is Action.CHECKPOINT_RESTART
    assert actions.last.origin == "preempted"
    kept = actions.run.state_dict()
    assert kept["restarts_so_far"] == 1 and kept["watchdog_restarts"] == 0, kept
