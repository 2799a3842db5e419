"""The Prometheus endpoints serve the documented families over HTTP, from a real run."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from hetfed.client.config import ClientConfig, ModelConfig
from hetfed.client.data import DataConfig
from hetfed.client.runtime import ClientRuntime
from tests.conftest import free_port, run_config


def scrape(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_aggregator_and_client_endpoints_after_a_real_run(aggregator: Callable[..., Any]) -> None:
    agg = aggregator(run_config(algorithm="fedavg_head", organizations=["a", "b"], rounds=1),
                     metrics_port=0, metrics_host="127.0.0.1")
    client_ports = [free_port(), free_port()]
    runtimes = [
        ClientRuntime(ClientConfig(
            organization=org, run="r", aggregator=f"127.0.0.1:{agg.port}", threads=1,
            metrics_port=port, metrics_host="127.0.0.1",
            data=DataConfig(dataset="digits", partition="iid", num_clients=2, client_index=i),
            model=ModelConfig(name="mlp", latent_dim=8)))
        for i, (org, port) in enumerate(zip("ab", client_ports, strict=True))
    ]
    threads = [threading.Thread(target=rt.run) for rt in runtimes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive()

    fams = scrape(agg.metrics_port)
    sent = {(s.labels["organization"], s.labels["direction"], s.labels["payload_kind"]): s.value
            for s in fams["hetfed_aggregator_bytes"].samples if s.name == "hetfed_aggregator_bytes_total"}
    head_bytes = 4 * (10 * 8 + 10)
    assert sent[("a", "up", "head_weights")] >= head_bytes
    assert sent[("a", "down", "head_weights")] >= head_bytes  # the evaluation round carries the final head
    assert not any(k[2] == "model_weights" for k in sent)
    assert {s.labels["organization"] for s in fams["hetfed_reported_test_accuracy"].samples} == {"a", "b"}
    assert "hetfed_round_duration_seconds" in fams and "hetfed_rejected_messages" in fams

    mine = scrape(client_ports[0])
    client_sent = {(s.labels["direction"], s.labels["payload_kind"]): s.value
                   for s in mine["hetfed_client_bytes"].samples if s.name == "hetfed_client_bytes_total"}
    # The client counts exactly what the aggregator counted for it, payload by payload.
    assert client_sent[("up", "head_weights")] == sent[("a", "up", "head_weights")]
    assert client_sent[("down", "head_weights")] == sent[("a", "down", "head_weights")]
    assert mine["hetfed_client_round"].samples[0].value == 2
    # Each process exports only its own side's family: nothing a dashboard sums is counted twice.
    assert "hetfed_client_bytes" not in fams and "hetfed_aggregator_bytes" not in mine
    assert not any(name.startswith("hetfed_reported_") for name in mine)
