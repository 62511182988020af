"""Leak rate vs steps to detection: how small a leak the leak report sees, and how soon.

    python -m watchdog.bench.sensitivity [--out PNG] [--seeds N] [--json]

For each leak size in a grid (the floor's total growth over the leak's life, as a share of the
memory limit) it renders `seeds` TPU-like jobs of 20,000 steps (the corpus' sawtooth with
evaluations, checkpoints, normal jitter and drift: `corpus._job`), the leak starting at 10% of the
run and growing linearly to its end, and replays each through the default detector, exactly as
`hbm-watchdog analyze` would. The headroom (30-40% of the limit) is larger than the largest leak,
so no job runs out of memory: what is measured is the leak report (`ReplayResult.leak_reported`, a
warning whatever the OOM's distance), not the action path. The same seeds without a leak are the
control: any report on them is false.

Seed `s` draws the same job (limit, model, noise) for every leak size and for the control, so
sizes differ only by the leak. Deterministic given the seeds. `measure` returns the figures,
`render_png` draws them, `main` is the command line.

The same jobs go through, for scale (`Row.others`):
- `oracle`: told the onset and the jobs' noise (`bench/oracle.py`), calibrated on
  `CALIBRATION_DRAWS` leak-free draws (seeds apart from the measured ones) to report on none; it
  reports caches too;
- `cache_aware_oracle`: the same, also told the caches' shape and calibrated on as many draws with
  the second control's cache (a different seed each) to report on none of them either: the
  delay that telling a leak from a cache costs, which ours must pay;
- `predict_linear_1h`: Prometheus `predict_linear` as a training job's alert rule would use it
  (`bench/baselines.py`); its alert is its report;
- `gpulse_leak_rule`: gpulse's leak rule at its defaults (OLS over 5 min, R² >= 0.7, >= 1 MB/s);
  its spike rule is left out here, since it fires on a training step's sawtooth, leak or none (both
  are in `hbm-watchdog bench`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from watchdog.bench.baselines import BASELINES
from watchdog.bench.corpus import _job, _limit
from watchdog.bench.memory_model import GiB, KiB, LinearLeak, MemoryModel, SaturatingGrowth, render
from watchdog.bench.oracle import CacheAwareOracle, Oracle, cache_time_constants, calibrate
from watchdog.core.sample import Sample
from watchdog.core.verdict import Status
from watchdog.core.detector import DetectorConfig
from watchdog.commands.cli import OneLineParser
from watchdog.core.inputs import file_to_write
from watchdog.core.numbers import option, parse_positive
from watchdog.core.replay import replay
from watchdog.fileio import save_figure

STEPS = 20_000
ONSET_FRACTION = 0.1  # the leak starts at 10% of the run and runs to its end
SIZES = (0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.12, 0.20)  # total growth over the leak's life / limit
DEFAULT_SEEDS = 8
NOISE = "normal"
HEADROOM = (0.30, 0.40)  # share of the limit the job's steady peak leaves: more than any leak in SIZES
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "deploy" / "img" / "leak_sensitivity.png"
CALIBRATION_DRAWS = 32  # leak-free draws the oracles' thresholds are set on (and as many with a cache, for the cache-aware one)
CALIBRATION_SEED = 10_000  # their seeds start here, apart from any measured seed
ORACLES = ("oracle", "cache_aware_oracle")
OTHERS = (*ORACLES, "predict_linear_1h", "gpulse_leak_rule")
CACHE_SHARE = 0.05  # the second control: a cache that fills by this share of the limit from the onset, and stops
CACHE_TAU_FRACTION = 0.1  # its time constant, as a share of the run (95% full after three of them)


@dataclass(frozen=True)
class Reports:
    """One detector's first reports on one leak size's jobs."""

    delays: tuple[int, ...]  # steps from onset to the first report, per seed reported at or after onset
    early: int  # seeds reported before onset (on the control: every report, all false)

    @property
    def reported(self) -> int:
        return len(self.delays)

    @property
    def median_delay(self) -> float | None:
        return float(statistics.median(self.delays)) if self.delays else None


@dataclass(frozen=True)
class Row:
    """One leak size over all seeds. `growth_share` 0 is the no-leak control."""

    growth_share: float  # the floor's rise from onset to the end of the run, as a share of the limit
    steps: int
    onset_step: int
    seeds: int
    delays: tuple[int, ...]  # steps from onset to the first leak report, one per seed reported at or after onset
    early: int  # seeds whose first report came before the onset (false reports; on the control, every report)
    others: tuple[tuple[str, Reports], ...] = ()  # the oracle's and the baselines' on the same jobs

    def of(self, name: str) -> Reports:
        return dict(self.others)[name]

    @property
    def life_steps(self) -> int:
        """Steps the leak runs for: onset to the end of the run."""
        return self.steps - self.onset_step

    @property
    def rate_per_kstep(self) -> float:
        """Growth per 1,000 steps as a share of the limit."""
        return self.growth_share * 1000 / self.life_steps

    @property
    def reported(self) -> int:
        return len(self.delays)

    @property
    def detection_rate(self) -> float:
        return self.reported / self.seeds

    @property
    def median_delay(self) -> float | None:
        return float(statistics.median(self.delays)) if self.delays else None

    @property
    def median_share_of_life(self) -> float | None:
        median = self.median_delay
        return None if median is None else median / self.life_steps

    def to_json(self) -> dict:
        return {
            "growth_share": self.growth_share, "rate_per_1k_steps": self.rate_per_kstep,
            "bytes_per_step_at_16GiB": self.growth_share * 16 * GiB / self.life_steps,
            "seeds": self.seeds, "reported": self.reported, "detection_rate": self.detection_rate,
            "early_reports": self.early, "median_delay_steps": self.median_delay,
            "median_delay_share_of_life": self.median_share_of_life,
            "min_delay_steps": min(self.delays, default=None), "max_delay_steps": max(self.delays, default=None),
            "delays": list(self.delays),
            "ours_vs": {name: _ratio(self.median_delay, r.median_delay) for name, r in self.others if name in ORACLES},
            "others": {name: {"reported": r.reported, "early_reports": r.early, "median_delay_steps": r.median_delay,
                              "median_delay_share_of_life": None if r.median_delay is None
                              else r.median_delay / self.life_steps,
                              "delays": list(r.delays)}
                       for name, r in self.others},
        }


def _ratio(ours: float | None, oracle: float | None) -> float | None:
    return None if ours is None or not oracle else ours / oracle


@dataclass(frozen=True)
class Sensitivity:
    rows: list[Row]  # one per leak size, smallest first
    control: Row  # the same jobs without a leak: every report on them is false
    steps: int
    onset_step: int
    seeds: int
    noise: str
    seconds: float
    oracle_thresholds: tuple[tuple[str, float], ...] = ()
    cache: Row | None = None  # the same jobs with a cache that fills and stops: every report on them is false

    def to_json(self) -> dict:
        return {"steps": self.steps, "onset_step": self.onset_step, "seeds": self.seeds, "noise": self.noise,
                "detector": "default DetectorConfig", "signal": "leak report (ReplayResult.first_leak_report_step)",
                "min_leak_share": DetectorConfig().min_leak_share, "seconds": round(self.seconds, 2),
                "rows": [r.to_json() for r in self.rows],
                "control": {"seeds": self.control.seeds, "false_reports": self.control.early,
                            "others_false_reports": {name: r.early for name, r in self.control.others}},
                "cache_control": None if self.cache is None else {
                    "growth_share": self.cache.growth_share, "time_constant_steps": CACHE_TAU_FRACTION * self.steps,
                    "false_reports": self.cache.early,
                    "others_false_reports": {name: r.early for name, r in self.cache.others}},
                "oracle_thresholds": dict(self.oracle_thresholds)}


def draw(seed: int, growth_share: float, steps: int = STEPS, onset_step: int | None = None, *, cache: bool = False
         ) -> tuple[list[Sample], MemoryModel, int]:
    """Seed `seed`'s job with a leak of `growth_share` (0: none), or with a cache of that size that
    fills from the onset and stops (`cache`): its samples, its model, its limit."""
    onset = int(steps * ONSET_FRACTION) if onset_step is None else onset_step
    rng = np.random.default_rng(seed)
    limit = _limit(rng)
    headroom = limit * rng.uniform(*HEADROOM)
    if growth_share >= HEADROOM[0]:
        raise ValueError(f"a leak of {growth_share:.0%} of the limit could run the job out of memory")
    if growth_share <= 0:
        growth: tuple = ()
    elif cache:
        growth = (SaturatingGrowth(onset, growth_share * limit, CACHE_TAU_FRACTION * steps),)
    else:
        growth = (LinearLeak(onset, growth_share * limit / (steps - onset)),)
    model = _job(rng, steps, limit, headroom, noise=NOISE, growth=growth)  # growth draws nothing: same job per seed
    trace = render(model, rng)
    assert trace.oom_step is None or trace.oom_step >= steps, "the sensitivity jobs must not run out of memory"
    return trace.samples, model, limit


def first_report(seed: int, growth_share: float, steps: int = STEPS, onset_step: int | None = None,
                 config: DetectorConfig | None = None) -> int | None:
    """The step of the first leak report on seed `seed`'s job with a leak of `growth_share` (0: none)."""
    samples, _, limit = draw(seed, growth_share, steps, onset_step)
    return replay(samples, memory_limit_bytes=limit, detector_config=config).first_leak_report_step


