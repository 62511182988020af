"""Memory sources, for real: RSS on this machine, XLA on PJRT CPU (which must fall back), replay.

There is no TPU here, so the TPU runtime source is tested for its fallback, not faked.
"""

import mmap

import pytest
from conftest import run_python

from watchdog.core.errors import InputError
from watchdog.core.sample import Sample, write_trace
from watchdog.runtime.sources import (
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
    after = source.read()
    assert after.peak_bytes_used < high.peak_bytes_used - (128 << 20)


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
    assert names("cpu") == ["rss"]


def test_tpu_runtime_source_is_unavailable_without_a_tpu():
    with pytest.raises(SourceUnavailable):
        TpuRuntimeSource().read()


def test_cpu_device_selects_rss():
    source, reading = select_source("auto", "cpu", memory_limit_bytes=8 << 30)
    assert source.name == "rss" and reading.bytes_limit == 8 << 30


XLA_FALLBACK = r"""
import logging, torch_xla
from watchdog.runtime.sources import select_source, SourceUnavailable
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record.msg)
logging.getLogger("watchdog.runtime.sources").addHandler(Keep()); logging.getLogger("watchdog.runtime.sources").setLevel(logging.INFO)
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
        "from watchdog.runtime.sources import current_device\n"
        "started = torch_xla._XLAC._xla_runtime_is_initialized\n"
        "print(current_device(), started())\n"
        "torch.ones(1, device=torch_xla.device())\n"
        "print(current_device(), started())\n")
    assert out.split() == ["xla:0", "False", "xla:0", "True"]
