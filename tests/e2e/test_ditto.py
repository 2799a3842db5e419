"""Ditto end to end over loopback gRPC: a real aggregator process running FedAvg and Ditto+MMD-D side by side,
real client processes, and one in-process Ditto client whose every request is recorded, to show that only the
global model's weights and metrics go up, never a byte of the personal model or of the MMD-D kernel."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from hetfed.cli.localrun import LocalRunOptions, summarize_run
from hetfed.v1 import aggregator_pb2 as apb
from tests.e2e.recording import run_recorded
from tests.e2e.runs import recorded_run

pytestmark = pytest.mark.e2e
ROUNDS, CLIENTS = 2, 2
# The paper's setup on small organizations (200 examples each), MMD-D refit every 4 steps on 2 batches.
OPTS = LocalRunOptions(algorithms=("fedavg", "ditto_mmdd"), clients=CLIENTS, rounds=ROUNDS, dataset="synthetic",
                       data={"synthetic_samples": 200}, train={"local_epochs": 1},
                       extra_algorithm_config={"ditto_mmdd": {"refit_every": 4, "refit_batches": 2}})
DITTO = "ditto-mmdd"


def _bytes(t: torch.Tensor) -> list[bytes]:
    """The tensor's bytes in float32 (what the wire would carry) and, for float64 tensors, as stored."""
    out = [t.detach().cpu().float().numpy().tobytes()]
    if t.dtype == torch.float64:
        out.append(t.detach().cpu().numpy().tobytes())
    return out


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """FedAvg (two client processes) and Ditto+MMD-D (org-1 a process, org-0 in this process, recorded)."""
    import hetfed.client.algorithms as algorithms

    secrets: list[bytes] = []  # every state w_L and the kernel held after a round's training
    shared: list[bytes] = []  # and w_G's, which must go up
    original = algorithms.client_half_type

    def recorded_type(spec: Any) -> Any:
        """The runtime's half class, remembering w_L, the kernel and w_G after every round's training."""
        base = original(spec)

        class Recorded(base):  # type: ignore[misc,valid-type]
            def train(self, round_: int, round_seed: int, received: Any) -> Any:
                upload = super().train(round_, round_seed, received)
                for p in self.personal.parameters():
                    secrets.extend(_bytes(p))
                for drift in self.drifts.values():
                    for p in drift.module.parameters():
                        secrets.extend(_bytes(p))
                for p in self.ctx.model.parameters():
                    shared.extend(_bytes(p))
                return upload

        return Recorded

    def run_in_process(cfg: dict[str, Any]) -> tuple[list[tuple[str, Any]], Any]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(algorithms, "client_half_type", recorded_type)
            return run_recorded(cfg)

    processes = [*((f"fedavg-org-{i}", "fedavg", i) for i in range(CLIENTS)), ("ditto-org-1", DITTO, 1)]
    with recorded_run(tmp_path_factory.mktemp("ditto"), OPTS, processes, (DITTO, 0), timeout=120,
                      run=run_in_process) as run:
        yield {"summaries": {s.run_id: summarize_run(s) for s in run.status}, "sent": run.sent,
               "secrets": secrets, "shared": shared}


def _uploaded(sent: list[tuple[str, Any]]) -> bytes:
    """Every byte the recorded client sent: each request message serialized, stream chunks included."""
    out = []
    for _, request in sent:
        for message in request if isinstance(request, list) else [request]:
            out.append(message.SerializeToString())
    return b"".join(out)


def _windows(blob: bytes, width: int = 16, stride: int = 4) -> list[bytes]:
    return [blob[i : i + width] for i in range(0, len(blob) - width + 1, stride)]


def test_no_byte_sequence_of_the_personal_model_or_the_kernel_goes_up(federation: dict[str, Any]) -> None:
    wire = _uploaded(federation["sent"])
    secrets, shared = federation["secrets"], federation["shared"]
    # w_L (4 tensors) and the MMD-D kernel (8 featuriser tensors and 3 scalars) after each of the two rounds.
    assert len(secrets) > 2 * 4
    for blob in secrets:
        # Every 16-byte window of a tensor (4 float32 values, at every float offset); a scalar (the kernel's ε and
        # bandwidths) whole in float64 (a lone 4-byte float32 could match anything by chance).
        leaked = [w for w in _windows(blob) if w in wire] if len(blob) >= 16 else (
            [blob] if len(blob) >= 8 and blob in wire else [])
        assert not leaked, f"{len(leaked)} byte sequences of the personal model or the kernel were uploaded"
    # The search does find what does go up: every tensor of w_G, whole, after every round.
    assert all(blob in wire for blob in shared)


def test_only_global_weights_and_metrics_go_up(federation: dict[str, Any]) -> None:
    pushes = [items for method, items in federation["sent"] if method.endswith("/PushUpdate")]
    assert len(pushes) == ROUNDS + 1
    for r, items in enumerate(pushes, start=1):
        update = apb.Update.FromString(b"".join(req.chunk.data for req in items))
        kinds = [p.WhichOneof("kind") for p in update.payloads]
        assert kinds == (["model_weights", "eval_metrics"] if r <= ROUNDS else ["eval_metrics"])
        for p in update.payloads:
            if p.WhichOneof("kind") == "model_weights":
                assert sorted(t.name for t in p.model_weights.tensors) == [
                    "encoder.1.bias", "encoder.1.weight", "head.bias", "head.weight"]
    for method, _ in federation["sent"]:
        assert method.endswith(("/Join", "/PushUpdate", "/PullInstructions", "/Status")), method


def test_the_global_model_is_fedavgs_and_the_personal_models_are_reported(federation: dict[str, Any]) -> None:
    fedavg, ditto = federation["summaries"]["fedavg"], federation["summaries"][DITTO]
    assert [r["round"] for r in ditto["rounds"]] == list(range(1, ROUNDS + 2))
    for a, b in zip(fedavg["rounds"], ditto["rounds"], strict=True):
        # Same data, batches and initial weights: Ditto's w̄ is FedAvg's, to the bit, every round.
        for org, m in b["per_organization"].items():
            assert m["global_model_test_accuracy"] == a["per_organization"][org]["test_accuracy"], (b["round"], org)
        # The same payload goes up: the global model's weights (and metrics).
        assert b["bytes_up"].get("model_weights") == a["bytes_up"].get("model_weights")
    final = ditto["rounds"][-1]["per_organization"]
    assert ditto["final_figures"]["global"] == pytest.approx(np.mean([m["global_model_test_accuracy"]
                                                                      for m in final.values()]))
    assert ditto["figure_labels"] == {"global": "global model"}
    assert all(0.0 <= m["test_accuracy"] <= 1.0 for m in final.values())