def oracles_for(steps: int = STEPS, onset_step: int | None = None, draws: int = CALIBRATION_DRAWS
                ) -> dict[str, Oracle | CacheAwareOracle]:
    """The two oracles for these jobs: `oracle`'s threshold set on `draws` leak-free draws,
    `cache_aware_oracle`'s on those and as many with the second control's cache."""
    onset = int(steps * ONSET_FRACTION) if onset_step is None else onset_step
    leak_free = [draw(CALIBRATION_SEED + i, 0.0, steps, onset)[:2] for i in range(draws)]
    caches = [draw(CALIBRATION_SEED + draws + i, CACHE_SHARE, steps, onset, cache=True)[:2] for i in range(draws)]
    taus = cache_time_constants(CACHE_TAU_FRACTION * steps)
    return {"oracle": Oracle(onset, calibrate(leak_free, Oracle(onset, math.inf))),
            "cache_aware_oracle": CacheAwareOracle(
                onset, calibrate(leak_free + caches, CacheAwareOracle(onset, math.inf, taus)), taus)}


def _baseline_first(name: str, samples: list[Sample], limit: int) -> int | None:
    detector = BASELINES[name](limit)
    for sample in samples:
        if detector.update(sample).status is Status.OOM_PROJECTED:
            return sample.step
    return None


