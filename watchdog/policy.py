"""Verdicts -> actions (placeholder interface; the real ladder lands with issue 3). Pure."""

from __future__ import annotations

from dataclasses import dataclass

from watchdog.errors import ConfigError
from watchdog.verdict import Action, Verdict


@dataclass(frozen=True)
class PolicyConfig:
    checkpoint_margin_steps: int = 50
    max_restarts: int = 3
    prefer_restart: bool = False

    def __post_init__(self) -> None:
        if self.checkpoint_margin_steps < 0:
            raise ConfigError("policy.checkpoint_margin_steps", "must not be negative")
        if self.max_restarts < 0:
            raise ConfigError("policy.max_restarts", "must not be negative")


class ActionPolicy:
    def __init__(self, config: PolicyConfig | None = None, restarts_so_far: int = 0):
        self.config = config or PolicyConfig()
        self.restarts_so_far = restarts_so_far

    def decide(self, verdict: Verdict) -> Action:
        return Action.NONE

    def reinit_finished(self, floor_before_bytes: float, floor_after_bytes: float) -> None:
        """Told by the training side after a checkpoint-and-reinit, with floors measured around it."""
