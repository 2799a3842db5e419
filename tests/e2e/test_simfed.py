"""SimFed end to end over loopback gRPC: a real aggregator process, real client processes, one in-process client
whose every request is recorded (what an organization uploads), and a run whose organizations count their
classes differently."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetfed.cli.localrun import LocalRunOptions, summarize_run
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import payloads_pb2 as pb
from hetfed.v1 import tensor_pb2 as tpb
from hetfed.wire import codec
from tests.conftest import load_benchmark
from tests.e2e.runs import recorded_run
from tests.e2e.test_fedh2l import _fields

pytestmark = pytest.mark.e2e
ROUNDS, CLIENTS, LATENT = 3, 3, 84  # LeNet's latent width
OPTS = LocalRunOptions(algorithms=("simfed",), clients=CLIENTS, rounds=ROUNDS, dataset="digits", partition="dirichlet",
                       models=("lenet",), data={"permute_labels": True},
                       extra_algorithm_config={"simfed": {"local_epochs": 1, "batch_size": 32,
                                                          "mask_init": "sparse"}})


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """org-1 and org-2 as processes, org-0 in this process with a recorder on its gRPC channel."""
    workdir = tmp_path_factory.mktemp("simfed")
    processes = [(f"org-{i}", "simfed", i) for i in range(1, CLIENTS)]
    with recorded_run(workdir, OPTS, processes, ("simfed", 0)) as run:
        (status,) = run.status
        yield {"summary": summarize_run(status), "sent": run.sent, "reports": run.reports,
               "state": workdir / "state" / "simfed"}


def _update(items: list[Any]) -> tuple[apb.Update, bytes]:
    raw = b"".join(req.chunk.data for req in items)
    return apb.Update.FromString(raw), raw


def test_a_short_permuted_label_run_finishes_with_personalised_downloads(federation: dict[str, Any]) -> None:
    summary = federation["summary"]
    rounds = {r["round"]: r for r in summary["rounds"]}
    assert sorted(rounds) == list(range(1, ROUNDS + 2))
    final = rounds[ROUNDS + 1]["per_organization"]
    assert sorted(final) == [f"org-{i}" for i in range(CLIENTS)]
    for m in final.values():
        assert 0.0 <= m["test_accuracy"] <= 1.0 and 0.0 < m["mask_density"] < 0.5
    assert summary["final_figures"]["mask_density"] == pytest.approx(np.mean([m["mask_density"] for m in final.values()]))
    for r in range(1, ROUNDS + 1):
        assert set(rounds[r]["bytes_up"]) == {"factorized_weights", "criteria_embeddings", "eval_metrics", "envelope"}
        # Round 1 has no reflection; from round 2 on every organization receives its own factors.
        assert set(rounds[r]["bytes_down"]) == ({"envelope"} if r == 1 else {"factorized_weights", "envelope"})
    assert "factorized_weights" not in rounds[ROUNDS + 1]["bytes_down"]


def test_uploads_are_factors_criteria_embeddings_and_metrics_only(federation: dict[str, Any]) -> None:
    from hetfed.client.algorithms.simfed.layers import criteria_inputs
    from hetfed.client.data import DataConfig, load_client_data
    from hetfed.client.models import build_model

    data = load_client_data(DataConfig(dataset="digits", partition="dirichlet", num_clients=CLIENTS, client_index=0,
                                       permute_labels=True))
    dense = build_model("lenet", data.input_shape, data.num_classes)
    encoder = {k: tuple(v.shape) for k, v in dense.state_dict().items() if k.startswith("encoder.")}
    head_sizes = {p.numel() for p in dense.head.parameters()}
    x_n = criteria_inputs(0, data.input_shape).numpy()  # the run's criteria inputs (seed 0)
    pushes = [items for method, items in federation["sent"] if method.endswith("/PushUpdate")]
    assert len(pushes) == ROUNDS + 1
    for r, items in enumerate(pushes, start=1):
        update, raw = _update(items)
        assert _fields(update) == {"envelope", "payloads"}
        kinds = [p.WhichOneof("kind") for p in update.payloads]
        assert kinds == (["factorized_weights", "criteria_embeddings", "eval_metrics"] if r <= ROUNDS
                         else ["eval_metrics"])
        # The criteria inputs themselves never travel (only their embeddings).
        assert x_n.astype("<f4").tobytes() not in raw
        for p in update.payloads:
            kind = p.WhichOneof("kind")
            if kind == "criteria_embeddings":
                ce = p.criteria_embeddings
                assert (ce.embeddings.dtype, list(ce.embeddings.shape)) == (tpb.DTYPE_FLOAT32, [1, LATENT])
                assert ce.criteria_set_id.startswith("normal(0,1) seed=0 count=1")
            elif kind == "factorized_weights":
                layers = p.factorized_weights.layers
                # Every factorised layer is an encoder layer (the dense LeNet's weight names); the head never goes.
                assert [f"{layer.name}.weight" for layer in layers] == [k for k in encoder if k.endswith("weight")]
                sent_floats = 0
                decoded = codec.factorized_weights_from_proto(p.factorized_weights, None).layers
                for layer, mask in zip(layers, decoded, strict=True):
                    rows, cols = layer.mask_shape
                    assert list(layer.u.shape) == [rows] and list(layer.v.shape) == [cols]
                    nnz = mask.mask_indices.size
                    # Each mask in its smallest form: gaps (1, 2 or 4 bytes by the largest), a bitmap, or dense.
                    gap = int(np.diff(mask.mask_indices, prepend=-1).max()) - 1 if nnz else 0
                    sizes = {pb.MASK_ENCODING_GAPS: (1 if gap < 256 else 2 if gap < 65536 else 4) * nnz,
                             pb.MASK_ENCODING_BITMAP: (rows * cols + 7) // 8, pb.MASK_ENCODING_DENSE: 4 * (rows * cols - nnz)}
                    assert sizes[layer.mask_encoding] == min(sizes.values())
                    form = {pb.MASK_ENCODING_GAPS: {"mask_indices"}, pb.MASK_ENCODING_BITMAP: {"mask_bitmap"},
                            pb.MASK_ENCODING_DENSE: set()}[layer.mask_encoding]
                    assert _fields(layer) == {"name", "u", "v", "mask_values", "mask_shape", "mask_encoding"} | form
                    # No dense weight: u, v and the sparse mask are far fewer numbers than the layer's weight.
                    assert rows + cols + nnz < 0.5 * rows * cols
                    assert rows * cols == math.prod(encoder[f"{layer.name}.weight"])
                    sent_floats += rows + cols + nnz
                    for t in (layer.u, layer.v, layer.mask_values):
                        assert t.shape[0] not in head_sizes or t.shape[0] in (rows, cols)
                assert sent_floats < 0.5 * sum(math.prod(s) for k, s in encoder.items() if k.endswith("weight"))
            else:
                assert kind == "eval_metrics"
    for method, req in federation["sent"]:
        if method.endswith("/Join"):
            assert _fields(req) <= {"run_id", "organization_id", "num_train_examples", "num_classes",
                                    "input_shape"} and not req.declared_tensors
        else:
            assert method.endswith(("/PullInstructions", "/PushUpdate", "/Status")), method


def test_the_checkpoint_holds_the_similarity_matrix_for_the_picture(federation: dict[str, Any]) -> None:
    from hetfed.aggregator.journal.store import RunStore

    _, arrays = RunStore(federation["state"].parent, "simfed").read_checkpoint()
    sigma, order = arrays["sigma"], json.loads(bytes(arrays["sigma_order"]).decode())
    assert order == [f"org-{i}" for i in range(CLIENTS)] and sigma.shape == (CLIENTS, CLIENTS)
    np.testing.assert_allclose(np.diag(sigma), 1.0)
    np.testing.assert_allclose(sigma, sigma.T, atol=1e-12)
    # σ is the cosine of the latest criteria embeddings the checkpoint holds.
    z = np.stack([arrays[f"z/{o}"].reshape(-1).astype(np.float64) for o in order])
    unit = z / np.linalg.norm(z, axis=1, keepdims=True)
    np.testing.assert_allclose(sigma - np.diag(np.diag(sigma)), unit @ unit.T - np.eye(CLIENTS), atol=1e-9)
    # The picture script reads the same σ in the same order and draws it.
    script = load_benchmark("simfed_similarity")
    drawn, drawn_order, _, meta = script.load_similarity(federation["state"].parent, "simfed")
    assert drawn_order == order and meta["half"]["closed_round"] == ROUNDS
    np.testing.assert_array_equal(drawn, sigma)
    out = federation["state"].parent / "similarity.png"
    script.draw(drawn, drawn_order, 0.9, "σ", out)
    assert out.read_bytes().startswith(b"\x89PNG")


def _npz_org(root: Path, classes: int, seed: int) -> Path:
    """An organization's own files: digits of its first ``classes`` classes, permuted by its own naming."""
    from hetfed.client.data.images import load_digits

    x, y = load_digits()
    keep = np.flatnonzero(y < classes)
    rng = np.random.default_rng(seed)
    keep = rng.permutation(keep)[:300]
    names = rng.permutation(classes)
    root.mkdir(parents=True)
    np.savez(root / "train.npz", x=x[keep], y=names[y[keep]])
    return root


