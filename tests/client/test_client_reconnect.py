"""Clients started before the aggregator retry with backoff and complete the run once it is up."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from hetfed.client.config import ClientConfig, ModelConfig, RetryConfig
from hetfed.client.data import DataConfig
from hetfed.client.runtime import ClientError, ClientRuntime, resolve_device
from tests.conftest import free_port, run_config, wait_until


def test_clients_wait_for_a_late_aggregator(aggregator: Callable[..., Any]) -> None:
    port = free_port()
    results: dict[str, Any] = {}

    def client(org: str, index: int) -> None:
        cfg = ClientConfig(organization=org, run="r", aggregator=f"127.0.0.1:{port}", threads=1,
                           data=DataConfig(dataset="digits", partition="iid", num_clients=2, client_index=index),
                           model=ModelConfig(name="mlp"),
                           retry=RetryConfig(initial_backoff_seconds=0.05, max_backoff_seconds=0.5))
        try:
            results[org] = ClientRuntime(cfg).run()
        except Exception as exc:  # reported by the assertion below
            results[org] = exc

    threads = [threading.Thread(target=client, args=(org, i)) for i, org in enumerate("ab")]
    for t in threads:
        t.start()
    time.sleep(1.5)  # the aggregator is deliberately absent for a while
    assert not results, "clients must keep retrying while nothing listens"
    aggregator(run_config(rounds=1), listen=f"127.0.0.1:{port}")
    wait_until(lambda: len(results) == 2, timeout=120, what="both clients to finish")
    for org in "ab":
        reports = results[org]
        assert not isinstance(reports, Exception), reports
        assert [r for r, _ in reports] == [1, 2]  # one training round, then the evaluation round


def test_gives_up_after_the_configured_time() -> None:
    cfg = ClientConfig(organization="a", run="r", aggregator=f"127.0.0.1:{free_port()}",
                       data=DataConfig(dataset="digits", partition="iid", num_clients=1),
                       retry=RetryConfig(initial_backoff_seconds=0.05, max_backoff_seconds=0.1,
                                         give_up_after_seconds=0.5))
    start = time.monotonic()
    with pytest.raises(ClientError, match=r"aggregator unreachable for 0s \(UNAVAILABLE"):
        ClientRuntime(cfg).run()
    assert time.monotonic() - start < 30


def test_device_resolution_on_a_cpu_machine() -> None:
    import torch

    if torch.cuda.is_available():
        assert resolve_device("auto") == "cuda"
    else:
        assert resolve_device("auto") == "cpu"
        with pytest.raises(ClientError, match="CUDA is not available"):
            resolve_device("cuda:0")
    assert resolve_device("cpu") == "cpu"
