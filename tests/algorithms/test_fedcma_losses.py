"""Fed-CMA's loss terms (eq. 5) against hand-computed and float64 references, and their wiring in the client."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetfed.client.algorithms.base import ClientContext
from hetfed.client.algorithms.fedcma import FedCMAClient
from hetfed.client.algorithms.fedcma.losses import (
    BatchMeanSquaredAlignment,
    ClassMeanAlignment,
    HeadConsensusTerm,
)
from hetfed.client.data import ArrayDataset, ClientData
from hetfed.client.models import build_model
from hetfed.client.training import Batch, Forward, cross_entropy, eval_mode
from hetfed.wire.payloads import ClassCounts, ClassMeanEmbeddings, HeadWeights, Received
from hetfed.wire.specs.fedcma import FedCMAConfig


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def test_head_consensus_term_by_hand() -> None:
    w_ref, b_ref = t([[0.0, 2.0, 5.0]]).requires_grad_(), t([0.0]).requires_grad_()
    lambda1, p_i = 0.5, 0.25
    term = HeadConsensusTerm(0.5 * lambda1 * p_i, w_ref, b_ref)
    w, b = t([[1.0, 2.0, 3.0]]).requires_grad_(), t([1.0]).requires_grad_()
    loss = term(w, b)
    # (λ1/2)·p_i·(||W - W̄||² + ||b - b̄||²) = 0.0625·(1 + 0 + 4 + 1)
    assert loss.item() == 0.375
    loss.backward()
    np.testing.assert_array_equal(w.grad.numpy(), [[0.125, 0.0, -0.25]])  # 2·0.0625·(W - W̄)
    np.testing.assert_array_equal(b.grad.numpy(), [0.125])
    assert w_ref.grad is None and b_ref.grad is None  # never backpropagate into v̄


def test_class_mean_alignment_by_hand() -> None:
    z = t([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]]).requires_grad_()
    labels = torch.tensor([0, 0, 1])
    centers = t([[1.0, 0.0], [0.0, 1.0]]).requires_grad_()
    # p^0 = 0.5 over b^0 = 2 points, p^1 = 1.0 over b^1 = 1 point
    weight = t([0.5 / 2, 1.0 / 1])
    align = ClassMeanAlignment(0.5, centers, weight, torch.tensor([True, True]))
    loss = align(z, labels)
    # (λ2/2)·[0.25·(1 + 0) + 1.0·1] = 0.25·1.25
    assert loss.item() == 0.3125
    loss.backward()
    # d/dz = λ2·w_k·(z - ē^k)
    np.testing.assert_array_equal(z.grad.numpy(), [[-0.125, 0.0], [0.0, 0.0], [0.0, 0.5]])
    assert centers.grad is None  # never backpropagate into ē
    # A class whose ē^k is not set contributes nothing.
    inactive = ClassMeanAlignment(0.5, centers, weight, torch.tensor([True, False]))
    assert inactive(z, labels).item() == 0.0625


def test_class_mean_alignment_matches_a_float64_reference() -> None:
    rng = np.random.default_rng(0)
    k, d, n = 4, 5, 30
    z = rng.uniform(size=(n, d))
    y = rng.integers(0, k, size=n)
    e = rng.uniform(size=(k, d))
    p = rng.dirichlet(np.ones(k))
    sizes = np.bincount(y, minlength=k)
    lam = 0.7
    want = 0.5 * lam * sum(p[c] / sizes[c] * ((z[y == c] - e[c]) ** 2).sum() for c in range(k) if sizes[c])
    w = torch.tensor(np.divide(p, np.maximum(sizes, 1)))
    got = ClassMeanAlignment(lam, torch.tensor(e), w, torch.ones(k, dtype=torch.bool))(torch.tensor(z), torch.tensor(y))
    assert float(got) == pytest.approx(want, rel=1e-12)


def test_reference_form_is_a_per_class_mse_on_the_batch() -> None:
    z = t([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    labels = torch.tensor([0, 0, 1])
    centers = t([[1.0, 0.0], [0.0, 1.0]])
    # class 0: mean of (1, 0, 0, 0) = 0.25; class 1: mean of (0, 1) = 0.5; times λ2
    assert float(BatchMeanSquaredAlignment(2.0, centers, torch.tensor([True, True]))(z, labels)) == 1.5
    assert float(BatchMeanSquaredAlignment(2.0, centers, torch.tensor([False, True]))(z, labels)) == 1.0


def make_client(model_name: str = "mlp", **cfg: object) -> FedCMAClient:
    """A Fed-CMA client on 3 classes with counts [5, 3, 0] (class 2 absent), d_e = 2."""
    rng = np.random.default_rng(1)
    y = np.array([0] * 5 + [1] * 3)
    x = rng.normal(size=(8, 1, 4, 4)).astype(np.float32)
    train = ArrayDataset(x, y)
    data = ClientData(train, ArrayDataset(x[:3], y[:3]), None, 3, (1, 4, 4), "toy")
    model = build_model(model_name, (1, 4, 4), 3, latent_dim=2, bounded_latent=True, seed=0)
    config = FedCMAConfig(latent_dim=2, num_classes=3, class_batch_size=4, **cfg)  # type: ignore[arg-type]
    return FedCMAClient(ClientContext("org", model, data, torch.device("cpu"), config, seed=0))


def received(means: list[list[float]], present: list[bool], totals: list[int], w: np.ndarray,
             b: np.ndarray) -> Received:
    return Received([
        ClassMeanEmbeddings(np.arange(3), np.array(means, np.float32), np.array(totals), np.array(present)),
        HeadWeights(w.astype(np.float32), b.astype(np.float32)),
    ])


def extra_terms(client: FedCMAClient, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """What eq. 5 adds to the cross-entropy on a batch: the sum of the client's terms after the first."""
    terms = client.terms()
    assert terms[0] is cross_entropy
    model = client.ctx.model
    batch, out = Batch(x, y), Forward(model(x))
    return sum((term(batch, out) for term in terms[1:]), torch.zeros(()))


