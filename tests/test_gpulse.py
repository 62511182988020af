"""gpulse's rules as the bench re-implements them: OLS over 5 minutes with R² >= 0.7 and >= 1 MB/s,
and usage up 20% within 30 s."""

import dataclasses
import random

from watchdog.bench.baselines import BASELINES, Gpulse
from watchdog.core.sample import Sample
from watchdog.core.verdict import Status

GB = 10**9
LIMIT = 16 * GB


def trace(rate_bytes_per_second, seconds=900, every=1.0, noise=0.0, seed=0, base=4 * GB):
    rng = random.Random(seed)
    return [Sample(i, 1000.0 + i * every, int(base + rate_bytes_per_second * i * every + rng.gauss(0, noise)), LIMIT)
            for i in range(int(seconds / every))]


def first_alert(samples, **options):
    detector = Gpulse(memory_limit_bytes=LIMIT, **options)
    return next(((s.timestamp - samples[0].timestamp, v) for s in samples
                 if (v := detector.update(s)).status is Status.OOM_PROJECTED), None)


def test_a_steady_2_mb_per_second_rise_is_a_leak_once_five_minutes_are_seen_with_a_time_to_oom():
    seen, verdict = first_alert(trace(2e6))
    assert 299 <= seen <= 301
    assert abs(verdict.slope_bytes_per_second - 2e6) < 1
    assert abs(verdict.projected_oom_seconds - (LIMIT - verdict.floor_bytes) / 2e6) < 1e-6 * LIMIT


def test_a_rise_under_1_mb_per_second_is_never_a_leak_however_clean():
    assert first_alert(trace(0.9e6)) is None


def test_a_fast_rise_buried_in_noise_fails_the_r_squared_rule():
    assert first_alert(trace(1.5e6, noise=2 * GB, seed=3), spikes=False) is None


def test_usage_up_20_percent_within_30_seconds_is_a_spike_and_spikes_can_be_left_out():
    samples = trace(0)
    samples[400] = dataclasses.replace(samples[400], bytes_used=int(samples[399].bytes_used * 1.25))
    seen, verdict = first_alert(samples)
    assert seen == 400 and verdict.explanation.startswith("spike")
    assert first_alert(samples, spikes=False) is None
    slow = [dataclasses.replace(s, bytes_used=int(4 * GB * (1 + 0.1 * (i // 60)))) for i, s in enumerate(trace(0))]
    seen, verdict = first_alert(slow)  # +10% a minute: never +20% within 30 s, but 6.7 MB/s for 5 minutes
    assert seen == 300 and verdict.explanation.startswith("leak")


def test_it_is_one_of_the_bench_baselines():
    assert isinstance(BASELINES["gpulse"](LIMIT), Gpulse)
