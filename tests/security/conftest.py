"""Shared fixtures of the security tests: one federation's certificates and in-process aggregators."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from hetfed.aggregator.config import aggregator_config_from_mapping
from hetfed.aggregator.serving.server import RunningAggregator, start_aggregator
from hetfed.cli.certs import FederationCerts, make_federation_certs
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import aggregator_pb2_grpc as agrpc
from hetfed.wire.config import to_mapping
from hetfed.wire.transport import TlsConfig, make_channel

RUN = "r"
RUN_ORGS = ("org-a", "org-b")
# Certified by the federation's CA but in no run.
OUTSIDER = "org-x"
OPERATOR = "hetfed-operator"


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> FederationCerts:
    """The federation's CA, aggregator certificate and certificates for the run's organizations and two others."""
    return make_federation_certs(tmp_path_factory.mktemp("certs"), [*RUN_ORGS, OUTSIDER, OPERATOR])


@pytest.fixture(scope="session")
def foreign_certs(tmp_path_factory: pytest.TempPathFactory) -> FederationCerts:
    """Another federation's CA, with a certificate that also says org-a."""
    return make_federation_certs(tmp_path_factory.mktemp("foreign"), ["org-a"])


AggregatorFactory = Callable[..., RunningAggregator]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[AggregatorFactory]:
    """Starts in-process aggregators hosting run ``r`` of org-a and org-b; stops them at teardown."""
    started: list[RunningAggregator] = []

    def _start(tls: TlsConfig | None = None, **server: Any) -> RunningAggregator:
        section: dict[str, Any] = {"listen": "127.0.0.1:0", "metrics_port": -1, "state_dir": str(tmp_path / "state"),
                                   **server}
        if tls is not None:
            section["tls"] = to_mapping(tls)
            section.setdefault("operators", [OPERATOR])
        config = aggregator_config_from_mapping({
            "server": section,
            "runs": [{"id": RUN, "algorithm": "local", "organizations": list(RUN_ORGS), "rounds": 1}],
        })
        agg = start_aggregator(config)
        started.append(agg)
        return agg

    yield _start
    for agg in started:
        agg.stop(grace=0)


def join(
    target: RunningAggregator | grpc.Channel,
    tls: TlsConfig | None = None,
    claimed: str = "",
    metadata: tuple[tuple[str, str], ...] = (),
) -> apb.JoinResponse:
    """Join run ``r`` claiming ``claimed``, on ``target`` if it is a channel, else on a fresh one."""
    request = apb.JoinRequest(run_id=RUN, organization_id=claimed)
    if isinstance(target, grpc.Channel):
        return agrpc.AggregatorStub(target).Join(request, metadata=metadata, timeout=10)
    with make_channel(f"127.0.0.1:{target.port}", tls) as ch:
        return agrpc.AggregatorStub(ch).Join(request, metadata=metadata, timeout=10)


def rejected(agg: RunningAggregator, reason: str, run: str = RUN) -> float:
    """hetfed_rejected_messages_total for ``reason`` (0 before the first)."""
    value = agg.service.metrics.registry.get_sample_value(
        "hetfed_rejected_messages_total", {"run": run, "reason": reason}
    )
    return value or 0.0
