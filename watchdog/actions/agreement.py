"""Every rank of a job takes the same action at the same step.

Each rank's watchdog watches its own device, so one rank may ask for a checkpoint while the
others see nothing. If that rank alone saved (a collective in Lightning, a barrier in most loops)
or exited, the others would wait in their next collective forever: the job hangs with every
process alive, which no restarter notices. So ranks agree: on the steps they sample, every rank
offers its most severe pending action, and at the next sampling step every rank gets the most
severe one offered.

- **Off the training thread.** An offer is posted to a thread of the agreement's own (a queue
  put), which makes the all_gather; its answer is read at the next sampling step, one sampling
  period later, when every rank's offer has long arrived. The training thread never waits for
  the slowest rank's arrival, and its cost does not grow with the number of ranks (an all_gather
  waited for on the training thread cost 0.4-1.9 ms at 2 ranks and 3.5-9 ms at 4 here).
  Answering one period later is also what keeps ranks whose counters disagree out of a hang: a
  rank waiting in the agreement while the others wait in the training's all-reduce was the hang;
  a rank reads an answer only after its own next offer, which (at any offset smaller than the
  sampling period) comes after every other rank's offer of the step it waits for.
- **A channel of its own.** The all_gather is of three integers per rank (its offer's severity,
  whose it is and its step, packed; its count of the training's collectives; its sampling period)
  on a gloo group made for it, so it never interleaves with the training's collectives (NCCL, XLA
  or the default gloo group), reads no device tensor and compiles nothing. Every rank sees every
  offer, so every rank reaches the same answer. The group is destroyed when the agreement closes:
  a watchdog started and stopped once per `fit` or `train()` (the Lightning and Hugging Face
  callbacks) left one gloo group, and its connections, behind each time.
- **Formed by every rank, or by none.** Before the group is made, every rank says on the job's
  rendezvous store that it is forming the agreement's Nth group, and waits (within the timeout)
  for all the others to say so. A rank that forms it alone (the watchdog on rank 0 only) never
  calls `new_group`, whose pairing is by call order: its group formed with the other rank's next
  `new_group`, the job's own, and both hung. It is told within the timeout (`agreement_unformed`).
- **Whose restart.** An offer also says whether it is the watchdog's own decision (or a drill) or a
  loop's proposal (`Watchdog.propose`: a preemption), so every rank counts a restart against the
  watchdog's budget only when the watchdog asked for it, whichever rank it was.
- **Same steps on every rank.** Offers are paired in the order they are made, and each carries
  its step: ranks whose counters disagree (an off-by-one, a skipped or an extra call) offer
  different steps in some pair, and every rank is told at once (`ranks_out_of_step`, then
  `RanksOutOfStep` raised by its next `step()`), never a hang. A setting every rank must share
  (`SHARED_SETTINGS`: `sample_every`) travels with each offer, and one that differs is named as
  such, not as steps that differ.
- **Who is waited for.** Each rank counts its offers on the rendezvous store as it makes them, so
  a rank whose training thread waits for an answer names the ranks that have not made the offer
  (`waiting_for`): in `agreement_waiting`, and in the stall watch's record when it ends the wait.
- **Bounded.** The group is made with `timeout_seconds`, and making it is bounded too (a rank that
  never joins, a restarted job's stale rendezvous store): a rank that died or stalled (or never
  comes) makes the others' all_gather fail, and they raise `PeerLost`, a `SystemExit` with status
  43 that a restarter (torchrun, `supervise`, JobSet) acts on.

Single process (torch.distributed not initialised, or one rank): no group, no communication.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import sys
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as NotYet
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Callable

from watchdog.core.errors import EXIT_PEER_LOST, ConfigError
from watchdog.core.verdict import Action
from watchdog.logs import exit_process, get_logger

log = get_logger(__name__)

_SEVERITY = {Action.NONE: 0, Action.WARN: 1, Action.CHECKPOINT_REINIT: 2, Action.CHECKPOINT_RESTART: 3}
_BY_SEVERITY = {level: action for action, level in _SEVERITY.items()}
_STEP_BITS = 56  # an offer is severity << 56 | the watchdog's own << 55 | step (steps are below 2**52: core/numbers.py)
_OWN = 1 << 55  # the offer is the watchdog's own decision (or a drill), not a loop's proposal (a preemption)
_STEP_MASK = (1 << 52) - 1
DEFAULT_TIMEOUT_SECONDS = 600.0
SAY_WAITING_SECONDS = 10.0  # an answer not there after this long is said once (`agreement_waiting`)
_GRACE_SECONDS = 5.0  # past the group's own timeout, the training thread stops waiting for the agreement's thread
_FIELDS = 3  # numbers per rank in an all_gather: the offer, the count of collectives, the sampling period


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
    """Ranks offered at different step numbers: every rank must call `Watchdog.step()` with the
    same numbers (the global step, not a per-rank counter)."""


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

    def origin(self, why: str = "") -> str:
        """Who decided it, for the action block's `decided` row, after `why` (this rank's own reason
        for its offer, where the agreed action is the one it offered)."""
        asker = f"rank {self.asked_by}" if self.own else f"rank {self.asked_by}'s loop (not its watchdog)"
        decided = f"asked by {asker}, agreed by all {self.ranks} ranks"
        return f"{why}; {decided}" if why else decided


class Agreement:
    """One all_gather per offer across every rank of the job, on a gloo group of its own, made by
    a thread of its own in the order the offers are posted.

    Make it on every rank at the same point of the program (making the group is itself collective),
    then, on every rank at the same steps, `collect` the answer to the previous offer and `post`
    the next (or `decide`, both at once, where a loop needs the answer now: whether every save landed).
    `close` it on every rank: its group is destroyed.
    """

    def __init__(self, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS):
        if not isinstance(timeout_seconds, (int, float)) or not 0 < timeout_seconds < 1e9:
            raise ConfigError("agreement_timeout_seconds", f"must be a positive number of seconds, got {timeout_seconds!r}")
        import torch.distributed as dist

        self.timeout_seconds = float(timeout_seconds)
        self.rank, self.ranks = dist.get_rank(), dist.get_world_size()
        self._store, self._key = _job_store(), f"{_KEY}/{next(_FORMED)}"
        self._group = _form_group(self.timeout_seconds, self.rank, self.ranks, self._store, self._key)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._listeners: list[Callable[[BaseException], None]] = []
        self._collectives, counted = collective_counter()
        self._shift = Shift()
        self._waiting: int | None = None  # the step whose answer the training thread waits for
        self._entered = 0  # offers this rank's thread has entered the all_gather of (counted on the store too)
        self._thread = threading.Thread(target=self._serve, name="hbm-watchdog-agreement", daemon=True)
        self._thread.start()
        # A process that ends with the thread still holding the group tore gloo down from C++'s exit
        # handlers and aborted ("terminate called without an active exception", SIGABRT instead of its status).
        atexit.register(self.close)
        log.info("agreement_joined", rank=self.rank, ranks=self.ranks, timeout_seconds=self.timeout_seconds,
                 collectives_counted=counted)

    # ---- the training thread's side ------------------------------------------------------------

    def post(self, step: int, proposal: Action | None, *, own: bool = True, every: int = 0) -> Future:
        """Offer `proposal` (None: nothing) at `step`; returns its answer to come, for `collect` (the
        offer in flight is its caller's to hold: the action path's). `own`: the watchdog's decision
        (or a drill), False for a loop's proposal (a preemption); `every`: the sampling period this
        offer keeps (`sample_every`), which every rank must share."""
        return self._ask(step, proposal, own, every)

    def collect(self, answer: Future, offered_at: int, step: int) -> Agreed | None:
        """What the ranks agreed on the offers posted at `offered_at` (`answer`: what `post` returned),
        to be carried out at `step` on every rank (None: nobody asked for anything). Waits only where
        another rank has not made that offer yet: said after `SAY_WAITING_SECONDS`, bounded by the timeout."""
        agreed = self._answer(answer, offered_at)
        return replace(agreed, step=step) if agreed is not None else None

    def decide(self, step: int, proposal: Action | None, *, own: bool = True) -> Agreed | None:
        """The most severe action any rank offered at `step`, now (None: nobody asked for
        anything), the lowest rank that offered it, and whether that rank's offer was the
        watchdog's own. Waits for every rank: for a loop's yes or no, not for every sampling step."""
        return self._answer(self._ask(step, proposal, own, 0), step)

    def report_to(self, tell: Callable[[BaseException], None]) -> None:
        """`tell(error)` from the agreement's thread as soon as it knows the ranks are out of step
        or a peer is lost: a loop hears it at its next step, not only at its next sampling step."""
        self._listeners.append(tell)

    def waiting_for(self, within: float = 2.0) -> dict | None:
        """While the training thread waits for an answer: `{"step", "ranks"}`, the step of the offer
        waited on and the ranks that have not made the offer this rank's thread waits in (None:
        the store did not tell within `within` seconds); None when it is not waiting. Any thread."""
        step = self._waiting
        if step is None:
            return None
        mine, store, key = self._entered, self._store, self._key
        behind: list[int] | None = None

        def read() -> None:
            nonlocal behind
            counts = [store.add(f"{key}/offers/{rank}", 0) for rank in range(self.ranks)]
            behind = [rank for rank, count in enumerate(counts) if count < mine and rank != self.rank]

        if store is not None and mine:
            reader = threading.Thread(target=_quietly, args=(read,), name="hbm-watchdog-agreement-who", daemon=True)
            reader.start()
            reader.join(within)  # a store that does not answer (its host stopped) leaves the ranks unknown
        return {"step": step, "ranks": behind}

    def close(self) -> None:
        """The newest offer's all_gather is finished (every rank made it), so that a group torn
        down after this has no work in flight; then the thread ends and the group is destroyed."""
        atexit.unregister(self.close)
        self._requests.put(None)  # after the offers posted: the thread ends once their all_gathers are done
        self._thread.join(timeout=2 * _GRACE_SECONDS)
        group, self._group = self._group, None
        if group is not None and not self._thread.is_alive():  # never under an all_gather still waiting
            import torch.distributed as dist

            try:
                dist.destroy_process_group(group)
            except Exception as exc:  # noqa: BLE001 - a group already gone with the job's: nothing held
                log.info("agreement_group_not_destroyed", rank=self.rank, error=_first_line(exc))

    def _ask(self, step: int, proposal: Action | None, own: bool, every: int) -> Future:
        answer: Future = Future()
        self._requests.put((step, severity(proposal) << _STEP_BITS | (_OWN if own else 0) | (step & _STEP_MASK),
                            self._collectives(), every, answer))
        return answer

    def _answer(self, answer: Future, step: int) -> Agreed | None:
        self._waiting = step
        try:
            try:
                return answer.result(timeout=SAY_WAITING_SECONDS)
            except NotYet:
                waiting = self.waiting_for()
                behind = waiting["ranks"] if waiting is not None else None
                who = (f"rank(s) {', '.join(map(str, behind))} have" if behind else "another rank has")
                log.warning("agreement_waiting", step=step, rank=self.rank, seconds=SAY_WAITING_SECONDS,
                            timeout_seconds=self.timeout_seconds, waiting_for=behind,
                            note=f"{who} not offered step {step} yet: slow or stalled, or calling Watchdog.step() "
                                 "with other step numbers; the wait ends at agreement_timeout_seconds")
            try:
                return answer.result(timeout=self.timeout_seconds + _GRACE_SECONDS)
            except NotYet:
                raise self._lost(step, f"no answer within {self.timeout_seconds:g} s") from None
        finally:
            self._waiting = None

    # ---- the agreement's thread ----------------------------------------------------------------

    def _serve(self) -> None:
        import torch
        import torch.distributed as dist

        offers = torch.zeros(_FIELDS * self.ranks, dtype=torch.int64)
        lost: PeerLost | None = None
        while (request := self._requests.get()) is not None:
            step, offer, collectives, every, answer = request
            if lost is None:
                self._entered += 1
                self._count_offer()
                try:
                    dist.all_gather_into_tensor(offers, torch.tensor([offer, collectives, every], dtype=torch.int64),
                                                group=self._group)
                except RuntimeError as exc:  # gloo: a peer's connection closed, or the group's timeout ran out
                    lost = self._lost(step, _first_line(exc))
                    self._tell(lost)
            if lost is not None:
                answer.set_exception(PeerLost(lost.reason))
                continue
            try:
                answer.set_result(self._agreed(step, offers.tolist()))
            except RanksOutOfStep as exc:
                log.error("ranks_out_of_step", step=step, rank=self.rank, ranks=self.ranks, error=str(exc))
                self._tell(exc)
                answer.set_exception(exc)

    def _count_offer(self) -> None:
        """This rank's count of offers entered, on the store, for a rank waiting to name who is behind
        (one add, about 20 µs, on this thread). A store that fails stops the counting, never the agreement."""
        store = self._store
        if store is not None:
            try:
                store.add(f"{self._key}/offers/{self.rank}", 1)
            except Exception:  # noqa: BLE001 - who is behind goes unnamed
                self._store = None

    def _agreed(self, step: int, gathered: list[int]) -> Agreed | None:
        """Every rank's offer, read the same way on every rank (triples of numbers: the offer, the
        rank's count of collectives, its sampling period; plain Python, the agreement's thread holds
        the GIL briefly)."""
        offers = gathered[0::_FIELDS]
        _same_settings(gathered[2::_FIELDS])
        steps = [offer & _STEP_MASK for offer in offers]
        low, high = min(steps), max(steps)
        if low != high:
            first = next(rank for rank, offered in enumerate(steps) if offered != steps[0])
            raise RanksOutOfStep(
                f"ranks called Watchdog.step() at different steps (from {low} to {high}) when they agree on actions "
                f"(rank 0 offered step {steps[0]}, rank {first} step {steps[first]}): every rank must call it "
                "with the same step numbers, the global step, as often on every rank")
        self._shift.check(gathered[1::_FIELDS])
        levels = [offer >> _STEP_BITS for offer in offers]
        level = max(levels)
        if not level:
            return None
        asker = levels.index(level)  # the lowest rank that asked
        return Agreed(_BY_SEVERITY[level], step, asker, self.ranks, own=bool(offers[asker] & _OWN))

    def _lost(self, step: int, error: str) -> PeerLost:
        log.error("agreement_failed", step=step, rank=self.rank, ranks=self.ranks,
                  timeout_seconds=self.timeout_seconds, exit_code=EXIT_PEER_LOST, error=error)
        return PeerLost(f"rank {self.rank} waited for the other ranks' agreement at step {step}: a rank died or "
                        f"stalled ({error}); restart the job from its newest checkpoint")

    def _tell(self, error: BaseException) -> None:
        for tell in self._listeners:
            tell(error)


SHARED_SETTINGS = ("sample_every",)
"""Settings every rank must share: they decide at which steps a rank offers (offers are paired in
the order they are made). Each offer carries them; one that differs is named (`_same_settings`)."""


def _same_settings(periods: list[int]) -> None:
    """Every rank's offer of a sampling step keeps the same `sample_every`, and all of them offer at
    a sampling step or all at a loop's question (`decide`, period 0): else RanksOutOfStep naming what
    differs, rather than the step numbers it makes differ."""
    if min(periods) == max(periods):
        return
    first = next(rank for rank, period in enumerate(periods) if period != periods[0])
    if min(periods) == 0:
        asking, sampling = (0, first) if periods[0] == 0 else (first, 0)
        raise RanksOutOfStep(
            f"ranks agree at different points: rank {asking} asked the others a loop's question (whether every "
            f"save landed) while rank {sampling} offered a sampling step's action; every rank must call step() and "
            "save at the same steps")
    raise RanksOutOfStep(
        f"ranks sample at different intervals: sample_every is {periods[0]} on rank 0 and {periods[first]} on rank "
        f"{first}; every rank must have the same sample_every, since the ranks' offers are paired in the order "
        "they are made")


def collective_counter() -> tuple[Callable[[], int], bool]:
    """How many collectives this rank has issued on the default group, read at each offer (0.3 µs),
    and whether it is read at all: only where the backend's counter counts collectives alone. NCCL's
    does (point-to-point sends have a counter of their own); gloo's counts every send and receive too
    (measured: a send from rank 0 to rank 1 moved both ranks' counters, as an all_reduce moves every
    rank's), so a pipeline's stages, or one send, would read as ranks out of step; XLA keeps none.
    Elsewhere the check is off: -1."""
    import torch.distributed as dist

    off = (lambda: -1), False
    try:
        if str(dist.get_backend()).lower() not in COUNTS_COLLECTIVES_ALONE:
            return off
        read = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group
        read()
    except Exception:  # noqa: BLE001 - a backend without the counter: the check is off
        return off
    return read, True


COUNTS_COLLECTIVES_ALONE = frozenset({"nccl"})
"""Backends whose sequence number counts collectives and no point-to-point operation."""


class Shift:
    """Ranks whose `step()` calls slid apart during the run while their step numbers still agree:
    a per-rank counter that one rank advanced once more (an extra call) offers the same numbers,
    one training step early. What tells it is the training's own collectives: at the same step,
    ranks in step have issued as many on the default group (DDP's all-reduces, FSDP's gathers).
    Only a shift that appears after the first offer found every count equal, and stays the same
    at two offers running, is one; only where the backend counts collectives alone
    (`collective_counter`: NCCL): a count that moves with point-to-point operations (gloo's) cannot
    tell an extra call from one send, and is never read."""

    __slots__ = ("_judged", "_previous")

    def __init__(self) -> None:
        self._judged: bool | None = None  # None until the first offer: equal counts there turn the check on
        self._previous = None

    def check(self, counts: list[int]) -> None:
        if self._judged is False or min(counts) < 0:
            return
        apart = [count - counts[0] for count in counts]
        if self._judged is None:
            self._judged = not any(apart)
            return
        previous, self._previous = self._previous, apart
        if any(apart) and apart == previous:
            rank = next(rank for rank, more in enumerate(apart) if more)
            more = apart[rank]
            raise RanksOutOfStep(
                f"ranks called Watchdog.step() out of step with their own collectives: at the same step number, rank "
                f"{rank} had issued {abs(more)} {'more' if more > 0 else 'fewer'} on the default group than rank 0, at "
                "two sampling steps running (a step() call more or fewer on one rank): every rank must call it with "
                "the same step numbers, the global step, as often on every rank")


_KEY = "hbm-watchdog/agreement"  # the agreement's keys on the job's rendezvous store
_FORMED = itertools.count()  # this process's agreements: every rank forms its Nth at the same point


def _job_store():
    """The job's rendezvous store (the default group's), or None where there is none to read."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a backend made without a store: no handshake, nobody named
        return None


def _quietly(call: Callable[[], None]) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 - an answer that does not come: unknown
        pass


def _form_group(timeout_seconds: float, rank: int, ranks: int, store=None, key: str = _KEY):
    """The agreement's gloo group, made within `timeout_seconds`: a failure to make it is `PeerLost`
    with one line saying why, and a making that never returns (torchrun's shared rendezvous store,
    kept across restarts, left a restarted group hanging) ends the process with the same line.

    First every rank says on the store that it forms this group (`key`), and waits for every other
    rank to say so: `new_group` pairs groups by the order they are made, so a rank that made this
    one alone would take another rank's next group, the job's own, for it."""
    import torch.distributed as dist

    why = (f"rank {rank} could not form the watchdog's agreement group with the other {ranks - 1} rank(s) within "
           f"{timeout_seconds:g} s: a rank never started its watchdog (every rank must, at the same point, before "
           f"the job makes groups of its own), or died starting it, or a restarted job read a stale rendezvous "
           f"store (under torchrun with gloo set {SHARED_STORE_SWITCH}=1)")

    def never_formed() -> None:
        log.error("agreement_unformed", rank=rank, ranks=ranks, timeout_seconds=timeout_seconds,
                  exit_code=EXIT_PEER_LOST, reason=why)
        exit_process(EXIT_PEER_LOST)

    guard = threading.Timer(timeout_seconds + _GRACE_SECONDS, never_formed)
    guard.daemon = True
    guard.start()
    try:
        if store is not None:
            store.set(f"{key}/forming/{rank}", "1")
            store.wait([f"{key}/forming/{other}" for other in range(ranks)], timedelta(seconds=timeout_seconds))
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_seconds))
    except Exception as exc:  # noqa: BLE001 - DistStoreError and the transport's RuntimeErrors alike
        log.error("agreement_unformed", rank=rank, ranks=ranks, timeout_seconds=timeout_seconds,
                  exit_code=EXIT_PEER_LOST, reason=why, error=_first_line(exc))
        raise PeerLost(why) from None
    finally:
        guard.cancel()


def join(timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> Agreement | None:
    """An Agreement when this process is one of several ranks, else None (nobody to agree with)."""
    if world_size() <= 1:
        return None
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
