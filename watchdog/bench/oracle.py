"""The oracles: how soon any detector could report a leak on the sensitivity jobs, for scale.

Both are told what no deployed detector knows:
- the leak's onset step;
- the job's schedule (which readings fall in an evaluation or a checkpoint, from the model);
- the job's noise, as draws of the same jobs without a leak: the threshold is the highest statistic
  those draws ever reach (`calibrate`), so the false-report rate is the one asked of ours: none.

`Oracle` tests for a ramp against nothing. The floor of each bucket of training readings (their
lowest: a reading taken mid-step carries activations on top) is compared with the mean floor
before the onset; after it, the statistic at bucket k is

    z_k = sum_i (f_i - mu0) (t_i - t0) / (sigma * sqrt(sum_i (t_i - t0)^2))

over the buckets since the onset, with sigma the spread of the floors before it. For floors with
white Gaussian noise this is the most powerful test there is for a ramp of any slope from t0. The
jobs' floors also wander (fragmentation drift, correlated over thousands of steps): the oracle
does not whiten it, and pays for it in its threshold, as every detector does. A detector that
modelled the wander could beat it; none of ours or the baselines does.

`Oracle` reports whatever rises after the onset, so it also reports a cache that fills and stops.
Ours must not, and cannot know that growth will go on. `CacheAwareOracle` is held to that: it is
also told the shape of the job's caches (`size * (1 - exp(-(t - t0) / tau))` from the onset, tau up
to a longest one) and is calibrated on such caches as well as on leak-free draws. Its statistic is
the generalised likelihood ratio of a ramp from t0 against the best of those caches, a level
shift and nothing included:

    D_k = (G_ramp - max(0, max_tau G_tau)) / sigma^2,   G_x = max(0, sum_i r_i x_i)^2 / sum_i x_i^2

where r_i = f_i - mu0 and G_x is how much the least-squares fit of `a * x` (a >= 0) lowers the
sum of squares. A ramp starts out looking like a slow cache, so this oracle can only report once
the floor has kept rising for longer than the caches it was told of take to fill: the delay that
telling a leak from such a cache costs on this noise even when the caches' shape is known.

Pure numpy; deterministic given the seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from watchdog.bench.memory_model import MemoryModel, _phase_masks
from watchdog.core.sample import Sample

BUCKET_SAMPLES = 8  # readings per bucket (the detector's own bucket size, in readings)


@dataclass(frozen=True)
class Rise:
    """The bucket floors after the onset, as the oracles see them."""

    last_steps: np.ndarray  # each bucket's last step: when its statistic is known
    elapsed: np.ndarray  # steps from the onset to each bucket's centre
    above: np.ndarray  # each floor above the mean floor before the onset, bytes
    sigma: float  # the floors' spread before the onset, bytes


def rise_after(onset_step: int, samples: list[Sample], model: MemoryModel) -> Rise | None:
    """The floors of the buckets of training readings that begin at or after `onset_step`, against
    those before it; None when there are too few before it or none after."""
    steps = np.fromiter((s.step for s in samples), dtype=np.int64, count=len(samples))
    used = np.fromiter((s.bytes_used for s in samples), dtype=np.float64, count=len(samples))
    evals, checkpoints = _phase_masks(model, steps)
    training = ~(evals | checkpoints) & (steps >= model.state_step)
    steps, used = steps[training], used[training]
    width = BUCKET_SAMPLES * model.sample_every
    bucket = steps // width
    ends, starts = np.unique(bucket, return_index=True)
    floors = np.minimum.reduceat(used, starts)
    centres = (ends + 0.5) * width
    last_steps = np.append(steps[starts[1:] - 1], steps[-1])
    before = (centres < onset_step) & (centres >= onset_step / 4)  # skip the start (allocations settling)
    after = (ends * width) >= onset_step
    if before.sum() < 4 or not after.any():
        return None
    mu0, sigma = floors[before].mean(), floors[before].std(ddof=1)
    return Rise(last_steps[after], centres[after] - onset_step, floors[after] - mu0, max(float(sigma), 1.0))


def _gain(above: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """At each bucket, how much fitting `a * shape` (a >= 0) to the floors so far lowers their sum of squares."""
    fit = np.maximum(np.cumsum(above * shape), 0.0)
    return fit * fit / np.maximum(np.cumsum(shape * shape), 1e-300)


class _Reports:
    """What both oracles share: a statistic over the floors after the onset (`_of`), and a report at
    the first bucket whose statistic reaches the threshold."""

    onset_step: int
    threshold: float

    def _of(self, rise: Rise) -> np.ndarray:
        raise NotImplementedError

    def statistic(self, samples: list[Sample], model: MemoryModel) -> tuple[np.ndarray, np.ndarray]:
        """(bucket last steps, statistic) for every bucket that begins after the onset."""
        rise = rise_after(self.onset_step, samples, model)
        if rise is None:
            return np.array([], dtype=np.int64), np.array([])
        return rise.last_steps, self._of(rise)

    def first_report(self, samples: list[Sample], model: MemoryModel) -> int | None:
        steps, value = self.statistic(samples, model)
        over = np.flatnonzero(value >= self.threshold)
        return int(steps[over[0]]) if over.size else None


@dataclass(frozen=True)
class Oracle(_Reports):
    """The matched filter for a ramp from the onset: reports any rise, caches included."""

    onset_step: int
    threshold: float  # z at or above which it reports (from `calibrate`)

    def _of(self, rise: Rise) -> np.ndarray:
        """z at each bucket."""
        t = rise.elapsed
        return np.cumsum(rise.above * t) / (rise.sigma * np.sqrt(np.cumsum(t * t)))


@dataclass(frozen=True)
class CacheAwareOracle(_Reports):
    """A ramp from the onset against every cache filling from it with a time constant up to
    `time_constants`' longest (a level shift and nothing included): reports a leak, not a cache."""

    onset_step: int
    threshold: float  # D at or above which it reports (from `calibrate`)
    time_constants: tuple[float, ...]  # the caches it is told of, in steps

    def _of(self, rise: Rise) -> np.ndarray:
        """D at each bucket."""
        t = rise.elapsed
        best_cache = np.zeros_like(t)
        for tau in self.time_constants:
            best_cache = np.maximum(best_cache, _gain(rise.above, -np.expm1(-t / tau)))
        return (_gain(rise.above, t) - best_cache) / rise.sigma ** 2


def cache_time_constants(longest: float, count: int = 16) -> tuple[float, ...]:
    """Time constants from 1/64 of `longest` up to it, evenly spaced in log: the shortest is a level shift."""
    return tuple(float(tau) for tau in np.geomspace(longest / 64, longest, count))


def calibrate(null: Iterable[tuple[list[Sample], MemoryModel]], probe: _Reports) -> float:
    """The lowest threshold no draw in `null` ever reaches: the highest statistic `probe` sees on
    them, just above (and above 0, so a floor that never rises is never reported)."""
    highest = -math.inf
    for samples, model in null:
        _, value = probe.statistic(samples, model)
        if value.size:
            highest = max(highest, float(value.max()))
    return math.nextafter(max(highest, 0.0), math.inf)
