"""The training thread's half of "what is leaking", shared by every loop that trains in process.

A census (`forensics.census`) and a creation-site capture (`CreationSites`) must run on the
training thread, between steps: the census walks the garbage collector's objects while no step
is building tensors, and the capture is a TorchFunctionMode, which is per thread. The sidecar
only decides *when*; this object does the work when the training thread comes by:

- a baseline census after the first step (so the optimizer state is in it), again after each
  rebuild (the old state is gone);
- a capture of creation sites, armed once a leak is suspected (a WARN, an action, or a leak
  reported with no OOM projected), run for a few steps, after which the census names the holder
  *and* the line that made the tensors;
- a census when an action is due, whose suspects go into the action's block.

Every census is logged (`leak_suspects`) with what it cost (`census_seconds`): it is the one
cost of the watchdog on the training thread that is not O(1), and it comes only at those moments.
Nothing here imports torch: a process that never imported it still gets its Python buffers counted.

A diagnosis never stops training: every census, the baseline at the first `step()` included,
goes through `_counted`, the one place that calls into the census. The census itself is total
(it runs none of the program's code, and leaves out and counts what it cannot read: `unread` in
the log); whatever still escapes it is logged as `leak_census_failed`, and the loop goes on.
"""

from __future__ import annotations

import re
import sys
import time
from collections import Counter
from typing import Callable, NamedTuple

from watchdog.logs import get_logger

log = get_logger(__name__)

NO_SUSPECTS = "no growing group of live tensors or Python buffers"
_FAILED = object()  # the baseline whose census failed: none is taken again until the next rebuild


class Suspects(NamedTuple):
    """One census's answer: what grew since the baseline, and whether creation sites were known."""

    step: int
    lines: list[str]
    creation_sites: bool


