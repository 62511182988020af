"""One validated configuration for the watchdog.

Every field is checked when the object is built, so a bad value fails at start-up with a
message naming the field (`ConfigError`), never hours into a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from watchdog.core.detector import DetectorConfig
from watchdog.core.errors import ConfigError
from watchdog.core.numbers import check_settings
from watchdog.core.numbers import MAX_SIZE, MAX_STEP
from watchdog.core.policy import PolicyConfig
from watchdog.core.recompilation import RecompilationConfig
from watchdog.core.verdict import Action

SOURCES = ("auto", "xla", "tpu", "cuda", "rss", "replay")


MAX_SECONDS = 1e9  # a wait in seconds (about 31 years): anything longer is a mistake, and inf overflows a timer
DEFAULT_STALL_EXIT_SECONDS = 900.0  # with several ranks: far below the collectives' own 30 minutes


@dataclass(frozen=True)
class WatchdogConfig:
    """Everything a `Watchdog` is told, checked when made (`ConfigError` names a bad field): how often
    and from where it reads memory, the budgets, the trace, the stall watch, the ranks' agreement,
    and the detector's and policy's settings (`DetectorConfig`, `PolicyConfig`, both importable from
    `watchdog`). Frozen, and settings only: what changes during a run (its restarts, where it ends)
    is the `Watchdog`'s state (`state_dict`, `load_state_dict`, `ends_at`)."""

    sample_every: int = 10
    """Wake the sidecar every this many training steps."""
    source: str = "auto"
    """Where memory numbers come from; `auto` takes the first that works for the device."""
    device: str | None = None
    """Device to watch (`xla:0`, `cuda:1`, `cpu`); None: captured on the thread that calls start()."""
    memory_limit_bytes: int | None = None
    """A budget when the device reports none, or one lower than the device's."""
    trace_file: Path | None = None
    """Append every sample to this trace CSV (the format in watchdog/ARCHITECTURE.md)."""
    replay_trace: Path | None = None
    """For `source="replay"`: the trace whose samples are served in order."""
    history_size: int = 4096
    """Samples kept in memory for forensics and reports; older ones are dropped."""
    stall_after_seconds: float = 600.0
    """A loop that has not stepped for this long is reported as stalled."""
    stall_check_seconds: float = 5.0
    stall_exit_after_seconds: float | None = None
    """A loop that has not stepped for this long records every thread's stack (the flight record,
    the log) and ends its process with status 43, so the job restarts from its newest checkpoint
    (`runtime/stall.py`): a stalled rank would hang every other rank in its next collective. None:
    `DEFAULT_STALL_EXIT_SECONDS` with several ranks, never for a single process (set a number to
    bound one too). Longer than the slowest stretch between two `step()` calls, saves included."""
    rank: int = 0
    agree_across_ranks: bool = True
    """With torch.distributed initialised and several ranks, every rank takes the most severe action
    any rank offered at a sampling step, at the next sampling step (`actions/agreement.py`). Every
    rank must then call `step()` with the same step numbers, as often."""
    agreement_timeout_seconds: float = 600.0
    """How long a rank waits for the others' offers before it exits 43 (a rank died or stalled),
    and how long making the agreement's group may take: longer than the slowest step between two
    sampling steps, checkpoints included."""
    forced_actions: tuple[tuple[int, Action], ...] = ()
    """Drills: (step, action) pairs, each asked for at that step as if the watchdog had decided it
    (agreed across ranks like any other)."""
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    recompilation: RecompilationConfig = field(default_factory=RecompilationConfig)
    """XLA graphs that keep compiling after warm-up: a finding with its cause, never an action."""
    forensics: bool = True
    """Name what is leaking on the training thread: a census at the first step and after each
    rebuild, a creation-site capture once a leak is suspected, a census when an action is handed
    over (each logged with its cost). Off: `step()` never does more than its O(1) work."""
    host_memory: bool = True
    """Watch the host's RAM too, through a Judge of its own (`readers/host_memory.py`): its OOM
    is the kernel's SIGKILL, with no traceback and no checkpoint. A host OOM projected asks for a
    checkpoint and a restart: a new process is what reliably gives host memory back."""
    host_memory_limit_bytes: int | None = None
    """The host's budget; None: the tightest memory cgroup limit, else the machine's memory."""
    host_sample_every: int | None = None
    """Read the host every this many steps (None: with every device sample)."""

    def __post_init__(self) -> None:
        check_settings(self)
        _positive_int("sample_every", self.sample_every)
        _positive_int("history_size", self.history_size, high=1 << 24)  # samples kept in memory
        if self.source not in SOURCES:
            raise ConfigError("source", f"must be one of {', '.join(SOURCES)}, got {self.source!r}")
        for name in ("memory_limit_bytes", "host_memory_limit_bytes"):  # True is an int, and was a 1-byte budget
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 < value < MAX_SIZE):
                raise ConfigError(name, f"must be a positive number of bytes below 2**63, got {value!r}")
        if self.host_sample_every is not None:
            _positive_int("host_sample_every", self.host_sample_every)
        for name in ("stall_after_seconds", "stall_check_seconds", "stall_exit_after_seconds"):
            value = getattr(self, name)
            if value is None and name == "stall_exit_after_seconds":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= MAX_SECONDS:
                raise ConfigError(name, f"must be a positive number of seconds up to {MAX_SECONDS:.0e}, got {value!r}")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ConfigError("rank", f"must be a non-negative integer, got {self.rank!r}")
        value = self.agreement_timeout_seconds
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < MAX_SECONDS:
            raise ConfigError("agreement_timeout_seconds", f"must be a positive number of seconds, got {value!r}")
        object.__setattr__(self, "forced_actions", _forced(self.forced_actions))
        if self.source == "replay" and self.replay_trace is None:
            raise ConfigError("replay_trace", "is required when source is 'replay'")
        if self.trace_file is not None:
            object.__setattr__(self, "trace_file", Path(self.trace_file))
        if self.replay_trace is not None:
            object.__setattr__(self, "replay_trace", Path(self.replay_trace))


def _forced(pairs) -> tuple[tuple[int, Action], ...]:
    try:
        forced = tuple((step, Action(action)) for step, action in pairs)
    except (TypeError, ValueError):
        raise ConfigError("forced_actions", f"must be (step, action) pairs, got {pairs!r}") from None
    for step, action in forced:
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**52 or not action.needs_checkpoint:
            raise ConfigError("forced_actions", f"expected (step, checkpoint action) pairs, got {(step, action.value)!r}")
    return tuple(sorted(forced))


def _positive_int(name: str, value: object, high: int = MAX_STEP) -> None:
    """A count of steps or samples: from 1, below `high` (a step's bound unless said otherwise)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < high:
        raise ConfigError(name, f"must be a positive integer below {high:,}, got {value!r}")
