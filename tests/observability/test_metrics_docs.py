"""docs/metrics.md lists every metric family either process exports, every panel and every alert."""

from __future__ import annotations

from hetfed.aggregator.config import aggregator_config_from_mapping
from hetfed.aggregator.observe.metrics import AggregatorMetrics
from hetfed.aggregator.observe.run_metrics import RunMetricsCollector
from hetfed.aggregator.serving.service import AggregatorService
from hetfed.client.config import ClientConfig
from hetfed.client.runtime import ClientRuntime
from scripts.observability import alerts, dashboards
from tests.observability.promharness import REPO

DOC = (REPO / "docs" / "metrics.md").read_text()


def exported_names(registry: object) -> set[str]:
    """Every sample-family name a registry describes, as Prometheus shows it (counters with _total)."""
    names = set()
    for fam in registry.collect():  # type: ignore[attr-defined]
        names.add(fam.name + "_total" if fam.type == "counter" else fam.name)
    return names


def test_every_metric_family_is_documented(tmp_path: object) -> None:
    metrics = AggregatorMetrics()
    cfg = aggregator_config_from_mapping({"server": {"state_dir": str(tmp_path)},
                                          "runs": [{"id": "r", "algorithm": "fedavg", "organizations": ["a"]}]})
    service = AggregatorService(cfg, metrics)
    metrics.registry.register(RunMetricsCollector(lambda: list(service.runs.values())))
    client = ClientRuntime(ClientConfig(organization="a", run="r"))
    aggregator_names, client_names = exported_names(metrics.registry), exported_names(client.registry)
    client.client.close()
    assert "hetfed_run_bytes_total" in aggregator_names and "hetfed_client_bytes_total" in client_names
    missing = sorted(n for n in aggregator_names | client_names if f"`{n}`" not in DOC)
    assert missing == [], f"document {missing} in docs/metrics.md"
    # The naming rule the page states: only client processes export hetfed_client_*.
    assert not any(n.startswith("hetfed_client_") for n in aggregator_names)
    assert all(n.startswith("hetfed_client_") for n in client_names)


def test_every_panel_and_alert_is_documented() -> None:
    titles = [p["title"] for d in dashboards.dashboards().values() for p in d["panels"]]
    assert [t for t in titles if f"| {t} |" not in DOC] == []
    assert [r["alert"] for r in alerts.RULES if f"`{r['alert']}`" not in DOC] == []
