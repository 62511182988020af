"""Writes deploy/grafana/dashboards/hbm-watchdog.json, the Grafana dashboard for hbm-watchdog.

Why generated: two dozen panels share one label selector, one datasource reference and one
shape of thresholds; written out by hand they drift apart. The JSON is committed (Grafana
provisioning reads files) and tests/test_dashboard.py fails when it is out of date:

    python deploy/grafana/build_dashboard.py           # rewrite the JSON
    python deploy/grafana/build_dashboard.py --check   # exit 1 if the committed JSON differs

The datasource is a dashboard variable, not a `${DS_...}` import input: file provisioning has no
import step to fill such inputs in.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's own watchdog package
from watchdog.fileio import write_atomically  # noqa: E402 - every file is written whole, through one helper

OUTPUT = Path(__file__).resolve().parent / "dashboards" / "hbm-watchdog.json"
UID = "hbm-watchdog"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job", pod=~"$pod", rank=~"$rank", device=~"$device"'
WINDOW = "$__rate_interval"

GREEN, ORANGE, RED, BLUE = "green", "orange", "red", "blue"


def steps(*pairs: tuple[str, float | None]) -> dict:
    """Absolute thresholds: the first colour is the base (from -inf)."""
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in pairs]}


def target(ref: str, expr: str, legend: str) -> dict:
    return {"refId": ref, "datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "range": True}


def targets(*pairs: tuple[str, str]) -> list[dict]:
    return [target(chr(ord("A") + i), expr, legend) for i, (expr, legend) in enumerate(pairs)]


def timeseries(title: str, description: str, unit: str, thresholds: dict, exprs: list[dict], *,
               threshold_lines: bool = False, overrides: list | None = None, draw: str = "line",
               decimals: int | None = None) -> dict:
    custom = {"drawStyle": draw, "lineWidth": 2, "fillOpacity": 10 if draw == "line" else 80,
              "showPoints": "never", "spanNulls": True,
              "stacking": {"mode": "normal" if draw == "bars" else "none", "group": "A"},
              "thresholdsStyle": {"mode": "line+area" if threshold_lines else "off"}}
    defaults: dict = {"unit": unit, "thresholds": thresholds, "custom": custom, "color": {"mode": "palette-classic"}}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {"type": "timeseries", "title": title, "description": description, "datasource": DATASOURCE,
            "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "none"}},
            "targets": exprs}


def stat(title: str, description: str, unit: str, thresholds: dict, exprs: list[dict], *,
         mappings: list | None = None, text_mode: str = "value") -> dict:
    return {"type": "stat", "title": title, "description": description, "datasource": DATASOURCE,
            "fieldConfig": {"defaults": {"unit": unit, "thresholds": thresholds, "mappings": mappings or [],
                                         "color": {"mode": "thresholds"}}, "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "background", "graphMode": "none", "textMode": text_mode,
                        "justifyMode": "center", "orientation": "auto"},
            "targets": exprs}


def series_override(name: str, **props: object) -> dict:
    return {"matcher": {"id": "byFrameRefID", "options": name},
            "properties": [{"id": key, "value": value} for key, value in props.items()]}


def panels() -> list[dict]:
    stats = [
        # Two signals, never one panel: a leak is a warning however far the OOM, while an OOM
        # projected near is what the watchdog acts on.
        stat("Leak detected", "1 while the memory floor rises steadily on any selected rank, however far the "
             "OOM: a warning, the watchdog takes no action on it.", "none",
             steps((GREEN, None), (ORANGE, 1)), targets((f"max(hbmwatch_leak_detected{{{SEL}}})", "leak")),
             mappings=[{"type": "value", "options": {"0": {"text": "no leak"}, "1": {"text": "LEAK"}}}]),
        stat("OOM projected", "1 while the peak is projected to reach the limit soon enough on any selected rank "
             "that the watchdog acts: checkpoint, then reinit or restart.", "none",
             steps((GREEN, None), (RED, 1)), targets((f"max(hbmwatch_oom_projected{{{SEL}}})", "OOM projected")),
             mappings=[{"type": "value", "options": {"0": {"text": "no OOM"}, "1": {"text": "ACTING"}}}]),
        stat("OOM in", "Shortest projected time before the peak reaches the limit (+Inf: none in sight).",
             "s", steps((RED, None), (ORANGE, 900), (GREEN, 3600)),
             targets((f"min(hbmwatch_projected_oom_seconds{{{SEL}}})", "time to OOM"))),
        stat("Steps left", "Fewest projected training steps before the peak reaches the limit.", "none",
             steps((RED, None), (ORANGE, 200), (GREEN, 1000)),
             targets((f"min(hbmwatch_projected_oom_steps{{{SEL}}})", "steps to OOM"))),
        stat("Memory in use", "Highest share of the memory limit in use on any selected rank.",
             "percentunit", steps((GREEN, None), (ORANGE, 0.8), (RED, 0.95)),
             targets((f"max(hbmwatch_memory_used_bytes{{{SEL}}} / hbmwatch_memory_limit_bytes{{{SEL}}})", "used"))),
        stat("Restarts", "Checkpoint-restarts this job has had (carried across processes).", "none",
             steps((GREEN, None), (ORANGE, 1), (RED, 2)),
             targets((f"max(hbmwatch_restarts_total{{{SEL}}})", "restarts"))),
        stat("Memory source", "Where the watchdog reads memory (xla, tpu, cuda, rss, replay) and its version.",
             "none", steps((BLUE, None)),
             targets((f"count by (source, version) (hbmwatch_build_info{{{SEL}}})", "{{source}} v{{version}}")),
             text_mode="name"),
    ]
    x = 0
    for panel, width in zip(stats, (3, 3, 4, 4, 4, 3, 3), strict=True):  # seven across Grafana's 24 columns
        panel["gridPos"] = {"x": x, "y": 0, "w": width, "h": 4}
        x += width

    projected_peak = (f"hbmwatch_memory_floor_bytes{{{SEL}}} + hbmwatch_memory_excursion_bytes{{{SEL}}}"
                      f" + clamp_min(hbmwatch_leak_slope_bytes_per_second{{{SEL}}}, 0) * $horizon")
    layout = [
        (timeseries(
            "Device memory: used, floor, limit and projected peak",
            "Used: newest sample. Floor: the detector's fitted resident floor. Projected peak: floor plus "
            "the transient excursion, carried $horizon seconds ahead at the fitted slope (OOM happens at the peak).",
            "bytes", steps((GREEN, None)),
            targets((f"hbmwatch_memory_used_bytes{{{SEL}}}", "used r{{rank}} {{device}}"),
                    (f"hbmwatch_memory_peak_bytes{{{SEL}}}", "high-water r{{rank}}"),
                    (f"hbmwatch_memory_floor_bytes{{{SEL}}}", "floor r{{rank}}"),
                    (f"hbmwatch_memory_limit_bytes{{{SEL}}}", "limit r{{rank}}"),
                    (projected_peak, "projected peak in ${horizon}s r{{rank}}")),
            overrides=[series_override("A", **{"color": {"mode": "fixed", "fixedColor": BLUE}}),
                       series_override("B", **{"color": {"mode": "fixed", "fixedColor": "purple"},
                                               "custom.fillOpacity": 0}),
                       series_override("C", **{"color": {"mode": "fixed", "fixedColor": GREEN}}),
                       series_override("D", **{"color": {"mode": "fixed", "fixedColor": RED},
                                               "custom.lineStyle": {"fill": "dash", "dash": [10, 10]},
                                               "custom.fillOpacity": 0}),
                       series_override("E", **{"color": {"mode": "fixed", "fixedColor": ORANGE},
                                               "custom.lineStyle": {"fill": "dot", "dash": [2, 6]},
                                               "custom.fillOpacity": 0})]),
         {"x": 0, "y": 4, "w": 16, "h": 10}),
        (timeseries(
            "Memory used of limit", "Share of the limit in use now, and the projected peak's share.",
            "percentunit", steps((GREEN, None), (ORANGE, 0.8), (RED, 0.95)),
            targets((f"hbmwatch_memory_used_bytes{{{SEL}}} / hbmwatch_memory_limit_bytes{{{SEL}}}", "used r{{rank}}"),
                    (f"(hbmwatch_memory_floor_bytes{{{SEL}}} + hbmwatch_memory_excursion_bytes{{{SEL}}})"
                     f" / hbmwatch_memory_limit_bytes{{{SEL}}}", "peak estimate r{{rank}}")),
            threshold_lines=True),
         {"x": 16, "y": 4, "w": 8, "h": 10}),
        (timeseries(
            "Leak slope: floor growth per step",
            "Robust (Theil-Sen) slope of the memory floor with its 95% interval; actions use the high edge. "
            "Bars: leak detected (a warning, no action) and OOM projected (the watchdog acts).",
            "bytes", steps((GREEN, None), (RED, 1)),
            targets((f"hbmwatch_leak_slope_bytes_per_step{{{SEL}}}", "slope r{{rank}}"),
                    (f"hbmwatch_leak_slope_low_bytes_per_step{{{SEL}}}", "low r{{rank}}"),
                    (f"hbmwatch_leak_slope_high_bytes_per_step{{{SEL}}}", "high r{{rank}}"),
                    (f"hbmwatch_leak_detected{{{SEL}}}", "leak detected r{{rank}}"),
                    (f"hbmwatch_oom_projected{{{SEL}}}", "OOM projected r{{rank}}")),
            overrides=[series_override(ref, **{"unit": "none", "custom.axisPlacement": "right",
                                               "custom.drawStyle": "bars", "custom.fillOpacity": 30,
                                               "max": 1, "min": 0, "color": {"mode": "fixed", "fixedColor": colour}})
                       for ref, colour in (("D", ORANGE), ("E", RED))]),
         {"x": 0, "y": 14, "w": 8, "h": 9}),
        (timeseries(
            "Time to OOM", "Projected seconds until the peak reaches the limit; the alert lines are 15 min and 1 h.",
            "s", steps((RED, None), (ORANGE, 900), (GREEN, 3600)),
            targets((f"hbmwatch_projected_oom_seconds{{{SEL}}}", "time to OOM r{{rank}}")),
            threshold_lines=True),
         {"x": 8, "y": 14, "w": 8, "h": 9}),
        (timeseries(
            "Steps to OOM", "Projected training steps left: central slope, and the pessimistic edge actions use.",
            "none", steps((RED, None), (ORANGE, 200), (GREEN, 1000)),
            targets((f"hbmwatch_projected_oom_steps{{{SEL}}}", "steps r{{rank}}"),
                    (f"hbmwatch_projected_oom_steps_pessimistic{{{SEL}}}", "pessimistic r{{rank}}")),
            threshold_lines=True, decimals=0),
         {"x": 16, "y": 14, "w": 8, "h": 9}),
        (timeseries(
            "Watchdog actions", "Actions the policy asked for: warn, checkpoint-and-reinit, checkpoint-and-restart.",
            "none", steps((GREEN, None), (RED, 1)),
            targets((f"sum by (action) (increase(hbmwatch_actions_total{{{SEL}}}[{WINDOW}]))", "{{action}}")),
            draw="bars", decimals=0),
         {"x": 0, "y": 23, "w": 8, "h": 8}),
        (timeseries(
            "Checkpoint duration", "Time to write a checkpoint: 95th percentile and mean over the window.",
            "s", steps((GREEN, None), (ORANGE, 30), (RED, 120)),
            targets((f"histogram_quantile(0.95, sum by (le, job, rank) "
                     f"(rate(hbmwatch_checkpoint_seconds_bucket{{{SEL}}}[{WINDOW}])))", "p95 r{{rank}}"),
                    (f"sum by (job, rank) (rate(hbmwatch_checkpoint_seconds_sum{{{SEL}}}[{WINDOW}]))"
                     f" / sum by (job, rank) (rate(hbmwatch_checkpoint_seconds_count{{{SEL}}}[{WINDOW}]))", "mean r{{rank}}"))),
         {"x": 8, "y": 23, "w": 8, "h": 8}),
        (timeseries(
            "Restarts and checkpoints", "Restarts carried across processes, and checkpoints written in the window.",
            "none", steps((GREEN, None), (ORANGE, 1), (RED, 2)),
            targets((f"max by (job) (hbmwatch_restarts_total{{{SEL}}})", "restarts"),
                    (f"sum by (job) (increase(hbmwatch_checkpoint_seconds_count{{{SEL}}}[{WINDOW}]))", "checkpoints")),
            decimals=0),
         {"x": 16, "y": 23, "w": 8, "h": 8}),
        (timeseries(
            "XLA compilations and steady-state recompilation",
            "Graphs compiled per window; after warm-up this should stay at zero. Recompiling: the watchdog's "
            "`recompilation` finding (the HbmSteadyStateRecompilation alert), whose log event names the cause "
            "and the Python line.",
            "none", steps((GREEN, None), (ORANGE, 1)),
            targets((f"increase(hbmwatch_xla_compilations_total{{{SEL}}}[{WINDOW}])", "compilations r{{rank}}"),
                    (f"hbmwatch_recompilation_detected{{{SEL}}}", "recompiling r{{rank}}")),
            overrides=[series_override("B", **{"custom.axisPlacement": "right", "custom.drawStyle": "line",
                                               "custom.stacking": {"mode": "none", "group": "B"},
                                               "custom.fillOpacity": 30, "max": 1, "min": 0,
                                               "color": {"mode": "fixed", "fixedColor": RED}})],
            draw="bars", threshold_lines=True),
         {"x": 0, "y": 31, "w": 8, "h": 8}),
        (timeseries(
            "Training progress", "Steps per second, and seconds since the step counter last moved (a stall).",
            "s", steps((GREEN, None), (ORANGE, 300), (RED, 600)),
            targets((f"hbmwatch_seconds_since_last_step{{{SEL}}}", "since last step r{{rank}}"),
                    (f"rate(hbmwatch_training_step{{{SEL}}}[{WINDOW}])", "steps/s r{{rank}}")),
            overrides=[series_override("B", **{"unit": "none", "custom.axisPlacement": "right"})],
            threshold_lines=True),
         {"x": 8, "y": 31, "w": 8, "h": 8}),
        (timeseries(
            "Watchdog sampling", "Memory samples per second, and failed reads (the watchdog is blind while they fail).",
            "none", steps((GREEN, None), (RED, 1)),
            targets((f"rate(hbmwatch_samples_total{{{SEL}}}[{WINDOW}])", "samples/s r{{rank}}"),
                    (f"increase(hbmwatch_sample_errors_total{{{SEL}}}[{WINDOW}])", "errors r{{rank}}"))),
         {"x": 16, "y": 31, "w": 8, "h": 8}),
        (timeseries(
            "Host memory (RAM)",
            "The host's RAM, whose exhaustion the kernel's OOM killer ends with SIGKILL: resident memory of the "
            "training process and its children, and the machine's available memory. The host's own series "
            "(used, floor, limit, projection) is device \"host\" in the panels above; on PJRT CPU the device's "
            "series is this same memory.",
            "bytes", steps((GREEN, None)),
            targets((f"hbmwatch_host_process_resident_bytes{{{SEL}}}", "resident r{{rank}}"),
                    (f"hbmwatch_host_available_bytes{{{SEL}}}", "available r{{rank}}")),
            overrides=[series_override("B", **{"color": {"mode": "fixed", "fixedColor": GREEN},
                                               "custom.fillOpacity": 0})]),
         {"x": 0, "y": 39, "w": 24, "h": 8}),
        (timeseries(
            "Goodput", "Share of the job's wall-clock time spent on training steps whose progress was kept, "
            "across its processes and reinits (kept in the job file; absent without one).",
            "percentunit", steps((RED, None), (ORANGE, 0.8), (GREEN, 0.9)),
            targets((f"max by (job) (hbmwatch_goodput_seconds_total{{{SEL}}})"
                     f" / max by (job) (hbmwatch_elapsed_seconds_total{{{SEL}}})", "goodput {{job}}")),
            threshold_lines=True),
         {"x": 0, "y": 47, "w": 8, "h": 8}),
        (timeseries(
            "Badput by cause", "The job's time not spent on kept progress: start-up and first compilation, "
            "recompilation, checkpoint save and restore, reinit, evaluation, steps redone after a restart, time "
            "between processes, and what no record explains.",
            "s", steps((GREEN, None)),
            targets((f"max by (cause) (hbmwatch_badput_seconds_total{{{SEL}}})", "{{cause}}")),
            draw="bars"),
         {"x": 8, "y": 47, "w": 16, "h": 8}),
        (timeseries(
            "GPU allocator: tensors, split remainders, reserved",
            "PyTorch's caching allocator on each cuda:N device (the cuda source; absent elsewhere). The series "
            "judged is tensors plus split remainders: free parts of blocks split for live tensors, usable only "
            "by requests that fit. Split remainders rising while tensors do not is fragmentation; reserved "
            "rising alone is cache, which the allocator hands back before it raises an OOM.",
            "bytes", steps((GREEN, None)),
            targets((f"hbmwatch_allocator_allocated_bytes{{{SEL}}}", "tensors r{{rank}} {{device}}"),
                    (f"hbmwatch_allocator_split_bytes{{{SEL}}}", "split remainders r{{rank}} {{device}}"),
                    (f"hbmwatch_allocator_reserved_bytes{{{SEL}}}", "reserved r{{rank}} {{device}}"),
                    (f"hbmwatch_memory_limit_bytes{{{SEL}}}", "limit r{{rank}} {{device}}")),
            overrides=[series_override("B", **{"color": {"mode": "fixed", "fixedColor": ORANGE}}),
                       series_override("C", **{"color": {"mode": "fixed", "fixedColor": "purple"},
                                               "custom.fillOpacity": 0}),
                       series_override("D", **{"color": {"mode": "fixed", "fixedColor": RED},
                                               "custom.lineStyle": {"fill": "dash", "dash": [10, 10]},
                                               "custom.fillOpacity": 0})]),
         {"x": 0, "y": 55, "w": 24, "h": 8}),
    ]
    result = stats + [dict(panel, gridPos=grid) for panel, grid in layout]
    for number, panel in enumerate(result, start=1):
        panel["id"] = number
    return result


def query_variable(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "definition": query, "query": {"query": query, "refId": f"{name}-values"},
            "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1}


def variables() -> list[dict]:
    return [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "refresh": 1, "regex": ""},
        query_variable("job", "Job", "label_values(hbmwatch_build_info, job)"),
        query_variable("pod", "Pod", 'label_values(hbmwatch_build_info{job=~"$job"}, pod)'),
        query_variable("rank", "Rank", 'label_values(hbmwatch_build_info{job=~"$job", pod=~"$pod"}, rank)'),
        query_variable("device", "Device",
                       'label_values(hbmwatch_build_info{job=~"$job", pod=~"$pod", rank=~"$rank"}, device)'),
        {"name": "horizon", "label": "Projection horizon (s)", "type": "custom",
         "query": "300,900,3600", "current": {"selected": True, "text": "900", "value": "900"},
         "options": [{"selected": value == "900", "text": value, "value": value} for value in ("300", "900", "3600")]},
    ]


def dashboard() -> dict:
    return {
        "uid": UID,
        "title": "hbm-watchdog: device and host memory, and leaks",
        "description": "Device memory, leak trend, projected OOM and the watchdog's actions (hbm-watchdog).",
        "tags": ["hbm-watchdog", "tpu", "xla", "memory"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": variables()},
        "annotations": {"list": []},
        "links": [],
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed JSON is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT} is out of date: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(OUTPUT, text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