def measure(sizes: Sequence[float] = SIZES, seeds: int = DEFAULT_SEEDS, steps: int = STEPS,
            progress: Callable[[], None] | None = None, config: DetectorConfig | None = None) -> Sensitivity:
    """Replay every (size, seed) job and the two controls (no leak; a cache that fills and stops);
    `progress` is called after each job."""
    if seeds < 1:
        raise ValueError(f"seeds must be positive, got {seeds}")
    if not sizes or any(not 0 < s < HEADROOM[0] for s in sizes):
        raise ValueError(f"leak sizes must lie between 0 and {HEADROOM[0]:.0%} of the limit, got {list(sizes)}")
    onset = int(steps * ONSET_FRACTION)
    started = time.perf_counter()
    oracles = oracles_for(steps, onset)

    def row(share: float, cache: bool = False) -> Row:
        firsts: dict[str, list[int | None]] = {name: [] for name in ("ours", *OTHERS)}
        for seed in range(seeds):
            samples, model, limit = draw(seed, share, steps, onset, cache=cache)
            firsts["ours"].append(replay(samples, memory_limit_bytes=limit, detector_config=config).first_leak_report_step)
            for name, oracle in oracles.items():
                firsts[name].append(oracle.first_report(samples, model))
            for name in OTHERS[len(ORACLES):]:
                firsts[name].append(_baseline_first(name, samples, limit))
            if progress:
                progress()
        reports = {name: _reports(found, 0.0 if cache else share, onset) for name, found in firsts.items()}
        ours = reports.pop("ours")
        return Row(growth_share=share, steps=steps, onset_step=onset, seeds=seeds, delays=ours.delays,
                   early=ours.early, others=tuple(reports.items()))

    control = row(0.0)
    cache = row(CACHE_SHARE, cache=True)
    rows = [row(share) for share in sorted(sizes)]
    return Sensitivity(rows=rows, control=control, steps=steps, onset_step=onset, seeds=seeds, noise=NOISE,
                       seconds=time.perf_counter() - started, cache=cache,
                       oracle_thresholds=tuple((name, o.threshold) for name, o in oracles.items()))


def _reports(firsts: list[int | None], share: float, onset: int) -> Reports:
    delays = tuple(first - onset for first in firsts if first is not None and share > 0 and first >= onset)
    early = sum(1 for first in firsts if first is not None and not (share > 0 and first >= onset))
    return Reports(delays, early)


# ---------------------------------------------------------------------------------------- output

def _pct(share: float) -> str:
    return f"{share * 100:.3g}%"


