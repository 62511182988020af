"""The oracle: how soon any detector could report a leak on the sensitivity jobs, for scale.

It is told what no deployed detector knows:
- the leak's onset step;
- the job's schedule (which readings fall in an evaluation or a checkpoint, from the model);
- the job's noise, as leak-free draws of the same jobs: its threshold is the highest statistic
  those draws ever reach (`calibrate`), so its false-report rate is the one asked of ours: none on
  leak-free jobs.

Its test is the matched filter for a ramp that starts at a known step. The floor of each bucket
of training readings (their lowest: a reading taken mid-step carries activations on top) is
compared with the mean floor before the onset; after it, the statistic at bucket k is

    z_k = sum_i (f_i - mu0) (t_i - t0) / (sigma * sqrt(sum_i (t_i - t0)^2))

over the buckets since the onset, with sigma the spread of the floors before it. For floors with
white Gaussian noise this is the most powerful test there is for a ramp of any slope from t0. The
jobs' floors also wander (fragmentation drift, correlated over thousands of steps): the oracle
does not whiten it, and pays for it in its threshold, as every detector does. A detector that
modelled the wander could beat it; none of ours or the baselines does.

Pure numpy; deterministic given the seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from watchdog.bench.memory_model import MemoryModel, _phase_masks
from watchdog.core.sample import Sample

BUCKET_SAMPLES = 8  # readings per bucket (the detector's own bucket size, in readings)


@dataclass(frozen=True)
class Oracle:
    onset_step: int
    threshold: float  # z at or above which it reports (from `calibrate`)

    def statistic(self, samples: list[Sample], model: MemoryModel) -> tuple[np.ndarray, np.ndarray]:
        """(bucket end steps, z) for every bucket closed after the onset."""
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
        t0 = self.onset_step
        before = (centres < t0) & (centres >= t0 / 4)  # skip the start (allocations settling)
        after = (ends * width) >= t0  # buckets that begin at or after the onset
        if before.sum() < 4 or not after.any():
            return np.array([], dtype=np.int64), np.array([])
        mu0, sigma = floors[before].mean(), floors[before].std(ddof=1)
        dt = centres[after] - t0
        z = np.cumsum((floors[after] - mu0) * dt) / (max(sigma, 1.0) * np.sqrt(np.cumsum(dt * dt)))
        return last_steps[after], z

    def first_report(self, samples: list[Sample], model: MemoryModel) -> int | None:
        steps, z = self.statistic(samples, model)
        over = np.flatnonzero(z >= self.threshold)
        return int(steps[over[0]]) if over.size else None


def calibrate(leak_free: list[tuple[list[Sample], MemoryModel]], onset_step: int) -> float:
    """The lowest threshold no leak-free draw ever reaches: the highest z seen on them, just above."""
    highest = -math.inf
    probe = Oracle(onset_step, math.inf)
    for samples, model in leak_free:
        _, z = probe.statistic(samples, model)
        if z.size:
            highest = max(highest, float(z.max()))
    return math.nextafter(max(highest, 0.0), math.inf)
