"""The Grafana dashboards as code, and a matplotlib preview of the bandwidth dashboard from a live Prometheus.

``python scripts/gen_observability.py`` writes ``helm/hetfed/dashboards/*.json`` from this module (and the
alert rules from ``alerts.py``). A test regenerates them and fails on drift; another type-checks them against
Grafana's own schema (``@grafana/schema``). Every panel reads Prometheus through the ``datasource`` variable
and filters on the ``run``, ``algorithm`` and ``organization`` variables (where its families carry them). A
``row`` spec starts a titled row of the panels after it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DS = {"type": "prometheus", "uid": "${datasource}"}
SCHEMA_VERSION = 39
RUN = 'run=~"$run", algorithm=~"$algorithm"'
ORG = 'run=~"$run", algorithm=~"$algorithm", organization=~"$organization"'
# The privacy families are labelled by run (and organization) only: their panels filter on those.
PRIVACY_ORG = 'run=~"$run", organization=~"$organization"'
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    """One PromQL target of a panel."""

    expr: str
    legend: str
    fmt: str = "time_series"


@dataclass(frozen=True)
class PanelSpec:
    """What a panel shows: its queries and how Grafana draws them."""

    title: str
    kind: str
    queries: tuple[Query, ...]
    unit: str
    description: str
    preview: bool = False  # drawn in the bandwidth dashboard's preview PNG
    stacked: bool = False
    width: int = 12


def traffic(expr_by: str, extra: str = "") -> str:
    """Bytes per second the aggregator counted, summed by ``expr_by``."""
    return f"sum by ({expr_by}) (rate(hetfed_aggregator_bytes_total{{{ORG}{extra}}}[{RATE}]))"


BANDWIDTH: tuple[PanelSpec, ...] = (
    PanelSpec("Bytes per second by algorithm and direction", "timeseries",
              (Query(traffic("algorithm, direction"), "{{algorithm}} {{direction}}"),), "Bps",
              "Serialized gRPC bytes per second the aggregator counted (hetfed_aggregator_bytes_total): up is "
              "client to aggregator.", preview=True),
    PanelSpec("Bytes per second by organization", "timeseries",
              (Query(traffic("organization, direction"), "{{organization}} {{direction}}"),), "Bps",
              "Each organization's traffic with the aggregator, both directions.", preview=True),
    PanelSpec("Payload composition by kind", "timeseries",
              (Query(traffic("payload_kind"), "{{payload_kind}}"),), "Bps",
              "Bytes per second by payload kind (envelope: chunk headers, envelopes and field tags), stacked.",
              preview=True, stacked=True),
    PanelSpec("Bytes per round", "timeseries",
              (Query(f"sum by (run, algorithm, direction) (hetfed_run_last_round_bytes{{{RUN}}})",
                     "{{run}} {{direction}}"),),
              "decbytes", "Bytes of each round as it closes (hetfed_run_last_round_bytes): the line steps once per "
              "round.", preview=True),
    PanelSpec("Cumulative bytes per run", "timeseries",
              (Query(f"sum by (run, algorithm) (hetfed_run_bytes_total{{{RUN}}})", "{{run}} ({{algorithm}})"),),
              "decbytes", "All bytes of the run so far, from the persisted round history: an aggregator restart "
              "does not reset it.", preview=True),
    PanelSpec("Train-round bytes against FedAvg with the same model", "timeseries",
              (Query(f'sum by (run, algorithm) (hetfed_run_bytes_total{{{RUN}, phase="train"}})',
                     "{{run}} ({{algorithm}})"),
               Query(f"sum by (run, algorithm) (hetfed_run_fedavg_reference_bytes_total{{{RUN}}})",
                     "FedAvg reference for {{run}}")),
              "decbytes", "The run's train-round bytes beside what FedAvg with the model the run declares "
              "(fedavg_model_bytes) would have moved in as many rounds with as many clients; runs that declare "
              "no model have no reference line.", preview=True),
    PanelSpec("Ratio to FedAvg", "bargauge",
              (Query(f'sum by (run, algorithm) (hetfed_run_bytes_total{{{RUN}, phase="train"}}) '
                     f"/ on (run, algorithm) sum by (run, algorithm) "
                     f"(hetfed_run_fedavg_reference_bytes_total{{{RUN}}})", "{{run}} ({{algorithm}})"),),
              "percentunit", "Train-round bytes divided by the FedAvg reference: 100% is textbook FedAvg's cost "
              "(the model up and down for every client and round). hetfed's own FedAvg sits near (2R-1)/2R: its "
              "first round sends no weights down, since every organization starts from the run seed's weights.",
              width=12),
    PanelSpec("Accuracy against cumulative bytes", "xychart",
              (Query(f"sum by (run, algorithm) (hetfed_run_bytes_total{{{RUN}}})", "{{run}}", "table"),
               Query(f"max by (run, algorithm) (hetfed_run_test_accuracy{{{RUN}}})", "{{run}}", "table")),
              "percentunit", "Each run's accuracy (hetfed_run_test_accuracy: the last closed round's, over every "
              "organization's test examples) against the bytes it has moved: one curve per run, log-scaled "
              "bytes. The two queries are merged on time and run, then split into one series per run.",
              preview=True, width=24),
    PanelSpec("Test accuracy per round", "timeseries",
              (Query(f"max by (run, algorithm) (hetfed_run_test_accuracy{{{RUN}}})", "{{run}} ({{algorithm}})"),),
              "percentunit", "The accuracy the organizations reported in the last closed round, weighted by "
              "their test examples."),
    PanelSpec("Final accuracy", "stat",
              (Query(f"max by (run, algorithm) (hetfed_run_final_test_accuracy{{{RUN}}})",
                     "{{run}} ({{algorithm}})"),),
              "percentunit", "The finished run's evaluation round. Organizations that withheld their accuracy "
              "are left out; no data when all did (see Withheld figures by organization)."),
)

ROUNDS: tuple[PanelSpec, ...] = (
    PanelSpec("Round latency quantiles", "timeseries",
              tuple(Query(f"histogram_quantile({q}, sum by (le, run, algorithm) "
                          f"(rate(hetfed_round_duration_seconds_bucket{{{RUN}}}[{RATE}])))", f"p{p} {{{{run}}}}")
                    for q, p in ((0.5, 50), (0.9, 90), (0.99, 99))),
              "s", "A round's opening to its close (hetfed_round_duration_seconds), 50th, 90th and 99th percentile."),
    PanelSpec("Clients per round", "timeseries",
              (Query(f"max by (run, algorithm) (hetfed_clients_per_round{{{RUN}}})", "{{run}} used"),
               Query(f"max by (run, algorithm) (hetfed_run_organizations{{{RUN}}})", "{{run}} listed")),
              "short", "Organizations whose update the last closed round used, beside those the run lists."),
    PanelSpec("Stragglers", "timeseries",
              (Query(f"max by (run, algorithm) (hetfed_run_organizations{{{RUN}}}) - on (run, algorithm) "
                     f"max by (run, algorithm) (hetfed_clients_per_round{{{RUN}}})", "{{run}} missing from last round"),
               Query(f'sum by (run) (rate(hetfed_rejected_messages_total{{run=~"$run", reason="late"}}[{RATE}]))',
                     "{{run}} late pushes/s")),
              "short", "Organizations the last round closed without (it closed at its deadline with a quorum), and "
              "late pushes refused since (reason late)."),
    PanelSpec("Rejections by reason", "timeseries",
              (Query(f'sum by (run, reason) (rate(hetfed_rejected_messages_total{{run=~"$run"}}[{RATE}]))',
                     "{{run}} {{reason}}"),),
              "reqps", "Refused messages per second by reason (docs/metrics.md lists the reasons).", stacked=True),
    PanelSpec("Open round age against its deadline", "timeseries",
              (Query(f"max by (run, algorithm) (hetfed_run_round_age_seconds{{{RUN}}}) / on (run, algorithm) "
                     f"max by (run, algorithm) (hetfed_run_round_deadline_seconds{{{RUN}}})", "{{run}}"),),
              "percentunit", "Seconds since the open round opened over round_deadline_seconds: at 100% the round "
              "closes as soon as a quorum has pushed."),
    PanelSpec("Rounds missed by organization", "bargauge",
              (Query(f"max by (run, organization) (hetfed_run_organization_rounds_missed{{{ORG}}})",
                     "{{run}} {{organization}}"),),
              "short", "Consecutive most recent closed rounds without the organization's update."),
    PanelSpec("Current round", "stat",
              (Query(f"max by (run, algorithm) (hetfed_current_round{{{RUN}}})", "{{run}}"),),
              "short", "The open round of each run."),
    PanelSpec("Privacy", "row", (), "", "Differential privacy the organizations declare with their updates "
              "(docs/privacy.md).", width=24),
    PanelSpec("ε per organization", "timeseries",
              (Query(f"max by (run, organization) (hetfed_privacy_epsilon{{{PRIVACY_ORG}}})",
                     "{{run}} {{organization}}"),),
              "none", "The ε each organization declared with its last accepted update (hetfed_privacy_epsilon): "
              "its client's accounting of everything it sent in the run so far. It only grows."),
    PanelSpec("Unprotected organizations", "stat",
              (Query('max by (run) (hetfed_privacy_unprotected_organizations{run=~"$run"})', "{{run}}"),),
              "short", "Organizations whose last accepted update declared no differential privacy; a run with "
              "require_privacy refuses such updates."),
    PanelSpec("Withheld figures by organization", "stat",
              (Query(f"count by (run, organization) (hetfed_reported_withheld{{{ORG}}})",
                     "{{run}} {{organization}}"),),
              "short", "How many figures each organization withheld in its last report (hetfed_reported_withheld): "
              "computed from private data and not released under its privacy settings. Accuracy and loss panels "
              "leave those organizations out; with every organization withholding they show no data, never 0."),
)


def _variables() -> list[dict[str, Any]]:
    def query_var(name: str, label: str, query: str) -> dict[str, Any]:
        return {
            "name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": f"{name}-var"},
            "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*", "sort": 1,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "hide": 0, "options": [], "regex": "", "skipUrlSync": False,
        }

    return [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus", "hide": 0, "options": [], "refresh": 1, "regex": "", "skipUrlSync": False},
        query_var("run", "run", "label_values(hetfed_run_finished, run)"),
        query_var("algorithm", "algorithm", 'label_values(hetfed_run_finished{run=~"$run"}, algorithm)'),
        query_var("organization", "organization",
                  'label_values(hetfed_aggregator_bytes_total{run=~"$run", algorithm=~"$algorithm"}, organization)'),
    ]


def _row(spec: PanelSpec, pid: int, y: int) -> dict[str, Any]:
    """A Grafana row: a full-width title over the panels after it (none collapsed into it)."""
    return {"id": pid, "type": "row", "title": spec.title, "datasource": DS, "collapsed": False,
            "gridPos": {"h": ROW_HEIGHT, "w": 24, "x": 0, "y": y}, "panels": []}


PANEL_HEIGHT, ROW_HEIGHT = 8, 1


def _panel(spec: PanelSpec, pid: int, x: int, y: int) -> dict[str, Any]:
    targets = [{"refId": chr(ord("A") + i), "datasource": DS, "expr": q.expr, "legendFormat": q.legend,
                "format": q.fmt, "range": True, "instant": False} for i, q in enumerate(spec.queries)]
    custom: dict[str, Any] = {}
    options: dict[str, Any] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                               "tooltip": {"mode": "multi", "sort": "desc"}}
    overrides: list[dict[str, Any]] = []
    transformations: list[dict[str, Any]] = []
    if spec.kind == "timeseries":
        custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if spec.stacked else 0,
                  "showPoints": "never", "spanNulls": True,
                  "stacking": {"mode": "normal" if spec.stacked else "none", "group": "A"}}
    elif spec.kind == "xychart":
        transformations = [{"id": "merge", "options": {}},
                           {"id": "partitionByValues", "options": {"fields": ["run"], "keepFields": False}}]
        options = {"seriesMapping": "auto", "mapping": "auto",
                   "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                   "tooltip": {"mode": "single", "sort": "none"}}
        custom = {"show": "points+lines", "pointSize": {"fixed": 4}, "lineWidth": 1}
        overrides = [
            {"matcher": {"id": "byName", "options": "Value #A"},
             "properties": [{"id": "unit", "value": "decbytes"}, {"id": "displayName", "value": "cumulative bytes"},
                            {"id": "custom.scaleDistribution", "value": {"type": "log", "log": 10}}]},
            {"matcher": {"id": "byName", "options": "Value #B"},
             "properties": [{"id": "unit", "value": "percentunit"}, {"id": "displayName", "value": "accuracy"}]},
        ]
    elif spec.kind in ("stat", "bargauge"):
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "orientation": "horizontal"}
    panel: dict[str, Any] = {
        "id": pid, "type": spec.kind, "title": spec.title, "description": spec.description, "datasource": DS,
        "gridPos": {"h": PANEL_HEIGHT, "w": spec.width, "x": x, "y": y}, "targets": targets, "options": options,
        "fieldConfig": {"defaults": {"unit": spec.unit, "custom": custom}, "overrides": overrides},
    }
    if transformations:
        panel["transformations"] = transformations
    return panel


def dashboard(uid: str, title: str, description: str, specs: tuple[PanelSpec, ...]) -> dict[str, Any]:
    """A dashboard of ``specs`` laid out two panels to a line, with the run, algorithm and organization variables;
    a ``row`` spec starts a line of its own."""
    panels: list[dict[str, Any]] = []
    x, y, height = 0, 0, 0  # where the next panel goes; the height of the line it would join
    for i, spec in enumerate(specs, start=1):
        if spec.kind == "row":
            y += height if x else 0
            panels.append(_row(spec, i, y))
            x, y, height = 0, y + ROW_HEIGHT, 0
            continue
        if x + spec.width > 24:
            x, y = 0, y + height
        panels.append(_panel(spec, i, x, y))
        x, height = x + spec.width, PANEL_HEIGHT
    return {
        "uid": uid, "title": title, "description": description, "tags": ["hetfed"], "editable": True,
        "schemaVersion": SCHEMA_VERSION, "version": 1, "graphTooltip": 1, "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"}, "timezone": "browser", "fiscalYearStartMonth": 0,
        "links": [], "annotations": {"list": []}, "templating": {"list": _variables()}, "panels": panels,
    }


def dashboards() -> dict[str, dict[str, Any]]:
    """Every dashboard by file name."""
    return {
        "hetfed-bandwidth.json": dashboard(
            "hetfed-bandwidth", "hetfed: federation bandwidth",
            "Communication cost per algorithm, organization, payload kind and round; accuracy against bytes.",
            BANDWIDTH),
        "hetfed-rounds.json": dashboard(
            "hetfed-rounds", "hetfed: rounds",
            "Round latency, participation, stragglers and rejections; the privacy organizations declare.", ROUNDS),
    }


def render_json(d: dict[str, Any]) -> str:
    """The committed form of a dashboard."""
    return json.dumps(d, indent=2) + "\n"


# ------------------------------------------------------------------ PromQL outside Grafana
def substitute(expr: str, values: dict[str, str], rate_interval: str = "1m") -> str:
    """A panel's PromQL with Grafana's variables replaced (``values``: variable -> regex; default ``.*``)."""
    out = expr.replace("$__rate_interval", rate_interval).replace("$__interval", rate_interval)
    return re.sub(r"\$(\w+)", lambda m: values.get(m.group(1), ".*"), out)


def variable_query(definition: str) -> str:
    """Grafana's ``label_values(selector, label)`` as the PromQL that lists those values."""
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", definition)
    if not m:
        raise ValueError(f"not a label_values() query: {definition!r}")
    return f"group by ({m.group(2)}) ({m.group(1)})"


