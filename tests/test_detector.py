"""The leak detector on hand-made traces, one per pattern a training job's memory shows.

Traces are generated here (pure Python, seeded): a floor, a per-step transient sampled at a
random phase, jitter. Each test states the behaviour the pattern must produce.
"""

from __future__ import annotations

import gc
import math
import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from watchdog.core.detector import DetectorConfig, LeakDetector
from watchdog.core.errors import ConfigError
from watchdog.core.judge import Judge
from watchdog.core.replay import replay
from watchdog.core.sample import Sample
from watchdog.core.trend import Series, fit_trend, newest_evidence, staircase_rise
from watchdog.core.units import format_bytes
from watchdog.core.verdict import Status

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
LIMIT = 16 * GiB
BASE = 9 * GiB
TRANSIENT = 3 * GiB


def job(steps, floor=lambda s: BASE, *, transient=TRANSIENT, jitter=8 * MiB, every=1, seed=0, spikes=None,
        limit=LIMIT, step_seconds=0.5):
    """Samples of a job: floor(step) + transient at a random phase (+ spikes(step)) + jitter."""
    rng = random.Random(seed)
    out = []
    for step in range(0, steps, every):
        used = floor(step) + transient * rng.random() + rng.gauss(0.0, jitter)
        if spikes:
            used += spikes(step) * rng.random()
        out.append(Sample(step, 1.7e9 + step * step_seconds, int(min(max(used, 0), limit - 1)), limit))
    return out


def statuses(samples, **config):
    """Verdicts as the pipeline gives them: the judge applies each sample's limit to the detector."""
    judge = Judge(DetectorConfig(**config))
    return [judge.judge(s)[0] for s in samples]


def first_alarm(verdicts):
    return next((v.step for v in verdicts if v.status is Status.OOM_PROJECTED), None)


def first_report(verdicts):
    return next((v.step for v in verdicts if v.leak_detected), None)


# ------------------------------------------------------------------------------- negatives

def test_flat_training_is_healthy_and_the_floor_is_the_floor():
    verdicts = statuses(job(6000))
    assert first_alarm(verdicts) is None
    final = verdicts[-1]
    assert final.status is Status.HEALTHY
    assert abs(final.floor_bytes - BASE) < 64 * MiB  # the minimum of the sawtooth, not its mean
    assert 0.8 * TRANSIENT < final.excursion_bytes < 1.5 * TRANSIENT
    assert final.projected_oom_step is None and final.projected_oom_steps == math.inf


def test_sawtooth_sampled_every_few_steps_at_random_phase_is_not_growth():
    verdicts = statuses(job(40_000, every=7, seed=3, transient=5 * GiB))
    assert first_alarm(verdicts) is None


def test_heavy_noise_without_trend_never_alarms():
    verdicts = statuses(job(8000, jitter=250 * MiB, transient=4 * GiB, seed=5))
    assert first_alarm(verdicts) is None


def test_one_off_level_shift_is_a_new_baseline_not_a_leak():
    shift = lambda s: BASE + (2 * GiB if s >= 2500 else 0)  # noqa: E731 - eval buffers kept after step 2500
    verdicts = statuses(job(10_000, shift))
    assert first_alarm(verdicts) is None
    assert abs(verdicts[-1].floor_bytes - (BASE + 2 * GiB)) < 64 * MiB


def test_growth_that_decays_to_a_plateau_is_not_a_leak():
    cache = lambda s: BASE + 2.5 * GiB * (1 - math.exp(-s / 1500))  # noqa: E731 - a cache filling
    verdicts = statuses(job(12_000, cache))
    assert first_alarm(verdicts) is None


def test_saturation_rise_reads_a_slowdown_that_holds_throughout_and_nothing_else():
    """A cache filling towards its size (1 - exp(-t/tau)) has about its rest to come; a steady leak,
    and a warm-up ramp or a level shift followed by a steady leak, slow down nowhere after their start: inf."""
    from watchdog.core.trend import saturation_rise

    xs = list(range(0, 240, 8))
    filling = [188 * (1 - math.exp(-x / 150)) for x in xs]
    rest = 188 - filling[-1]
    assert 0.99 * rest <= saturation_rise(xs, filling) <= 1.01 * rest
    assert saturation_rise(xs, [1.25 * x for x in xs]) == math.inf
    assert saturation_rise(xs, [min(x, 40) * 1.0 + 0.3 * x for x in xs]) == math.inf, "a warm-up, then a steady leak"
    assert saturation_rise(xs, [(50 if x > 30 else 0) + 0.3 * x for x in xs]) == math.inf, "a shift, then a leak"
    assert saturation_rise(xs, [5.0] * len(xs)) == math.inf


