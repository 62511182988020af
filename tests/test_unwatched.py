"""The unwatched run's stand-in for the `Watchdog` (`runtime/unwatched.py`): it reads and judges
nothing, and still takes drills and a loop's own proposals through the one action path."""

from watchdog import Action
from watchdog.actions.action_path import FORCED, REINITIALISED
from watchdog.core.errors import EXIT_RESTART_REQUESTED
from watchdog.runtime.unwatched import Unwatched


def test_drills_and_proposals_take_the_action_path_and_count_as_the_watchdogs_would(events, monkeypatch):
    monkeypatch.delenv("HBMWATCH_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    stand_in = Unwatched(((4, Action.CHECKPOINT_REINIT), (7, Action.CHECKPOINT_RESTART))).start()
    assert not stand_in.watches and stand_in.verdict is None and stand_in.source_name == "none"
    with stand_in.phase("eval", steps=3):  # nothing to tell: a no-op
        pass
    rebuilt = []
    handed = []
    states = []
    for step in range(9):
        if step == 8:
            stand_in.propose(Action.CHECKPOINT_RESTART, "stop signal")
        action = stand_in.step(step)
        if action is None:
            continue
        handed.append((step, action, stand_in.last_action.origin))
        stand_in.carry_out(action, save=lambda: f"ckpt-{step}.pt", rebuild=lambda: rebuilt.append(step))
        states.append(stand_in.last_action.state)
    assert handed == [(4, Action.CHECKPOINT_REINIT, FORCED), (7, Action.CHECKPOINT_RESTART, FORCED),
                      (8, Action.CHECKPOINT_RESTART, "stop signal")]
    assert rebuilt == [4]
    assert states == ["rebuilt", "exited", "exited"], "nothing measures a stand-in's rebuild: it stays rebuilt"
    blocks = events.named("action_outcome")
    assert [(b["step"], b["outcome"], b["exit_code"]) for b in blocks] == [
        (4, REINITIALISED, None), (7, "exit 42: restart requested", EXIT_RESTART_REQUESTED),
        (8, "exit 42: restart requested", EXIT_RESTART_REQUESTED)]
    # the drill's restart stands for the watchdog's; the stop signal's is the job's only
    assert stand_in.state_dict() == {"restarts_so_far": 2, "watchdog_restarts": 1, "watchdog_restart_step": 7, "cycles": []}


def test_a_drill_and_a_proposal_at_one_step_hand_over_the_more_severe_as_the_watchdog_does(events, monkeypatch):
    """The stand-in's drills and proposals wait in the `Watchdog`'s chores: a proposal no longer
    hides a more severe drill of its step, and drills given out of order still come at their steps."""
    monkeypatch.delenv("HBMWATCH_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    stand_in = Unwatched(((6, Action.CHECKPOINT_REINIT), (3, Action.CHECKPOINT_RESTART))).start()
    handed = []
    for step in range(8):
        if step == 3:
            stand_in.propose(Action.CHECKPOINT_REINIT, "the loop's own")
        action = stand_in.step(step)
        if action is not None:
            handed.append((step, action, stand_in.last_action.origin))
            stand_in.carry_out(action, save=lambda: True, rebuild=lambda: None)
    assert handed == [(3, Action.CHECKPOINT_RESTART, FORCED), (6, Action.CHECKPOINT_REINIT, FORCED)]
