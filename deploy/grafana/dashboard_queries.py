"""The dashboard's PromQL, read back out of the committed JSON, with Grafana's variables filled in.

Why: the end-to-end test, the lint test and the dashboard picture must all look at exactly the
queries a Grafana user gets, so they read them from the JSON file instead of repeating them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

DASHBOARD_FILE = Path(__file__).resolve().parent / "dashboards" / "hbm-watchdog.json"

# Grafana's own variables, always defined.
BUILTIN_VARIABLES = {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__all"}
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
METRIC = re.compile(r"\b(hbmwatch_[a-z0-9_]+)\b")

# Metrics only a GPU gives (the cuda source's allocator figures): a run on a CPU has none of them.
GPU_ONLY_PREFIX = "hbmwatch_allocator_"

# What the variables resolve to against a local Prometheus (one job, no pod label).
LOCAL_VALUES = {"job": "hbm-watchdog", "pod": ".*", "rank": ".*", "device": ".*", "horizon": "900",
                "__rate_interval": "30s", "datasource": "prometheus"}


@dataclass(frozen=True)
class Query:
    panel: str
    ref_id: str
    expr: str
    legend: str


def load(path: Path = DASHBOARD_FILE) -> dict:
    return json.loads(path.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    """Panels, with those nested in collapsed rows flattened in."""
    found = []
    for panel in dashboard.get("panels", []):
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def queries(dashboard: dict) -> list[Query]:
    return [Query(panel.get("title", ""), target.get("refId", ""), target.get("expr", ""),
                  target.get("legendFormat", ""))
            for panel in all_panels(dashboard) if panel.get("type") != "row"
            for target in panel.get("targets", [])]


def variables_used(text: str) -> set[str]:
    return {braced or bare for braced, bare in VARIABLE.findall(text)}


def substitute(text: str, values: dict[str, str]) -> str:
    """Fill `$name` and `${name}` in; an unknown variable is an error, not silently left in."""
    def fill(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no value for dashboard variable ${name}")
        return values[name]

    return VARIABLE.sub(fill, text)


def needs_a_gpu(expr: str) -> bool:
    """Whether every metric of a query is one only a GPU gives."""
    names = metric_names(expr)
    return bool(names) and all(name.startswith(GPU_ONLY_PREFIX) for name in names)


def metric_names(expr: str) -> set[str]:
    return set(METRIC.findall(expr))