def test_saturation_rise_is_judged_by_likelihood_so_a_noisy_fill_is_still_a_fill_and_a_noisy_leak_still_a_leak():
    """Issue 62: a fill's slowdown counted segment by segment is undone by the noise of one segment
    (and read an 8-segment rest as 24 MiB where 40 were to come). Judged by the likelihood of a
    saturating curve against a line, every draw of a noisy fill is a fill whose rest is never
    under-stated, and no draw of a noisy leak, nor of a leak after a shift, is one."""
    from watchdog.core.trend import saturation_rise

    xs = list(range(0, 240, 8))
    rng = random.Random(0)
    rest = 188 * math.exp(-xs[-1] / 150)
    for _ in range(20):
        filling = saturation_rise(xs, [188 * (1 - math.exp(-x / 150)) + rng.gauss(0, 3) for x in xs])
        assert 0.9 * rest <= filling <= 2 * rest
        assert saturation_rise(xs, [1.25 * x + rng.gauss(0, 5) for x in xs]) == math.inf
        assert saturation_rise(xs, [(50 if x > 30 else 0) + 0.3 * x + rng.gauss(0, 1) for x in xs]) == math.inf


def test_a_young_cache_filling_ever_more_slowly_close_under_the_limit_gets_no_action_and_its_twin_does():
    """Issue 54: a cache that fills ever more slowly, its plateau 30 MiB under the limit, got a
    reinit at step 202 (the newest windows' line reached the limit at step 318); seen over its whole
    ramp it slows throughout and levels off below it. Its twin grows at the cache's first rate and
    never slows: acted on before the limit."""
    from watchdog.core.verdict import Action

    def first_action(fill):
        rng = random.Random(0)
        judge = Judge(memory_limit_bytes=1000 * MiB + 218 * MiB)
        for step in range(1200):
            used = 1000 * MiB + fill(step) + rng.uniform(0, 4) * MiB
            verdict, action = judge.judge(Sample(step, step * 0.1, int(used), None))
            assert used < judge.limit_bytes, f"step {step}: over the limit with no action"
            if action.needs_checkpoint:
                return step, verdict
        return None, verdict

    step, last = first_action(lambda s: 188 * MiB * (1 - math.exp(-s / 150)))
    assert step is None, last.explanation
    step, verdict = first_action(lambda s: 188 * MiB / 150 * s)
    assert step is not None and step < 180, "the twin reaches the limit at step 174 and is acted on first"


@pytest.mark.parametrize("start, rate", [(200, 0.5), (400, 0.25), (800, 0.1)])
def test_a_leak_after_a_cache_filled_is_projected_as_early_as_ever(start, rate):
    """The ramp's slowdown must not hold back a leak that follows a cache's fill: the whole history
    then slows at first and not later. Measured against the detector without that check: the same
    steps (450 to 2,630 over these and six more such cases), by the projection, 56-130 MiB before the limit."""
    rng = random.Random(0)
    judge = Judge(memory_limit_bytes=1400 * MiB)
    for step in range(0, 20_000, 10):
        fill = 150 * (1 - math.exp(-step / 150)) + rate * max(0, step - start)
        used = 1000 * MiB + fill * MiB + rng.uniform(0, 4) * MiB
        verdict, action = judge.judge(Sample(step, step * 0.1, int(used), None))
        if action.needs_checkpoint:
            break
    assert verdict.explanation.startswith("floor rising"), verdict.explanation
    assert 1400 * MiB - used > 50 * MiB


def test_a_single_spike_does_not_move_the_floor_or_raise_the_alarm():
    spike = lambda s: 5 * GiB if 3000 <= s < 3004 else 0  # noqa: E731
    verdicts = statuses(job(6000, spikes=spike, transient=1 * GiB))
    assert first_alarm(verdicts) is None
    assert abs(verdicts[-1].slope_bytes_per_step) < 16 * KiB


