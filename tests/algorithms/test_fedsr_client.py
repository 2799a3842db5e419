"""FedSR's client half in process: its model, its objective against a hand computation, what it uploads
(r only when shared), loading, the optimiser across rounds, evaluation cadence and determinism."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from hetfed.client.algorithms import ClientContext, client_half_type
from hetfed.client.algorithms.fedavg import shared_state
from hetfed.client.algorithms.fedsr import REFERENCE_PREFIX, FedSRClient
from hetfed.client.algorithms.fedsr.losses import ProbabilisticSplitModel
from hetfed.client.data import ClientData, DataConfig, load_client_data
from hetfed.client.models import SplitModel, build_model
from hetfed.client.runtime import run_round
from hetfed.client.training import Batch
from hetfed.wire.config import ConfigError
from hetfed.wire.payloads import EvalMetrics, ModelWeights, Received
from hetfed.wire.phases import Action
from hetfed.wire.specs import get_spec
from hetfed.wire.specs.fedsr import FedSRConfig


@functools.lru_cache(maxsize=1)
def data() -> ClientData:
    # Three domains (M0, M15, M30), M30 held out: organization 0 holds M0.
    return load_client_data(DataConfig(dataset="mnist5k", partition="rotated_lodo", num_clients=2, target_domain=2))


def client(config: FedSRConfig, model_name: str = "mlp", latent: int | None = 8, org: str = "org-0") -> FedSRClient:
    d = data()
    half = client_half_type(get_spec("fedsr"))
    assert half is FedSRClient

    def build() -> SplitModel:
        return half.make_model(model_name, d.input_shape, d.num_classes, seed=3, latent_dim=latent,
                               bounded_latent=False, config=config)

    return FedSRClient(ClientContext(org, build(), d, torch.device("cpu"), config, seed=3, build_model=build))


def test_every_name_has_the_same_halves_and_its_own_defaults() -> None:
    assert {client_half_type(get_spec(n)) for n in ("fedsr", "fedl2r", "fedcmi")} == {FedSRClient}
    sr, l2r, cmi = FedSRConfig(), get_spec("fedl2r").config(), get_spec("fedcmi").config()
    assert (sr.alpha_l2r, sr.alpha_cmi, sr.l2r_squared, sr.cmi_scale, sr.shared_reference, sr.probabilistic) == (
        0.01, 5e-4, False, True, False, True)
    assert (sr.local_steps, sr.batch_size, sr.lr, sr.momentum, sr.weight_decay, sr.num_samples) == (
        5, 64, 0.01, 0.9, 5e-4, 20)
    assert (l2r.alpha_l2r, l2r.alpha_cmi, l2r.probabilistic) == (0.01, 0.0, False)
    assert (cmi.alpha_l2r, cmi.alpha_cmi, cmi.probabilistic) == (0.0, 5e-4, True)


@pytest.mark.parametrize(("fields", "match"), [
    ({"probabilistic": False}, r"alpha_cmi = 0.0005 needs probabilistic = true"),
    ({"alpha_cmi": 0.0, "shared_reference": True}, r"shared_reference needs the CMI term"),
    ({"alpha_l2r": -1.0}, r"alpha_l2r must be >= 0"),
    ({"num_samples": 0}, r"num_samples must be >= 1"),
    ({"eval_every": 0}, r"eval_every must be >= 1"),
    ({"weighting": "median"}, r"weighting must be 'examples' or 'uniform'"),
])
def test_bad_configs_are_refused(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        FedSRConfig(**fields)  # type: ignore[arg-type]


def test_the_model_is_the_registered_network_made_probabilistic_or_left_as_it_is() -> None:
    d = data()
    prob = FedSRClient.make_model("rmnist_cnn", d.input_shape, 10, seed=1, latent_dim=None, bounded_latent=False,
                                  config=FedSRConfig())
    assert isinstance(prob, ProbabilisticSplitModel)
    assert (prob.to_params.in_features, prob.to_params.out_features, prob.latent_dim) == (1600, 128, 64)
    det = FedSRClient.make_model("rmnist_cnn", d.input_shape, 10, seed=1, latent_dim=None, bounded_latent=False,
                                 config=get_spec("fedl2r").config())
    assert type(det) is SplitModel
    reference = build_model("rmnist_cnn", d.input_shape, 10, seed=1)
    for (k, a), (k2, b) in zip(det.state_dict().items(), reference.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b)


def test_objective_is_cross_entropy_plus_both_terms_by_hand() -> None:
    cfg = FedSRConfig(alpha_l2r=0.5, l2r_squared=True, alpha_cmi=0.2, cmi_scale=False)
    c = client(cfg)
    x, y = c.ctx.train.x[:6], c.ctx.train.y[:6]
    c._noise = torch.Generator().manual_seed(11)
    out = c.forward(c.ctx.model, Batch(x, y))
    got = sum(term(Batch(x, y), out) for term in c.terms())
    model = c.ctx.model
    assert isinstance(model, ProbabilisticSplitModel)
    with torch.no_grad():
        mu, sigma = (t.double() for t in model.distribution(x))
        eps = torch.randn(mu.shape, generator=torch.Generator().manual_seed(11)).double()
        z = mu + sigma * eps
        ce = F.cross_entropy(F.linear(z, model.head.weight.double(), model.head.bias.double()), y)
        r_sigma = np.log1p(np.e) + 1e-4  # softplus(1) + ε, r_μ = 0 at initialisation
        kl = (np.log(r_sigma) - sigma.log() + (sigma**2 + mu**2) / (2 * r_sigma**2) - 0.5).sum(1).mean()
        want = ce + 0.5 * z.pow(2).sum(1).mean() + 0.2 * kl
    assert float(got.detach()) == pytest.approx(float(want), rel=1e-5)


def test_deterministic_network_has_only_the_l2_term() -> None:
    c = client(get_spec("fedl2r").config(alpha_l2r=0.25))
    assert c.cmi is None and c.l2r is not None and len(c.terms()) == 2
    batch = Batch(c.ctx.train.x[:4], c.ctx.train.y[:4])
    out = c.forward(c.ctx.model, batch)
    z = c.ctx.model.embed(batch.x)
    assert torch.equal(out["z"], z) and "mu" not in out.extras
    penalty = c.terms()[1](batch, out).detach()
    assert float(penalty) == pytest.approx(0.25 * float(z.detach().norm(dim=1).mean()), rel=1e-6)
    assert len(client(FedSRConfig(alpha_l2r=0.0, alpha_cmi=0.0)).terms()) == 1  # the ablation: cross-entropy only


@pytest.mark.parametrize("shared", [False, True])
def test_upload_is_the_model_and_r_only_when_shared(shared: bool) -> None:
    c = client(FedSRConfig(shared_reference=shared))
    model_keys = set(shared_state(c.ctx.model))
    assert "to_params.weight" in model_keys and "head.weight" in model_keys
    upload = c.train(1, 7, Received([]))
    assert [type(p) for p in upload] == [ModelWeights, EvalMetrics]
    mw = upload[0]
    assert isinstance(mw, ModelWeights) and mw.num_examples == 900
    ref = {REFERENCE_PREFIX + k for k in ("r_mu", "r_sigma_raw", "scale")} if shared else set()
    assert set(mw.tensors) == model_keys | ref
    declared = {d.name: d.decl.shape for d in c.declarations(None)}
    assert declared == {k: tuple(v.shape) for k, v in mw.tensors.items()}
    if shared:
        assert mw.tensors["reference.r_mu"].shape == (10, 8) and mw.tensors["reference.scale"].shape == ()


def test_loading_takes_the_global_model_and_r_and_refuses_foreign_tensors() -> None:
    c = client(FedSRConfig(shared_reference=True))
    sent = c.upload()
    tensors = {k: np.full_like(v, 0.5) for k, v in sent.tensors.items()}
    c.load(Received([ModelWeights(tensors, 1)]))
    assert c.cmi is not None
    assert torch.all(c.cmi.r_mu == 0.5) and torch.all(c.ctx.model.head.weight == 0.5)
    local = client(FedSRConfig())
    with pytest.raises(ValueError, match=r"does not have: \['reference.r_mu'"):
        local.load(Received([ModelWeights(tensors, 1)]))


def test_one_optimiser_over_model_and_r_kept_across_rounds_when_asked() -> None:
    kept = client(FedSRConfig())
    opt = kept.optimizer()
    assert kept.optimizer() is opt
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    assert kept.cmi is not None and {id(p) for p in kept.cmi.parameters()} <= params
    assert len(params) == len(list(kept.ctx.model.parameters())) + 3  # r_mu, r_sigma_raw, C
    fresh = client(FedSRConfig(keep_optimizer_state=False))
    assert fresh.optimizer() is not fresh.optimizer()


def test_evaluation_every_k_rounds_resends_the_last_figures() -> None:
    c = client(FedSRConfig(eval_every=2, num_samples=3))
    rounds = [run_round(c, Action.TRAIN, r, r, Received([]))[1] for r in (1, 2, 3)]
    assert [m.extra["evaluated_round"] for m in rounds] == [0.0, 0.0, 2.0]  # type: ignore[attr-defined]
    assert all("target_test_accuracy" in m.extra for m in rounds)  # type: ignore[attr-defined]
    assert rounds[0].test_accuracy == rounds[1].test_accuracy  # type: ignore[attr-defined]


def test_rounds_and_predictions_are_reproducible() -> None:
    a, b = client(FedSRConfig(num_samples=4)), client(FedSRConfig(num_samples=4))
    ua, ub = a.train(1, 5, Received([])), b.train(1, 5, Received([]))
    for k, v in ua[0].tensors.items():  # type: ignore[attr-defined]
        np.testing.assert_array_equal(v, ub[0].tensors[k])  # type: ignore[attr-defined]
    assert a.measure(1) == b.measure(1)
    other = client(FedSRConfig(num_samples=4), org="org-1")  # another organization draws other noise
    uo = other.train(1, 5, Received([]))
    assert not np.array_equal(uo[0].tensors["head.weight"], ua[0].tensors["head.weight"])  # type: ignore[attr-defined]
