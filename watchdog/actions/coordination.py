"""All ranks take the same action at the same step.

Each rank's watchdog watches its own device, so one rank may decide to checkpoint while the
others see nothing. If that rank alone saved and rebuilt (or exited), the others would block in
the next collective forever. So ranks agree: an all_reduce(MAX) of the action's severity, and
everyone takes the most severe action any rank proposed.

The agreement is a collective, so every rank must call it at the same steps. It runs on a gloo
group of its own (CPU tensors): reading the result must not force an XLA graph execution or a
device-to-host copy of the training step (a rule of the domain, watchdog/ARCHITECTURE.md), nor touch NCCL streams.
"""

from __future__ import annotations

import sys

from watchdog.core.errors import ConfigError
from watchdog.core.verdict import Action

_SEVERITY = {Action.NONE: 0, Action.WARN: 1, Action.CHECKPOINT_REINIT: 2, Action.CHECKPOINT_RESTART: 3}
_BY_SEVERITY = {level: action for action, level in _SEVERITY.items()}

_control_groups: dict[int, object] = {}  # id(default group) -> gloo group for control messages
_coordinators: dict[int, "ActionCoordinator"] = {}  # every -> the one behind agree_on_action(every=...)


def severity(action: Action | None) -> int:
    """NONE (and no action at all) < WARN < CHECKPOINT_REINIT < CHECKPOINT_RESTART."""
    return 0 if action is None else _SEVERITY[action]


def most_severe(actions) -> Action | None:
    """The most severe of several proposals; None when none of them asks for anything."""
    level = max((severity(a) for a in actions), default=0)
    return _BY_SEVERITY[level] if level else None


def distributed_world_size() -> int:
    """World size of an initialised torch.distributed job, else 1. Costs a dict lookup when torch.distributed is unused."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


def agree_on_action(action: Action | None, *, step: int | None = None, every: int = 1) -> Action | None:
    """The most severe action proposed by any rank; `action` itself when not running multi-rank.

    Single process: O(1), no communication. Multi-rank: one tiny all_reduce per call, so every
    rank must call it at the same steps; called every step that is a small but real per-step cost.
    With `every=N` and `step`, only steps divisible by N communicate (a process-wide
    `ActionCoordinator` holds proposals in between). An agreed NONE comes back as `action`
    (None or NONE), so callers keep their own "nothing" value.
    """
    if distributed_world_size() == 1:
        return action
    if every > 1:
        if step is None:
            raise ValueError("agree_on_action(every > 1) needs the step")
        return _shared_coordinator(every).agree(action, step)
    return _all_reduce_max(action)


def _all_reduce_max(action: Action | None) -> Action | None:
    import torch
    import torch.distributed as dist

    level = torch.tensor([severity(action)], dtype=torch.int64)
    dist.all_reduce(level, op=dist.ReduceOp.MAX, group=_control_group())
    agreed = int(level.item())
    return _BY_SEVERITY[agreed] if agreed else action


class ActionCoordinator:
    """Agreement on only the steps divisible by `every` (use the watchdog's sample interval).

    A rank's proposal on an off step is held (the most severe one wins) and offered at the next
    communicating step, so nothing is lost and every rank still acts at the same step, at most
    `every - 1` steps later. Single process: no holding, the action comes straight back.
    """

    def __init__(self, every: int = 1):
        if every < 1:
            raise ConfigError("every", f"must be at least 1, got {every}")
        self.every = every
        self._pending: Action | None = None

    def agree(self, action: Action | None, step: int) -> Action | None:
        if distributed_world_size() == 1:
            return action
        if severity(action) > severity(self._pending):
            self._pending = action
        if step % self.every:
            return None
        proposal, self._pending = self._pending, None
        return _all_reduce_max(proposal)


def _shared_coordinator(every: int) -> ActionCoordinator:
    if every not in _coordinators:
        _coordinators[every] = ActionCoordinator(every)
    return _coordinators[every]


def _control_group():
    """A gloo group alongside the default one (created once; creating it is itself collective)."""
    import torch.distributed as dist

    default = dist.group.WORLD
    if dist.get_backend() == "gloo":
        return default
    key = id(default)
    if key not in _control_groups:
        _control_groups[key] = dist.new_group(backend="gloo")
    return _control_groups[key]
