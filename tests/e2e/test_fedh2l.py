"""FedH2L end to end over loopback gRPC: a real aggregator process, real client processes, and one
in-process client whose every request is recorded to show what an organization uploads."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import unknown_fields

from hetfed.cli.localrun import LocalRunOptions, aggregator_config, client_config, summarize_run
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import tensor_pb2 as tpb
from hetfed.wire.payloads import EvalMetrics, ModelWeights, SeedPosteriors
from tests.conftest import RawClient
from tests.e2e.recording import client_runtime
from tests.e2e.runs import recorded_run

pytestmark = pytest.mark.e2e
ROUNDS, CLIENTS, BATCH, K = 6, 3, 32, 10
OPTS = LocalRunOptions(algorithms=("fedh2l",), clients=CLIENTS, rounds=ROUNDS, partition="rotated",
                       models=("lenet", "mlp", "fedgen_cnn"),
                       extra_algorithm_config={"fedh2l": {"eval_every": 3}})


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A short heterogeneous run: org-1 and org-2 as processes, org-0 in this process with a recorder."""
    processes = [(f"org-{i}", "fedh2l", i) for i in range(1, CLIENTS)]
    with recorded_run(tmp_path_factory.mktemp("fedh2l"), OPTS, processes, ("fedh2l", 0)) as run:
        with urllib.request.urlopen(f"http://127.0.0.1:{run.fed.metrics_port}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        (status,) = run.status
        yield {"status": status, "summary": summarize_run(status), "sent": run.sent, "reports": run.reports,
               "metrics": metrics}


def test_short_heterogeneous_run_finishes_with_wdp_cdp_acc(federation: dict[str, Any]) -> None:
    summary = federation["summary"]
    rounds = {r["round"]: r for r in summary["rounds"]}
    assert sorted(rounds) == list(range(1, ROUNDS + 2))  # ROUNDS iterations, then the evaluate round
    final = rounds[ROUNDS + 1]["per_organization"]
    assert sorted(final) == [f"org-{i}" for i in range(CLIENTS)]
    for org, m in final.items():
        wdp, cdp, acc = m["test_accuracy"], m["cross_test_accuracy"], m["global_test_accuracy"]
        assert 0.0 <= cdp <= 1.0 and 0.0 <= wdp <= 1.0
        # ACC is over every domain's equal-sized test set: the mean of WDP and the CDP domains.
        assert acc == pytest.approx((wdp + (CLIENTS - 1) * cdp) / CLIENTS, abs=1e-9), org
        assert m["teachers"] == CLIENTS - 1  # the evaluate round ran learn(T) with every peer
    # The spec's figures WDP, CDP and ACC are the means over the nodes.
    assert summary["figure_labels"] == {"wdp": "WDP", "cdp": "CDP", "acc": "ACC"}
    for key, source in (("wdp", "test_accuracy"), ("cdp", "cross_test_accuracy"), ("acc", "global_test_accuracy")):
        assert summary["final_figures"][key] == pytest.approx(np.mean([m[source] for m in final.values()]))
    for r in range(1, ROUNDS + 1):
        assert set(rounds[r]["bytes_up"]) == {"seed_posteriors", "eval_metrics", "envelope"}
        assert set(rounds[r]["bytes_down"]) == ({"envelope"} if r == 1 else {"seed_posteriors", "envelope"})
    # Each round after the first relays every node's posteriors to each of its peers: N(N-1) down, N up.
    up, down = rounds[3]["bytes_up"]["seed_posteriors"], rounds[3]["bytes_down"]["seed_posteriors"]
    per_node = up / CLIENTS
    assert per_node > BATCH * (K * 4 + 8)
    # Relayed bytes are the pushed bytes plus the relay's source_organization field (tag, length, "org-i").
    relayed = CLIENTS * (CLIENTS - 1)
    assert down == pytest.approx((CLIENTS - 1) * up + relayed * (2 + len("org-0")), abs=relayed)
    # Prometheus: per-node and mean gauges of the three figures.
    for name in ("wdp", "cdp", "acc"):
        assert f'hetfed_reported_metric{{algorithm="fedh2l",name="{name}",organization="org-0",run="fedh2l"}}' \
            in federation["metrics"]
        assert f'hetfed_reported_metric_mean{{algorithm="fedh2l",name="{name}",run="fedh2l"}}' in federation["metrics"]


def _fields(message: Any) -> set[str]:
    assert len(unknown_fields.UnknownFieldSet(message)) == 0
    return {f.name for f, _ in message.ListFields()}


def test_uploads_are_exactly_posteriors_indices_confidences_metrics_and_envelope(federation: dict[str, Any]) -> None:
    pushes = [items for method, items in federation["sent"] if method.endswith("/PushUpdate")]
    assert len(pushes) == ROUNDS + 1
    for r, items in enumerate(pushes, start=1):
        assert all(_fields(req) <= {"run_id", "round", "organization_id", "chunk"} for req in items)
        update = apb.Update.FromString(b"".join(req.chunk.data for req in items))
        assert _fields(update) == {"envelope", "payloads"}
        assert _fields(update.envelope) == {"run_id", "round", "organization_id", "payload_kinds"}
        kinds = [p.WhichOneof("kind") for p in update.payloads]
        assert kinds == (["seed_posteriors", "eval_metrics"] if r <= ROUNDS else ["eval_metrics"])
        for p in update.payloads:
            _fields(p)
            if p.WhichOneof("kind") == "eval_metrics":
                assert _fields(p.eval_metrics) <= {f.name for f in p.eval_metrics.DESCRIPTOR.fields}
                continue
            sp = p.seed_posteriors
            assert {"seed_set_id", "indices", "probabilities"} <= _fields(sp) <= {
                "seed_set_id", "indices", "probabilities", "teaching_confidence"}
            assert (sp.indices.dtype, list(sp.indices.shape), len(sp.indices.data)) == (tpb.DTYPE_INT64, [BATCH], BATCH * 8)
            assert (sp.probabilities.dtype, list(sp.probabilities.shape), len(sp.probabilities.data)) == (
                tpb.DTYPE_FLOAT32, [BATCH, K], BATCH * K * 4)
            probs = np.frombuffer(sp.probabilities.data, "<f4").reshape(BATCH, K)
            np.testing.assert_allclose(probs.sum(1), 1, atol=1e-5)
            idx = np.frombuffer(sp.indices.data, "<i8")
            assert idx.min() >= 0 and idx.max() < 100  # org-0 teaches on its own domain's part only
    (join,) = [req for method, req in federation["sent"] if method.endswith("/Join")]
    assert _fields(join) == {"run_id", "organization_id", "seed_set", "num_train_examples", "num_classes",
                             "input_shape"}
    assert not join.declared_tensors
    for method, req in federation["sent"]:
        if method.endswith("/PullInstructions"):
            assert _fields(req) <= {"run_id", "organization_id", "completed_round", "wait_seconds"}
        elif method.endswith("/Status"):
            assert _fields(req) <= {"run_id"}
        else:
            assert method.endswith(("/Join", "/PushUpdate")), method


def _fedh2l_run() -> tuple[dict[str, Any], dict[str, Any]]:
    (run,) = aggregator_config(OPTS, "unused")["runs"]
    return {**run, "rounds": 2}, run["seed_set"]


def test_a_client_with_another_seed_set_is_refused(aggregator: Callable[..., Any], tmp_path: Path) -> None:
    from hetfed.client.data import DataConfig
    from hetfed.client.data.rotated import build_seed_set
    from hetfed.client.data.seedset import SeedSet
    from hetfed.client.runtime import ClientError

    run, _ = _fedh2l_run()
    agg = aggregator(run)
    # The organization mounts a seed-set file that differs from the run's in one pixel.
    good = build_seed_set(DataConfig(dataset="mnist5k", partition="rotated", num_clients=CLIENTS))
    x = good.x.copy()
    x[0, 0, 14, 14] ^= 1
    SeedSet(good.id, x, good.y, good.domain).save(tmp_path / "seed.npz")
    cfg = client_config(OPTS, "fedh2l", 0, agg.port)
    cfg["data"]["seed_set_path"] = str(tmp_path / "seed.npz")
    cfg["retry"] = {"give_up_after_seconds": 5.0}
    with pytest.raises(ClientError, match=r"FAILED_PRECONDITION.*seed_set_mismatch"):
        client_runtime(cfg).run()
    # The unchanged file is accepted (Join succeeds; the client then waits for peers, so we stop there).
    good.save(tmp_path / "good.npz")
    raw = RawClient(agg.port, "org-0", run="fedh2l")
    try:
        req = apb.JoinRequest(run_id="fedh2l", organization_id="org-0")
        loaded = SeedSet.load(tmp_path / "good.npz")
        req.seed_set.id, req.seed_set.sha256 = loaded.id, loaded.sha256
        assert raw.stub.Join(req, metadata=raw.metadata, timeout=10).algorithm == "fedh2l"
    finally:
        raw.close()


def test_model_weights_and_foreign_posteriors_are_refused(aggregator: Callable[..., Any],
                                                          raw_client: Callable[..., RawClient]) -> None:
    run, seed_set = _fedh2l_run()
    agg = aggregator(run)
    c = raw_client(agg.port, "org-1", run="fedh2l")
    req = apb.JoinRequest(run_id="fedh2l", organization_id="org-1")
    req.seed_set.id, req.seed_set.sha256 = seed_set["id"], seed_set["sha256"]
    c.stub.Join(req, metadata=c.metadata, timeout=10)
    c.pull(completed=0)
    w = ModelWeights({"encoder.1.weight": np.ones((4, 4), np.float32)}, 10)
    with pytest.raises(grpc.RpcError) as err:
        c.push(1, [w, EvalMetrics()])
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "payload_kind_not_allowed" in err.value.details()
    # Posteriors on another organization's part of the seed set are no teaching signal of org-1.
    probs = np.full((4, K), 0.1, np.float32)
    foreign = SeedPosteriors(seed_set["id"], np.arange(4, dtype=np.int64), probs, 0.5)
    with pytest.raises(grpc.RpcError) as err:
        c.push(1, [foreign, EvalMetrics()])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "own domain part" in err.value.details()
    own = SeedPosteriors(seed_set["id"], np.arange(100, 104, dtype=np.int64), probs, 0.5)
    assert c.push(1, [own, EvalMetrics()]).accepted
    other = raw_client(agg.port, "org-2", run="fedh2l")
    req.organization_id = "org-2"
    other.stub.Join(req, metadata=other.metadata, timeout=10)
    with pytest.raises(grpc.RpcError) as err:  # posteriors are required every training round
        other.push(1, [EvalMetrics()])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "missing_payload" in err.value.details()
