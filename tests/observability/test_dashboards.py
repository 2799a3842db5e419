"""The dashboards and rules are what the generator writes, pass Grafana's schema types, and promtool accepts them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.observability import alerts, dashboards
from tests.observability.promharness import REPO, RULES, require

NODE_MODULES = Path(os.environ.get("HETFED_NODE_MODULES", REPO / ".ci" / "node" / "node_modules"))
TSC_FLAGS = ["--noEmit", "--strict", "--moduleResolution", "bundler", "--module", "esnext", "--target", "es2022"]


GENERATOR = "python scripts/gen_observability.py"


def test_committed_files_are_generated(tmp_path: Path) -> None:
    """The generator, run into a temporary directory, writes exactly the committed files, byte for byte."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_observability.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert fresh, "the generator wrote nothing"
    for rel in fresh:
        committed = REPO / rel
        assert committed.is_file(), f"{rel} is generated but not committed; run {GENERATOR}"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), f"{rel} differs; run {GENERATOR}"
    # Nothing else in the generated folders: a dashboard or rules file without a source is stale.
    for folder in {rel.parent for rel in fresh if rel.parts[:2] == ("helm", "hetfed")}:
        stale = sorted({p.relative_to(REPO) for p in (REPO / folder).iterdir()} - set(fresh))
        assert not stale, f"{stale} have no source in scripts/observability/; delete them or add their source"


def test_dashboards_type_check_against_grafana_schema(tmp_path: Path) -> None:
    """tsc checks each dashboard JSON ``satisfies Dashboard`` from @grafana/schema; a broken one must fail."""
    if not (NODE_MODULES / "@grafana" / "schema").is_dir() or not (NODE_MODULES / "typescript").is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"{NODE_MODULES} lacks typescript or @grafana/schema; .ci/run installs them")
        pytest.skip(f"no typescript and @grafana/schema in {NODE_MODULES} (see .ci/run)")
    (tmp_path / "node_modules").symlink_to(NODE_MODULES)
    files = dict(dashboards.dashboards())
    broken = json.loads(json.dumps(files["hetfed-bandwidth.json"]))
    broken["panels"][0]["gridPos"] = {"w": 12, "x": 0, "y": 0}  # no height: the schema requires h
    broken["templating"]["list"][1]["refresh"] = "sometimes"
    files["broken-control.json"] = broken
    for name, d in files.items():
        ident = re.sub(r"\W", "_", name.removesuffix(".json"))
        (tmp_path / f"{ident}.ts").write_text(
            'import type { Dashboard } from "@grafana/schema";\n'
            f"export const {ident} = ({json.dumps(d, indent=1)}) satisfies Dashboard;\n")
    tsc = NODE_MODULES / "typescript" / "bin" / "tsc"
    proc = subprocess.run([require("node"), str(tsc), *TSC_FLAGS, *sorted(p.name for p in tmp_path.glob("*.ts"))],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stdout.splitlines() if "error TS" in line]
    assert errors, "the broken control dashboard passed the type check"
    assert all(line.startswith("broken_control.ts") for line in errors), "\n".join(errors)
    assert any("gridPos" in e or "'h'" in e for e in errors) and any("VariableRefresh" in e for e in errors), errors


def test_every_panel_filters_on_the_template_variables() -> None:
    for d in dashboards.dashboards().values():
        names = [v["name"] for v in d["templating"]["list"]]
        assert names == ["datasource", "run", "algorithm", "organization"]
        for p in d["panels"]:
            assert p["datasource"]["uid"] == "${datasource}"
            # A row holds no query; every other panel has at least one.
            assert (p["type"] == "row") == ("targets" not in p), p["title"]
            for t in p.get("targets", ()):
                assert '$run"' in t["expr"], (p["title"], t["expr"])
        ids = [p["id"] for p in d["panels"]]
        assert len(set(ids)) == len(ids)
        # Panels tile the 24-column grid without overlapping.
        cells = set()
        for p in d["panels"]:
            g = p["gridPos"]
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & mine and g["x"] + g["w"] <= 24
            cells |= mine


def test_panel_queries_parse(tmp_path: Path) -> None:
    exprs = [dashboards.substitute(e, {}) for d in dashboards.dashboards().values()
             for _t, e in dashboards.panel_exprs(d)]
    path = tmp_path / "panels.yml"
    path.write_text(json.dumps({"groups": [{"name": "p", "rules": [{"record": f"p:{i}", "expr": e}
                                                                  for i, e in enumerate(exprs)]}]}))
    proc = subprocess.run([require("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    path.write_text(json.dumps({"groups": [{"name": "p", "rules": [{"record": "p:bad", "expr": "sum by (run"}]}]}))
    assert subprocess.run([require("promtool"), "check", "rules", str(path)], capture_output=True).returncode != 0


def test_substitute_and_variable_query() -> None:
    e = 'rate(x{run=~"$run", organization=~"$organization"}[$__rate_interval])'
    assert dashboards.substitute(e, {"run": "fedavg"}, "30s") == 'rate(x{run=~"fedavg", organization=~".*"}[30s])'
    assert dashboards.variable_query('label_values(m{run=~"$run"}, algorithm)') == \
        'group by (algorithm) (m{run=~"$run"})'
    with pytest.raises(ValueError, match="label_values"):
        dashboards.variable_query("query_result(up)")


def test_rules_check_and_every_alert_fires_in_promtool_unit_tests() -> None:
    helm = REPO / "helm" / "hetfed" / "rules" / "hetfed-alerts.yaml"
    for path in (RULES, helm):
        text = path.read_text()
        # The chart's file is the plain file's groups as a list (the PrometheusRule's spec.groups).
        if path == helm:
            path = path.parent / "_check.yaml"  # promtool wants the groups: wrapper
            try:
                path.write_text("groups:\n" + "\n".join("  " + line for line in text.splitlines()[1:]) + "\n")
                proc = subprocess.run([require("promtool"), "check", "rules", str(path)], capture_output=True,
                                      text=True)
            finally:
                path.unlink()
        else:
            proc = subprocess.run([require("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0 and "4 rules found" in proc.stdout, proc.stdout + proc.stderr
    tests = REPO / "tests" / "observability" / "alerts.test.yml"
    fired = set(re.findall(r"alertname: (\w+)\n\s+exp_alerts:\n\s+- exp_labels", tests.read_text()))
    assert fired == {r["alert"] for r in alerts.RULES}
    proc = subprocess.run([require("promtool"), "test", "rules", str(tests)], capture_output=True, text=True)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


def test_yaml_emitter_round_trips_through_json_shapes() -> None:
    text = alerts.to_yaml({"a": [{"b": "x: \"y\"", "c": 1}, "s"], "d": {}, "e": True})
    assert text == 'a:\n  - b: "x: \\"y\\""\n    c: 1\n  - "s"\nd: {}\ne: true'
