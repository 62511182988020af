"""Memory sources, for real: RSS on this machine, XLA on PJRT CPU (which must fall back), replay.

There is no TPU here, so the TPU runtime source is tested for its fallback, not faked (its chips'
numbers are served over libtpu's real protocol in tests/test_tpu_chips.py); TorchTPU cannot be
installed beside torch_xla 2.9, so its `torch.tpu` is two stand-in calls.
"""

import mmap
import sys

import pytest
from conftest import run_python

from watchdog.core.errors import InputError
from watchdog.core.sample import Sample, write_trace
from watchdog.core.readings import AllocatorMemory
from watchdog.readers.sources import (
    ReplaySource,
    RssSource,
    SourceUnavailable,
    TpuRuntimeSource,
    candidates,
    select_source,
)


def resident_block(size: int) -> mmap.mmap:
    """Fresh pages, written so they are resident: malloc could hand back memory already resident."""
    block = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        block[offset] = 1
    return block


def test_rss_source_sees_an_allocation():
    source = RssSource(memory_limit_bytes=1 << 40)
    before = source.read()
    block = resident_block(64 << 20)
    after = source.read()
    assert after.bytes_used - before.bytes_used > 48 << 20
    assert after.bytes_limit == 1 << 40
    assert after.peak_bytes_used >= after.bytes_used
    del block


def test_rss_peak_is_since_the_last_reading_so_freed_memory_does_not_stay_the_peak():
    """After a reinit frees memory, a lifetime peak would read as an OOM about to happen."""
    source = RssSource()
    source.read()
    block = resident_block(256 << 20)  # a new lifetime high
    high = source.read()
    assert high.peak_bytes_used >= high.bytes_used > 200 << 20
    block.close()
    source.read()  # its interval began at the high: its peak includes it
    after = source.read()
    assert after.peak_bytes_used < high.peak_bytes_used - (128 << 20)


def test_rss_peak_sees_a_copy_made_and_freed_between_two_readings():
    """An evaluation's end-of-pass concatenation: made and freed between two samples, it is where the
    OOM would come from, and the kernel's high-water mark (reset at each reading) still saw it."""
    source = RssSource()
    before = source.read()
    resident_block(256 << 20).close()  # made, touched and freed in between
    after = source.read()
    assert after.bytes_used < before.bytes_used + (64 << 20)
    assert after.peak_bytes_used >= before.bytes_used + (200 << 20)


def test_replay_source_serves_the_trace_in_order_then_holds_the_last(tmp_path):
    path = tmp_path / "t.csv"
    write_trace(path, [Sample(i, float(i), 100 + i, 1000, None) for i in range(3)])
    source = ReplaySource(path)
    assert [source.read().bytes_used for _ in range(5)] == [100, 101, 102, 102, 102]