def test_periodic_eval_spikes_are_transients_and_count_towards_the_peak():
    evals = lambda s: 3 * GiB if s % 500 < 3 else 0  # noqa: E731 - eval buffers every 500 steps
    verdicts = statuses(job(8000, spikes=evals, transient=1 * GiB))
    assert first_alarm(verdicts) is None
    assert verdicts[-1].excursion_bytes > 2 * GiB  # OOM happens at the peak: the eval spike is in it


# ----------------------------------------------------------------------------------- leaks

@pytest.mark.parametrize("rate", [96 * KiB, 1 * MiB])
def test_linear_leak_is_caught_with_slope_and_projection(rate):
    room = LIMIT - BASE - TRANSIENT
    true_oom = int(room / rate)
    steps = int(true_oom * 0.9)
    verdicts = statuses(job(steps, lambda s: BASE + rate * s, seed=int(rate)))
    alarm = first_alarm(verdicts)
    assert alarm is not None and alarm < 0.75 * true_oom
    final = verdicts[-1]
    assert final.status is Status.OOM_PROJECTED
    assert final.slope_low_bytes_per_step <= rate * 1.05 and final.slope_high_bytes_per_step >= rate * 0.95
    assert abs(final.slope_bytes_per_step - rate) < 0.1 * rate
    # Pessimistic by design (the excursion gets a margin): a little early, never late.
    assert 0.85 * true_oom < final.projected_oom_step <= 1.02 * true_oom
    assert final.projected_oom_steps_pessimistic <= final.projected_oom_steps  # actions use the pessimistic side
    assert final.slope_bytes_per_second == pytest.approx(final.slope_bytes_per_step / 0.5, rel=0.01)
    assert final.projected_oom_seconds == pytest.approx(final.projected_oom_steps * 0.5, rel=0.01)
    assert final.explanation.startswith("floor rising") and "limit at step" in final.explanation