class LeakFollower:
    """Baseline, capture and naming of a leak; call its methods on the training thread (but `arm`).

    `read` and `staged`: where memory is watched, what a baseline census holds beside it is
    measured: `read()` before and after the census, told to `staged(before, after)` (the sidecar's
    judges learn what the census an action takes needs)."""

    def __init__(self, capture_steps: int = 8, *, read: Callable[[], tuple] | None = None,
                 staged: Callable[[tuple, tuple], None] | None = None):
        self._capture_steps = capture_steps
        self._read, self._staged = read, staged
        self._baseline = None  # forensics.Census once taken (_FAILED where its census raised)
        self._sites = None  # CreationSites, made with the first baseline (it needs torch)
        self.last: Suspects | None = None  # the newest census's answer
        # Bounded phases whose runs peak higher each time (the sidecar says which): a census at each
        # run's end names what the run holds then, for an action taken between runs (`phase_ended`).
        self.phases_climbing: frozenset[str] = frozenset()
        self.phase_held: tuple[str, int, list[str]] | None = None  # (phase, step, its census's lines)
        self._before_rebuild: tuple | None = None  # (the baseline, the action's suspects) a rebuild replaced

    # ---- what is due ---------------------------------------------------------------------------

    @property
    def baseline_due(self) -> bool:
        return self._baseline is None

    @property
    def pending(self) -> bool:
        """Whether `between_steps` has work: a baseline to take, or a capture armed or running."""
        return self._baseline is None or (self._sites is not None and self._sites._pending)

    # ---- the training thread -------------------------------------------------------------------

    def take_baseline(self, step: int | None = None) -> None:
        """Count what is alive now, as the reference later growth is measured against. Never raises."""
        from watchdog.forensics import census as forensics

        started = time.perf_counter()
        baseline = self._counted(step, forensics.census)
        self._baseline = _FAILED if baseline is None else baseline
        if baseline is None:
            return
        if self._sites is None and "torch" in sys.modules:  # where tensors are made: a TorchFunctionMode
            from watchdog.forensics.creation_sites import CreationSites

            self._sites = CreationSites(steps=self._capture_steps)
        log.info("leak_baseline_taken", step=step, census_seconds=round(time.perf_counter() - started, 3),
                 **_unread_field(baseline.unread))

    def between_steps(self, step: int) -> None:
        """The baseline if it is due; a capture's start, its steps and, when it ends, the census
        that names the leak with its creation sites."""
        if self._baseline is None:
            before = self._read() if self._read is not None else None
            self.take_baseline(step)
            if before is not None:  # what the census held beside memory, at least
                self._staged(before, self._read())
            return
        if self._sites is not None and self._sites.between_steps():
            self.name(step)

    def name(self, step: int) -> list[str]:
        """Log what grew since the baseline, what holds it and, after a capture, where it was
        created; return those lines (for an action's block). Never raises."""
        if self._baseline is None or self._baseline is _FAILED:
            return []
        from watchdog.forensics import census as forensics

        started = time.perf_counter()
        sites = self._sites if self._sites is not None and self._sites.done else None
        unread: Counter = Counter()
        suspects = self._counted(step, forensics.explain_leak, self._baseline, sites=sites, unread=unread)
        if suspects is None:
            return []
        log.warning("leak_suspects", step=step, suspects=suspects or [NO_SUSPECTS],
                    creation_sites=sites is not None, census_seconds=round(time.perf_counter() - started, 3),
                    **_unread_field(unread))
        self.last = Suspects(step, suspects, sites is not None)
        return suspects

    @staticmethod
    def _counted(step: int | None, census: Callable, *args, **kwargs):
        """The one call into a census: its answer, or None where it raised (logged). A diagnosis
        never stops training, nor the checkpoint an action needs."""
        try:
            return census(*args, **kwargs)
        except Exception:  # noqa: BLE001 - whatever a program's objects do, the loop goes on
            log.error("leak_census_failed", step=step, exc_info=True)
            return None

    def suspects(self, step: int) -> list[str]:
        """What is leaking, named as an action leaves: a census now, or, where it finds nothing
        growing, what a climbing phase's newest run held at its end."""
        return self.name(step) or self.held_by_phase()

    def after_rebuild(self, step: int, *, capture: bool) -> list[str]:
        """`rebuilt`, then `not_freed`: what the action's census named that the rebuild left held."""
        self.rebuilt(capture=capture)
        return self.not_freed(step)

    def rebuilt(self, *, capture: bool = False) -> None:
        """The training state was dropped and rebuilt: a new baseline is due, and the capture
        may run again, on the rebuilt state (`capture`: ask for it now, to start after the
        baseline: a leak that outlives the rebuild is then named with the line that makes it)."""
        self._before_rebuild = (self._baseline, self.last)
        self._baseline = None
        self.phase_held = None
        if self._sites is not None:
            self._sites.reset()
            if capture:
                self._sites.arm()

    def not_freed(self, step: int) -> list[str]:
        """Just after a rebuild: what the action's census named that its holder still holds, counted
        against the same baseline (a global list, a module's cache, a metric's history: outside the
        rebuilt state). Empty where the rebuild freed it, or where nothing was named. Never raises.
        The allocator's pages handed back say nothing of this: a rebuild once read "recovered 217 MiB"
        while a global list still held every leaked tensor."""
        before, self._before_rebuild = self._before_rebuild, None
        if before is None:
            return []
        baseline, named = before
        if baseline is None or baseline is _FAILED or named is None:
            return []
        holders = {holder for line in named.lines if (holder := holder_of(line))}
        if not holders:
            return []
        from watchdog.forensics import census as forensics

        lines = self._counted(step, forensics.explain_leak, baseline) or []
        return [line for line in lines if holder_of(line) in holders]

    def phase_ended(self, phase: str, step: int) -> None:
        """A run of `phase` ended: while its runs climb, what it holds now (before the loop lets its
        outputs go) is counted and kept, since between runs, where an action on the climb comes,
        nothing of it is alive to name."""
        if phase in self.phases_climbing:
            lines = self.name(step)
            if lines:
                self.phase_held = (phase, step, lines)

    def held_by_phase(self) -> list[str]:
        """The newest climbing run's lines, said as such (empty when none was counted)."""
        if self.phase_held is None:
            return []
        phase, step, lines = self.phase_held
        return [f"held at the end of the {phase} run (step {step:,}): {line}" for line in lines]

    def close(self) -> None:
        if self._sites is not None:
            self._sites.close()

    # ---- any thread ----------------------------------------------------------------------------

    def arm(self) -> bool:
        """Ask for a capture from the next step on; once until the next rebuild. False when one was
        already asked for, or before the first baseline (no torch yet)."""
        return self._sites is not None and self._sites.arm()


_HELD_BY = re.compile(r"held by ([^;]*)")
_COUNT = re.compile(r"[0-9][0-9,.]*")


def holder_of(line: str) -> str | None:
    """What holds a suspect line's group, its counts left out ("list of N (global 'train_logits' in
    module __main__)"): the same holder before and after a rebuild, however much it held."""
    found = _HELD_BY.search(line)
    return _COUNT.sub("N", found.group(1)) if found else None


def _unread_field(unread: Counter) -> dict:
    """`unread`: the objects a census left out because reading them raised, by type (when any)."""
    return {"unread": dict(unread.most_common(8))} if unread else {}
