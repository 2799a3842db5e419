"""Ditto's client half: one real step of the half against eq. 4 built by hand in float64, what persists across
rounds, what is uploaded, and the spec's validation."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from hetfed.cli.experiments import docs_page
from hetfed.client.algorithms import ClientContext, make_client_half
from hetfed.client.algorithms.ditto import DittoClient
from hetfed.client.algorithms.ditto.cosine import CosineDrift
from hetfed.client.algorithms.ditto.features import forward_with_layers
from hetfed.client.algorithms.ditto.penalty import add_proximal_gradient
from hetfed.client.data import DataConfig, load_client_data
from hetfed.client.losses import ProximalTerm
from hetfed.client.model_registry import MODELS
from hetfed.client.models import build_model, state_arrays
from hetfed.client.runtime import run_round
from hetfed.client.training import Batch, Forward, epoch_batches
from hetfed.wire.config import ConfigError, from_mapping
from hetfed.wire.payloads import EvalMetrics, ModelWeights, Received
from hetfed.wire.phases import Action
from hetfed.wire.specs import SPECS, get_spec
from hetfed.wire.specs.ditto import DittoConfig

torch.set_num_threads(1)
NO_PAYLOADS = Received([], frozenset())


def _half(name: str = "ditto", seed: int = 3, **cfg: object) -> DittoClient:
    data = load_client_data(DataConfig(dataset="synthetic", partition="natural", num_clients=2, client_index=0,
                                       seed=seed, synthetic_samples=120))
    spec = get_spec(name)
    fields = {"batch_size": 10, "lr": 0.05, "momentum": 0.0, "weight_decay": 0.0, "local_steps": 1,
              "refit_batches": 2, **cfg}
    config = spec.config(**fields)

    def build() -> torch.nn.Module:
        return build_model("linear", data.input_shape, data.num_classes, seed=seed)

    ctx = ClientContext("org-0", build(), data, torch.device("cpu"), config, seed, build_model=build)  # type: ignore[arg-type]
    half = make_client_half(spec, ctx)
    assert isinstance(half, DittoClient)
    return half


def _perturbed_global(half: DittoClient, scale: float = 0.05) -> ModelWeights:
    """A 'received' w̄ unlike this organization's models (what the aggregator sends in round 2)."""
    rng = np.random.default_rng(0)
    arrays = {k: v + scale * rng.standard_normal(v.shape).astype(np.float32)
              for k, v in state_arrays(half.ctx.model).items()}
    return ModelWeights(arrays, 0)


def _first_batch(half: DittoClient, round_seed: int) -> Batch:
    return next(epoch_batches(half.ctx.train, half.config, half.ctx.rng(round_seed)))


def _params64(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().double().clone().requires_grad_(True) for p in model.parameters()]


