"""The labelled corpus: TPU-like shape, honest labels, true OOM steps, determinism, real-trace loading."""

import gzip
import math

import numpy as np
import pytest

from watchdog.bench.corpus import LabelledTrace, synthetic_corpus
from watchdog.bench.memory_model import (
    GiB,
    KiB,
    LevelShift,
    LinearLeak,
    MemoryModel,
    MiB,
    SaturatingGrowth,
    StepwiseLeak,
    render,
)
from watchdog.bench.realtraces import (
    DATA_ENV,
    default_data_path,
    load_machines,
    real_corpus,
    resolve_data_path,
)
from watchdog.core.errors import InputError


@pytest.fixture(scope="module")
def corpus() -> list[LabelledTrace]:
    return synthetic_corpus(0)


def _quiet_model(**overrides) -> MemoryModel:
    base = dict(steps=4000, limit_bytes=16 * GiB, runtime_bytes=GiB, state_bytes=8 * GiB,
                activation_bytes=2 * GiB, step_seconds=0.5)
    return MemoryModel(**(base | overrides))


# ------------------------------------------------------------------------------------ memory model

def test_true_oom_step_is_where_floor_plus_largest_transient_reaches_the_limit():
    # floor 9 GiB + 2 GiB activations = 11 GiB; 5 GiB of headroom at 1 MiB/step from step 100.
    model = _quiet_model(growth=(LinearLeak(100, MiB),))
    rendered = render(model, np.random.default_rng(0))
    assert rendered.oom_step == 100 + 5 * 1024
    assert rendered.samples == [] or rendered.samples[-1].step < rendered.oom_step


def test_a_job_dies_at_its_oom_so_the_trace_stops_there():
    model = _quiet_model(steps=6000, growth=(LinearLeak(0, 2 * MiB),))
    rendered = render(model, np.random.default_rng(0))
    assert rendered.oom_step == 2560
    assert rendered.samples[-1].step == 2559


def test_eval_spike_larger_than_activations_can_be_the_step_that_runs_out():
    model = _quiet_model(eval_every=500, eval_span=1, eval_bytes=4 * GiB, growth=(LinearLeak(0, MiB),))
    rendered = render(model, np.random.default_rng(0))
    # Activations alone would last until 5120; the 4 GiB eval at a multiple of 500 hits the limit first.
    assert rendered.oom_step == 3500


def test_readings_jump_between_floor_and_floor_plus_activations():
    rendered = render(_quiet_model(), np.random.default_rng(1))
    used = np.array([s.bytes_used for s in rendered.samples[10:]])
    floor = 9 * GiB
    assert used.min() == pytest.approx(floor, abs=1)
    assert used.max() > floor + 1.9 * GiB
    assert np.mean(used > floor + GiB) == pytest.approx(0.42, abs=0.05)  # uniform phase, 15% idle


def test_weights_and_optimizer_state_arrive_at_step_one_or_two():
    rendered = render(_quiet_model(state_step=2), np.random.default_rng(0))
    assert rendered.samples[0].bytes_used == GiB  # runtime only
    assert rendered.floor_bytes[2] == 9 * GiB


def test_growth_components():
    steps = np.arange(0, 1000)
    assert StepwiseLeak(100, 50, 10.0).bytes_at(steps)[[99, 100, 149, 150]].tolist() == [0, 10, 10, 20]
    assert LevelShift(10, 5.0).bytes_at(steps)[[9, 10, 999]].tolist() == [0, 5, 5]
    cache = SaturatingGrowth(0, 100.0, 100.0).bytes_at(steps)
    assert cache[-1] < 100 and cache[-1] > 99.99 and np.all(np.diff(cache) >= 0)


def test_timestamps_follow_steps_with_compile_eval_and_checkpoint_pauses():
    model = _quiet_model(compile_seconds=90, eval_every=1000, eval_seconds=60, checkpoint_every=1500,
                         checkpoint_seconds=30)
    samples = render(model, np.random.default_rng(0)).samples
    gaps = np.diff([s.timestamp for s in samples])
    assert np.all(gaps > 0)
    assert np.median(gaps) == pytest.approx(0.5, rel=0.05)
    assert gaps[999] > 55 and gaps[1499] > 25  # eval before step 1000, checkpoint at step 1500
    assert samples[0].timestamp - 1_735_689_600 > 90  # the first step compiles


# ---------------------------------------------------------------------------------- the corpus

def test_corpus_size_and_mix(corpus):
    assert 60 <= len(corpus) <= 120
    leaks = [t for t in corpus if t.leak]
    assert 0.35 <= len(leaks) / len(corpus) <= 0.65
    kinds = {t.kind for t in corpus}
    for kind in ("level_shift", "eval_buffers_kept", "compile_warmup", "saturating_cache", "heavy_noise",
                 "linear_small_leak", "linear_large_leak", "stepwise_leak", "late_onset_leak", "noisy_leak"):
        assert kind in kinds
    planned = [t.meta["steps"] for t in corpus]
    assert min(planned) <= 3_000 and max(planned) == 80_000
    assert sum(len(t.samples) for t in corpus) < 1_200_000  # replays in seconds


