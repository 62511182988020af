"""Steady-state recompilation: XLA graphs that keep compiling after warm-up. Pure: no torch, no I/O.

Warm-up compiles in bursts: the first step's graphs, the optimizer state's first update, the
first eval, a few bucketed shapes. Then a healthy loop compiles nothing: every step replays a
cached executable. Compilations that keep coming mean that something inside the step changes
(a shape, a Python value turned into a graph constant, a tensor read before the sync whose graph
grows): every new graph costs compile time and device memory for its executable.

The detector sees the process's compilation counter at each memory sample and raises a finding
when, after `warmup_steps`:

- rate: compilations arrived in `consecutive` sampling intervals in a row, or
- count: more graphs were compiled after warm-up than during it, spread over at least
  `consecutive` separate intervals (a first eval compiles its graphs in one burst: one interval).

A finding is information: it never asks for a checkpoint. If the executables push memory towards
the limit, the memory pipeline acts on that as on any other growth. The finding clears once no
graph has been compiled for `quiet_factor` times its compile interval, and may be raised again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from watchdog.core.errors import ConfigError
from watchdog.core.numbers import check_settings


@dataclass(frozen=True)
class RecompilationConfig:
    warmup_steps: int = 100
    """Graphs compiled before this step are warm-up."""
    consecutive: int = 3
    """Sampling intervals in a row with compilations that make a rate; also the spread a count needs."""
    min_compiles: int = 3
    """Never a finding on fewer compilations after warm-up."""
    quiet_factor: float = 10.0
    """The finding clears after this many compile intervals without a compilation."""
    explain: bool = True
    """Turn on torch_xla's compile analysis (it runs only when a graph compiles) to name the cause."""
    capture_compiles: int = 3
    """Once found: read the cause of this many compilations, then report."""
    capture_steps: int = 1000
    """...or report after this many steps, whatever was captured by then."""

    def __post_init__(self) -> None:
        check_settings(self, "recompilation")
        for name in ("consecutive", "min_compiles", "capture_compiles", "capture_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"recompilation.{name}", f"must be a positive integer, got {value!r}")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) or self.warmup_steps < 0:
            raise ConfigError("recompilation.warmup_steps", f"must be a non-negative integer, got {self.warmup_steps!r}")
        if not isinstance(self.quiet_factor, (int, float)) or not self.quiet_factor >= 1:
            raise ConfigError("recompilation.quiet_factor", f"must be a number >= 1, got {self.quiet_factor!r}")


@dataclass(frozen=True)
class Recompilation:
    """What was found: counts and rate; the cause is read afterwards (see `compile_causes`)."""

    step: int
    trigger: str
    """`rate` (compiling in consecutive intervals) or `count` (more than during warm-up)."""
    warmup_compiles: int
    compiles_after_warmup: int
    steps_after_warmup: int
    steps_per_compile: float

    @property
    def every(self) -> str:
        """`every step` or `every ~12 steps`: how often a new graph comes."""
        return every(self.steps_per_compile)


def every(steps_per_compile: float) -> str:
    if steps_per_compile <= 1.5:
        return "every step"
    return f"every ~{steps_per_compile:.0f} steps"


class RecompilationDetector:
    """Feed it (step, compilations so far) at each sample; `observe` returns a new finding once."""

    def __init__(self, config: RecompilationConfig | None = None):
        self.config = config or RecompilationConfig()
        self._reset()

    def _reset(self) -> None:
        self.active: Recompilation | None = None
        self._first_step: int | None = None
        self._warmup_end_step: int | None = None
        self._warmup_compiles = 0
        self._baseline = 0  # compilations already accounted for (warm-up, or up to a cleared finding)
        self._previous: tuple[int, int] | None = None
        self._run = 0  # sampling intervals in a row with compilations
        self._intervals_with_compiles = 0
        self._last_compile_step: int | None = None

    @property
    def steps_per_compile(self) -> float:
        """Steps per compilation after warm-up; +inf while none has come (or still warming up)."""
        if self._warmup_end_step is None or self._previous is None:
            return math.inf
        compiles = self._previous[1] - self._warmup_compiles
        steps = self._previous[0] - self._warmup_end_step
        return steps / compiles if compiles > 0 and steps > 0 else math.inf

    @property
    def warmup_end_step(self) -> int | None:
        """The step warm-up ended at; None while warming up."""
        return self._warmup_end_step

    def observe(self, step: int, compiles: int) -> Recompilation | None:
        config = self.config
        previous = self._previous
        if previous is not None and step == previous[0]:
            return None
        if previous is not None and (step < previous[0] or compiles < previous[1]):
            self._reset()  # the counters started over (a new process, metrics cleared): warm up again
            previous = None
        self._previous = (step, compiles)
        if previous is None:
            self._first_step = step
        if self._warmup_end_step is None:
            # Warm-up is counted from the first step this process saw: a resumed job compiles its
            # graphs again at step 5,000, and that is warm-up too.
            if step - self._first_step >= config.warmup_steps:
                self._warmup_end_step = step
                self._warmup_compiles = self._baseline = compiles
            return None

        new = compiles - previous[1]
        if new > 0:
            self._run += 1
            self._intervals_with_compiles += 1
            self._last_compile_step = step
        else:
            self._run = 0
        if self.active is not None:
            self._maybe_clear(step, compiles)
            return None
        after = compiles - self._baseline
        if after < config.min_compiles:
            return None
        if self._run >= config.consecutive:
            trigger = "rate"
        elif after > self._warmup_compiles and self._intervals_with_compiles >= config.consecutive:
            trigger = "count"
        else:
            return None
        steps_after = step - self._warmup_end_step
        self.active = Recompilation(step=step, trigger=trigger, warmup_compiles=self._warmup_compiles,
                                    compiles_after_warmup=compiles - self._warmup_compiles,
                                    steps_after_warmup=steps_after,
                                    steps_per_compile=self.steps_per_compile)
        return self.active

    def _maybe_clear(self, step: int, compiles: int) -> None:
        assert self.active is not None and self._last_compile_step is not None
        quiet = step - self._last_compile_step
        if quiet > self.config.quiet_factor * max(self.active.steps_per_compile, 1.0):
            self.active = None
            self._baseline = compiles
            self._run = 0
            self._intervals_with_compiles = 0