def test_organizations_with_different_numbers_of_classes_federate(
    aggregator: Callable[..., Any], tmp_path: Path
) -> None:
    from hetfed.client.config import ClientConfig
    from hetfed.client.runtime import ClientRuntime
    from hetfed.wire.config import from_mapping

    run = {"id": "r", "algorithm": "simfed", "organizations": ["five", "ten"], "rounds": 2,
           "algorithm_config": {"local_epochs": 1, "batch_size": 64}}
    agg = aggregator(run)
    reports: dict[str, list[Any]] = {}

    def client(org: str, classes: int) -> None:
        cfg = {"organization": org, "run": "r", "aggregator": f"127.0.0.1:{agg.port}", "threads": 1,
               "data": {"dataset": "npz", "partition": "natural", "path": str(_npz_org(tmp_path / org, classes, classes))},
               "model": {"name": "lenet"}, "retry": {"give_up_after_seconds": 60.0}}
        reports[org] = ClientRuntime(from_mapping(ClientConfig, cfg)).run()

    threads = [threading.Thread(target=client, args=a) for a in (("five", 5), ("ten", 10))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(reports) == ["five", "ten"]
    status = agg.service.runs["r"].status()
    assert status.finished
    for org in ("five", "ten"):
        rounds = [r for r, _ in reports[org]]
        assert rounds == [1, 2, 3]  # two training rounds and the evaluation
        assert 0.0 <= reports[org][-1][1].test_accuracy <= 1.0
    # Both organizations were matched and reflected: each one's round-2 download is its own.
    half = agg.service.runs["r"].aggregation.half
    assert set(half.latest) == {"five", "ten"} and half.sigma.shape == (2, 2)
