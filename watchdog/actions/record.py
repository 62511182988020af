"""An action's record once handed over (`ActionOutcome`): where it is in its life (`state`), who
decided it and on what verdict, what is leaking, what the loop did and what it gave back, and the
block a person reads of it (drawn with the station's words, `station/blocks.py`). Built once by the
action path at the hand-over (`actions/action_path.py`), moved along by it, closed by the sidecar
when it measures the rebuild (`runtime/sampler.py`). Pure: no threads, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from watchdog.core.errors import EXIT_FUTILE, EXIT_RESTART_REQUESTED, EXIT_UNSAVED
from watchdog.core.units import format_bytes
from watchdog.core.verdict import Action, Verdict
from watchdog.station.blocks import action_words, block_rows, block_title, oom_text, rate_text

# An action's states on its record (`ActionOutcome.state`), in order: handed to the loop by `step()`,
# its checkpoint saved, the training state rebuilt in process, that rebuild measured by the sidecar
# (its reading judged); or the process leaving for it (exit 42, 44, 45). Decided and agreed come
# before the record (`core.verdict.Decided`, the ranks' agreement).
HANDED, SAVED, REBUILT, MEASURED, EXITED = "handed over", "saved", "rebuilt", "measured", "exited"



@dataclass
class ActionOutcome:
    """One action of the watchdog, from what it saw to what it gave back (the `action_outcome` block)."""

    step: int
    action: Action
    verdict: Verdict | None  # what the decision was based on
    suspects: list[str] = field(default_factory=list)  # what is leaking, with its holder
    checkpoint: str | None = None  # path of the checkpoint saved for it
    outcome: str = ""  # "reinitialised in process", "exit 42: restart requested", ...
    recovered_bytes: float | None = None  # measured after a reinit: the reading before it less the one after
    memory_after_bytes: float | None = None
    memory: str = "device"  # which memory asked for it: "device", or "host" (the host's RAM)
    origin: str = ""  # who decided it, when not this rank's watchdog alone: "forced (a drill)", "asked by rank 0, ..."
    exit_code: int | None = None  # the status the process ends with for it (42, 44, 45); None: training went on
    futile: str | None = None  # why restarting will not save this job, where it will not (then: exit 45)
    not_freed: list[str] = field(default_factory=list)  # after a reinit: what its census named, still held
    # A reinit's readings of each memory at its hand-over (device, host), which the sidecar measures its
    # rebuild against: they travel with the readings after it, in one message (`Watchdog.reinit_finished`).
    readings_before: tuple | None = field(default=None, repr=False)
    state: str = HANDED  # where the action is (above): moved by the action path, closed by the sidecar
    logged: bool = field(default=False, repr=False)  # its block is logged (once: `ActionPath.log_outcome`)

    def block(self) -> str:
        rows = []
        verdict = self.verdict
        if verdict is not None:
            where = "host memory " if self.memory == "host" else ""
            rows.append(("seen", f"{where}floor rising {rate_text(verdict.slope_bytes_per_step)} "
                                 f"at {format_bytes(verdict.floor_bytes)}; {oom_text(verdict)}"))
        for index, suspect in enumerate(self.suspects or ["no growing group of live tensors or Python buffers found"]):
            rows.append(("leaking" if index == 0 else "", suspect))
        if self.origin:
            rows.append(("decided", self.origin))
        done_as = self.done_as()
        if done_as is not self.action:  # the title names what was done; this row, what was asked
            rows.append(("asked", f"{action_words(self.action)}; with no rebuild given, the loop saves and exits "
                                  f"{self.exit_code} to be restarted"))
        if self.futile:
            rows.append(("in vain", f"restarting will not save this job: {self.futile}"))
        done = [self.outcome or self.action.value]
        if self.checkpoint:
            done.insert(0, f"checkpoint {self.checkpoint}")
        rows.append(("done", ", ".join(done)))
        for index, line in enumerate(self.not_freed):
            rows.append(("not freed" if index == 0 else "", f"the rebuild did not free it: {line}" if index == 0 else line))
        if self.recovered_bytes is not None:
            after = f" (memory now {format_bytes(self.memory_after_bytes, 2)})" if self.memory_after_bytes is not None else ""
            rows.append(("recovered", f"{format_bytes(self.recovered_bytes, 2)} given back{after}" if self.recovered_bytes > 0
                         else f"nothing given back{after}: the leak outlives a rebuild, the next action restarts"))
        memory = " (host memory)" if self.memory == "host" else ""
        title = {EXIT_UNSAVED: "checkpoint failed", EXIT_FUTILE: "checkpoint and stop"}.get(self.exit_code,
                                                                                          action_words(done_as))
        return "\n".join([block_title(f"watchdog: {title} at step {self.step:,}{memory}"), *block_rows(rows)])

    def done_as(self) -> Action:
        """What the loop did with the action, which the block's title names: a reinit the loop carried
        out as an exit 42 (no rebuild given: `carry_out(action, save=...)` alone) is a restart."""
        if self.action is Action.CHECKPOINT_REINIT and self.exit_code == EXIT_RESTART_REQUESTED:
            return Action.CHECKPOINT_RESTART
        return self.action

    def fields(self) -> dict:
        """The raw fields for JSON logs (base units)."""
        verdict = self.verdict
        return {"step": self.step, "action": self.action.value, "memory": self.memory, "suspects": self.suspects,
                "checkpoint": self.checkpoint, "outcome": self.outcome, "origin": self.origin, "exit_code": self.exit_code,
                "futile": self.futile, "not_freed": self.not_freed,
                "recovered_bytes": self.recovered_bytes,
                "slope_bytes_per_step": verdict.slope_bytes_per_step if verdict else None,
                "projected_oom_step": verdict.projected_oom_step if verdict else None}
