"""FedSR end to end over loopback gRPC: a real aggregator process, a real client process, and one in-process
client whose every request is recorded, once with r local (the default) and once shared, to show exactly what
an organization uploads, and that nothing of the held-out target domain crosses the wire."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from google.protobuf import unknown_fields

from hetfed.cli.localrun import LocalRunOptions, summarize_run
from hetfed.client.data import DataConfig, load_client_data
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import tensor_pb2 as tpb
from tests.e2e.runs import recorded_run

pytestmark = pytest.mark.e2e
ROUNDS, CLIENTS, TARGET, Z, K = 2, 2, 2, 64, 10
# Two sources (M0, M15) and the held-out target M30: the smallest leave-one-domain-out federation.
SETTINGS = {"num_samples": 2, "eval_every": 1}
REFERENCE = {"reference.r_mu": [K, Z], "reference.r_sigma_raw": [K, Z], "reference.scale": []}


def _options(shared: bool) -> LocalRunOptions:
    return LocalRunOptions(algorithms=("fedsr",), clients=CLIENTS, rounds=ROUNDS, data={"target_domain": TARGET},
                           extra_algorithm_config={"fedsr": {**SETTINGS, "shared_reference": shared}})


def _model_shapes() -> dict[str, list[int]]:
    """The floating state of the run's probabilistic rmnist_cnn, by name."""
    from hetfed.client.algorithms.fedavg import shared_state
    from hetfed.client.algorithms.fedsr import FedSRClient
    from hetfed.wire.specs.fedsr import FedSRConfig

    model = FedSRClient.make_model("rmnist_cnn", (1, 28, 28), K, seed=0, latent_dim=Z, bounded_latent=False,
                                   config=FedSRConfig())
    return {k: list(v.shape) for k, v in shared_state(model).items()}


def _federation(tmp_path_factory: pytest.TempPathFactory, shared: bool) -> Iterator[dict[str, Any]]:
    opts = _options(shared)
    workdir = tmp_path_factory.mktemp("fedsr-shared" if shared else "fedsr-local")
    with recorded_run(workdir, opts, [("org-1", "fedsr", 1)], ("fedsr", 0)) as run:
        (status,) = run.status
        yield {"summary": summarize_run(status), "sent": run.sent, "state": workdir / "state"}


@pytest.fixture(scope="module")
def local_r(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    yield from _federation(tmp_path_factory, shared=False)


@pytest.fixture(scope="module")
def shared_r(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    yield from _federation(tmp_path_factory, shared=True)


def _fields(message: Any) -> set[str]:
    assert len(unknown_fields.UnknownFieldSet(message)) == 0
    return {f.name for f, _ in message.ListFields()}


def _updates(sent: list[tuple[str, Any]]) -> list[apb.Update]:
    return [apb.Update.FromString(b"".join(req.chunk.data for req in items))
            for method, items in sent if method.endswith("/PushUpdate")]


def test_a_short_run_reports_the_target_and_source_validation(local_r: dict[str, Any]) -> None:
    summary = local_r["summary"]
    assert [r["round"] for r in summary["rounds"]] == list(range(1, ROUNDS + 2))
    final = summary["rounds"][-1]["per_organization"]
    assert sorted(final) == ["org-0", "org-1"]
    for m in final.values():
        assert 0.0 <= m["target_test_accuracy"] <= 1.0 and m["num_test_examples"] == 100
    # Both organizations hold the same global model and draw the same prediction noise: one target accuracy.
    assert final["org-0"]["target_test_accuracy"] == final["org-1"]["target_test_accuracy"]
    assert summary["figure_labels"] == {"target": "target acc", "source_val": "source val acc"}
    assert summary["final_figures"]["target"] == pytest.approx(final["org-0"]["target_test_accuracy"])
    assert summary["final_figures"]["source_val"] == pytest.approx(
        np.mean([m["test_accuracy"] for m in final.values()]))


@pytest.mark.parametrize("shared", [False, True])
def test_uploads_are_exactly_the_model_r_only_when_shared_and_metrics(shared: bool, request: pytest.FixtureRequest) -> None:
    run = request.getfixturevalue("shared_r" if shared else "local_r")
    expected = {**_model_shapes(), **(REFERENCE if shared else {})}
    assert not any(k.startswith("reference.") for k in _model_shapes())
    updates = _updates(run["sent"])
    assert len(updates) == ROUNDS + 1
    for r, update in enumerate(updates, start=1):
        assert _fields(update) == {"envelope", "payloads"}
        kinds = [p.WhichOneof("kind") for p in update.payloads]
        assert kinds == (["model_weights", "eval_metrics"] if r <= ROUNDS else ["eval_metrics"])
        for p in update.payloads:
            _fields(p)
            if p.WhichOneof("kind") == "eval_metrics":
                # Scalars only: the own validation split's and the target's accuracy and loss, no example.
                assert _fields(p.eval_metrics) <= {f.name for f in p.eval_metrics.DESCRIPTOR.fields}
                assert set(p.eval_metrics.extra) == {"evaluated_round", "target_test_accuracy", "target_test_loss"}
                continue
            mw = p.model_weights
            assert _fields(mw) == {"tensors", "num_examples"} and mw.num_examples == 900
            got = {t.name: list(t.tensor.shape) for t in mw.tensors}
            assert got == expected  # encoder, BN statistics, (μ, σ) layer and classifier; r only when shared
            for t in mw.tensors:
                assert t.tensor.dtype == tpb.DTYPE_FLOAT32
                assert len(t.tensor.data) == 4 * int(np.prod(t.tensor.shape, dtype=np.int64))
    joins = [req for method, req in run["sent"] if method.endswith("/Join")]
    declared = {d.name: list(d.shape) for j in joins for d in j.declared_tensors}
    assert declared == expected  # the schema fixed for the run at Join is the same set
    for method, _ in run["sent"]:
        assert method.endswith(("/Join", "/PushUpdate", "/PullInstructions")), method


def test_no_target_image_crosses_the_wire_or_reaches_the_aggregator(local_r: dict[str, Any],
                                                                    shared_r: dict[str, Any]) -> None:
    data = load_client_data(DataConfig(dataset="mnist5k", partition="rotated_lodo", num_clients=CLIENTS,
                                       target_domain=TARGET))
    target = data.extra_eval["target_test"]
    # Every target image as it would be serialized (float32 pixels, and the stored 8-bit pixels).
    needles = [x.astype("<f4").tobytes() for x in target.x[:50]] + [
        np.rint(x * 255).astype(np.uint8).tobytes() for x in target.x[:50]]
    for run in (local_r, shared_r):
        blobs = [req.SerializeToString() for method, items in run["sent"]
                 for req in (items if isinstance(items, list) else [items])]
        blobs += [f.read_bytes() for f in run["state"].rglob("*") if f.is_file()]
        haystack = b"\x00".join(blobs)
        assert len(haystack) > 1_000_000  # the model went up several times
        assert not any(n in haystack for n in needles)