def format_table(result: Sensitivity) -> str:
    """One line per leak size: reported n/N, median steps to detection and its share of the leak's life."""
    lines = [
        f"Leak report sensitivity: {result.steps:,}-step jobs, {result.noise} noise, {result.seeds} seeds per size, "
        f"onset at step {result.onset_step:,} (leak life {result.steps - result.onset_step:,} steps), "
        f"default detector",
        f"{'growth':>7} {'per 1k steps':>12} {'per step @16GiB':>15} {'reported':>9} {'median delay':>13} "
        f"{'of life':>8} {'min-max delay':>15} {'early':>6}",
    ]
    for r in result.rows:
        median, share = r.median_delay, r.median_share_of_life
        spread = f"{min(r.delays):,}-{max(r.delays):,}" if r.delays else "-"
        lines.append(
            f"{_pct(r.growth_share):>7} {_pct(r.rate_per_kstep):>12} "
            f"{r.growth_share * 16 * GiB / r.life_steps / KiB:>11.1f} KiB {f'{r.reported}/{r.seeds}':>9} "
            f"{'-' if median is None else f'{median:,.0f}':>13} {'-' if share is None else f'{share:.0%}':>8} "
            f"{spread:>15} {r.early:>6}")
    c = result.control
    lines.append(f"no leak (same seeds): {c.early}/{c.seeds} reported (false reports)")
    lines.append("growth = the floor's rise from onset to the end of the run, as a share of the limit; "
                 "delay = steps from onset to the first leak report; early = reports before onset")
    if c.others:
        lines += ["", *format_comparison(result)]
    return "\n".join(lines)


def format_comparison(result: Sensitivity) -> list[str]:
    """Median delay per leak size (reported n/N): ours, the oracle's, each baseline's, and ours / the oracle's."""
    n = result.seeds
    names = [name for name, _ in result.control.others]

    def cell(reports: Reports) -> str:
        median = reports.median_delay
        return f"{'-' if median is None else f'{median:,.0f}'} ({reports.reported}/{n})"

    header = (f"{'growth':>7} {'hbm-watchdog':>16} " + " ".join(f"{name:>18}" for name in names)
              + "".join(f" {'ours/' + name:>24}" for name in ORACLES))
    lines = [f"Median steps from onset to the first report (reported/{n}); the oracles' thresholds are set on "
             f"{CALIBRATION_DRAWS} leak-free draws (and, for the cache-aware one, {CALIBRATION_DRAWS} with a cache)",
             header]
    for r in result.rows:
        ours = Reports(r.delays, r.early)
        ratios = [_ratio(ours.median_delay, r.of(name).median_delay) for name in ORACLES]
        lines.append(f"{_pct(r.growth_share):>7} {cell(ours):>16} "
                     + " ".join(f"{cell(r.of(name)):>18}" for name in names)
                     + "".join(f" {'-' if ratio is None else f'{ratio:.2f}x':>24}" for ratio in ratios))
    for label, control in (("without a leak", result.control),
                           (f"with a cache of {_pct(CACHE_SHARE)} filling from the onset and stopping", result.cache)):
        if control is not None:
            lines.append(f"false reports on the same jobs {label}: "
                         + ", ".join([f"hbm-watchdog {control.early}/{n}"]
                                     + [f"{name} {r.early}/{n}" for name, r in control.others]))
    return lines


