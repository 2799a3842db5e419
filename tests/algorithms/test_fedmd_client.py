"""FedMD's client half on a tiny linear model: the digest loss (mean absolute error on the logits) and one digest
step against a float64 hand computation; the logits it uploads on the round's public subset; the round's order
(digest, then revisit, then score)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hetfed.client.algorithms import ClientContext, client_half_type
from hetfed.client.algorithms.fedmd import FedMDClient, digest_loss
from hetfed.client.data import ArrayDataset, ClientData
from hetfed.client.data.seedset import SeedSet
from hetfed.client.models import SplitModel
from hetfed.wire.payloads import EvalMetrics, Received, SeedPosteriors
from hetfed.wire.specs import get_spec
from hetfed.wire.specs.fedmd import public_subset

K, D, N_PUB = 3, 4, 10
SPEC = get_spec("fedmd")
CPU = torch.device("cpu")
rng = np.random.default_rng(3)
PUB = SeedSet("pub", rng.integers(0, 256, (N_PUB, 1, 2, 2), dtype=np.uint8), rng.integers(0, K, N_PUB),
              np.zeros(N_PUB, np.int64))
Y = np.array([0, 1, 2, 1, 0, 2], np.int64)
X = rng.standard_normal((Y.size, 1, 2, 2)).astype(np.float32)
W0 = rng.standard_normal((K, D))
B0 = rng.standard_normal(K)
IDX = np.array([1, 4, 5, 8], np.int64)
CONSENSUS = rng.standard_normal((IDX.size, K)).astype(np.float32)


def linear() -> SplitModel:
    model = SplitModel(nn.Flatten(), D, K)
    with torch.no_grad():
        model.head.weight.copy_(torch.as_tensor(W0))
        model.head.bias.copy_(torch.as_tensor(B0))
    return model


def client(**fields: object) -> FedMDClient:
    config = SPEC.config(**{"optimizer": "sgd", "lr": 0.5, "momentum": 0.0, "digest_batch_size": 64, **fields})
    data = ClientData(ArrayDataset(X, Y), ArrayDataset(X, Y), None, K, (1, 2, 2), "toy", public=PUB)
    assert client_half_type(SPEC) is FedMDClient
    return FedMDClient(ClientContext("org-0", linear(), data, CPU, config, seed=4))


def received() -> Received:
    return Received([SeedPosteriors("pub", IDX, CONSENSUS, 0.0)], frozenset())


def hand_mae_and_gradient() -> tuple[float, np.ndarray, np.ndarray]:
    """L = (1/(n·K))·Σ_i Σ_k |W x_i + b − c_i|_k and its gradient, written out in float64."""
    x = PUB.x[IDX].reshape(IDX.size, D).astype(np.float64) / 255.0
    c = CONSENSUS.astype(np.float64)
    loss, gw, gb = 0.0, np.zeros((K, D)), np.zeros(K)
    for i in range(IDX.size):
        for k in range(K):
            r = sum(W0[k, j] * x[i, j] for j in range(D)) + B0[k] - c[i, k]
            loss += abs(r)
            gw[k] += np.sign(r) * x[i]
            gb[k] += np.sign(r)
    scale = IDX.size * K
    return loss / scale, gw / scale, gb / scale


def test_the_digest_loss_is_the_mean_absolute_error_of_the_logits() -> None:
    logits = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, 1.0]])
    target = torch.tensor([[0.5, 1.0, 0.5], [-1.0, 3.0, 4.0]])
    assert digest_loss(logits, target).tolist() == pytest.approx([(0.5 + 3.0 + 0.0) / 3, (1.0 + 0.0 + 3.0) / 3])


def test_one_digest_step_is_sgd_on_the_hand_computed_mae_gradient() -> None:
    half = client()
    loss = half.digest(received().maybe(SeedPosteriors), np.random.default_rng(0))
    hand_loss, gw, gb = hand_mae_and_gradient()
    assert loss == pytest.approx(hand_loss, rel=1e-6)  # one batch, one step: its loss before the step
    head = half.ctx.model.head
    np.testing.assert_allclose(head.weight.detach().double().numpy(), W0 - 0.5 * gw, rtol=0, atol=1e-6)
    np.testing.assert_allclose(head.bias.detach().double().numpy(), B0 - 0.5 * gb, rtol=0, atol=1e-6)


def test_digest_batches_cover_the_subset_once_per_epoch() -> None:
    half = client(digest_batch_size=3, digest_epochs=2, lr=1e-9)
    seen: list[list[int]] = []
    original = half.ctx.model.forward

    def record(x: torch.Tensor) -> torch.Tensor:
        seen.append([int(v) for v in x.shape[:1]])
        return original(x)

    half.ctx.model.forward = record  # type: ignore[method-assign]
    half.digest(received().maybe(SeedPosteriors), np.random.default_rng(0))
    assert seen == [[3], [1], [3], [1]]  # ⌈4/3⌉ batches, twice


def test_a_round_digests_revisits_then_uploads_logits_on_its_subset() -> None:
    half = client(public_subset=5, local_epochs=1, batch_size=6, lr=0.1)
    sent = half.train(2, 77, received())
    scores, metrics = sent
    assert isinstance(scores, SeedPosteriors) and isinstance(metrics, EvalMetrics)
    idx = public_subset(77, N_PUB, 5)
    assert scores.seed_set_id == "pub" and np.array_equal(scores.indices, idx)
    # The logits are the trained model's, on the subset's public examples (after digest and revisit).
    with torch.no_grad():
        expected = half.ctx.model(torch.as_tensor(PUB.features()[idx])).numpy()
    np.testing.assert_array_equal(scores.probabilities, expected)
    assert not np.allclose(half.ctx.model.head.weight.detach().numpy(), W0)
    assert metrics.extra["digest_loss"] == pytest.approx(hand_mae_and_gradient()[0], rel=1e-6)
    # Round 1 has no consensus: no digest, the revisit only.
    assert client().train(1, 5, Received([], frozenset()))[1].extra["digest_loss"] == 0.0  # type: ignore[union-attr]


def test_a_consensus_on_another_seed_set_is_refused() -> None:
    with pytest.raises(ValueError, match="seed set"):
        client().digest(SeedPosteriors("other", IDX, CONSENSUS, 0.0), np.random.default_rng(0))
