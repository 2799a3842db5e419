"""FedSR's model wrapper, sampled prediction, L2R and CMI terms against hand-computed and float64 references."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hetfed.client.algorithms.fedsr.losses import (
    SIGMA_EPS,
    CMITerm,
    L2RTerm,
    ProbabilisticSplitModel,
    build_probabilistic_model,
    gaussian_kl,
    l2_norm_penalty,
    predict_proba,
)
from hetfed.client.models import (
    ReLULinear,
    encoder_builder,
    rmnist_cnn,
    rmnist_cnn_k5,
    rmnist_dirt,
    rmnist_trunk,
)


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def closed_form_kl(mq: list[float], sq: list[float], mp: list[float], sp: list[float]) -> float:
    """KL of diagonal Gaussians in plain Python floats (double precision)."""
    return sum(math.log(b) - math.log(a) + (a * a + (m - n) ** 2) / (2 * b * b) - 0.5
               for m, a, n, b in zip(mq, sq, mp, sp, strict=True))


def test_gaussian_kl_by_hand() -> None:
    # One dimension: log 2 - log 0.5 + (0.25 + 1) / 8 - 1/2 = log 4 - 0.34375.
    kl = gaussian_kl(t([1.0]), t([0.5]), t([0.0]), t([2.0]))
    assert kl.item() == pytest.approx(math.log(4.0) - 0.34375, abs=1e-15)
    # Equal distributions have zero divergence.
    assert gaussian_kl(t([0.3, -2.0]), t([0.7, 1.1]), t([0.3, -2.0]), t([0.7, 1.1])).item() == pytest.approx(
        0.0, abs=1e-15)


def test_gaussian_kl_sums_dimensions_float64_closed_form() -> None:
    mq, sq, mp, sp = [0.5, -1.0, 2.0], [0.3, 1.5, 0.9], [0.0, 0.4, 2.5], [1.0, 0.7, 2.2]
    mq2, sq2, mp2, sp2 = [1.0, 0.0, -3.0], [2.0, 0.1, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]
    kl = gaussian_kl(t([mq, mq2]), t([sq, sq2]), t([mp, mp2]), t([sp, sp2]))
    assert kl.shape == (2,)
    assert kl[0].item() == pytest.approx(closed_form_kl(mq, sq, mp, sp), abs=1e-14)
    assert kl[1].item() == pytest.approx(closed_form_kl(mq2, sq2, mp2, sp2), abs=1e-14)


def test_gaussian_kl_matches_monte_carlo() -> None:
    mq, sq, mp, sp = t([0.5, -1.0]), t([0.6, 1.3]), t([0.0, 0.4]), t([1.0, 0.8])
    gen = torch.Generator().manual_seed(0)
    n = 400_000
    z = mq + sq * torch.randn((n, 2), generator=gen, dtype=torch.float64)

    def log_density(z: torch.Tensor, m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return (-0.5 * ((z - m) / s) ** 2 - torch.log(s) - 0.5 * math.log(2 * math.pi)).sum(dim=1)

    ratio = log_density(z, mq, sq) - log_density(z, mp, sp)
    mc, se = ratio.mean().item(), ratio.std().item() / math.sqrt(n)
    exact = gaussian_kl(mq, sq, mp, sp).item()
    assert abs(mc - exact) < 4 * se  # se ≈ 0.003 here
    assert exact == pytest.approx(closed_form_kl(mq.tolist(), sq.tolist(), mp.tolist(), sp.tolist()), abs=1e-14)


def test_l2r_squared_and_unsquared_by_hand() -> None:
    z = t([[3.0, 4.0], [1.0, 0.0]])
    assert l2_norm_penalty(z).item() == pytest.approx(13.0, abs=1e-15)  # (25 + 1) / 2
    assert l2_norm_penalty(z, squared=False).item() == pytest.approx(3.0, abs=1e-15)  # (5 + 1) / 2
    assert L2RTerm(0.1)(z).item() == pytest.approx(1.3, abs=1e-15)
    assert L2RTerm(0.01, squared=False)(z).item() == pytest.approx(0.03, abs=1e-15)


def test_l2r_gradient_by_hand() -> None:
    z = t([[3.0, 4.0], [1.0, 0.0]]).requires_grad_()
    L2RTerm(0.5)(z).backward()
    # d/dz of 0.5 · mean ‖z‖² = 0.5 · 2z / B = z / 2.
    assert torch.equal(z.grad, t([[1.5, 2.0], [0.5, 0.0]]))
    z.grad = None
    L2RTerm(1.0, squared=False)(z).backward()
    # d/dz of mean ‖z‖ = z / (B ‖z‖).
    assert torch.allclose(z.grad, t([[0.3, 0.4], [0.5, 0.0]]), atol=1e-15)


def test_l2r_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="alpha_l2r"):
        L2RTerm(-1.0)
    with pytest.raises(ValueError, match="batch, z_dim"):
        l2_norm_penalty(t([1.0, 2.0]))


def _cmi(alpha: float, *, learnable_scale: bool = False, sigma_eps: float = SIGMA_EPS) -> CMITerm:
    term = CMITerm(alpha, num_classes=3, z_dim=2, learnable_scale=learnable_scale, sigma_eps=sigma_eps).double()
    with torch.no_grad():
        term.r_mu.copy_(t([[0.0, 0.0], [1.0, -1.0], [0.5, 2.0]]))
        term.r_sigma_raw.copy_(t([[0.0, 1.0], [-1.0, 2.0], [0.3, 0.4]]))
    return term


def test_cmi_default_reference_distribution() -> None:
    term = CMITerm(0.3, num_classes=4, z_dim=5)
    assert torch.equal(term.r_mu.detach(), torch.zeros(4, 5))
    expected = math.log1p(math.e) + SIGMA_EPS  # softplus(1) + ε
    assert torch.allclose(term.r_sigma().detach(), torch.full((4, 5), expected))
    assert term.scale is None
    assert sorted(n for n, _ in term.named_parameters()) == ["r_mu", "r_sigma_raw"]
    assert sorted(n for n, _ in CMITerm(0.3, 4, 5, learnable_scale=True).named_parameters()) == [
        "r_mu", "r_sigma_raw", "scale"]


def test_cmi_term_float64_closed_form() -> None:
    term = _cmi(0.3)
    mu = t([[0.2, -0.1], [1.5, 0.0], [0.0, 1.0]])
    sigma = t([[0.9, 1.2], [0.4, 0.7], [2.0, 0.5]])
    labels = torch.tensor([0, 1, 1])
    rm = [[0.0, 0.0], [1.0, -1.0], [0.5, 2.0]]
    rs = [[math.log1p(math.exp(v)) + SIGMA_EPS for v in row] for row in [[0.0, 1.0], [-1.0, 2.0], [0.3, 0.4]]]
    per = [closed_form_kl(mu[b].tolist(), sigma[b].tolist(), rm[y], rs[y])
           for b, y in enumerate(labels.tolist())]
    assert torch.allclose(term.kl(mu, sigma, labels), t(per), atol=1e-14, rtol=0)
    assert term(mu, sigma, labels).item() == pytest.approx(0.3 * sum(per) / 3, abs=1e-14)


def test_cmi_reference_scale_multiplies_mu_and_sigma() -> None:
    term = _cmi(1.0, learnable_scale=True, sigma_eps=0.0)
    assert term.scale is not None
    with torch.no_grad():
        term.scale.fill_(2.0)
    mu, sigma, labels = t([[0.2, -0.1], [1.5, 0.0]]), t([[0.9, 1.2], [0.4, 0.7]]), torch.tensor([2, 0])
    plain = _cmi(1.0, sigma_eps=0.0)
    assert torch.allclose(term.kl(mu, sigma, labels), plain.kl(2 * mu, 2 * sigma, labels), atol=1e-14, rtol=0)


def test_cmi_gradient_reaches_encoder_outputs_and_reference() -> None:
    term = _cmi(0.5, learnable_scale=True)
    mu = t([[0.2, -0.1], [1.5, 0.0]]).requires_grad_()
    sigma = t([[0.9, 1.2], [0.4, 0.7]]).requires_grad_()
    labels = torch.tensor([2, 2])
    term(mu, sigma, labels).backward()
    for g in (mu.grad, sigma.grad, term.r_mu.grad, term.r_sigma_raw.grad, term.scale.grad):
        assert g is not None and torch.isfinite(g).all()
    assert mu.grad.abs().min() > 0 and sigma.grad.abs().min() > 0
    # Only the rows of the classes in the batch move.
    assert torch.equal(term.r_mu.grad[:2], torch.zeros(2, 2)) and term.r_mu.grad[2].abs().min() > 0
    assert torch.equal(term.r_sigma_raw.grad[:2], torch.zeros(2, 2)) and term.r_sigma_raw.grad[2].abs().min() > 0
    # d/dr_μ of 0.5 · mean_b Σ_d (μ - r_μ)² / (2 r_σ²) (scale 1) = 0.5 · Σ_b (r_μ - μ_b) / (B r_σ²).
    rs2 = term.r_sigma()[2].detach() ** 2
    expected = 0.5 * ((term.r_mu[2].detach() - mu[0].detach()) + (term.r_mu[2].detach() - mu[1].detach())) / (
        2 * rs2)
    assert torch.allclose(term.r_mu.grad[2], expected, atol=1e-14, rtol=0)


def test_cmi_rejects_bad_input() -> None:
    term = _cmi(0.3)
    mu, sigma = t([[0.2, -0.1]]), t([[0.9, 1.2]])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        term(mu, sigma, torch.tensor([3]))
    with pytest.raises(ValueError, match="labels must have shape"):
        term(mu, sigma, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="shape"):
        term(t([[0.2, -0.1, 0.0]]), t([[0.9, 1.2, 1.0]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="alpha_cmi"):
        CMITerm(-0.1, 3, 2)


def _tiny_model() -> ProbabilisticSplitModel:
    torch.manual_seed(3)
    return ProbabilisticSplitModel(nn.Identity(), feature_dim=3, z_dim=2, num_classes=4).double()


def test_reparameterised_sample_and_its_gradient_reach_mu_and_sigma() -> None:
    model = _tiny_model()
    x = t([[0.5, -1.0, 2.0], [1.0, 0.0, -0.5]])
    out = model.forward_sample(x, torch.Generator().manual_seed(7))
    noise = torch.randn((2, 2), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    params = model.to_params(x).detach()
    mu, raw = params[:, :2], params[:, 2:]
    sigma = F.softplus(raw) + SIGMA_EPS
    assert torch.allclose(out.mu, mu, atol=1e-15) and torch.allclose(out.sigma, sigma, atol=1e-15)
    assert torch.allclose(out.z, mu + sigma * noise, atol=1e-15)
    assert torch.allclose(out.logits, model.head(mu + sigma * noise), atol=1e-14)
    # Loss Σ z: dL/dμ = 1 and dL/dσ = ε, so dL/dW_μ[j] = Σ_b x_b and dL/dW_raw[j] = Σ_b ε_bj·sigmoid(raw_bj)·x_b.
    out.z.sum().backward()
    grad = model.to_params.weight.grad
    assert torch.allclose(grad[:2], x.sum(dim=0).expand(2, 3), atol=1e-14)
    expected_raw = (noise * torch.sigmoid(raw)).T @ x
    assert torch.allclose(grad[2:], expected_raw, atol=1e-14)
    assert torch.allclose(model.to_params.bias.grad, torch.cat([t([2.0, 2.0]), (noise * torch.sigmoid(raw)).sum(0)]),
                          atol=1e-14)


def test_full_objective_gradient_reaches_every_parameter() -> None:
    model = _tiny_model()
    cmi = _cmi(0.3)
    x, y = t([[0.5, -1.0, 2.0], [1.0, 0.0, -0.5]]), torch.tensor([0, 2])
    out = model.forward_sample(x, torch.Generator().manual_seed(1))
    loss = F.cross_entropy(out.logits, y) + L2RTerm(0.1)(out.z) + cmi(out.mu, out.sigma, y)
    loss.backward()
    for name, p in [*model.named_parameters(), *cmi.named_parameters()]:
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_prediction_averages_softmax_over_samples_float64_reference() -> None:
    torch.manual_seed(0)
    model = ProbabilisticSplitModel(nn.Sequential(nn.Linear(5, 8), nn.ReLU()), 8, 3, 4).eval()
    x = torch.randn(6, 5)
    probs = predict_proba(model, x, generator=torch.Generator().manual_seed(11))
    assert probs.shape == (6, 4) and probs.dtype == torch.float32
    # The same noise (one randn((20, B, z)) call on the same seed), everything else in float64.
    noise = torch.randn((20, 6, 3), generator=torch.Generator().manual_seed(11)).double()
    m64 = ProbabilisticSplitModel(nn.Sequential(nn.Linear(5, 8), nn.ReLU()), 8, 3, 4).double()
    m64.load_state_dict(model.state_dict())
    mu, sigma = m64.distribution(x.double())
    logits = m64.head(mu + sigma * noise)  # (20, 6, 4)
    reference = torch.stack([F.softmax(logits[s], dim=1) for s in range(20)]).sum(0) / 20
    assert torch.allclose(probs.double(), reference, atol=1e-6, rtol=0)
    assert torch.allclose(probs.sum(1), torch.ones(6), atol=1e-6)
    # Reproducible under a seed, different under another; S is configurable.
    again = predict_proba(model, x, generator=torch.Generator().manual_seed(11))
    assert torch.equal(probs, again)
    assert not torch.equal(probs, predict_proba(model, x, generator=torch.Generator().manual_seed(12)))
    assert predict_proba(model, x, num_samples=3, generator=torch.Generator().manual_seed(11)).shape == (6, 4)
    # One sample is exactly the softmax of a training forward pass with the same noise.
    one = predict_proba(model, x, num_samples=1, generator=torch.Generator().manual_seed(5))
    logits1 = model.forward_sample(x, torch.Generator().manual_seed(5)).logits
    assert torch.allclose(one, F.softmax(logits1, dim=1), atol=1e-7)
    with pytest.raises(ValueError, match="num_samples"):
        predict_proba(model, x, num_samples=0)


def test_build_probabilistic_rmnist_replaces_the_final_projection() -> None:
    state = torch.get_rng_state()
    model = build_probabilistic_model(rmnist_cnn, (1, 28, 28), 64, 10, seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    assert model.feature_dim == 1600 and model.to_params.out_features == 128
    assert not any(isinstance(m, nn.Linear) for m in model.encoder.modules())  # two convs, then the one fc
    convs = [m for m in model.encoder.modules() if isinstance(m, nn.Conv2d)]
    assert [c.kernel_size for c in convs] == [(3, 3), (3, 3)] and [c.out_channels for c in convs] == [32, 64]
    again = build_probabilistic_model(rmnist_cnn, (1, 28, 28), 64, 10, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(),
                                                     strict=True))
    x = torch.rand(5, 1, 28, 28)
    mu, sigma = model.distribution(x)
    assert mu.shape == sigma.shape == (5, 64) and (sigma >= SIGMA_EPS).all()
    assert model(x).shape == (5, 10) and torch.equal(model.embed(x), mu)


def test_build_probabilistic_on_an_activated_encoder_appends_a_layer() -> None:
    lenet = encoder_builder("lenet")
    model = build_probabilistic_model(lenet, (1, 28, 28), 16, 10, seed=0)
    assert isinstance(model.encoder[-1], nn.ReLU) and model.feature_dim == 16
    assert model.to_params.in_features == 16 and model.to_params.out_features == 32
    assert model(torch.rand(2, 1, 28, 28)).shape == (2, 10)


def test_rmnist_networks() -> None:
    assert rmnist_trunk((1, 28, 28))[1] == 1600 and rmnist_trunk((1, 28, 28), kernel_size=5)[1] == 1024
    x = torch.rand(3, 1, 28, 28)
    assert rmnist_cnn((1, 28, 28), 64, False)(x).shape == (3, 64)
    assert isinstance(rmnist_cnn((1, 28, 28), 64, False)[-1], nn.Linear)
    bounded = rmnist_cnn_k5((1, 28, 28), 8, True)(x)
    assert bounded.shape == (3, 8) and ((bounded > 0) & (bounded < 1)).all()
    with pytest.raises(ValueError, match="at least 1 channel and 10x10"):
        rmnist_cnn((1, 9, 9), 64, False)


def test_dirts_network_made_probabilistic_classifies_relu_of_the_sample() -> None:
    """rmnist_dirt: fc11 becomes Linear(1024, 2·z); the classifier is DIRT's own (Xavier, zero bias) on relu(z)."""
    state = torch.get_rng_state()
    model = build_probabilistic_model(rmnist_dirt, (1, 28, 28), 64, 10, seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    assert model.feature_dim == 1024 and (model.to_params.in_features, model.to_params.out_features) == (1024, 128)
    assert not any(isinstance(m, nn.Linear) for m in model.encoder.modules())
    assert [c.kernel_size for c in model.encoder.modules() if isinstance(c, nn.Conv2d)] == [(5, 5), (5, 5)]
    head = model.head
    assert type(head) is ReLULinear and (head.in_features, head.out_features) == (64, 10)
    bound = math.sqrt(6 / 74)
    assert not head.bias.any() and 0.97 * bound < float(head.weight.detach().abs().max()) <= bound
    x = torch.rand(5, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        out = model.forward_sample(x, torch.Generator().manual_seed(3))
        mu, sigma = model.distribution(x)
        noise = torch.randn(mu.shape, generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(out.z, mu + sigma * noise, rtol=0, atol=0)
        torch.testing.assert_close(out.logits, F.linear(F.relu(out.z), head.weight, head.bias), rtol=0, atol=0)
        assert (out.z < 0).any()
        p = predict_proba(model, x, num_samples=4, generator=torch.Generator().manual_seed(5))
        assert p.shape == (5, 10) and torch.allclose(p.sum(1), torch.ones(5))
    again = build_probabilistic_model(rmnist_dirt, (1, 28, 28), 64, 10, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(),
                                                     strict=True))


def test_fedsr_client_builds_and_trains_dirts_network() -> None:
    from hetfed.client.algorithms.fedsr.client import FedSRClient
    from hetfed.wire.specs import get_spec

    config = get_spec("fedsr").config()
    model = FedSRClient.make_model("rmnist_dirt", (1, 28, 28), 10, seed=1, latent_dim=None, bounded_latent=False,
                                   config=config)
    assert isinstance(model, ProbabilisticSplitModel) and type(model.head) is ReLULinear
    assert model.latent_dim == 64 and model.to_params.in_features == 1024
    x, y = torch.rand(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    loss = F.cross_entropy(model.forward_sample(x, torch.Generator().manual_seed(0)).logits, y)
    loss.backward()
    assert model.head.weight.grad is not None and model.to_params.weight.grad is not None
    # The paper's network keeps a fresh plain Linear classifier, as before.
    plain = FedSRClient.make_model("rmnist_cnn", (1, 28, 28), 10, seed=1, latent_dim=None, bounded_latent=False,
                                   config=config)
    assert type(plain.head) is nn.Linear


def test_a_whole_models_head_of_the_wrong_size_is_refused() -> None:
    def whole(shape: tuple[int, ...], dim: int, bounded: bool) -> nn.Module:
        return rmnist_dirt(shape, dim, bounded, num_classes=3)

    with pytest.raises(ValueError, match=r"head is Linear\(64, 3\), the probabilistic model needs "
                                         r"Linear\(z_dim=64, num_classes=10\)"):
        build_probabilistic_model(whole, (1, 28, 28), 64, 10)
