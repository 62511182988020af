"""Lint of the Grafana dashboard: it is generated, self-consistent, and only uses real metrics."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_exporter import leaking_telemetry, names, scrape, served  # noqa: F401 - `served` is a fixture

GRAFANA = Path(__file__).resolve().parents[1] / "deploy" / "grafana"
sys.path.insert(0, str(GRAFANA))

import dashboard_queries  # noqa: E402

DASHBOARD = dashboard_queries.load()
PANELS = [p for p in dashboard_queries.all_panels(DASHBOARD) if p.get("type") != "row"]
VARIABLES = {v["name"]: v for v in DASHBOARD["templating"]["list"]}


@pytest.mark.slow
def test_committed_json_is_what_the_builder_writes():
    out = subprocess.run([sys.executable, str(GRAFANA / "build_dashboard.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_uids_ids_and_titles_are_unique():
    assert DASHBOARD["uid"] == "hbm-watchdog"
    dashboards = [dashboard_queries.load(p) for p in (GRAFANA / "dashboards").glob("*.json")]
    assert len({d["uid"] for d in dashboards}) == len(dashboards)
    assert len({p["id"] for p in PANELS}) == len(PANELS)
    assert len({p["title"] for p in PANELS}) == len(PANELS)


def test_datasource_is_a_variable_not_an_import_input():
    text = dashboard_queries.DASHBOARD_FILE.read_text()
    assert "${DS_" not in text and "__inputs" not in DASHBOARD
    assert VARIABLES["datasource"]["type"] == "datasource" and VARIABLES["datasource"]["query"] == "prometheus"
    for panel in PANELS:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]


def test_filter_variables_exist_and_every_query_uses_them():
    for name in ("job", "pod", "rank", "device"):
        assert VARIABLES[name]["type"] == "query" and VARIABLES[name]["includeAll"], name
    for query in dashboard_queries.queries(DASHBOARD):
        for metric in dashboard_queries.metric_names(query.expr):
            # every selector of every metric is filtered by all four variables
            assert query.expr.count(metric + "{") == query.expr.count(metric), (query.panel, metric)
        assert {"job", "pod", "rank", "device"} <= dashboard_queries.variables_used(query.expr), query.panel


def test_every_panel_has_a_unit_and_thresholds_and_every_target_a_ref_id():
    for panel in PANELS:
        defaults = panel["fieldConfig"]["defaults"]
        assert defaults.get("unit"), f"{panel['title']}: no unit"
        steps = defaults["thresholds"]["steps"]
        assert steps and steps[0]["value"] is None, f"{panel['title']}: thresholds need a base step"
        assert all(a["value"] < b["value"] for a, b in zip(steps[1:], steps[2:])), panel["title"]
        ref_ids = [t.get("refId") for t in panel["targets"]]
        assert panel["targets"] and all(ref_ids) and len(set(ref_ids)) == len(ref_ids), panel["title"]
        for override in panel["fieldConfig"]["overrides"]:  # overrides point at targets that exist
            if override["matcher"]["id"] == "byFrameRefID":
                assert override["matcher"]["options"] in ref_ids, panel["title"]


def test_every_variable_used_is_defined():
    texts = [q.expr for q in dashboard_queries.queries(DASHBOARD)]
    texts += [q.legend for q in dashboard_queries.queries(DASHBOARD)]
    texts += [p.get("title", "") + p.get("description", "") for p in PANELS]
    texts += [v.get("definition", "") for v in VARIABLES.values()]
    used = set().union(*(dashboard_queries.variables_used(t) for t in texts))
    undefined = used - set(VARIABLES) - dashboard_queries.BUILTIN_VARIABLES
    assert not undefined
    assert set(dashboard_queries.LOCAL_VALUES) >= used - {"__all"}  # the e2e test can fill every one


def test_every_metric_in_the_dashboard_exists_in_the_exporters_real_output(served):  # noqa: F811
    exported = names(scrape(served(leaking_telemetry())))
    used = set().union(*(dashboard_queries.metric_names(q.expr) for q in dashboard_queries.queries(DASHBOARD)))
    used |= set().union(*(dashboard_queries.metric_names(v.get("definition", "")) for v in VARIABLES.values()))
    assert used and not used - exported, f"not exported: {sorted(used - exported)}"


def test_leak_detected_and_oom_projected_are_shown_apart():
    """A leak is a warning (orange) however far the OOM; an OOM projected near is the action path (red)."""
    by_title = {p["title"]: p for p in PANELS}
    for title, metric, colour in (("Leak detected", "hbmwatch_leak_detected", "orange"),
                                  ("OOM projected", "hbmwatch_oom_projected", "red")):
        (query,) = by_title[title]["targets"]
        assert dashboard_queries.metric_names(query["expr"]) == {metric}, title
        assert by_title[title]["fieldConfig"]["defaults"]["thresholds"]["steps"][-1] == {"color": colour, "value": 1}
    timeline = [dashboard_queries.metric_names(target["expr"])
                for target in by_title["Leak slope: floor growth per step"]["targets"]]
    assert {"hbmwatch_leak_detected"} in timeline and {"hbmwatch_oom_projected"} in timeline


def test_provisioning_points_grafana_at_the_dashboard_folder():
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "hbm-watchdog.yml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    sources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"]
