"""FedADG's client half: its losses against hand-computed values, its generator and discriminator against float64
numpy, a whole round (E0 classifier epoch, then two adversarial batches of D, F+C and G steps) against an
independent float64 replay, what goes up (F, C and G; never D) and the wire contract that refuses the rest."""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import hetfed.client.algorithms.fedadg as fedadg_client
from hetfed.client.algorithms import ClientContext, client_half_type, make_client_half
from hetfed.client.data.core import ArrayDataset, ClientData
from hetfed.client.models import SplitModel
from hetfed.wire import codec
from hetfed.wire.contract import check_update, schema_from_declared
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import EvalMetrics, HeadWeights, ModelWeights, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import get_spec

torch.set_num_threads(1)
NOTHING = Received([], frozenset())
N, FEATURES, LATENT, K = 25, 4, 3, 3
NOISE, G_HIDDEN, PROJECTION, D_HIDDEN = 2, 5, 4, 3
SEED, ROUND_SEED, ORG = 7, 11, "org-0"
# One batch an epoch (batch = N): E0 = 1 classifier step, then E1 = 2 adversarial batches of three steps each.
CONFIG = {"local_epochs": 2, "classifier_epochs": 1, "batch_size": N, "lr": 0.1, "adversarial_lr": 0.05,
          "momentum": 0.9, "weight_decay": 0.01, "alpha": 0.85, "label_smoothing": 0.1, "label_value": 0.7,
          "noise_dim": NOISE, "generator_hidden": G_HIDDEN, "generator_relu": True, "projection_dim": PROJECTION,
          "discriminator_hidden": D_HIDDEN}
MODEL = ["encoder.0.weight", "encoder.0.bias", "head.weight", "head.bias"]
GENERATOR = ["generator.net.fc1.weight", "generator.net.fc1.bias", "generator.net.fc2.weight",
             "generator.net.fc2.bias"]


def model() -> SplitModel:
    torch.manual_seed(0)
    return SplitModel(nn.Sequential(nn.Linear(FEATURES, LATENT), nn.Tanh()), LATENT, K)


def data() -> ClientData:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N, FEATURES)).astype(np.float32)
    y = rng.integers(0, K, size=N)
    return ClientData(ArrayDataset(x, y), ArrayDataset(x[:5], y[:5]), None, K, (FEATURES,), "tiny")


def half(**fields: Any) -> Any:
    spec = get_spec("fedadg")
    ctx = ClientContext(ORG, model(), data(), torch.device("cpu"), spec.config(**{**CONFIG, **fields}), SEED)
    return make_client_half(spec, ctx)


# ------------------------------------------------------------------------------------------------ the losses
def test_the_label_code_puts_the_label_value_at_the_label() -> None:
    code = fedadg_client.label_code(torch.tensor([2, 0]), 3, 0.7)
    assert code.tolist() == [[0.0, 0.0, pytest.approx(0.7)], [pytest.approx(0.7), 0.0, 0.0]]


def test_the_smoothed_cross_entropy_gives_the_label_one_minus_eps_and_the_others_eps_over_k_minus_1() -> None:
    # Row 1: softmax (1/4, 1/4, 1/2), label 2, q = (0.05, 0.05, 0.9): 0.05·ln 4·2 + 0.9·ln 2 = 1.1·ln 2.
    # Row 2: uniform softmax, label 0: −Σ q ln(1/3) = ln 3.
    logits = torch.tensor([[0.0, 0.0, math.log(2.0)], [0.0, 0.0, 0.0]], dtype=torch.float64)
    y = torch.tensor([2, 0])
    got = fedadg_client.smoothed_cross_entropy(logits, y, 0.1).item()
    assert got == pytest.approx((1.1 * math.log(2) + math.log(3)) / 2, abs=1e-15)
    # Not torch's label smoothing, which gives the label 1 − ε + ε/K: on row 1 alone they differ.
    torchs = F.cross_entropy(logits[:1], y[:1], label_smoothing=0.1).item()
    assert torchs == pytest.approx((0.1 / 3) * 2 * math.log(4) + (0.9 + 0.1 / 3) * math.log(2), abs=1e-15)
    assert abs(torchs - 1.1 * math.log(2)) > 0.01
    with pytest.raises(ValueError, match="at least 2 classes"):
        fedadg_client.smoothed_cross_entropy(logits[:, :1], torch.tensor([0, 0]), 0.1)