def render_png(result: Sensitivity, path: str | Path) -> Path:
    """Steps to the first leak report against leak rate: median with min-max bars, n/N reported per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    life = result.steps - result.onset_step
    n = result.seeds
    fig, ax = plt.subplots(figsize=(9, 5), dpi=100)
    ax.axhline(life, color="0.35", linestyle="--", linewidth=1.2)
    ax.text(0.99, life, "end of run ", transform=ax.get_yaxis_transform(), va="bottom", ha="right",
            color="0.3", fontsize=9)

    seen = [r for r in result.rows if r.delays]
    missed = [r for r in result.rows if not r.delays]
    if seen:
        x = np.array([r.growth_share * 100 for r in seen])
        med = np.array([r.median_delay for r in seen])
        lo = med - np.array([min(r.delays) for r in seen])
        hi = np.array([max(r.delays) for r in seen]) - med
        full = np.array([r.reported == n for r in seen])
        ax.errorbar(x, med, yerr=[lo, hi], fmt="none", ecolor="tab:blue", elinewidth=1.4, capsize=4, alpha=0.8)
        ax.plot(x, med, color="tab:blue", linewidth=1, alpha=0.5)
        ax.scatter(x[full], med[full], s=55, color="tab:blue", zorder=3,
                   label=f"median (bars: min-max), all {n} seeds reported")
        ax.scatter(x[~full], med[~full], s=55, facecolor="white", edgecolor="tab:blue", linewidth=1.6, zorder=3,
                   label="median of the seeds reported (some never were)")
        for r, xi, top in zip(seen, x, med + hi):
            ax.annotate(f"{r.reported}/{n}", (xi, top), textcoords="offset points", xytext=(0, 6), ha="center",
                        fontsize=9, color="tab:blue" if r.reported == n else "tab:red")
    caches = result.cache
    for name, style, told in (("oracle", "--", "told the onset"),
                              ("cache_aware_oracle", ":", "also told the caches' shape")):
        points = [(r.growth_share * 100, r.of(name)) for r in result.rows
                  if name in dict(r.others) and r.of(name).delays]
        if points:
            also = "" if caches is None else f" (reports {caches.of(name).early}/{n} filling caches)"
            ax.plot([x for x, _ in points], [o.median_delay for _, o in points], color="0.45", linestyle=style,
                    marker="s" if name == "oracle" else "D", markersize=5, linewidth=1.2, zorder=2,
                    label=f"{name.replace('_', '-')}, median: {told}{also}")
    if missed:
        xm = [r.growth_share * 100 for r in missed]
        ax.scatter(xm, [life] * len(missed), marker="x", s=60, color="tab:red", zorder=3,
                   label="never reported in the run")
        for xi in xm:
            ax.annotate(f"0/{n}", (xi, life), textcoords="offset points", xytext=(0, -16), ha="center",
                        fontsize=9, color="tab:red")

    ax.set_xscale("log")
    ticks = [r.growth_share * 100 for r in result.rows]
    ax.set_xticks(ticks, [f"{t:g}%" for t in ticks])
    ax.minorticks_off()
    ax.set_xlim(ticks[0] / 1.35, ticks[-1] * 1.35)
    threshold = DetectorConfig().min_leak_share
    if ticks[0] / 1.35 < threshold * 100 < ticks[-1]:  # the report's floor, where the grid shows it
        ax.axvline(threshold * 100, color="tab:orange", linestyle=":", linewidth=1.2)
        ax.text(threshold * 100, 0.02, f" reported only once the floor\n has risen {_pct(threshold)} of the limit",
                transform=ax.get_xaxis_transform(), color="tab:orange", fontsize=8, va="bottom")
    ax.set_ylim(0, life * 1.12)
    ax.set_xlabel("leak size: floor growth from onset to the end of the run (% of the memory limit)")
    ax.set_ylabel("steps from leak onset to the first leak report")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    per_kstep = 1000 / life
    top = ax.secondary_xaxis("top", functions=(lambda v: v * per_kstep, lambda v: v / per_kstep))
    top.set_xticks([t * per_kstep for t in ticks], [f"{t * per_kstep:.2g}%" for t in ticks])
    top.minorticks_off()
    top.set_xlabel("leak rate: % of the limit per 1,000 steps", fontsize=9)
    right = ax.secondary_yaxis("right", functions=(lambda v: v / life * 100, lambda v: v * life / 100))
    right.set_ylabel("% of the leak's life", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    c = result.control
    ax.set_title(f"Leak rate vs steps to detection: {result.steps:,}-step jobs, {result.noise} noise, {n} seeds per "
                 f"size\nonset at step {result.onset_step:,}, no OOM in the run; "
                 f"same jobs without a leak: {c.early}/{c.seeds} reported", fontsize=10)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, out)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------------- command line

def _progress(total: int):
    """(tick, close): `bench`'s bar on a terminal when tqdm is installed, else a counter line every ~10%."""
    from watchdog.bench.cli import _progress_bar

    bar = _progress_bar(total, "replays")
    if bar is not None:
        return (lambda: bar.update()), bar.close
    done = 0
    every = max(1, total // 10)

    def tick() -> None:
        nonlocal done
        done += 1
        if done % every == 0 or done == total:
            print(f"sensitivity: {done}/{total} replays", file=sys.stderr, flush=True)

    return tick, (lambda: None)


def parser() -> argparse.ArgumentParser:
    made = OneLineParser(prog="python -m watchdog.bench.sensitivity", description=__doc__.splitlines()[0])
    made.add_argument("--out", metavar="PNG", type=option(file_to_write), default=None,
                      help=f"write the picture here (e.g. {DEFAULT_OUT.relative_to(DEFAULT_OUT.parents[2])})")
    made.add_argument("--seeds", metavar="N", type=option(parse_positive), default=DEFAULT_SEEDS,
                      help=f"jobs per leak size (default {DEFAULT_SEEDS})")
    made.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return made


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    tick, close = _progress((len(SIZES) + 2) * args.seeds)
    try:
        result = measure(SIZES, args.seeds, progress=tick)
    finally:
        close()
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(format_table(result))
        print(f"{(len(SIZES) + 2) * args.seeds} replays in {result.seconds:.1f} s")
    if args.out is not None:
        path = render_png(result, Path(args.out))
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
