"""The training thread's work between steps, found by `Watchdog.step()` in one deque (`queue`).

A chore is an action to hand over (a `Decided`: the sidecar's, a drill's, the loop's own
proposal), `FOLLOW` (the follower that names what leaks has work, or an action's block is due), or
an exception from the agreement's thread (ranks out of step, a peer lost), raised into the loop.
`step()` checks the deque's truth and nothing else; the work here runs only when it holds
something: the follower's census, the job file's step, an action's block, then the most severe
action waiting, taken by the action path (handed over now, or with several ranks held for the
next offer).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from watchdog.actions.action_path import DEVICE, FORCED, ActionPath
from watchdog.actions.agreement import PeerLost, severity
from watchdog.core.verdict import Action, Decided, Verdict
from watchdog.forensics.follower import LeakFollower
from watchdog.logs import get_logger
from watchdog.runtime.sampler import FOLLOW

log = get_logger(__name__)
NEVER = 1 << 62  # no forced action to come


class Chores:
    """The deque the training thread checks, and the work it asks for (the module docstring).
    `follower`: the census driver (None: forensics off). `forced`: drills, `(step, action)`
    (`WatchdogConfig.forced_actions`)."""

    def __init__(self, actions: ActionPath, follower: LeakFollower | None, forced=()):
        self.queue: deque = deque([FOLLOW] if follower is not None else [])  # a baseline at the first step
        self.actions, self.follower = actions, follower
        self.failed: Callable[[], None] = lambda: None  # the way out is no clean end (set at start: exit 43)
        self._forced = sorted(forced, key=lambda drill: drill[0])  # a trainer's drills may come in any order

    @property
    def next_forced(self) -> int:
        """The step of the next drill (`NEVER`: none left); `step()` keeps it for its one comparison,
        from `force`'s answer."""
        return self._forced[0][0] if self._forced else NEVER

    def force(self, step: int, verdict: Verdict | None) -> int:
        """Forced actions due at `step` join the queue, each standing for the watchdog's own (decided on
        `verdict`, the newest); those of steps this process never ran (it resumed past them) are
        dropped. Returns the step of the next one (`NEVER`: none)."""
        forced = self._forced
        while forced and forced[0][0] <= step:
            at, action = forced.pop(0)
            if at == step:
                log.warning("forced_action", action=action.value, step=step)
                self.queue.append(Decided(action, verdict, DEVICE, FORCED))
        return self.next_forced

    def propose(self, action: Action, verdict: Verdict | None, origin: str) -> None:
        """A loop's own checkpoint action (`origin`: why, e.g. "preempted"), decided on `verdict` (the
        newest, if any): it waits with the watchdog's and is taken as they are, but is not the
        watchdog's restart to count (`own=False`). Any other action is ignored."""
        if action.needs_checkpoint:
            self.queue.append(Decided(action, verdict, DEVICE, origin, own=False))

    def do(self, step: int) -> Action | None:
        """Between steps: every chore waiting, then the most severe action, taken by the action path."""
        queue, follow, decided = self.queue, False, None
        while queue:
            chore = queue.popleft()
            if chore is FOLLOW:
                follow = True
            elif isinstance(chore, BaseException):  # from the agreement's thread: ranks out of step, a peer lost
                if isinstance(chore, PeerLost):
                    self.failed()
                raise chore
            elif decided is None or severity(chore.action) > severity(decided.action):
                decided = chore
        if follow:
            self._follow(step)
        return None if decided is None else self.actions.take(step, decided)

    def _follow(self, step: int) -> None:
        # Its marker was taken off before looking: a capture the sidecar arms meanwhile queues another.
        actions = self.actions
        if actions.account is not None:
            actions.account.between_steps(step)
        actions.between_steps()
        follower = self.follower
        if follower is not None:
            follower.between_steps(step)
            if follower.pending:
                self.queue.append(FOLLOW)

    def suspects(self, step: int) -> list[str]:
        """This process's census of what is leaking (empty with forensics off)."""
        return self.follower.suspects(step) if self.follower is not None else []

    def after_rebuild(self, step: int, capture: bool) -> list[str]:
        """The old state is gone: a new baseline and, where a leak was acted on, a new capture; what the
        rebuild did not free, named again (`LeakFollower.after_rebuild`)."""
        if self.follower is None:
            return []
        held = self.follower.after_rebuild(step, capture=capture)
        self.queue.append(FOLLOW)
        return held

    def phase_ended(self, name: str, step: int) -> None:
        """A bounded phase ended: a climbing phase's run is counted by the follower."""
        if self.follower is not None and self.follower.phases_climbing:
            self.follower.phase_ended(name, step)

    def close(self) -> None:
        if self.follower is not None:
            self.follower.close()