def test_the_adversarial_losses_are_the_least_squares_ones_by_hand() -> None:
    d_reference = torch.tensor([0.5, 0.75], dtype=torch.float64)
    d_features = torch.tensor([0.25, 0.0], dtype=torch.float64)
    # D: mean((1 − 0.5)² + 0.25², (1 − 0.75)² + 0²) = mean(0.3125, 0.0625).
    assert fedadg_client.discriminator_loss(d_reference, d_features).item() == 0.1875
    # F: mean((1 − 0.25)², (1 − 0)²) = mean(0.5625, 1).
    assert fedadg_client.alignment_loss(d_features).item() == 0.78125
    # G: mean(0.5², 0.75²) = mean(0.25, 0.5625).
    assert fedadg_client.generator_loss(d_reference).item() == 0.40625


def _leaky(a: np.ndarray) -> np.ndarray:
    return np.where(a > 0, a, 0.01 * a)


def test_the_generator_and_discriminator_are_their_float64_formulas() -> None:
    torch.manual_seed(1)
    g = fedadg_client.DistributionGenerator(NOISE, K, G_HIDDEN, LATENT, relu=True).double()
    d = fedadg_client.Discriminator(LATENT, K, PROJECTION, D_HIDDEN).double()
    p = {n: t.detach().numpy() for n, t in [*g.named_parameters(), *d.named_parameters()]}
    # D's weights: Kaiming-uniform, within sqrt(6 / fan_in) (the reference code's initialize_params).
    for name, fan_in in (("projection.weight", LATENT), ("net.0.weight", PROJECTION + K), ("net.2.weight", D_HIDDEN)):
        assert np.abs(p[name]).max() <= math.sqrt(6 / fan_in)
    # G's weights: Xavier-uniform with gain 0.5, so within 0.5·sqrt(6 / (fan_in + fan_out)).
    assert np.abs(p["net.fc1.weight"]).max() <= 0.5 * math.sqrt(6 / (NOISE + K + G_HIDDEN))
    rng = np.random.default_rng(0)
    xi = rng.uniform(size=(4, NOISE))
    code = np.eye(K)[[0, 2, 1, 2]] * 0.7
    z = rng.normal(size=(4, LATENT))
    h = _leaky(np.concatenate([xi, code], 1) @ p["net.fc1.weight"].T + p["net.fc1.bias"])
    want_g = np.maximum(h @ p["net.fc2.weight"].T + p["net.fc2.bias"], 0)
    got_g = g(torch.from_numpy(xi), torch.from_numpy(code)).detach().numpy()
    np.testing.assert_allclose(got_g, want_g, rtol=0, atol=1e-14)
    proj = np.concatenate([z @ p["projection.weight"].T, code], 1)
    a = _leaky(proj @ p["net.0.weight"].T + p["net.0.bias"]) @ p["net.2.weight"].T + p["net.2.bias"]
    want_d = (1 / (1 + np.exp(-a)))[:, 0]
    got_d = d(torch.from_numpy(z), torch.from_numpy(code)).detach().numpy()
    np.testing.assert_allclose(got_d, want_d, rtol=0, atol=1e-14)
    bare = fedadg_client.DistributionGenerator(NOISE, K, G_HIDDEN, LATENT, relu=False)
    assert [type(m).__name__ for m in bare.net] == ["Linear", "LeakyReLU", "Linear"]


