"""The alert rules: promtool checks them, promtool's unit tests exercise every alert."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

PROMETHEUS_DIR = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "rules.yml"
PROMTOOL = "/usr/bin/promtool"
REQUIRED_ALERTS = {"HbmLeakDetected", "HbmOomProjected", "HbmOomProjectedWithin1h", "HbmOomProjectedWithin15m",
                   "HbmRestartLoop", "HbmTrainingStalled", "HbmSteadyStateRecompilation", "HbmWatchdogExporterDown"}


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=60)


def alerts() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"] if "alert" in rule]


@pytest.mark.slow
def test_promtool_check_rules_passes():
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in out.stdout


@pytest.mark.slow
def test_promtool_unit_tests_pass():
    out = promtool("test", "rules", "rules_test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@pytest.mark.slow
def test_local_prometheus_config_is_valid_and_loads_the_rules():
    out = promtool("check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 rule files found" in out.stdout


def test_every_alert_is_actionable_and_unit_tested():
    rules = alerts()
    assert REQUIRED_ALERTS <= {rule["alert"] for rule in rules}
    tested = yaml.safe_load((PROMETHEUS_DIR / "rules_test.yml").read_text())
    fired_in_tests = {case["alertname"] for test in tested["tests"] for case in test.get("alert_rule_test", [])
                      if case.get("exp_alerts")}
    for rule in rules:
        name = rule["alert"]
        assert "for" in rule, f"{name}: no `for:` (a single bad scrape would page)"
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert {"summary", "description"} <= set(rule["annotations"]), name
        assert "$labels.job" in rule["annotations"]["summary"] or "$labels.instance" in rule["annotations"]["summary"], name
        assert name in fired_in_tests, f"{name} is never shown firing in rules_test.yml"


def test_oom_alerts_escalate_from_warning_to_critical():
    by_name = {rule["alert"]: rule for rule in alerts()}
    hour, quarter = by_name["HbmOomProjectedWithin1h"], by_name["HbmOomProjectedWithin15m"]
    assert "< 3600" in hour["expr"] and hour["labels"]["severity"] == "warning"
    assert "< 900" in quarter["expr"] and quarter["labels"]["severity"] == "critical"


def test_leak_warning_and_oom_action_are_separate_alerts():
    """leak_detected (steady floor growth, however far the OOM) only warns; oom_projected is the watchdog's
    action path. Each alert reads its own signal, so neither can stand in for the other."""
    by_name = {rule["alert"]: rule for rule in alerts()}
    leak, oom = by_name["HbmLeakDetected"], by_name["HbmOomProjected"]
    assert "hbmwatch_leak_detected == 1" in leak["expr"] and "oom_projected" not in leak["expr"]
    assert leak["labels"]["severity"] == "warning" and "no action" in leak["annotations"]["description"]
    assert "hbmwatch_oom_projected == 1" in oom["expr"] and "leak_detected" not in oom["expr"]
    assert oom["labels"]["severity"] == "critical"
    assert "projected_oom_seconds" in oom["annotations"]["description"]  # steps ($value) and seconds left
    others = [rule for name, rule in by_name.items() if name not in ("HbmLeakDetected", "HbmOomProjected")]
    assert not any("leak_detected" in rule["expr"] or "oom_projected" in rule["expr"] for rule in others)