def test_labels_are_honest(corpus):
    for trace in corpus:
        assert trace.family == "synthetic"
        assert all(s.bytes_used < trace.limit_bytes for s in trace.samples)
        steps = [s.step for s in trace.samples]
        assert steps == sorted(set(steps))
        if trace.leak:
            assert trace.onset_step < trace.oom_step
            assert trace.samples[-1].step < trace.oom_step <= 1.2 * trace.meta["steps"]
            assert trace.oom_step - trace.onset_step > 500
            assert trace.checkpoint_margin_steps >= 10
        else:
            assert trace.oom_step is None and trace.onset_step is None
            assert trace.samples[-1].step >= trace.meta["steps"] - trace.meta["sample_every"]


def test_small_leaks_are_kib_per_step_and_large_ones_mib(corpus):
    small = [t.meta["leak_bytes_per_step"] for t in corpus if t.kind == "linear_small_leak"]
    large = [t.meta["leak_bytes_per_step"] for t in corpus if t.kind == "linear_large_leak"]
    assert min(small) >= 2 * KiB and max(small) <= 64 * KiB
    assert min(large) >= 128 * KiB and max(large) <= 8 * MiB
    assert all(t.meta["leak_bytes_per_step"] == 0 for t in corpus if t.hard_negative)


def test_the_corpus_is_deterministic_given_the_seed(corpus):
    again = synthetic_corpus(0)
    assert [t.name for t in again] == [t.name for t in corpus]
    assert all(a.samples == b.samples and a.oom_step == b.oom_step for a, b in zip(again, corpus))
    other = synthetic_corpus(1)
    assert other[0].samples != corpus[0].samples


def test_hard_negatives_and_slow_growth_are_marked(corpus):
    growing = [t for t in corpus if t.growing]
    assert growing and all(t.kind == "slow_growth" and not t.leak for t in growing)
    assert all(t.hard_negative == (not t.leak and not t.growing) for t in corpus)


# ----------------------------------------------------------------------------------- real traces

def _write_alibaba_like(path, rows):
    with gzip.open(path, "wt") as handle:
        handle.write("machine_id,seconds,mem_util_percent\n")
        for machine, seconds, percent in rows:
            handle.write(f"m_{machine},{seconds},{percent}\n")


def test_missing_real_data_is_a_clear_input_error(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    with pytest.raises(InputError, match="real traces not found at .*alibaba_mem_util.csv.gz"):
        real_corpus()


def test_data_path_from_the_environment_or_shipped_in_the_package(tmp_path, monkeypatch):
    monkeypatch.delenv(DATA_ENV, raising=False)
    assert default_data_path().parts[-4:] == ("watchdog", "bench", "data", "alibaba_mem_util.csv.gz")
    assert default_data_path().is_file()
    data = tmp_path / "mine.csv.gz"
    _write_alibaba_like(data, [(1, 0, 50), (1, 10, 51), (2, 0, 70), (2, 30, 71)])
    monkeypatch.setenv(DATA_ENV, str(data))
    assert resolve_data_path() == data
    machines = load_machines()
    assert sorted(machines) == [1, 2]
    assert machines[2].tolist() == [[0, 70], [30, 71]]


def test_a_file_in_another_format_is_refused(tmp_path):
    data = tmp_path / "bad.csv.gz"
    with gzip.open(data, "wt") as handle:
        handle.write("step,timestamp,bytes_used\n1,2,3\n")
    with pytest.raises(InputError, match="expected header"):
        load_machines(data)


def test_real_corpus_negatives_never_reach_the_limit_and_injected_leaks_do():
    traces = real_corpus()  # the copy shipped in the package
    negatives = [t for t in traces if not t.leak]
    injected = [t for t in traces if t.leak]
    assert len(negatives) >= 20 and len(injected) >= 20
    for trace in negatives:
        assert trace.family == "real"
        assert max(s.bytes_used for s in trace.samples) <= 0.98 * 0.9 * trace.limit_bytes + 1
    for trace in injected:
        assert trace.family == "real_injected"
        assert trace.onset_step < trace.oom_step and trace.samples[-1].step < trace.oom_step
        slope = trace.meta["slope_bytes_per_step"]
        last = trace.samples[-1]
        # The leak is in the data: the last reading carries (last - onset) * slope above the background.
        assert last.bytes_used >= (last.step - trace.onset_step) * slope
        gaps = np.diff([s.step for s in trace.samples])
        assert gaps.min() >= 1
    assert math.isclose(traces[0].samples[1].timestamp - traces[0].samples[0].timestamp,
                        10 * (traces[0].samples[1].step - traces[0].samples[0].step))
    again = real_corpus()
    assert [t.samples for t in again] == [t.samples for t in traces]