def _forward64(params: list[torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first-layer features, logits) of the linear model from its parameters (encoder weight, bias, head ...)."""
    w1, b1, w2, b2 = params
    z = x.double() @ w1.T + b1
    return z, z @ w2.T + b2


@pytest.mark.parametrize("measure", ["cosine", "mkmmd", "mmdd"])
def test_one_step_of_the_real_half_is_eq4_and_reaches_the_personal_model_only(measure: str) -> None:
    lam, mu, lr = 0.3, 0.7, 0.05
    half = _half({"cosine": "ditto_cos", "mkmmd": "ditto_mkmmd", "mmdd": "ditto_mmdd"}[measure], lam=lam, mu=mu, lr=lr)
    half.train(1, 11, NO_PAYLOADS)  # round 1: w_L = w_G = the run's initial weights, then one step each
    received = _perturbed_global(half)
    w_bar = [torch.as_tensor(received.tensors[k]) for k, _ in half.ctx.model.named_parameters()]
    personal_before = _params64(half.personal)
    batch = _first_batch(half, 12)

    upload = half.train(2, 12, Received([received], frozenset()))

    # The frozen copy θ̄ is w̄ and got no gradient; the drift's kernel got none from the personal step either.
    for p, w in zip(half.reference.parameters(), w_bar, strict=True):
        assert p.grad is None and not p.requires_grad
        assert torch.equal(p.detach(), w)
    drift = half.drifts[""].module
    assert all(p.grad is None for p in drift.parameters())
    # w_L's step, rebuilt in float64 from eq. 4 with the kernel as it stood at the step.
    z, logits = _forward64(personal_before, batch.x)
    with torch.no_grad():
        z_ref, _ = _forward64([w.double() for w in w_bar], batch.x)
    ce = F.cross_entropy(logits, batch.y)
    prox = ProximalTerm(lam, [w.double() for w in w_bar])(personal_before)
    if measure == "cosine":
        d = CosineDrift()(z, z_ref)
    else:
        d = copy.deepcopy(drift).double()(z, z_ref) if measure == "mmdd" else drift(z, z_ref)
    (ce + prox + mu * d).backward()
    for p, p0 in zip(half.personal.parameters(), personal_before, strict=True):
        assert p0.grad is not None
        expected = p0.detach() - lr * p0.grad
        torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-6)
    # Only w_G goes up (its step is FedAvg's, see the next test).
    weights, metrics = upload
    assert isinstance(weights, ModelWeights) and isinstance(metrics, EvalMetrics)
    for name, p in half.ctx.model.named_parameters():
        np.testing.assert_array_equal(weights.tensors[name], p.detach().numpy())
        assert not np.array_equal(weights.tensors[name], dict(half.personal.named_parameters())[name].detach().numpy())


def test_global_step_is_fedavgs_and_the_personal_model_persists_across_rounds() -> None:
    half = _half(lam=0.1, lr=0.05)
    fedavg = make_client_half(get_spec("fedavg"), dataclasses.replace(half.ctx, config=get_spec("fedavg").config(
        batch_size=10, lr=0.05, local_steps=1)))
    assert torch.equal(half.personal.encoder[1].weight, half.ctx.model.encoder[1].weight)  # w_L = w̄ at the start
    half.train(1, 5, NO_PAYLOADS)
    personal = [p.detach().clone() for p in half.personal.parameters()]
    received = _perturbed_global(half, scale=0.5)
    fedavg.train(2, 6, Received([received], frozenset()))
    up = half.train(2, 6, Received([received], frozenset()))[0]
    assert isinstance(up, ModelWeights)
    # The global model is loaded from w̄ and stepped exactly as FedAvg steps it; w_L continues from its own weights
    # (one step away from where it stood, far from the perturbed w̄).
    for name, p in fedavg.ctx.model.named_parameters():
        np.testing.assert_array_equal(up.tensors[name], p.detach().numpy())
    for p, before, (name, _) in zip(half.personal.parameters(), personal, half.personal.named_parameters(),
                                     strict=True):
        moved, pulled = torch.norm(p.detach() - before), torch.norm(p.detach() - torch.as_tensor(received.tensors[name]))
        assert moved < 0.2 * pulled, name


def test_evaluate_reports_the_personal_model_and_the_global_models_accuracy() -> None:
    half = _half(lam=0.1)
    half.train(1, 5, NO_PAYLOADS)
    received = _perturbed_global(half, scale=1.0)
    metrics = half.evaluate(2, Received([received], frozenset()))
    from hetfed.client.training import evaluate

    assert metrics.test_accuracy == evaluate(half.personal, half.ctx.test)[0]
    assert metrics.extra["global_model_test_accuracy"] == evaluate(half.ctx.model, half.ctx.test)[0]
    assert half.deployed_model() is half.personal
    for name, p in half.ctx.model.named_parameters():
        np.testing.assert_array_equal(received.tensors[name], p.detach().numpy())


def test_kernel_state_persists_and_refits_follow_the_schedule() -> None:
    every_step = _half("ditto_mkmmd", local_steps=3, refit_every=-1)
    every_step.train(1, 1, NO_PAYLOADS)
    assert every_step.drifts[""].refits == 3
    periodic = _half("ditto_mmdd", local_steps=5, refit_every=2, mmdd_steps=1)
    periodic.train(1, 1, NO_PAYLOADS)
    assert periodic.drifts[""].refits == 3  # before steps 0, 2, 4
    kernel = periodic.drifts[""].module
    before = {k: v.clone() for k, v in kernel.state_dict().items()}
    periodic.train(2, 2, NO_PAYLOADS)
    assert periodic.drifts[""].module is kernel and periodic.drifts[""].refits == 6
    assert any(not torch.equal(before[k], v) for k, v in kernel.state_dict().items())  # trained further, not reset


def test_runs_are_deterministic() -> None:
    a, b = _half("ditto_mmdd", local_steps=4), _half("ditto_mmdd", local_steps=4)
    for half in (a, b):
        half.train(1, 9, NO_PAYLOADS)
    for p, q in zip(a.personal.parameters(), b.personal.parameters(), strict=True):
        assert torch.equal(p, q)


def test_an_mmd_on_a_batch_of_one_row_is_skipped_not_an_error() -> None:
    half = _half("ditto_mmdd", local_steps=1, batch_size=1, refit_every=-1)
    half.train(1, 1, NO_PAYLOADS)
    assert half.drifts[""].refits == 0


def test_double_softmax_is_cross_entropy_of_the_softmax() -> None:
    half = _half(double_softmax=True)
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    y = torch.tensor([0])
    p = torch.softmax(logits, 1)
    expected = -torch.log(torch.exp(p[0, 0]) / torch.exp(p[0]).sum())
    torch.testing.assert_close(half.classification()(Batch(logits, y), Forward(logits)), expected)
    assert _half().classification()(Batch(logits, y), Forward(logits)) == F.cross_entropy(logits, y)


def test_double_softmax_is_fl4health_loss_on_a_two_example_batch() -> None:
    # FL4Health's Synthetic model ends in nn.Softmax(dim=1) and trains with nn.CrossEntropyLoss (mean reduction):
    # loss = mean_i [log Σ_k exp(s_ik) − s_i,y_i] with s = softmax(logits), computed here by hand in float64.
    logits = [[1.0, -0.5, 0.25], [0.0, 2.0, -1.0]]
    labels = [2, 1]
    want = 0.0
    for row, y in zip(logits, labels, strict=True):
        e = [math.exp(v) for v in row]
        s = [v / sum(e) for v in e]
        want += math.log(sum(math.exp(v) for v in s)) - s[y]
    want /= 2
    half = _half(double_softmax=True)
    t = torch.tensor(logits, dtype=torch.float64)
    y = torch.tensor(labels)
    got = half.classification()(Batch(t, y), Forward(t))
    assert float(got) == pytest.approx(want, rel=1e-15, abs=0)
    assert float(torch.nn.CrossEntropyLoss()(torch.nn.Softmax(dim=1)(t), y)) == float(got)


def test_proximal_gradient_is_the_gradient_of_the_penalty() -> None:
    torch.manual_seed(0)
    params = [torch.randn(3, 2, dtype=torch.float64, requires_grad=True), torch.randn(4, dtype=torch.float64,
                                                                                       requires_grad=True)]
    reference = [torch.randn(3, 2, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    ProximalTerm(0.4, reference)(params).backward()
    expected = [p.grad.clone() for p in params if p.grad is not None]
    for p in params:
        p.grad = torch.ones_like(p)
    add_proximal_gradient(params, reference, 0.4)
    for p, r, e in zip(params, reference, expected, strict=True):
        torch.testing.assert_close(p.grad, 1.0 + e)
        torch.testing.assert_close(e, 0.4 * (p.detach() - r))


@pytest.mark.parametrize("name", [n for n, e in MODELS.items() if not e.vision])
def test_feature_layers_by_name_on_every_registered_architecture(name: str) -> None:
    shape = (60,) if name in ("mlp", "linear") else (1, 28, 28)
    model = build_model(name, shape, 10)
    first = next(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear | torch.nn.Conv2d))
    x = torch.randn(4, *shape)
    out, feats = forward_with_layers(model, ("", first), x)
    torch.testing.assert_close(out, model(x))
    torch.testing.assert_close(feats[""], model.embed(x))
    assert feats[first].shape[0] == 4 and feats[first].dim() == 2


def test_an_unknown_feature_layer_is_a_clear_error_naming_the_layers() -> None:
    with pytest.raises(ValueError, match=r"model has no layer 'encoder.9'; its layers are: encoder, encoder.0"):
        _half(feature_layers=("encoder.9",))
    half = _half("ditto_cos", feature_layers=("encoder.1", ""), local_steps=2)
    half.train(1, 1, NO_PAYLOADS)
    assert set(half.drifts) == {"encoder.1", ""}


@pytest.mark.parametrize(("fields", "message"), [
    ({"mu": 1.0}, "mu = 1.0 needs a measure"),
    ({"measure": "mmd"}, "measure"),
    ({"lam": -1.0}, "lam must be >= 0"),
    ({"refit_every": 0}, "refit_every must be -1"),
    ({"refit_batches": 0}, "refit_batches must be >= 1"),
    ({"mmdd_steps": -1}, "mmdd_steps must be >= 0"),
    ({"qp_epsilon": 0.0}, "qp_epsilon must be > 0"),
    ({"feature_layers": []}, "feature_layers must name at least one layer"),
    ({"feature_layers": ["", ""]}, "each once"),
    ({"mkmmd_bandwidth": "width"}, "mkmmd_bandwidth"),
])
def test_config_validation(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_mapping(DittoConfig, fields)


def test_variants_differ_only_in_their_defaults() -> None:
    base = {f.name for f in dataclasses.fields(DittoConfig)}
    expected = {"ditto": ("none", 0.1, 0.0), "ditto_cos": ("cosine", 0.01, 1.0), "ditto_mkmmd": ("mkmmd", 0.01, 1.0),
                "ditto_mmdd": ("mmdd", 0.01, 1.0)}
    for name, (measure, lam, mu) in expected.items():
        spec = SPECS[name]
        assert {f.name for f in dataclasses.fields(spec.config_type)} == base
        cfg = spec.config()
        assert (cfg.measure, cfg.lam, cfg.mu) == (measure, lam, mu)
        assert spec.upload == SPECS["fedavg"].upload and spec.download == SPECS["fedavg"].download
        assert docs_page(spec) == "algorithms/ditto.md"
        assert [f.key for f in spec.figures] == ["global"]


def test_keep_optimizer_state_carries_both_models_momentum_across_rounds() -> None:
    kept, fresh = (_half(lam=0.1, momentum=0.9, local_steps=2, keep_optimizer_state=keep) for keep in (True, False))
    for half in (kept, fresh):
        half.train(1, 4, NO_PAYLOADS)
    # Round 1 is the same either way (both optimisers start empty).
    for a, b in zip([*kept.ctx.model.parameters(), *kept.personal.parameters()],
                    [*fresh.ctx.model.parameters(), *fresh.personal.parameters()], strict=True):
        assert torch.equal(a, b)
    global_opt, personal_opt = kept.optimizer(), kept.optimizer("personal_optimizer")
    assert personal_opt is not None and personal_opt is not global_opt
    assert all("momentum_buffer" in personal_opt.state[p] for p in kept.personal.parameters())
    received = _perturbed_global(kept)
    for half in (kept, fresh):
        half.train(2, 5, Received([received], frozenset()))
    assert kept.optimizer() is global_opt and kept.optimizer("personal_optimizer") is personal_opt
    assert fresh.optimizer() is not fresh.optimizer()
    # The carried momentum moves both models differently from a fresh optimiser's first steps.
    for a, b in ((kept.ctx.model, fresh.ctx.model), (kept.personal, fresh.personal)):
        assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_evaluation_every_k_rounds_resends_the_last_figures_with_this_rounds_losses() -> None:
    half = _half(lam=0.1, eval_every=2)
    ups = [run_round(half, Action.TRAIN, r, r, NO_PAYLOADS)[1] for r in (1, 2, 3)]
    metrics = [m for m in ups if isinstance(m, EvalMetrics)]
    assert len(metrics) == 3
    first, second, third = metrics
    assert [m.extra["evaluated_round"] for m in metrics] == [1.0, 1.0, 3.0]
    assert second.test_accuracy == first.test_accuracy
    assert second.extra["global_model_test_accuracy"] == first.extra["global_model_test_accuracy"]
    assert second.train_loss != first.train_loss
    assert second.extra["global_train_loss"] != first.extra["global_train_loss"]
    from hetfed.client.training import evaluate

    assert third.test_accuracy == evaluate(half.personal, half.ctx.test)[0]


@pytest.mark.parametrize("name", ["ditto_mmdd", "ditto_mkmmd"])
def test_drift_kernels_are_built_on_the_clients_device(name: str) -> None:
    """A CUDA client failed its first refit with the MMD-D kernel left on the CPU; every parameter and buffer of
    a drift measure must live where the features do (the meta device stands in for a GPU here)."""
    half = _half(name)
    half.ctx = dataclasses.replace(half.ctx, device=torch.device("meta"))
    module = half.drift_for("", 20).module
    tensors = [*module.parameters(), *module.buffers()]
    assert tensors and {t.device.type for t in tensors} == {"meta"}