def test_client_objective_is_eq5_with_p_weights_from_the_counts() -> None:
    client = make_client()
    (counts,) = client.setup(round_seed=1)
    assert isinstance(counts, ClassCounts)
    np.testing.assert_array_equal(counts.counts, [5, 3, 0])
    batch = client.fixed_batch()
    np.testing.assert_array_equal(np.bincount(batch.y.numpy(), minlength=3), [4, 3, 0])  # b_i^k = min(b, n_i^k)
    v_w, v_b = np.full((3, 2), 0.1), np.array([0.0, 0.5, -0.5])
    rec = received([[0.2, 0.8], [0.6, 0.4], [0.0, 0.0]], [True, True, False], [10, 12, 6], v_w, v_b)
    client._receive(rec)
    model = client.ctx.model
    # The first v̄ received initialises the head (the common v̄⁰).
    np.testing.assert_allclose(model.head.weight.detach().numpy(), v_w, atol=1e-7)
    with torch.no_grad():
        model.head.weight.add_(0.3)
    x, y = client.ctx.train.x[:4], client.ctx.train.y[:4]
    got = extra_terms(client, x, y).item()
    # Hand computation: p_i = 8 / 28, p_i^0 = 5/10, p_i^1 = 3/12 (class 2 absent, its ē not set).
    lam1, lam2 = 0.5, 0.5
    head_term = 0.5 * lam1 * (8 / 28) * float(((model.head.weight.detach().numpy() - v_w) ** 2).sum())
    z = model.embed(batch.x).detach().numpy().astype(np.float64)
    yb = batch.y.numpy()
    e = np.array([[0.2, 0.8], [0.6, 0.4]])
    align = 0.5 * lam2 * sum(p / n * ((z[yb == k] - e[k]) ** 2).sum() for k, p, n in ((0, 0.5, 4), (1, 0.25, 3)))
    assert got == pytest.approx(head_term + align, rel=1e-5)


def test_alignment_is_skipped_while_the_global_means_are_zero() -> None:
    client = make_client()
    client.setup(round_seed=1)
    v_w, v_b = np.zeros((3, 2)), np.zeros(3)
    client._receive(received([[0, 0]] * 3, [False] * 3, [10, 12, 6], v_w, v_b))
    assert not client.alignment_active()
    with torch.no_grad():
        client.ctx.model.head.weight.fill_(1.0)
    assert len(client.terms()) == 2  # cross-entropy and the head term
    x, y = client.ctx.train.x, client.ctx.train.y
    # Only the head term: (λ1/2)·p_i·||W - 0||² with W all ones (6 entries), bias unchanged at 0.
    assert extra_terms(client, x, y).item() == pytest.approx(0.25 * (8 / 28) * 6)


