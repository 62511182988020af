"""The baselines behave as the tools they model, failure modes included."""

import math

import numpy as np
import pytest

from watchdog.bench.baselines import (
    BASELINES,
    LinearBackwardRegression,
    PredictLinear,
    StaticThreshold,
)
from watchdog.core.sample import Sample
from watchdog.core.verdict import Status

GiB = 1 << 30
LIMIT = 16 * GiB


def trace(values, seconds_per_step=10.0, limit=LIMIT):
    return [Sample(step=i, timestamp=1e9 + i * seconds_per_step, bytes_used=int(v), bytes_limit=limit)
            for i, v in enumerate(values)]


def first_alarm(detector, samples):
    for sample in samples:
        verdict = detector.update(sample)
        if verdict.status is Status.OOM_PROJECTED:
            return sample.step, verdict
    return None, None


def sawtooth(n, floor, amplitude, seed=0):
    rng = np.random.default_rng(seed)
    return floor + amplitude * rng.random(n)


# ------------------------------------------------------------------------------------ threshold

def test_threshold_fires_on_a_single_spike_that_is_no_leak():
    values = np.full(2000, 0.7 * LIMIT)
    values[1000] = 0.93 * LIMIT  # one checkpoint spike
    step, _ = first_alarm(StaticThreshold(0.9), trace(values))
    assert step == 1000


def test_threshold_stays_quiet_below_90_percent_and_projects_nothing():
    step, _ = first_alarm(StaticThreshold(0.9), trace(np.full(500, 0.89 * LIMIT)))
    assert step is None
    verdict = StaticThreshold(0.9).update(trace([0.95 * LIMIT])[0])
    assert verdict.status is Status.OOM_PROJECTED and verdict.projected_oom_step is None


# ------------------------------------------------------------------------------- predict_linear

def test_predict_linear_projects_a_steady_leak_and_fires_after_its_hold():
    # 10 s per step; 1 MiB/step = 0.1 MiB/s; starts at 70%: 4.8 GiB left, about 4915 steps (13.6 h).
    values = 0.7 * LIMIT + np.arange(4000) * (1 << 20)
    detector = PredictLinear()  # mixin: [6h], 24h ahead, for: 1h
    step, verdict = first_alarm(detector, trace(values))
    assert step == 361  # the condition holds from the second sample (step 1); 1h later is step 361
    assert verdict.projected_oom_step == pytest.approx(4915, abs=3)
    assert verdict.slope_bytes_per_step == pytest.approx(1 << 20)


def test_predict_linear_for_hold_resets_when_the_condition_breaks():
    detector = PredictLinear(window_seconds=600, horizon_seconds=3600, hold_seconds=300)
    rising = 0.8 * LIMIT + np.arange(25) * 0.004 * LIMIT  # 25 samples, 240 s of a steep rise to 90%
    flat = np.full(100, rising[-1])
    statuses = [detector.update(s).status for s in trace(np.concatenate([rising, flat]))]
    assert Status.SUSPECT in statuses[:25] and Status.OOM_PROJECTED not in statuses[:25]
    assert statuses[-1] is Status.HEALTHY


def test_predict_linear_fires_on_a_level_shift_near_the_limit():
    # Eval buffers kept after the first eval: +2 GiB once, at 75%. No leak, but the 1h window's
    # least-squares line through the step points past the limit for well over the 15 min hold.
    values = np.concatenate([np.full(1000, 0.75 * LIMIT), np.full(1000, 0.75 * LIMIT + 2 * GiB)])
    step, verdict = first_alarm(BASELINES["predict_linear_1h"](LIMIT), trace(values))
    assert step is not None and step > 1000
    assert verdict.projected_oom_step is not None  # an OOM that never comes


def test_predict_linear_fires_on_a_cache_that_plateaus():
    steps = np.arange(3000)
    values = 0.65 * LIMIT + 0.25 * LIMIT * -np.expm1(-steps / 800)
    step, _ = first_alarm(BASELINES["predict_linear_1h"](LIMIT), trace(values))
    assert step is not None  # the cache stops at 90%: never an OOM


# ------------------------------------------------------------------------------------------ LBR

def test_lbr_detects_a_clean_linear_leak_and_projects_it():
    values = sawtooth(3000, 0.5 * LIMIT, 0.01 * LIMIT) + np.arange(3000) * 0.0001 * LIMIT
    step, verdict = first_alarm(LinearBackwardRegression(), trace(values))
    assert step is not None and step < 400
    assert verdict.slope_bytes_per_step == pytest.approx(0.0001 * LIMIT, rel=0.1)
    assert verdict.projected_oom_step == pytest.approx(5000, rel=0.1)


def test_lbr_fires_on_a_plateau():
    # A compile/allocator cache filling smoothly and stopping is as linear as a leak to R².
    steps = np.arange(3000)
    values = sawtooth(3000, 0.5 * LIMIT, 0.005 * LIMIT) + 0.2 * LIMIT * -np.expm1(-steps / 3000)
    step, _ = first_alarm(LinearBackwardRegression(), trace(values))
    assert step is not None


def test_lbr_fires_on_a_level_shift_allocated_over_a_few_hundred_steps():
    values = sawtooth(3000, 0.5 * LIMIT, 0.005 * LIMIT)
    values[1000:] += np.minimum(np.arange(2000) / 300, 1.0) * 0.1 * LIMIT  # buffers filled over 300 steps
    step, _ = first_alarm(LinearBackwardRegression(), trace(values))
    assert step is not None and step > 1000


def test_lbr_misses_a_leak_buried_in_training_noise():
    # The activation sawtooth (30% of the limit) drowns R², whatever the slope.
    values = sawtooth(4000, 0.4 * LIMIT, 0.3 * LIMIT) + np.arange(4000) * 0.00007 * LIMIT
    step, _ = first_alarm(LinearBackwardRegression(), trace(values))
    assert step is None


def test_lbr_ignores_a_flat_sawtooth_and_a_falling_trend():
    assert first_alarm(LinearBackwardRegression(), trace(sawtooth(2000, 0.5 * LIMIT, 0.2 * LIMIT)))[0] is None
    falling = 0.8 * LIMIT - np.arange(2000) * 0.0001 * LIMIT
    assert first_alarm(LinearBackwardRegression(), trace(falling))[0] is None


def test_every_baseline_warms_up_without_a_limit_and_resets():
    for name, make in BASELINES.items():
        detector = make(None)
        verdict = detector.update(Sample(0, 0.0, 100))
        assert verdict.status is Status.WARMING_UP, name
        assert math.isinf(verdict.projected_oom_steps)
        detector.reset()