def test_replay_of_a_bad_trace_is_an_input_error_not_a_fallback(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("nope\n")
    with pytest.raises(InputError):
        select_source("replay", "cpu", replay_trace=path)


def test_auto_order_depends_on_the_device():
    names = lambda device: [name for name, _ in candidates("auto", device, None)]
    assert names("xla:0") == ["xla", "tpu", "rss"]
    assert names("cuda:1") == ["cuda", "rss"]
    assert names("tpu:0") == ["tpu", "rss"], "TorchTPU: libtpu's metrics, nothing of torch_xla"
    assert names("cpu") == ["rss"]


def test_tpu_runtime_source_is_unavailable_without_a_tpu():
    with pytest.raises(SourceUnavailable):
        TpuRuntimeSource().read()


def test_cpu_device_selects_rss():
    source, reading = select_source("auto", "cpu", memory_limit_bytes=8 << 30)
    assert source.name == "rss" and reading.bytes_limit == 8 << 30


XLA_FALLBACK = r"""
import logging, torch_xla
from watchdog.readers.sources import select_source, SourceUnavailable
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record.msg)
logging.getLogger("watchdog.readers.sources").addHandler(Keep()); logging.getLogger("watchdog.readers.sources").setLevel(logging.INFO)
device = str(torch_xla.device())
source, reading = select_source("auto", device, memory_limit_bytes=4 << 30)
print("SELECTED", source.name, reading.bytes_used > 0)
print("REJECTED", sorted(r["source"] for r in records if r["event"] == "memory_source_unavailable"))
try:
    select_source("xla", device)
except SourceUnavailable as exc:
    print("XLA_ONLY", "UNIMPLEMENTED" in str(exc))
"""


@pytest.mark.slow
def test_xla_on_pjrt_cpu_falls_back_to_rss_and_says_why():
    out = run_python(XLA_FALLBACK, timeout=180)
    assert "SELECTED rss True" in out
    assert "REJECTED ['tpu', 'xla']" in out
    assert "XLA_ONLY True" in out


@pytest.mark.slow  # a fresh process: torch_xla imported, as a library would, its runtime not yet started
def test_the_device_guess_never_starts_torch_xlas_runtime():
    out = run_python(
        "import torch, torch_xla\n"
        "from watchdog.readers.sources import current_device\n"
        "started = torch_xla._XLAC._xla_runtime_is_initialized\n"
        "print(current_device(), started())\n"
        "torch.ones(1, device=torch_xla.device())\n"
        "print(current_device(), started())\n")
    assert out.split() == ["xla:0", "False", "xla:0", "True"]


class _TorchTpu:
    """`torch.tpu` as TorchTPU registers it (torch-tpu needs torch 2.11, not installable beside torch_xla
    2.9): only the two calls the device guess makes."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return 3


def test_a_torchtpu_program_is_watched_on_its_tpu_device(monkeypatch):
    import torch

    from watchdog.readers.sources import current_device

    monkeypatch.delitem(sys.modules, "torch_xla", raising=False)  # as in a TorchTPU job, whatever this worker ran
    assert current_device() != "tpu:3"
    monkeypatch.setattr(torch, "tpu", _TorchTpu, raising=False)
    assert current_device() == "tpu:3"


@pytest.mark.slow  # a fresh process: what a TorchTPU job imports
def test_a_tpu_device_never_imports_torch_xla_and_says_why_each_source_was_passed_over():
    out = run_python(
        "import sys, logging\n"
        "from watchdog.readers.sources import select_source\n"
        "rejected = []\n"
        "class Keep(logging.Handler):\n"
        "    def emit(self, record): rejected.append(record.msg.get('source'))\n"
        "logging.getLogger('watchdog').addHandler(Keep()); logging.getLogger('watchdog').setLevel(logging.INFO)\n"
        "source, _ = select_source('auto', 'tpu:0', memory_limit_bytes=4 << 30)\n"
        "print(source.name, rejected[0], 'torch_xla' in sys.modules)\n", fresh=True)
    assert out.split() == ["rss", "tpu", "False"]


# ---- the CUDA source -------------------------------------------------------------------------------
# No GPU here: the allocator's numbers below are made up (the H100's real ones are replayed in
# tests/test_cuda_fixtures.py); what runs for real is the CUDA-less path.

GiB, MiB = 1 << 30, 1 << 20


class Allocator:
    """torch.cuda as the cuda source calls it, over the allocator state a test sets (`now`): the
    device's free bytes follow what the allocator reserved, as the driver's do."""

    def __init__(self, now: dict, total: int = 80 * GiB, other: int = 2 * GiB, fraction: float = 1.0):
        self.now, self.total, self.other, self.fraction = now, total, other, fraction
        self.breakdowns = self.device_reads = 0

    def is_initialized(self) -> bool:
        return True

    def memory_stats_as_nested_dict(self, index: int) -> dict:
        assert isinstance(index, int), "the source passes an index: no name is parsed on each call"
        self.breakdowns += 1
        now = self.now
        return {"allocated_bytes": {"all": {"current": now["allocated"], "peak": now["peak"]}},
                "reserved_bytes": {"all": {"current": now["reserved"]}},
                "inactive_split_bytes": {"all": {"current": now["split"]}}, "num_alloc_retries": 0}

    def mem_get_info(self, index: int) -> tuple[int, int]:
        self.device_reads += 1
        return self.total - self.other - self.now["reserved"], self.total

    def get_per_process_memory_fraction(self, index: int) -> float:
        return self.fraction

    def reset_peak_memory_stats(self, index=None) -> None:
        raise AssertionError("the allocator's peak is every reader's: the source never resets it")


def state(allocated: float, reserved: float, peak: float | None = None, split: float = 0) -> dict:
    return {"allocated": int(allocated * GiB), "reserved": int(reserved * GiB),
            "peak": int((peak if peak is not None else allocated) * GiB), "split": int(split * GiB)}


def cuda_source(allocator: Allocator, **plan):
    """The cuda source, its readings a millisecond apart (a fast step at sample_every=1)."""
    from watchdog.readers.breakdown_plan import BreakdownPlan
    from watchdog.readers.sources import CudaSource

    ticks = iter(range(10**9))
    return CudaSource("cuda:0", cuda=allocator, plan=BreakdownPlan(**plan), clock=lambda: next(ticks) / 1000)


def test_a_steady_allocator_is_read_on_the_device_every_sample_and_broken_down_every_tenth():
    allocator = Allocator(state(1, 2))
    source = cuda_source(allocator)
    readings = [source.read() for _ in range(30)]
    assert allocator.device_reads >= 30 and allocator.breakdowns == 1 + 3, "at construction, then 1 in 10"
    assert {r.bytes_used for r in readings} == {1 * GiB} and {r.bytes_limit for r in readings} == {78 * GiB}
    assert [r.allocator is not None for r in readings[:11]] == [True] + [False] * 9 + [True], \
        "a reading that carries the series says so: no allocator figures"
    assert [r.peak_bytes_used for r in readings[:2]] == [1 * GiB] * 2, "the series stands in for an unknown peak"


def test_a_growing_cache_is_read_at_once_and_is_not_a_leak():
    """The cache grows: the device's free bytes fall, so the breakdown is read; the series stays."""
    allocator = Allocator(state(4, 4))
    source = cuda_source(allocator)
    source.read()
    for reserved in (6, 9, 12):
        allocator.now = state(4, reserved)
        before = allocator.breakdowns
        reading = source.read()
        assert allocator.breakdowns == before + 1 and reading.bytes_used == 4 * GiB
        assert reading.allocator == AllocatorMemory(4 * GiB, 0, reserved * GiB)


def test_fragmentation_is_counted_and_each_figure_served():
    allocator = Allocator(state(4, 6))
    source = cuda_source(allocator)
    source.read()
    allocator.now = state(4, 7, split=0.5)
    assert source.read().bytes_used == int(4.5 * GiB)
    allocator.now = state(4, 8, split=1.5)
    assert source.read().allocator == AllocatorMemory(4 * GiB, int(1.5 * GiB), 8 * GiB)


def test_tensors_growing_inside_the_cache_are_read_within_every_readings_then_at_each_while_they_climb():
    """The device cannot see tensors fill the cache; the breakdown every `every`-th reading does, and
    from then on every reading is a breakdown until the series stops making new highs."""
    allocator = Allocator(state(1, 6))
    source = cuda_source(allocator, every=4)
    source.read()
    used = []
    for n in range(1, 13):
        allocator.now = state(1 + 0.25 * n, 6)
        used.append(source.read().bytes_used / GiB)
    assert used[:3] == [1, 1, 1], "carried: the device reading did not move"
    assert used[3:] == [1 + 0.25 * n for n in range(4, 13)], "read at the fourth, then every reading of the climb"
    for _ in range(4):
        source.read()
    assert allocator.breakdowns == 1 + 1 + 9 + 4, "the climb stopped: four more breakdowns found no new high"
    for _ in range(3):
        source.read()
    assert allocator.breakdowns == 15, "then readings carry the series again"


def test_near_the_limit_every_reading_is_a_breakdown():
    allocator = Allocator(state(5, 7.5), total=10 * GiB, other=1 * GiB)  # reserved 7.5 of a 9 GiB limit: 83%
    source = cuda_source(allocator)
    for _ in range(5):
        source.read()
    assert allocator.breakdowns == 1 + 1
    allocator.now = state(5, 8.2)  # 91%
    for _ in range(5):
        source.read()
    assert allocator.breakdowns == 2 + 5


def test_the_cuda_limit_is_what_the_allocator_may_still_reserve_capped_by_its_fraction():
    shared = cuda_source(Allocator(state(20, 30), other=44 * GiB))  # the device has 6 GiB free
    assert shared.read().bytes_limit == 36 * GiB, "other processes' memory is already taken from the free"
    capped = cuda_source(Allocator(state(20, 30), other=10 * GiB, fraction=0.4))
    assert {capped.read().bytes_limit for _ in range(3)} == {32 * GiB}, "carried readings keep the cap"


def test_the_cuda_peak_is_since_the_previous_breakdown_and_the_users_peak_is_never_reset():
    allocator = Allocator(state(10, 12))
    source = cuda_source(allocator)
    source.read()
    allocator.now = state(12, 14, peak=15)
    assert source.read().peak_bytes_used == 15 * GiB, "a new high since the last breakdown"
    assert source.read().peak_bytes_used == 12 * GiB, "none since: the current series stands in"
    for _ in range(9):  # the climb is over: ten breakdowns in a row found no new high
        source.read()
    allocator.now = state(2, 14, peak=15)  # a rebuild freed tensors into the cache: the device sees nothing
    assert source.read().bytes_used == 12 * GiB, "carried"
    after_rebuild = source.read_fresh()
    assert (after_rebuild.bytes_used, after_rebuild.peak_bytes_used) == (2 * GiB, 2 * GiB), \
        "the old lifetime high is not this state's peak"
    allocator.now = state(3, 14, peak=15)
    assert {source.read().peak_bytes_used for _ in range(10)} == {2 * GiB, 3 * GiB}, \
        "carried (the floor seen), then read: never the old 15 GiB"
    assert allocator.now["peak"] == 15 * GiB, "torch.cuda.max_memory_allocated() still says 15 GiB"


def test_a_rebuild_is_measured_by_a_fresh_reading_of_any_source(tmp_path):
    from watchdog.readers.sources import fresh_reading

    allocator = Allocator(state(8, 9))
    source = cuda_source(allocator)
    source.read()
    allocator.now = state(1, 9)
    assert fresh_reading(source).bytes_used == 1 * GiB
    trace = tmp_path / "t.csv"
    write_trace(trace, [Sample(0, 1.0, 5, 10), Sample(1, 2.0, 6, 10)])
    replay = ReplaySource(trace)
    assert [fresh_reading(replay).bytes_used, fresh_reading(replay).bytes_used] == [5, 6], "read() for the rest"


def test_without_cuda_the_cuda_source_is_unavailable_and_creates_no_context():
    from watchdog.readers.sources import CudaSource

    with pytest.raises(SourceUnavailable, match="CUDA is not available"):
        CudaSource("cuda:0")  # this machine's real torch, with no GPU

    class Unused(Allocator):
        def is_initialized(self) -> bool:
            return False

    with pytest.raises(SourceUnavailable, match="has not used CUDA yet"):
        CudaSource("cuda:0", cuda=Unused(state(0, 0)))