def test_stepwise_leak_is_a_leak_not_a_series_of_level_shifts():
    chunk, every = 64 * MiB, 100  # a cache keyed by something that never repeats
    verdicts = statuses(job(9000, lambda s: BASE + chunk * (s // every)))
    assert first_alarm(verdicts) is not None
    assert verdicts[-1].slope_bytes_per_step == pytest.approx(chunk / every, rel=0.15)


def test_late_onset_leak_is_caught_after_onset_and_not_before():
    onset, rate = 30_000, 200 * KiB
    oom = onset + (LIMIT - BASE - TRANSIENT) / rate
    verdicts = statuses(job(40_000, lambda s: BASE + rate * max(0, s - onset), every=4))
    alarm = first_alarm(verdicts)
    assert alarm is not None and onset < alarm < onset + 0.5 * (oom - onset)


@pytest.mark.parametrize("projected_oom_steps", [2_000, 5_000])
def test_a_fast_leak_late_in_a_long_run_is_caught_before_its_oom(projected_oom_steps):
    # 60k steps in, the whole-run buckets are ~500 steps wide: the fast leak shows in the recent ones.
    onset = 60_000
    rate = (LIMIT - BASE - TRANSIENT) / projected_oom_steps
    verdicts = statuses(job(onset + projected_oom_steps, lambda s: BASE + rate * max(0, s - onset), every=4))
    alarm = first_alarm(verdicts)
    assert alarm is not None and onset < alarm < onset + 0.75 * projected_oom_steps


def test_a_leak_seen_late_through_noise_is_confirmed_before_its_oom_not_after():
    # The candidate shows only when the OOM is near; holding it for a quarter of its window (the
    # usual wait that lets a filling cache show itself) would outlast the OOM.
    onset, projected_oom_steps = 2_000, 1_500
    rate = (LIMIT - BASE - TRANSIENT) / projected_oom_steps
    verdicts = statuses(job(onset + projected_oom_steps, lambda s: BASE + rate * max(0, s - onset), every=2,
                            jitter=600 * MiB, transient=1 * GiB))
    alarm = first_alarm(verdicts)
    assert alarm is not None and onset < alarm < onset + 0.95 * projected_oom_steps


def test_leak_under_heavy_noise_is_still_caught():
    rate = 1 * MiB
    verdicts = statuses(job(3500, lambda s: BASE + rate * s, jitter=150 * MiB, transient=2 * GiB))
    assert first_alarm(verdicts) is not None


def test_leak_after_a_level_shift_is_caught():
    floor = lambda s: BASE + (1 * GiB if s >= 800 else 0) + 512 * KiB * max(0, s - 4000)  # noqa: E731
    verdicts = statuses(job(8000, floor))
    assert first_alarm(verdicts) is not None and first_alarm(verdicts) > 4000


# ------------------------------------------------------------------------------- mechanics

def test_warming_up_until_enough_history_then_reset_starts_over():
    detector = LeakDetector()
    samples = job(2000)
    first = detector.update(samples[0])
    assert first.status is Status.WARMING_UP
    for s in samples[1:]:
        last = detector.update(s)
    assert last.status is Status.HEALTHY
    detector.reset()
    assert detector.update(samples[-1]).status is Status.WARMING_UP


def test_steps_going_back_mean_a_new_process_and_a_new_baseline():
    detector = LeakDetector()
    for s in job(2000):
        detector.update(s)
    restarted = Sample(100, 1.8e9, BASE, LIMIT)
    assert detector.update(restarted).status is Status.WARMING_UP


def test_headroom_brings_the_projected_oom_forward():
    samples = job(9000, lambda s: BASE + 256 * KiB * s)
    plain = statuses(samples)[-1]
    careful = statuses(samples, headroom_bytes=512 * MiB)[-1]
    assert careful.projected_oom_step == pytest.approx(plain.projected_oom_step - 2048, abs=300)


def test_fit_trend_ignores_an_outlier():
    xs = [float(i) for i in range(32)]
    ys = [1000.0 + 10.0 * x for x in xs]
    ys[20] += 1e6
    trend = fit_trend(xs, ys)
    assert trend.slope == pytest.approx(10.0)
    assert trend.low <= 10.0 <= trend.high


@pytest.mark.parametrize("field, value", [("bucket_steps", 0), ("max_buckets", 15), ("consistency", 2.0),
                                          ("headroom_bytes", -1), ("rise_sigmas", 0)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"detector.{field}"):
        DetectorConfig(**{field: value})


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), jitter=st.integers(0, 200), transient=st.integers(1, 6),
       every=st.sampled_from([1, 3, 10]))
def test_any_flat_noisy_trace_never_yields_an_action(seed, jitter, transient, every):
    samples = job(6000, transient=transient * GiB, jitter=jitter * MiB, every=every, seed=seed)
    result = replay(samples)
    assert result.first_leak_report_step is None and result.first_action_step is None


@pytest.mark.slow  # pure, but 250,000 updates under tracemalloc (~7 s): the whole suite's, not the inner loop's
def test_detector_memory_stays_flat_over_a_quarter_million_samples():
    """Bounded history: after the first buckets fill, 200,000 more samples (two more doublings of
    the bucket width) allocate nothing lasting. A million took 15-37 s of the suite for the same
    check; the soak bench (`python -m watchdog.bench.soak`) runs the whole watchdog for 100,000 steps."""
    detector = LeakDetector(limit_bytes=LIMIT)
    rng = random.Random(7)
    update = detector.update

    def feed(start, count):
        for step in range(start, start + count):
            update(Sample(step, step * 0.5, BASE + int(TRANSIENT * rng.random()), LIMIT))

    def held() -> int:
        # A full collection empties the interpreter's free lists (up to 2,000 spare tuples of each
        # size); without it the figure depends on how full they happened to be, not on the detector.
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        feed(0, 50_000)
        early = held()
        feed(50_000, 200_000)
        late = held()
    finally:
        tracemalloc.stop()
    assert len(detector._xs) <= detector.config.max_buckets
    assert late - early < 64 * KiB, f"detector grew by {late - early} bytes over 200k samples"


# -------------------------------------------------------------- growth that stops (issue 16)
# PJRT-CPU-like memory: a small transient on a resident floor, sampled every few steps, and a
# budget tens of MiB above the peak, as in the runs that found these cases.

def small_job(steps, floor, *, limit, every=5, transient=3 * MiB, jitter=0.3 * MiB, seed=1):
    rng = random.Random(seed)
    return [Sample(s, 1.7e9 + 0.1 * s, int(floor(s) + transient * rng.random() + rng.gauss(0.0, jitter)), limit)
            for s in range(0, steps, every)]


def cache_fill(slots, total, lump, seed, steps=8000):
    """A cache of `slots` entries filled by random draws, one per step (each step finds fewer new
    ones), held in memory that grows in lumps of `lump` bytes (an allocator's heap growth)."""
    rng = random.Random(seed)
    filled, held = set(), []
    for _ in range(steps):
        filled.add(rng.randrange(slots))
        held.append(lump * math.ceil(len(filled) * total / slots / lump))
    return lambda step: BASE + held[step], held


@pytest.mark.parametrize("slots, lump, seed", [(500, 32 * MiB, 0), (500, 32 * MiB, 1), (1000, 32 * MiB, 0),
                                               (1000, 32 * MiB, 1), (1000, 8 * MiB, 0)])
def test_a_lumpy_concave_fill_is_not_extrapolated_linearly_once_it_slows(slots, lump, seed):
    # 185 MiB in lumps, levelling off 75 MiB below the budget. Two lumps can land close together
    # and then none for a long while, so the newest quarters of a window can look alike while the
    # fill slows: the newest buckets' rise, allowing one lump, shows it.
    total = 185 * MiB
    floor, held = cache_fill(slots, total, lump, seed)
    last_lump = max(s for s in range(1, len(held)) if held[s] != held[s - 1])
    judge = Judge()
    outcomes = [(s.step, *judge.judge(s)) for s in small_job(8000, floor, limit=int(BASE + total + 78 * MiB))]
    assert not [step for step, _, action in outcomes if action.needs_checkpoint]
    late_alarms = [step for step, verdict, _ in outcomes if step > last_lump + 400 and verdict.status is Status.OOM_PROJECTED]
    assert late_alarms == [], f"still projecting the old rate {late_alarms[0] - last_lump} steps after the last lump"


def test_the_newest_buckets_are_believed_when_they_show_a_slowdown_and_not_for_a_lump_that_is_due():
    xs = [float(64 * i) for i in range(64)]
    staircase = [1e9 + 32 * MiB * (i // 8) for i in range(64)]  # a steady leak in lumps: 32 MiB every 8 buckets
    for end in range(40, 64):  # wherever the window ends between two lumps, it is still the same leak
        trend = fit_trend(xs[:end], staircase[:end])
        assert newest_evidence(trend, Series(xs[:end], staircase[:end])) is trend
    concave = [1e9 + 16 * MiB * math.ceil(16 * -math.expm1(-i / 25)) for i in range(64)]  # lumps ever further apart
    trend = fit_trend(xs, concave)
    believed = newest_evidence(trend, Series(xs, concave))
    assert believed.slope < 0.5 * trend.slope and believed.high < trend.slope
    assert believed.level == concave[-1]  # projected from the floor measured now, not the line's overshoot
    stopped = [1e9 + 256 * KiB * min(x, 2500) for x in xs]  # a leak that stopped 1,500 steps ago
    assert newest_evidence(fit_trend(xs, stopped), Series(xs, stopped)).low <= 0


def test_lumps_ever_further_apart_are_a_fill_levelling_off_and_lumps_at_a_steady_rate_are_not():
    xs = [64.0 * i for i in range(64)]

    def rise(at, height=lambda k: 32 * MiB):
        """`staircase_rise` on floors with lump k of `height(k)` at step at[k]."""
        ys = [1e9 + sum(height(k) for k, a in enumerate(at) if x >= a) for x in xs]
        return staircase_rise(fit_trend(xs, ys), Series(xs, ys))

    # A fill of 10 lumps with a time constant of 1,500 steps: 9 by the window's end, one to come.
    fill = [-1500 * math.log(1 - k / 10) for k in range(1, 10)]
    assert 32 * MiB <= rise(fill) <= 2 * 32 * MiB
    assert rise(range(300, 4032, 500)) == math.inf  # a leak's steady staircase
    assert rise([125 * 2 ** k for k in range(6)], lambda k: 8 * MiB * 2 ** k) == math.inf  # a heap doubling
    assert rise([300, 700, 1400, 2500, 3300]) == math.inf  # slower and slower, then a lump sooner: a leak's
    assert rise([300, 700, 1400, 1700, 2500, 3500]) == math.inf  # a sooner lump anywhere in the window


@pytest.mark.parametrize("seed", range(4))
def test_a_fill_in_lumps_ever_further_apart_is_neither_acted_on_nor_reported(seed):
    """A bench negative's shape (lumpy_cache_fill): six 400 MiB lumps, 512, 640, 896, 1,216 and
    2,112 steps apart, levelling off 1.5 GiB below the limit. Each lump makes the window look like
    a steady staircase whose OOM is 4,000 steps away; the gaps widening say it is slowing down."""
    lumps = (576, 1088, 1728, 2624, 3840, 5952)
    floor = lambda s: int(11.1 * GiB) + 400 * MiB * sum(s >= a for a in lumps)  # noqa: E731
    verdicts = statuses(job(8000, floor, transient=GiB, seed=seed))
    assert first_alarm(verdicts) is None and first_report(verdicts) is None


@pytest.mark.parametrize("spread", [0.6, 0.9])
@pytest.mark.parametrize("seed", range(5))
def test_a_leak_whose_lumps_come_at_irregular_times_is_still_acted_on_in_time(spread, seed):
    """400 MiB every 400 steps on average, each gap drawn within `spread` of that: now and then a
    gap is longer than the one before, which alone must not pass for a fill levelling off."""
    rng = random.Random(seed)
    lumps, at = [], 300.0
    while at < 8000:
        lumps.append(at)
        at += 400 * rng.uniform(1 - spread, 1 + spread)
    floor = lambda s: BASE + 400 * MiB * sum(s >= a for a in lumps)  # noqa: E731
    samples = job(8000, floor, transient=GiB, seed=seed)
    oom = next(s.step for s in samples if floor(s.step) + GiB >= LIMIT)
    judge = Judge()
    acted = next((s.step for s in samples if judge.judge(s)[1].needs_checkpoint), None)
    assert acted is not None and acted < oom - 200, f"acted at {acted}, OOM at {oom}"


def stopped_leak(onset, duration, rate, every, seed=1):
    """A leak that runs for `duration` steps and stops 17.7 MiB below the budget, as in the issue."""
    floor = lambda s: BASE + rate * min(max(0, s - onset), duration)  # noqa: E731
    limit = int(BASE + rate * duration + 3 * MiB + 17.7 * MiB)
    return small_job(onset + duration + 3000, floor, limit=limit, every=every, seed=seed), onset + duration, limit


RECOVERY_BUCKET = DetectorConfig().recent_bucket_steps  # the widest bucket the newest evidence comes from
RECOVERY_BOUND = 5 * RECOVERY_BUCKET  # the detector's docstring, item 5: the 4-bucket tail, clear of the stop


@pytest.mark.parametrize("onset, duration, rate, every, buckets", [
    (300, 1200, 85 * KiB, 5, 5),  # the case: 1,200 steps of 85 KiB/step, early in the run
    (200, 600, 200 * KiB, 2, 5),
    (5000, 3000, 40 * KiB, 5, 5),
    (20_000, 2000, 100 * KiB, 4, 5),  # recent tier: 64-step buckets beside 256-step ones
    (60_000, 3000, 30 * KiB, 8, 7),  # slower: the 6-bucket tail
    (9000, 1000, 20 * KiB, 1, 7),
])
def test_a_leak_that_stops_is_healthy_again_within_the_stated_bound_and_stays_so(onset, duration, rate, every,
                                                                                   buckets):
    samples, stop, _ = stopped_leak(onset, duration, rate, every)
    judge = Judge()
    outcomes = [(s.step, *judge.judge(s)) for s in samples]
    assert any(v.status is Status.OOM_PROJECTED for step, v, _ in outcomes if step < stop)  # it was caught running
    after = [(step, v, a) for step, v, a in outcomes if step >= stop + buckets * RECOVERY_BUCKET + every]
    assert after and all(v.status is Status.HEALTHY for _, v, _ in after), \
        next(f"{v.status.value} at stop + {step - stop}: {v.explanation}" for step, v, _ in after if v.status is not Status.HEALTHY)
    assert not any(a.needs_checkpoint for _, _, a in after)


def test_a_projection_never_says_the_limit_is_reached_while_the_measured_peak_is_below_it():
    samples, stop, limit = stopped_leak(300, 1200, 85 * KiB, 5)
    judge, peak = Judge(), 0
    for sample in samples:
        verdict, _ = judge.judge(sample)
        peak = max(peak, sample.bytes_used)
        assert peak < limit
        if verdict.projected_oom_step is not None:
            assert verdict.projected_oom_steps > 0 and verdict.projected_oom_step > sample.step, (
                f"step {sample.step}: '{verdict.explanation}' with the peak {format_bytes(limit - peak)} below the limit")
        if sample.step > stop + RECOVERY_BOUND:  # the floor is the one measured, not a line's overshoot
            assert verdict.floor_bytes < BASE + 85 * KiB * 1200 + 2 * MiB


def test_a_transient_margin_past_the_limit_is_not_the_limit_reached():
    """The margin for unsampled transient tops may reach past the limit before the measured peak does:
    the central projection still counts down (to the measured peak's crossing); the pessimistic one,
    which actions read, may say now."""
    rate = 64 * KiB
    floor = lambda s: BASE + rate * s  # noqa: E731
    transient = 2 * GiB
    measured_room = 150 * MiB  # at the last sample; the 10% margin on 2 GiB takes 205 MiB
    limit = int(BASE + rate * 6000 + transient + measured_room)
    judge = Judge()
    verdicts = [judge.judge(s)[0] for s in small_job(6000, floor, limit=limit, every=1, transient=transient)]
    last = verdicts[-1]
    assert last.status is Status.OOM_PROJECTED
    assert last.projected_oom_steps > 0 and last.projected_oom_steps_pessimistic == 0


# --------------------------------------------------------------- the leak report: the other signal

def test_a_slow_leak_with_no_oom_in_sight_is_reported_and_never_acted_on():
    """60 KiB/step from step 2,000 of 20,000: 1 GiB by the end, 6% of the limit; the OOM is ~80k
    steps away, far past what the action path extrapolates to. The report comes; no alarm."""
    onset = 2000
    verdicts = statuses(job(20_000, lambda s: BASE + 60 * KiB * max(0, s - onset), every=4))
    reported = first_report(verdicts)
    assert reported is not None and onset < reported < 18_000
    assert first_alarm(verdicts) is None
    at = next(v for v in verdicts if v.step == reported)
    assert at.status is Status.SUSPECT and "leak detected, no action" in at.explanation
    assert at.slope_bytes_per_step == pytest.approx(60 * KiB, rel=0.2)
    assert verdicts[-1].leak_detected  # and it stays up while the leak goes on


def test_a_report_once_up_is_not_taken_down_by_a_shorter_window_that_rises_less_than_the_share():
    """256 KiB/step from the start against 8 GiB, on a 7-step sawtooth: the report goes up once the
    rise passes `min_leak_share`; later the candidate is at times a short window rising by less than
    that share, and the report must stay up (an alert with a `for:` would otherwise never fire)."""
    verdicts = statuses(job(1500, lambda s: 4 * GiB + 256 * KiB * s, transient=0, jitter=0, limit=8 * GiB,
                            spikes=lambda s: (s % 7) * 16 * MiB))
    reported = first_report(verdicts)
    assert reported is not None and first_alarm(verdicts) is None
    assert all(v.leak_detected for v in verdicts if v.step >= reported)


def test_an_oom_projected_is_also_a_leak_reported():
    verdicts = statuses(job(8000, lambda s: BASE + 1 * MiB * max(0, s - 1000)))
    alarm = first_alarm(verdicts)
    assert alarm is not None
    assert all(v.leak_detected for v in verdicts if v.status is Status.OOM_PROJECTED)
    assert first_report(verdicts) <= alarm


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flat_training_and_a_level_shift_are_never_reported(seed):
    assert first_report(statuses(job(20_000, every=4, seed=seed))) is None
    shifted = job(20_000, lambda s: BASE + (GiB if s > 6000 else 0), every=4, seed=seed)
    assert first_report(statuses(shifted)) is None


def test_growth_below_the_materiality_share_is_not_reported():
    """1 KiB/step for 18k steps: 18 MiB, a tenth of a percent of the limit, in quiet memory."""
    quiet = job(20_000, lambda s: BASE + 1 * KiB * max(0, s - 2000), every=4, jitter=0.2 * MiB,
                transient=16 * MiB)
    assert first_report(statuses(quiet)) is None
    assert first_report(statuses(quiet, min_leak_share=0.0)) is not None  # the share is what held it back


def test_a_leak_that_stops_takes_its_report_down():
    onset, stop = 1000, 18_000
    verdicts = statuses(job(30_000, lambda s: BASE + 100 * KiB * (min(s, stop) - onset if s > onset else 0),
                            every=4))
    reported = first_report(verdicts)
    assert reported is not None and reported < stop
    assert not any(v.leak_detected for v in verdicts if v.step > stop + 6000)