# ----------------------------------------------------------------------------------------- a whole round
def _sgd(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], bufs: dict[str, torch.Tensor],
         lr: float) -> None:
    """torch's SGD by hand: d = g + wd·p; b ← d on the first step, else 0.9·b + d; p ← p − lr·b."""
    for n, p in params.items():
        step = grads[n] + CONFIG["weight_decay"] * p
        bufs[n] = step if n not in bufs else CONFIG["momentum"] * bufs[n] + step
        params[n] = (p - lr * bufs[n]).detach().requires_grad_(True)


def reference_round(h: Any) -> dict[str, dict[str, np.ndarray]]:
    """The round written out in float64 from the reference code's train_step (pacs-ours/localTrain.py:65-106),
    from ``h``'s initial weights, its batch order and its noise draws."""
    f = {n: p.detach().double().requires_grad_(True) for n, p in h.ctx.model.named_parameters()}
    g = {n: p.detach().double().requires_grad_(True) for n, p in h.generator.named_parameters()}
    d = {n: p.detach().double().requires_grad_(True) for n, p in h.discriminator.named_parameters()}
    ds = h.ctx.data.train
    x_all, y_all = torch.from_numpy(ds.x).double(), torch.from_numpy(ds.y).long()
    alpha, eps, lr, lr1 = CONFIG["alpha"], CONFIG["label_smoothing"], CONFIG["lr"], CONFIG["adversarial_lr"]

    def feat(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ f["encoder.0.weight"].T + f["encoder.0.bias"])

    def logits(z: torch.Tensor) -> torch.Tensor:
        return z @ f["head.weight"].T + f["head.bias"]

    def ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        q = torch.full_like(out, eps / (K - 1))
        q[torch.arange(len(y)), y] = 1 - eps
        return -(q * torch.log_softmax(out, 1)).sum(1).mean()

    def gen(xi: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        a = torch.cat([xi, code], 1) @ g["net.fc1.weight"].T + g["net.fc1.bias"]
        return torch.relu(F.leaky_relu(a) @ g["net.fc2.weight"].T + g["net.fc2.bias"])

    def disc(z: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        a = torch.cat([z @ d["projection.weight"].T, code], 1)
        a = F.leaky_relu(a @ d["net.0.weight"].T + d["net.0.bias"]) @ d["net.2.weight"].T + d["net.2.bias"]
        return torch.sigmoid(a)[:, 0]

    rng = np.random.default_rng([SEED, ROUND_SEED, zlib.crc32(ORG.encode())])
    noise = torch.Generator().manual_seed(zlib.crc32(f"{SEED}/{ROUND_SEED}/{ORG}/noise".encode()))
    task_bufs: dict[str, torch.Tensor] = {}
    g_bufs: dict[str, torch.Tensor] = {}
    d_bufs: dict[str, torch.Tensor] = {}
    # E0: one classifier step of F and C.
    order = torch.from_numpy(rng.permutation(N))
    loss = ce(logits(feat(x_all[order])), y_all[order])
    _sgd(f, dict(zip(f, torch.autograd.grad(loss, list(f.values())), strict=True)), task_bufs, lr)
    for _ in range(CONFIG["local_epochs"]):
        order = torch.from_numpy(rng.permutation(N))
        x, y = x_all[order], y_all[order]
        xi = torch.rand(N, NOISE, generator=noise).double()
        code = F.one_hot(y, K).double() * CONFIG["label_value"]
        # 1. D, with F's features and G's reference fixed.
        z, r = feat(x).detach(), gen(xi, code).detach()
        loss = torch.mean((1 - disc(r, code)) ** 2 + disc(z, code) ** 2)
        _sgd(d, dict(zip(d, torch.autograd.grad(loss, list(d.values())), strict=True)), d_bufs, lr1)
        # 2. F and C against the new D.
        z = feat(x)
        loss = alpha * ce(logits(z), y) + (1 - alpha) * torch.mean((1 - disc(z, code)) ** 2)
        _sgd(f, dict(zip(f, torch.autograd.grad(loss, list(f.values())), strict=True)), task_bufs, lr)
        # 3. G on the same noise, against the new D.
        loss = torch.mean(disc(gen(xi, code), code) ** 2)
        _sgd(g, dict(zip(g, torch.autograd.grad(loss, list(g.values())), strict=True)), g_bufs, lr1)
    return {part: {n: p.detach().numpy() for n, p in params.items()} for part, params in
            (("model", f), ("generator", g), ("discriminator", d))}


def test_a_round_is_the_float64_replay_of_the_reference_steps() -> None:
    h = half()
    want = reference_round(half())
    h.train(1, ROUND_SEED, NOTHING)
    for part, module in (("model", h.ctx.model), ("generator", h.generator), ("discriminator", h.discriminator)):
        for name, p in module.named_parameters():
            np.testing.assert_allclose(p.detach().numpy(), want[part][name], rtol=0, atol=5e-7,
                                       err_msg=f"{part}.{name}")


def test_each_part_moves_and_the_discriminator_is_not_reset_between_rounds() -> None:
    h = half()
    start = {part: {n: p.detach().clone() for n, p in m.named_parameters()}
             for part, m in (("model", h.ctx.model), ("generator", h.generator), ("discriminator", h.discriminator))}
    h.train(1, ROUND_SEED, NOTHING)
    for part, m in (("model", h.ctx.model), ("generator", h.generator), ("discriminator", h.discriminator)):
        assert all(not torch.equal(p, start[part][n]) for n, p in m.named_parameters()), part
    opt = h.discriminator_optimizer
    after_one = {id(p): opt.state[p]["momentum_buffer"].clone() for p in h.discriminator.parameters()}
    # Round 2 gets the global F, C and G; D and its momentum carry on (the fresh task optimiser does not).
    upload = h.upload()
    h.train(2, ROUND_SEED + 1, Received([upload], frozenset()))
    assert h.discriminator_optimizer is opt
    assert all(not torch.equal(opt.state[p]["momentum_buffer"], after_one[id(p)]) for p in h.discriminator.parameters())
    assert h.optimizer("task") is not h.optimizer("task")  # keep_optimizer_state = false: fresh every round


def test_local_steps_runs_exactly_that_many_adversarial_batches() -> None:
    # One batch an epoch (batch = N): local_steps = 2 with E0 = 0 is the round of E1 = 2 epochs, bit for bit,
    # whatever local_epochs says; a third step changes it.
    def after(**fields: Any) -> dict[str, torch.Tensor]:
        h = half(classifier_epochs=0, **fields)
        h.train(1, ROUND_SEED, NOTHING)
        return {f"{part}.{n}": p.detach().clone() for part, m in
                (("model", h.ctx.model), ("generator", h.generator), ("discriminator", h.discriminator))
                for n, p in m.named_parameters()}

    two_epochs, two_steps, three_steps = after(local_epochs=2), after(local_epochs=7, local_steps=2), \
        after(local_epochs=7, local_steps=3)
    assert all(torch.equal(two_epochs[n], two_steps[n]) for n in two_epochs)
    assert all(not torch.equal(three_steps[n], two_steps[n]) for n in two_steps)


# ------------------------------------------------------------------------------------------------- the wire
def test_the_upload_is_f_c_and_g_and_never_d() -> None:
    h = half()
    upload, metrics = h.train(1, ROUND_SEED, NOTHING)
    assert isinstance(metrics, EvalMetrics) and metrics.train_loss > 0
    assert sorted(upload.tensors) == sorted(MODEL + GENERATOR) and upload.num_examples == N
    sent = codec.payload_to_proto(upload).SerializeToString() + codec.payload_to_proto(metrics).SerializeToString()
    assert not any(p.detach().numpy().tobytes() in sent for p in h.discriminator.parameters())
    assert all(p.detach().numpy().tobytes() in sent for p in h.generator.parameters())
    # F (4·3 + 3) and C (3·3 + 3) and G ((2 + 3)·5 + 5 + 5·3 + 3) values, in float32.
    assert sum(a.nbytes for a in upload.tensors.values()) == (15 + 12 + 48) * 4
    assert sorted(d.name for d in h.declarations(None)) == sorted(MODEL + GENERATOR)


def test_the_global_f_c_and_g_are_loaded_and_a_foreign_tensor_is_refused() -> None:
    h = half()
    sent = {n: np.full(a.shape, 0.25, np.float32) for n, a in h.upload().tensors.items()}
    h.evaluate(1, Received([ModelWeights(sent, 0)], frozenset()))
    now = {**{n: p.detach().numpy() for n, p in h.ctx.model.named_parameters()},
           **{"generator." + n: p.detach().numpy() for n, p in h.generator.named_parameters()}}
    assert all(np.array_equal(now[n], sent[n]) for n in sent)
    foreign = {**sent, "discriminator.projection.weight": np.zeros((PROJECTION, LATENT + K), np.float32)}
    with pytest.raises(ValueError, match=r"does not have: \['discriminator.projection.weight'\]"):
        h.evaluate(1, Received([ModelWeights(foreign, 0)], frozenset()))


def test_the_contract_refuses_a_discriminator_tensor_and_an_undeclared_kind() -> None:
    spec, h = get_spec("fedadg"), half()
    schema = schema_from_declared(h.declarations(None), spec)
    metrics = codec.payload_to_proto(EvalMetrics())
    upload = h.upload()
    ok = check_update(spec, Phase.TRAIN, [codec.payload_to_proto(upload), metrics], schema, 10**6)
    assert sorted(ok.get(ModelWeights).tensors) == sorted(MODEL + GENERATOR)
    d_weight = h.discriminator.projection.weight.detach().numpy()
    with_d = codec.payload_to_proto(ModelWeights({**upload.tensors, "discriminator.projection.weight": d_weight}, N))
    with pytest.raises(WireError, match=r"unexpected tensors \['discriminator.projection.weight'\]") as refused:
        check_update(spec, Phase.TRAIN, [with_d, metrics], schema, 10**6)
    assert refused.value.reason == "shape_mismatch"
    head = codec.payload_to_proto(HeadWeights(upload.tensors["head.weight"], upload.tensors["head.bias"]))
    with pytest.raises(WireError, match="fedadg does not accept head_weights") as refused:
        check_update(spec, Phase.TRAIN, [codec.payload_to_proto(upload), head, metrics], schema, 10**6)
    assert refused.value.reason == "payload_kind_not_allowed"


# ------------------------------------------------------------------------------------------------ the config
def test_the_defaults_are_the_reference_codes() -> None:
    c = get_spec("fedadg").config()
    assert (c.classifier_epochs, c.local_epochs, c.batch_size, c.lr, c.adversarial_lr, c.momentum, c.weight_decay) \
        == (3, 7, 10, 0.01, 0.007, 0.9, 1e-5)
    assert (c.alpha, c.label_smoothing, c.label_value, c.noise_dim, c.generator_hidden, c.generator_relu,
            c.projection_dim, c.discriminator_hidden, c.weighting) == \
        (0.85, 0.01, 0.7, 64, 256, False, 256, 256, "uniform")  # G's and D's sizes are hetfed's own


@pytest.mark.parametrize(("fields", "message"), [
    ({"local_steps": 5}, "local_steps .* needs classifier_epochs = 0"),
    ({"alpha": 1.5}, r"alpha must be in \[0, 1\]"),
    ({"label_smoothing": 1.0}, r"label_smoothing must be in \[0, 1\)"),
    ({"noise_dim": 0}, "noise_dim must be >= 1"),
    ({"adversarial_lr": 0.0}, "adversarial_lr must be > 0"),
    ({"classifier_epochs": -1}, "classifier_epochs must be >= 0"),
])
def test_the_config_refuses_what_it_cannot_run(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_spec("fedadg").config(**fields)


def test_it_does_not_serve_privacy() -> None:
    # The runtime refuses [privacy] at Join for a half without a mechanism (D and G train outside DP-SGD).
    assert client_half_type(get_spec("fedadg")).privacy_mechanism is None
