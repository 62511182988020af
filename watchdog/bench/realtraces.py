"""Real memory traces (Alibaba cluster machines) as hard negatives and as background for injected leaks.

Source: `watchdog/bench/data/alibaba_mem_util.csv.gz`, shipped with the package (columns
`machine_id,seconds,mem_util_percent`, 10-second samples with gaps, integer percent; origin and
Apache-2.0 attribution in `data/README.md` beside it). A sample becomes one "step" (step = seconds / 10,
so a gap in time is a gap in steps).

Percent becomes bytes of a device on which the machine's whole memory is `WORKLOAD_SHARE` of the
limit (drawn per trace, the same rule for negatives and injected leaks). Read literally (machine
size = limit) the data cannot label anything: these machines sit at 95-98% for days, so a rise of
2% anywhere is an "OOM", far inside swings of 20% that revert by themselves. A training job sized
to leave headroom is the case the watchdog is for; the traces keep their real shape and noise.

- `real` traces: unmodified windows. No machine in the data ever exceeded 98%, so none ran out
  of memory: a detector must not act on any of them.
- `real_injected` traces: other machines' windows plus a linear leak of known onset and slope,
  chosen so that it exhausts memory before the window ends; the trace stops at that OOM step.
"""

from __future__ import annotations

import functools
import gzip
import os
import warnings
from pathlib import Path

import numpy as np

from watchdog.bench.corpus import LabelledTrace
from watchdog.bench.memory_model import START_TIMESTAMP, GiB
from watchdog.core.errors import InputError
from watchdog.core.inputs import open_regular
from watchdog.core.sample import Sample

DATA_FILE = "alibaba_mem_util.csv.gz"
DATA_ENV = "HBMWATCH_DATA"
BUNDLED_DATA = Path(__file__).resolve().parent / "data" / DATA_FILE
HEADER = b"machine_id,seconds,mem_util_percent"
SECONDS_PER_STEP = 10

NEGATIVE_TRACES = 24
NEGATIVE_WINDOW_STEPS = 12_960  # a day and a half of 10-second samples
INJECTED_TRACES = 24
INJECTED_WINDOW_STEPS = 8_640  # one day
MACHINE_SIZES = (32 * GiB, 64 * GiB, 128 * GiB, 256 * GiB)
WORKLOAD_SHARE = (0.6, 0.9)  # the machine's 100% is this share of the device limit (uniform)


def default_data_path() -> Path:
    """`$HBMWATCH_DATA` (the file or its folder), else the copy shipped in this package."""
    override = os.environ.get(DATA_ENV)
    if override:
        path = Path(override)
        return path / DATA_FILE if path.is_dir() else path
    return BUNDLED_DATA


def resolve_data_path(path: str | os.PathLike[str] | None = None) -> Path:
    resolved = Path(path) if path else default_data_path()
    if resolved.is_dir():
        resolved = resolved / DATA_FILE
    try:  # opened once now, so a FIFO or a device fails before minutes of other work, never hangs
        open_regular(resolved, "rb", what="real traces ").close()
    except FileNotFoundError:
        raise InputError(f"real traces not found at {resolved}: pass --data PATH or set {DATA_ENV}") from None
    except OSError as exc:
        raise InputError(f"{resolved}: cannot read the real traces: {exc.strerror or exc}") from None
    return resolved


MAX_INFLATED_BYTES = 512 << 20  # the shipped traces inflate to 89 MB; a larger file is not ours


@functools.lru_cache(maxsize=2)
def _load_machines(path: str, mtime: float) -> dict[int, np.ndarray]:
    """machine number -> array of (seconds, percent) rows, in file order. Parsed once per process."""
    try:
        with open_regular(path, "rb", what="real traces ") as handle:
            # Read with a bound: a 2 MiB gzip may inflate to gigabytes (a "zip bomb"), and reading it
            # whole raised MemoryError. The shipped file inflates to 89 MB.
            raw = gzip.GzipFile(fileobj=handle).read(MAX_INFLATED_BYTES + 1)
    except (OSError, EOFError) as exc:
        raise InputError(f"{path}: cannot read the real traces: {exc}") from None
    if len(raw) > MAX_INFLATED_BYTES:
        raise InputError(f"{path}: inflates to more than {MAX_INFLATED_BYTES >> 20:,} MiB: not the real traces' file")
    newline = raw.find(b"\n")
    if raw[:newline].strip() != HEADER:
        raise InputError(f"{path}:1: expected header {HEADER.decode()!r}")
    body = raw[newline + 1:].replace(b"m_", b"").replace(b"\n", b",")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            values = np.fromstring(body, dtype=np.int64, sep=",")  # text mode: one C pass over 5M rows
        except ValueError:  # "could not be read to its end": a field that is no integer
            raise InputError(f"{path}: malformed rows (expected machine_id,seconds,percent, integers, on every "
                             "line)") from None
    if values.size % 3:
        raise InputError(f"{path}: malformed rows (expected machine_id,seconds,percent on every line)")
    rows = values.reshape(-1, 3)
    order = np.argsort(rows[:, 0], kind="stable")
    rows = rows[order]
    ids, starts = np.unique(rows[:, 0], return_index=True)
    bounds = list(starts[1:]) + [len(rows)]
    return {int(i): rows[s:e, 1:] for i, s, e in zip(ids, starts, bounds)}


