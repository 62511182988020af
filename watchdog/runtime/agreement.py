"""Every rank of a job takes the same action at the same step.

Each rank's watchdog watches its own device, so one rank may ask for a checkpoint while the
others see nothing. If that rank alone saved (a collective in Lightning, a barrier in most loops)
or exited, the others would wait in their next collective forever: the job hangs with every
process alive, which no restarter notices. So ranks agree: on the steps they sample, every rank
offers its most severe pending action and every rank gets the most severe one offered.

- **A channel of its own.** The agreement is one all_gather of one integer per rank (its offer's
  severity and its step, packed) on a gloo group made for it, so it never interleaves with the
  training's collectives (NCCL, XLA or the default gloo group), reads no device tensor and
  compiles nothing. Every rank sees every offer, so every rank reaches the same answer; one packed
  integer is also cheap for gloo (two ranks here: 0.4 ms, against 1.0-1.3 ms for an all_reduce of
  three integers, measured in one run).
- **Whose restart.** An offer also says whether it is the watchdog's own decision (or a drill) or a
  loop's proposal (`Watchdog.propose`: a preemption), so every rank counts a restart against the
  watchdog's budget only when the watchdog asked for it, whichever rank it was.
- **Same steps on every rank.** The step each rank calls with travels with its offer; ranks whose
  counters disagree get `RanksOutOfStep` together, never a hang.
- **Bounded.** The group is made with `timeout_seconds`: a rank that died or stalled during an
  agreement (or never comes to it) makes the others' all_gather fail, and they raise `PeerLost`,
  a `SystemExit` with status 43 that a restarter (torchrun, `supervise`, JobSet) acts on.

Single process (torch.distributed not initialised, or one rank): no group, no communication.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import timedelta

from watchdog.core.errors import EXIT_PEER_LOST, ConfigError
from watchdog.core.verdict import Action
from watchdog.logs import get_logger

log = get_logger(__name__)

_SEVERITY = {Action.NONE: 0, Action.WARN: 1, Action.CHECKPOINT_REINIT: 2, Action.CHECKPOINT_RESTART: 3}
_BY_SEVERITY = {level: action for action, level in _SEVERITY.items()}
_STEP_BITS = 56  # an offer is severity << 56 | the watchdog's own << 55 | step (steps are below 2**52: core/numbers.py)
_OWN = 1 << 55  # the offer is the watchdog's own decision (or a drill), not a loop's proposal (a preemption)
_STEP_MASK = (1 << 52) - 1
DEFAULT_TIMEOUT_SECONDS = 600.0


def severity(action: Action | None) -> int:
    """NONE (and no action at all) < WARN < CHECKPOINT_REINIT < CHECKPOINT_RESTART."""
    return 0 if action is None else _SEVERITY[action]


def world_size() -> int:
    """Ranks of an initialised torch.distributed job, else 1; a dict lookup when torch.distributed is unused."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


class RanksOutOfStep(RuntimeError):
    """Ranks called an agreement at different step numbers: every rank must call `Watchdog.step()`
    with the same numbers (the global step, not a per-rank counter)."""


class PeerLost(SystemExit):
    """A rank died or stalled during an agreement: this one exits 43, and the restarter restarts the group."""

    def __init__(self, reason: str):
        super().__init__(EXIT_PEER_LOST)
        self.reason = reason

    def __str__(self) -> str:
        return f"exit {EXIT_PEER_LOST}: {self.reason}"


@dataclass(frozen=True, slots=True)
class Agreed:
    """An agreed action: what every rank does at `step`, and the (lowest) rank that asked for it."""

    action: Action
    step: int
    asked_by: int
    ranks: int
    own: bool = True  # the watchdog's own decision (or a drill), not a loop's proposal such as a preemption


class Agreement:
    """One all_gather per call across every rank of the job, on a gloo group of its own.

    Make it on every rank at the same point of the program (making the group is itself collective),
    then call `decide` on every rank at the same steps.
    """

    def __init__(self, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS):
        if not isinstance(timeout_seconds, (int, float)) or not 0 < timeout_seconds < 1e9:
            raise ConfigError("agreement_timeout_seconds", f"must be a positive number of seconds, got {timeout_seconds!r}")
        import torch
        import torch.distributed as dist

        self.timeout_seconds = float(timeout_seconds)
        self.rank, self.ranks = dist.get_rank(), dist.get_world_size()
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_seconds))
        self._offers = [torch.zeros(1, dtype=torch.int64) for _ in range(self.ranks)]
        log.info("agreement_joined", rank=self.rank, ranks=self.ranks, timeout_seconds=self.timeout_seconds)

    def decide(self, step: int, proposal: Action | None, *, own: bool = True) -> Agreed | None:
        """The most severe action any rank offered at `step` (None: nobody asked for anything), the
        lowest rank that offered it, and whether that rank's offer was the watchdog's own (`own`:
        False for a loop's proposal, such as a preemption's restart)."""
        import torch
        import torch.distributed as dist

        mine = torch.tensor([severity(proposal) << _STEP_BITS | (_OWN if own else 0) | (step & _STEP_MASK)],
                            dtype=torch.int64)
        try:
            dist.all_gather(self._offers, mine, group=self._group)
        except RuntimeError as exc:  # gloo: a peer's connection closed, or the group's timeout ran out
            reason = (f"rank {self.rank} waited for the other ranks' agreement at step {step}: a rank died or "
                      f"stalled ({_first_line(exc)}); restart the job from its newest checkpoint")
            log.error("agreement_failed", step=step, rank=self.rank, ranks=self.ranks,
                      timeout_seconds=self.timeout_seconds, exit_code=EXIT_PEER_LOST, error=_first_line(exc))
            raise PeerLost(reason) from None
        offers = [int(offer) for offer in torch.cat(self._offers).tolist()]
        steps = {offer & _STEP_MASK for offer in offers}
        if len(steps) > 1:
            raise RanksOutOfStep(
                f"ranks called Watchdog.step() at different steps (from {min(steps)} to {max(steps)}) when they "
                "agree on actions: every rank must call it with the same step numbers")
        levels = [offer >> _STEP_BITS for offer in offers]
        level = max(levels)
        if not level:
            return None
        asker = levels.index(level)
        return Agreed(_BY_SEVERITY[level], step, asker, self.ranks, own=bool(offers[asker] & _OWN))


def join(timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> Agreement | None:
    """An Agreement when this process is one of several ranks, else None (nobody to agree with)."""
    if world_size() <= 1:
        return None
    import os

    import torch.distributed as dist

    risk = restart_hang_risk(os.environ, dist.get_backend())
    if risk is not None:
        log.warning("restart_may_hang", reason=risk)
    return Agreement(timeout_seconds)


SHARED_STORE_SWITCH = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def restart_hang_risk(environ, backend: str) -> str | None:
    """Why a restart of this job may hang, said once at start, or None. Under torchrun with gloo,
    torch's rendezvous store shared with the process group (torch 2.9 here) can leave a restarted
    attempt hanging while its groups form, with nothing said for over ten minutes (a Hugging Face
    job's agreed restart did); `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` avoids it."""
    if "TORCHELASTIC_RUN_ID" not in environ or str(backend).lower() != "gloo" or environ.get(SHARED_STORE_SWITCH):
        return None
    return (f"torchrun with gloo and {SHARED_STORE_SWITCH} unset: a restarted attempt can hang while its process "
            f"groups form; set {SHARED_STORE_SWITCH}=1 for every rank (docs/many-ranks.md)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"
