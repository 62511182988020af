"""Draws the dashboard's main panels with matplotlib from real Prometheus `query_range` data.

Why: a reader should see what the Grafana dashboard shows before installing Grafana. The
picture uses the dashboard's own queries (read from the committed JSON), evaluated by a real
Prometheus over a real run: by default it starts the demo stack itself (`hbm-watchdog train`
on PJRT CPU with an injected leak, scraped every second), or it reads an existing Prometheus:

    python deploy/grafana/snapshot.py                          # start the demo run + Prometheus
    python deploy/grafana/snapshot.py --prometheus http://localhost:9090 --minutes 360 --job my-job
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "prometheus")]

import dashboard_queries  # noqa: E402
import local_stack  # noqa: E402  (puts the repository on sys.path)

from watchdog.fileio import save_figure  # noqa: E402

OUTPUT = HERE.parent / "img" / "dashboard.png"
MAIN_PANELS = (
    "Device memory: used, floor, limit and projected peak",
    "Leak slope: floor growth per step",
    "Time to OOM",
    "Watchdog actions",
)
DEMO_HORIZON_SECONDS = "10"  # the demo compresses hours into a minute; so does its projection
UNIT_LABEL = {"bytes": "bytes", "s": "seconds", "none": ""}
BAR_SECONDS = 5  # bar panels: one bar per this many seconds, counting increases over the same window
LINE_STYLES = ["-", "--", "-", "--", ":"]
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", help="an existing Prometheus URL (default: start the demo stack)")
    parser.add_argument("--job", default=local_stack.JOB)
    parser.add_argument("--minutes", type=float, default=5.0, help="window to draw from an existing Prometheus")
    parser.add_argument("--steps", type=int, default=2400, help="length of the demo run")
    parser.add_argument("-o", "--output", type=Path, default=OUTPUT)
    return parser.parse_args(argv)


def series(prometheus: local_stack.Prometheus, query: dashboard_queries.Query, values: dict[str, str],
           start: float, end: float, step: float) -> list[tuple[str, list[float], list[float]]]:
    expr = dashboard_queries.substitute(query.expr, values)
    legend = dashboard_queries.substitute(query.legend, values)
    found = []
    for result in prometheus.query_range(expr, start, end, step):
        labels = result["metric"]
        name = LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), legend)
        xs = [float(t) - start for t, _ in result["values"]]
        ys = [float(v) for _, v in result["values"]]
        found.append((name, xs, [y if math.isfinite(y) else math.nan for y in ys]))
    return found


def draw(prometheus: local_stack.Prometheus, values: dict[str, str], start: float, end: float,
         output: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    dashboard = dashboard_queries.load()
    panels = {p["title"]: p for p in dashboard_queries.all_panels(dashboard)}
    by_panel: dict[str, list[dashboard_queries.Query]] = {}
    for query in dashboard_queries.queries(dashboard):
        by_panel.setdefault(query.panel, []).append(query)
    step = max(1.0, (end - start) / 600)
    bar_step = max(float(BAR_SECONDS), step)
    firing = _alert_spans(prometheus, "HbmLeakDetected", start, end, step)

    fig, axes = plt.subplots(2, 2, figsize=(14, 8.5), constrained_layout=True)
    fig.suptitle(f"{dashboard['title']}\n{subtitle}", fontsize=12)
    for ax, title in zip(axes.flat, MAIN_PANELS):
        panel = panels[title]
        defaults = panel["fieldConfig"]["defaults"]
        bars = defaults["custom"]["drawStyle"] == "bars"
        panel_values = dict(values, __rate_interval=f"{bar_step:.0f}s") if bars else values
        drawn = [(query, _override(panel, query.ref_id), found)
                 for query in by_panel[title]
                 for found in series(prometheus, query, panel_values, start, end, bar_step if bars else step)]
        left = [ys for _, o, (_, _, ys) in drawn if o.get("custom.axisPlacement") != "right"]
        scale, unit_label = _scale(defaults["unit"], left)
        right = ax.twinx() if any(o.get("custom.axisPlacement") == "right" for _, o, _ in drawn) else None
        bottom: dict[float, float] = {}
        for i, (query, override, (name, xs, ys)) in enumerate(drawn):
            color = (override.get("color") or {}).get("fixedColor")
            if override.get("custom.axisPlacement") == "right":
                right.bar(xs, ys, width=step, alpha=0.3, label=name, color=color or "tab:blue")  # type: ignore[union-attr]
            elif bars:
                base = [bottom.get(x, 0.0) for x in xs]
                heights = [0.0 if math.isnan(y) else y / scale for y in ys]
                ax.bar(xs, heights, bottom=base, width=-bar_step * 0.9, align="edge", label=name, color=color)  # window ends at x
                bottom.update({x: b + h for x, b, h in zip(xs, base, heights)})
            else:
                ax.plot(xs, [y / scale for y in ys], LINE_STYLES[i % len(LINE_STYLES)], lw=1.6, label=name,
                        color=color)
        for x0, x1 in firing:
            ax.axvspan(x0, x1, color="red", alpha=0.08, lw=0)
        _threshold_lines(ax, defaults, scale)
        ax.set_title(title, fontsize=11)
        ax.set_xlim(0, end - start)
        ax.set_xlabel("seconds since start")
        ax.set_ylabel(unit_label + (" per step" if "per step" in title else "") + (" per window" if bars else ""))
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if right is not None:
            h2, l2 = right.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
            right.set_ylim(0, 1.6)
            right.set_yticks([0, 1])
            right.set_ylabel("alarm")
        if firing:
            handles.append(Patch(color="red", alpha=0.15))
            labels.append("HbmLeakDetected alert firing")
        ax.legend(handles, labels, fontsize=8, loc="upper left", framealpha=0.9)
    output.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, output, dpi=110)
    print(f"wrote {output}")


def _scale(unit: str, values: list[list[float]]) -> tuple[float, str]:
    """A divisor and axis label that keep tick labels short (bytes shown in KiB, MiB or GiB)."""
    if unit != "bytes":
        return 1.0, UNIT_LABEL.get(unit, unit)
    largest = max((abs(v) for ys in values for v in ys if not math.isnan(v)), default=0.0)
    for power, name in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if largest >= 2 ** (10 * power):
            return float(2 ** (10 * power)), name
    return 1.0, "bytes"


def _override(panel: dict, ref_id: str) -> dict:
    for override in panel["fieldConfig"].get("overrides", []):
        if override["matcher"].get("options") == ref_id:
            return {p["id"]: p["value"] for p in override["properties"]}
    return {}


def _threshold_lines(ax, defaults: dict, scale: float) -> None:
    """Draw the panel's thresholds that fall inside the data's range (as Grafana's lines would)."""
    if defaults["custom"]["thresholdsStyle"]["mode"] == "off":
        return
    low, high = ax.get_ylim()
    for threshold in defaults["thresholds"]["steps"][1:]:
        value = threshold["value"] / scale
        if low <= value <= high:
            ax.axhline(value, color=threshold["color"], lw=1, ls="--", alpha=0.8)


def _alert_spans(prometheus, alertname: str, start: float, end: float, step: float) -> list[tuple[float, float]]:
    spans = []
    for result in prometheus.query_range(f'ALERTS{{alertname="{alertname}", alertstate="firing"}}', start, end, step):
        times = [float(t) - start for t, _ in result["values"]]
        span_start = previous = times[0]
        for t in times[1:]:
            if t - previous > 1.5 * step:
                spans.append((span_start, previous))
                span_start = t
            previous = t
        spans.append((span_start, previous))
    return spans


def demo(args: argparse.Namespace) -> None:
    """Start the demo run and a Prometheus, let the run finish, draw it."""
    with tempfile.TemporaryDirectory(prefix="hbm-snapshot-") as workdir:
        run = prometheus = None
        try:
            run = local_stack.WatchedRun(local_stack.leaking_trainer_command(args.steps),
                                         env=local_stack.DEMO_ENV).start()
            prometheus = local_stack.Prometheus(Path(workdir), [run.target]).start()
            start = time.time()
            run.process.wait(timeout=args.steps * 0.5 + 60)  # type: ignore[union-attr]
            end = time.time()
            time.sleep(2)  # the last rule evaluation
            values = dict(dashboard_queries.LOCAL_VALUES, horizon=DEMO_HORIZON_SECONDS)
            draw(prometheus, values, start, end, args.output,
                 f"hbm-watchdog train on torch_xla (PJRT CPU), --inject-leak {local_stack.DEMO_LEAK}, "
                 f"--memory-limit {local_stack.DEMO_MEMORY_LIMIT}; Prometheus scrapes every 1 s; "
                 f"projection horizon {DEMO_HORIZON_SECONDS} s")
        finally:
            for process in (run, prometheus):
                if process is not None:
                    process.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prometheus is None:
        demo(args)
        return 0
    prometheus = local_stack.Prometheus.existing(args.prometheus)
    end = time.time()
    values = dict(dashboard_queries.LOCAL_VALUES, job=args.job)
    draw(prometheus, values, end - args.minutes * 60, end, args.output, f"job {args.job} at {args.prometheus}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
