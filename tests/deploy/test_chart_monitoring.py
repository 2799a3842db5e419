"""Dashboards and alert rules shipped by the chart: every dashboards/*.json and rules/*.yaml file, gated as asked."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import yaml

from tests.deploy.conftest import Helm, by_kind, validate_all

DASHBOARD = {"title": "hetfed test dashboard", "uid": "hetfed-test", "schemaVersion": 39, "panels": []}
RULES = [
    {"name": "hetfed-test", "rules": [
        {"alert": "HetfedTestAlert", "expr": "increase(hetfed_rejected_messages_total[5m]) > 10", "for": "5m",
         "labels": {"severity": "warning"}, "annotations": {"summary": "rejections"}},
    ]},
]
MORE_RULES = [{"name": "hetfed-more", "rules": [{"record": "hetfed:rounds:rate5m", "expr": "rate(hetfed_current_round[5m])"}]}]


def with_fixtures(chart_copy: Callable[[], Path]) -> Path:
    """A chart copy with two dashboards and two rules files (instead of the shipped ones)."""
    chart = chart_copy()
    for pattern in ("dashboards/*.json", "rules/*.yaml"):
        for shipped in chart.glob(pattern):
            shipped.unlink()
    (chart / "dashboards").mkdir(exist_ok=True)
    (chart / "dashboards" / "bandwidth.json").write_text(json.dumps(DASHBOARD, indent=2))
    (chart / "dashboards" / "rounds.json").write_text(json.dumps({**DASHBOARD, "uid": "hetfed-rounds"}))
    (chart / "rules").mkdir(exist_ok=True)
    (chart / "rules" / "alerts.yaml").write_text(yaml.safe_dump(RULES))
    (chart / "rules" / "records.yaml").write_text(yaml.safe_dump(MORE_RULES))
    return chart


def test_dashboards_configmap_from_every_json_file(helm: Helm, chart_copy: Callable[[], Path]) -> None:
    """One ConfigMap labelled for the Grafana sidecar holds every dashboard file, unchanged."""
    chart = with_fixtures(chart_copy)
    objects = helm.objects(chart=chart, sets=("dashboards.annotations.grafana_folder=hetfed",))
    (cm,) = [c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"] == "fl-hetfed-dashboards"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "hetfed"}
    assert sorted(cm["data"]) == ["bandwidth.json", "rounds.json"]
    assert json.loads(cm["data"]["bandwidth.json"]) == DASHBOARD
    validate_all([cm])
    # The label key and value are configurable; disabled means no ConfigMap.
    custom = helm.objects(chart=chart, sets=("dashboards.label=dashboards", "dashboards.labelValue=hetfed"))
    (cm,) = [c for c in by_kind(custom, "ConfigMap") if c["metadata"]["name"] == "fl-hetfed-dashboards"]
    assert cm["metadata"]["labels"]["dashboards"] == "hetfed" and "grafana_dashboard" not in cm["metadata"]["labels"]
    off = helm.objects(chart=chart, sets=("dashboards.enabled=false",))
    assert "fl-hetfed-dashboards" not in {c["metadata"]["name"] for c in by_kind(off, "ConfigMap")}


def test_no_dashboards_no_configmap(helm: Helm, chart_copy: Callable[[], Path]) -> None:
    """A chart without dashboard files renders no empty ConfigMap."""
    chart = chart_copy()
    for f in (chart / "dashboards").glob("*.json") if (chart / "dashboards").is_dir() else []:
        f.unlink()
    names = {c["metadata"]["name"] for c in by_kind(helm.objects(chart=chart), "ConfigMap")}
    assert "fl-hetfed-dashboards" not in names


def test_prometheus_rule_from_every_rules_file_when_api_and_value(helm: Helm, chart_copy: Callable[[], Path]) -> None:
    """A PrometheusRule with every group of every rules file, only with the API and prometheusRule.enabled."""
    chart = with_fixtures(chart_copy)
    objects = helm.objects(chart=chart, api_versions=("monitoring.coreos.com/v1",),
                           sets=("prometheusRule.enabled=true", "prometheusRule.labels.release=prom"))
    (rule,) = by_kind(objects, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "prom"
    assert rule["spec"]["groups"] == RULES + MORE_RULES
    assert by_kind(helm.objects(chart=chart, sets=("prometheusRule.enabled=true",)), "PrometheusRule") == []
    assert by_kind(helm.objects(chart=chart, api_versions=("monitoring.coreos.com/v1",)), "PrometheusRule") == []


def test_the_shipped_dashboards_and_rules_render_unchanged(helm: Helm) -> None:
    """The chart as released carries every generated dashboard and alert rule, byte for byte (no templating)."""
    chart = Path(__file__).resolve().parents[2] / "helm" / "hetfed"
    dashboards = sorted(chart.glob("dashboards/*.json"))
    rules = sorted(chart.glob("rules/*.yaml"))
    assert dashboards and rules
    objects = helm.objects(api_versions=("monitoring.coreos.com/v1",), sets=("prometheusRule.enabled=true",))
    (cm,) = [c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"].endswith("-dashboards")]
    assert sorted(cm["data"]) == [d.name for d in dashboards]
    for d in dashboards:  # the same JSON (a YAML block scalar keeps no trailing newline)
        assert cm["data"][d.name] == d.read_text().rstrip("\n")
    (rule,) = by_kind(objects, "PrometheusRule")
    assert rule["spec"]["groups"] == [g for r in rules for g in yaml.safe_load(r.read_text())]
    validate_all([cm])
