"""Status per organization (joined, last accepted round, bytes up and down): counted, filtered, kept across restarts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hetfed.cli.certs import make_federation_certs
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import aggregator_pb2_grpc as agrpc
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from hetfed.wire.transport import make_channel
from tests.conftest import RawClient, run_config, wait_until

W = np.array([1.0, -2.0, 4.0], np.float32)


def org_rows(status: apb.StatusResponse) -> list[tuple[str, bool, int, int, int]]:
    (run,) = status.runs
    return [(o.organization_id, o.joined, o.last_round_pushed, o.bytes_up, o.bytes_down)
            for o in run.organization_status]


def test_per_organization_status_survives_a_restart(
    aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]
) -> None:
    """Joins are checkpointed and accepted updates replayed: a restarted aggregator reports the same rounds."""
    agg = aggregator(run_config(organizations=["a", "b", "c"], rounds=3))
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    for cl in (a, b):
        cl.join([(PayloadKind.MODEL_WEIGHTS, "w", W)])
    a.push(1, [ModelWeights({"w": W}, 1), EvalMetrics(test_accuracy=0.5, num_test_examples=2)])
    b.push(1, [ModelWeights({"w": W}, 1), EvalMetrics(test_accuracy=0.5, num_test_examples=2)])
    status = a.stub.Status(apb.StatusRequest(), timeout=10)
    rows = org_rows(status)
    assert [r[:3] for r in rows] == [("a", True, 1), ("b", True, 1), ("c", False, -1)]
    assert rows[0][3] > 3 * 4 and rows[0][4] > 0 and rows[2][3:] == (0, 0)
    agg.stop(grace=0.1)
    agg2 = aggregator(run_config(organizations=["a", "b", "c"], rounds=3))
    a2 = raw_client(agg2.port, "a")
    restored = org_rows(a2.stub.Status(apb.StatusRequest(), timeout=10))
    assert [r[:3] for r in restored] == [r[:3] for r in rows]  # joins are checkpointed, pushes replayed


def test_closed_rounds_keep_the_bytes_across_a_restart(
    aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]
) -> None:
    """Bytes counted up to a round close are in the checkpoint and come back exactly."""
    agg = aggregator(run_config(organizations=["a"], rounds=3))
    a = raw_client(agg.port, "a")
    a.join([(PayloadKind.MODEL_WEIGHTS, "w", W)])
    a.push(1, [ModelWeights({"w": W}, 1), EvalMetrics(test_accuracy=0.5, num_test_examples=2)])
    wait_until(lambda: agg.service.runs["r"].round == 2, timeout=10, what="round 1 to close")
    before = org_rows(a.stub.Status(apb.StatusRequest(), timeout=10))
    agg.stop(grace=0.1)
    agg2 = aggregator(run_config(organizations=["a"], rounds=3))
    after = org_rows(raw_client(agg2.port, "a").stub.Status(apb.StatusRequest(), timeout=10))
    assert after == before and before[0][2] == 1 and before[0][3] > 0


def test_an_organization_sees_only_itself_under_mtls(tmp_path: Path, aggregator: Callable[..., Any]) -> None:
    """Under mTLS an organization's Status lists only its own entry; the operator sees every organization."""
    certs = make_federation_certs(tmp_path / "certs", ["a", "b", "op"])
    tls = certs.aggregator_tls()
    agg = aggregator(run_config(organizations=["a", "b"]), tls={"cert": tls.cert, "key": tls.key, "ca": tls.ca},
                     operators=["op"])
    seen = {}
    for who in ("a", "op"):
        with make_channel(f"localhost:{agg.port}", certs.client_tls(who)) as ch:
            status = agrpc.AggregatorStub(ch).Status(apb.StatusRequest(), timeout=10)
        seen[who] = [o.organization_id for o in status.runs[0].organization_status]
    assert seen == {"a": ["a"], "op": ["a", "b"]}