def test_no_gradient_reaches_the_global_means_or_head() -> None:
    client = make_client()
    client.setup(round_seed=1)
    client._receive(received([[0.2, 0.8], [0.6, 0.4], [0, 0]], [True, True, False], [10, 12, 6],
                             np.zeros((3, 2)), np.zeros(3)))
    x, y = client.ctx.train.x, client.ctx.train.y
    extra_terms(client, x, y).backward()
    assert client.global_means is not None and client.global_head is not None
    assert not client.global_means.requires_grad and client.global_means.grad is None
    assert all(not v.requires_grad for v in client.global_head)
    assert client.ctx.model.head.weight.grad is not None


def test_uploaded_means_are_eval_mode_means_over_the_fixed_batches() -> None:
    client = make_client("fedgen_cnn")  # has BatchNorm: train-mode and eval-mode latents differ
    client.setup(round_seed=1)
    model = client.ctx.model
    model.train()
    means = client.class_means()
    assert model.training  # the mode is restored
    batch = client.fixed_batch()
    model.eval()
    with torch.no_grad():
        z = model.embed(batch.x).double().numpy()
    model.train()
    yb = batch.y.numpy()
    np.testing.assert_allclose(means.means[0], z[yb == 0].mean(0), rtol=1e-6)
    np.testing.assert_allclose(means.means[1], z[yb == 1].mean(0), rtol=1e-6)
    np.testing.assert_array_equal(means.means[2], [0.0, 0.0])
    # Counted with the setup counts n_i^k (eq. 7's weights), not the 4 and 3 points of the fixed batches: their
    # summed form under secure aggregation, (n_i^k·e_i^k, n_i^k), and the head's, (N_i·v_i, N_i), are eq. 7's.
    np.testing.assert_array_equal(means.counts, [5, 3, 0])
    np.testing.assert_array_equal(means.presence, [True, True, False])
    assert client.head().num_examples == 8
    assert means.means.shape == (3, 2) and (means.means >= 0).all() and (means.means <= 1).all()


def test_fixed_batches_do_not_change_between_rounds_or_restarts() -> None:
    a, b = make_client(), make_client()
    a.setup(round_seed=1)
    b.setup(round_seed=999)  # the draw depends on the run seed and organization only
    assert torch.equal(a.fixed_batch().x, b.fixed_batch().x)


def test_a_model_of_the_wrong_width_is_refused_at_setup() -> None:
    client = make_client()
    client.cfg = FedCMAConfig(latent_dim=3, num_classes=3)
    with pytest.raises(ValueError, match="latent_dim=3"):
        client.setup(round_seed=1)


def _bn_running_stats(model: torch.nn.Module) -> list[torch.Tensor]:
    return [b.clone() for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)
            for b in (m.running_mean, m.running_var)]


def test_reference_head_consensus_is_lambda1_times_the_squared_distance() -> None:
    for alignment in ("paper", "reference"):  # the head term's form does not depend on the alignment's
        client = make_client(head_consensus="reference", alignment=alignment, lambda1=0.8)
        client.setup(round_seed=1)
        client._receive(received([[0, 0]] * 3, [False] * 3, [10, 12, 6], np.zeros((3, 2)), np.zeros(3)))
        with torch.no_grad():
            client.ctx.model.head.weight.fill_(0.5)
            client.ctx.model.head.bias.copy_(torch.tensor([1.0, 0.0, -2.0]))
        x, y = client.ctx.train.x, client.ctx.train.y
        # λ1·(||W - 0||² + ||b - 0||²) = 0.8·(6·0.25 + 1 + 4) = 5.2, no 1/2 and no p_i
        assert extra_terms(client, x, y).item() == pytest.approx(5.2, rel=1e-6)


def test_paper_head_consensus_keeps_p_weights_under_the_reference_alignment() -> None:
    client = make_client(alignment="reference", head_consensus="paper")
    client.setup(round_seed=1)
    client._receive(received([[0, 0]] * 3, [False] * 3, [10, 12, 6], np.zeros((3, 2)), np.zeros(3)))
    with torch.no_grad():
        client.ctx.model.head.weight.fill_(1.0)
    x, y = client.ctx.train.x, client.ctx.train.y
    assert extra_terms(client, x, y).item() == pytest.approx(0.25 * (8 / 28) * 6)