def load_machines(path: str | os.PathLike[str] | None = None) -> dict[int, np.ndarray]:
    resolved = resolve_data_path(path)
    return _load_machines(str(resolved), resolved.stat().st_mtime)


def _window(rows: np.ndarray, steps: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(step, percent) of a random window `steps` long; steps count from the window's start."""
    all_steps = rows[:, 0] // SECONDS_PER_STEP
    latest_start = max(int(all_steps[-1]) - steps, 0)
    start = int(rng.integers(0, latest_start + 1))
    keep = (all_steps >= start) & (all_steps < start + steps)
    return all_steps[keep] - start, rows[keep, 1].astype(np.float64)


def _samples(steps: np.ndarray, used: np.ndarray, limit: int) -> list[Sample]:
    used = np.clip(used, 0, limit - 1).astype(np.int64)
    return [Sample(step=s, timestamp=START_TIMESTAMP + s * SECONDS_PER_STEP, bytes_used=u, bytes_limit=limit)
            for s, u in zip(steps.tolist(), used.tolist())]


def _device(rng: np.random.Generator) -> tuple[int, float]:
    """(limit in bytes, bytes per percent of machine memory) for one trace."""
    limit = int(rng.choice(MACHINE_SIZES))
    return limit, rng.uniform(*WORKLOAD_SHARE) * limit / 100.0


def _negative(machine: int, rows: np.ndarray, rng: np.random.Generator) -> LabelledTrace:
    limit, bytes_per_percent = _device(rng)
    steps, percent = _window(rows, NEGATIVE_WINDOW_STEPS, rng)
    return LabelledTrace(
        name=f"m_{machine}", kind="real_unmodified", family="real",
        samples=_samples(steps, percent * bytes_per_percent, limit), limit_bytes=limit, leak=False,
        onset_step=None, oom_step=None, checkpoint_margin_steps=int(rng.integers(6, 31)),
        description=f"machine m_{machine}, unmodified ({percent.max() * bytes_per_percent / limit:.0%} of the limit at most)")


def _injected(machine: int, rows: np.ndarray, rng: np.random.Generator) -> LabelledTrace | None:
    """Add a linear leak that reaches the limit around a target step; None if this window cannot host one."""
    limit, bytes_per_percent = _device(rng)
    steps, percent = _window(rows, INJECTED_WINDOW_STEPS, rng)
    if steps.size < INJECTED_WINDOW_STEPS // 2:
        return None
    background = percent * bytes_per_percent
    onset = int(INJECTED_WINDOW_STEPS * rng.uniform(0.15, 0.5))
    target = int(INJECTED_WINDOW_STEPS * rng.uniform(0.65, 0.95))
    level = float(np.median(background[steps >= onset]))
    slope = (limit - level) / (target - onset)
    leak = np.maximum(steps - onset, 0) * slope
    # The OOM may fall inside a gap in the samples: find it on every step, background interpolated.
    every_step = np.arange(int(steps[-1]) + 1)
    over = np.flatnonzero(np.interp(every_step, steps, background) + np.maximum(every_step - onset, 0) * slope
                          >= limit)
    if not over.size or over[0] < onset + 0.1 * INJECTED_WINDOW_STEPS:
        return None  # a spike would end it right at onset: not a leak a detector could see coming
    oom = int(over[0])
    used = background + leak
    alive = steps < oom  # the process dies at its OOM
    return LabelledTrace(
        name=f"m_{machine}+leak", kind="real_injected_leak", family="real_injected",
        samples=_samples(steps[alive], used[alive], limit), limit_bytes=limit, leak=True,
        onset_step=onset, oom_step=oom, checkpoint_margin_steps=int(rng.integers(6, 31)),
        description=f"machine m_{machine} + leak of {slope / limit * 360:.2%} of the limit per hour from step {onset}",
        meta={"slope_bytes_per_step": slope})


def real_corpus(path: str | os.PathLike[str] | None = None, seed: int = 0) -> list[LabelledTrace]:
    """Unmodified negatives and injected leaks on disjoint machines; deterministic given the seed."""
    machines = load_machines(path)
    rng = np.random.default_rng([seed, 2])
    order = [int(m) for m in rng.permutation(sorted(machines))]
    negatives = [_negative(m, machines[m], rng) for m in order[:NEGATIVE_TRACES]]
    injected: list[LabelledTrace] = []
    for machine in order[NEGATIVE_TRACES:]:
        if len(injected) == INJECTED_TRACES:
            break
        trace = _injected(machine, machines[machine], rng)
        if trace is not None:
            injected.append(trace)
    return negatives + injected