def panel_exprs(d: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of a dashboard (rows have none)."""
    return [(p["title"], t["expr"]) for p in d["panels"] for t in p.get("targets", ())]


# ------------------------------------------------------------------ preview
def render_preview(url: str, png: Path, start: float, end: float, step: float, rate_interval: str = "1m",
                   values: dict[str, str] | None = None) -> dict[str, Any]:
    """Draw the bandwidth dashboard's main panels from range queries against a live Prometheus."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hetfed.cli.prom import PNG_KEY, prom_range

    specs = [s for s in BANDWIDTH if s.preview]
    cols = 2
    rows = (len(specs) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(14, 3.6 * rows), dpi=90, squeeze=False)
    described = []
    try:
        for ax, spec in zip(axes.flat, specs, strict=False):
            results = [prom_range(url, substitute(q.expr, values or {}, rate_interval), start, end, step)
                       for q in spec.queries]
            n = (_draw_xy if spec.kind == "xychart" else _draw_lines)(ax, spec, results, start)
            ax.set_title(spec.title, fontsize=10)
            ax.grid(True, alpha=0.3)
            if n:
                ax.legend(fontsize=7)
            described.append({"title": spec.title, "series": n})
        for ax in list(axes.flat)[len(specs):]:
            ax.set_visible(False)
        fig.suptitle("hetfed: federation bandwidth (preview from Prometheus)")
        fig.tight_layout()
        desc = {"panels": described}
        png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(png, metadata={"Title": "hetfed bandwidth dashboard preview", PNG_KEY: json.dumps(desc)})
    finally:
        plt.close(fig)
    return desc


def _legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def _draw_lines(ax: Any, spec: PanelSpec, results: list[list[dict[str, Any]]], start: float) -> int:
    n = 0
    for q, series in zip(spec.queries, results, strict=True):
        for s in series:
            ts = [float(t) - start for t, _ in s["values"]]
            vs = [float(v) for _, v in s["values"]]
            ax.step(ts, vs, where="post", label=_legend(q.legend, s["metric"]), linewidth=1.2)
            n += 1
    ax.set_xlabel("seconds")
    ax.set_ylabel({"Bps": "bytes/s", "decbytes": "bytes", "percentunit": "fraction"}.get(spec.unit, spec.unit))
    return n


def _draw_xy(ax: Any, spec: PanelSpec, results: list[list[dict[str, Any]]], start: float) -> int:
    bytes_by_run = {s["metric"].get("run", ""): dict(s["values"]) for s in results[0]}
    n = 0
    for s in results[1]:
        run = s["metric"].get("run", "")
        xs, ys = [], []
        for t, v in s["values"]:
            if t in bytes_by_run.get(run, {}):
                xs.append(float(bytes_by_run[run][t]))
                ys.append(float(v))
        if xs:
            ax.plot(xs, ys, marker="o", markersize=3, label=f"{run} ({s['metric'].get('algorithm', '')})")
            n += 1
    ax.set_xscale("log")
    ax.set_xlabel("cumulative bytes (log scale)")
    ax.set_ylabel("test accuracy")
    return n