def test_reference_alignment_on_the_client_is_the_batch_mse_against_the_set_means() -> None:
    client = make_client(alignment="reference", head_consensus="reference", lambda1=0.5, lambda2=2.0, server_lr=0.5)
    client.setup(round_seed=1)
    v_w, v_b = np.zeros((3, 2)), np.zeros(3)
    client._receive(received([[0.2, 0.8], [0.6, 0.4], [0, 0]], [True, True, False], [10, 12, 6], v_w, v_b))
    model = client.ctx.model
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.zero_()
    x, y = client.ctx.train.x[2:7], client.ctx.train.y[2:7]  # classes 0, 0, 0, 1, 1
    with torch.no_grad():
        z = model.embed(x).double().numpy()
    e = np.array([[0.2, 0.8], [0.6, 0.4]])
    yb = y.numpy()
    want = 2.0 * sum(((z[yb == k] - e[k]) ** 2).mean() for k in (0, 1))
    assert extra_terms(client, x, y).item() == pytest.approx(want, rel=1e-5)


def test_alignment_bn_chooses_which_statistics_normalise_the_fixed_batches() -> None:
    rec = received([[0.2, 0.8], [0.6, 0.4], [0, 0]], [True, True, False], [10, 12, 6], np.zeros((3, 2)), np.zeros(3))
    p, e = np.array([5 / 10, 3 / 12]), np.array([[0.2, 0.8], [0.6, 0.4]])
    for mode in ("train", "eval"):
        client = make_client("fedgen_cnn", alignment_bn=mode)
        client.setup(round_seed=1)
        client._receive(rec)
        model, fixed = client.ctx.model, client.fixed_batch()
        model.train()
        with torch.no_grad():  # the latents eq. 5 should see: the fixed batches' own statistics, or the running ones
            if mode == "eval":
                with eval_mode(model):
                    z = model.embed(fixed.x).double().numpy()
            else:
                z = model.embed(fixed.x).double().numpy()
        yb = fixed.y.numpy()
        want = 0.5 * 0.5 * sum(p[k] / (yb == k).sum() * ((z[yb == k] - e[k]) ** 2).sum() for k in (0, 1))
        x, y = client.ctx.train.x[:2], client.ctx.train.y[:2]
        got = client.terms()[-1](Batch(x, y), Forward(torch.zeros(2, 3))).item()
        assert got == pytest.approx(want, rel=1e-5), mode
        assert model.training  # the mode is restored after an eval-mode pass


def test_alignment_bn_eval_does_not_touch_running_statistics() -> None:
    rec = received([[0.2, 0.8], [0.6, 0.4], [0, 0]], [True, True, False], [10, 12, 6], np.zeros((3, 2)), np.zeros(3))
    for mode, changes in (("train", True), ("eval", False)):
        client = make_client("fedgen_cnn", alignment_bn=mode)
        client.setup(round_seed=1)
        client._receive(rec)
        model = client.ctx.model
        model.train()
        before = _bn_running_stats(model)
        x, y = client.ctx.train.x[:2], client.ctx.train.y[:2]
        client.terms()[-1](Batch(x, y), Forward(torch.zeros(2, 3)))  # the alignment pass alone
        moved = any(not torch.equal(a, b) for a, b in zip(before, _bn_running_stats(model), strict=True))
        assert moved is changes, mode


def test_keep_optimizer_state_carries_momentum_across_rounds() -> None:
    kept, fresh = make_client(keep_optimizer_state=True), make_client(keep_optimizer_state=False)
    assert kept.optimizer() is kept.optimizer()
    assert fresh.optimizer() is not fresh.optimizer()
    assert FedCMAConfig().keep_optimizer_state  # the reference code's default


def test_privacy_with_an_unbounded_latent_is_refused_before_anything_is_released() -> None:
    """The class-sum release takes its bound C_z = sqrt(d_e) from [0, 1]^d_e: without it there is no sensitivity."""
    from hetfed.client.privacy.config import PrivacyConfig
    from hetfed.client.privacy.ledger import Release
    from hetfed.client.privacy.session import PrivacySession

    plain = make_client(bounded_latent=False)
    counts = plain.setup(0)[0]
    assert isinstance(counts, ClassCounts) and counts.counts.tolist() == [5, 3, 0]  # without DP it runs
    client = make_client(bounded_latent=False)
    ctx = client.ctx
    session = PrivacySession(PrivacyConfig(epsilon_budget=3.0), "run", "org", None, len(ctx.data.train),
                             torch.device("cpu"))
    session.release_examples()  # before Join, as the runtime does
    private = FedCMAClient(ClientContext("org", ctx.model, ctx.data, ctx.device, ctx.config, seed=0, privacy=session))
    with pytest.raises(ValueError, match="needs bounded latents"):
        private.setup(0)
    assert session.ledger.releases == [Release(1.0, 20.0)] and session.ledger.pending == []  # the count alone
