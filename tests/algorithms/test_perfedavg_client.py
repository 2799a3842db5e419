"""Per-FedAvg's client half on a linear softmax model in float64: the FO and HF meta-steps and the personalising
α-step against numpy computed by hand (the softmax cross-entropy's gradient and Hessian-vector product written
out), on the batches the organization's generators draw; what goes up and what the contract refuses."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from hetfed.client.algorithms import ClientContext, client_half_type, make_client_half
from hetfed.client.algorithms.perfedavg import _EVAL_STREAM, PerFedAvgClient
from hetfed.client.data.core import ArrayDataset, ClientData
from hetfed.client.models import SplitModel
from hetfed.client.training import DeviceData
from hetfed.wire import codec
from hetfed.wire.contract import check_update, schema_from_declared
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import EvalMetrics, HeadWeights, ModelWeights, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import get_spec

torch.set_num_threads(1)
NOTHING = Received([], frozenset())
N, FEATURES, K = 23, 4, 3
SEED, ROUND_SEED, ORG = 7, 11, "org-0"
ALPHA, BETA, B, STEPS = 0.3, 0.2, 4, 3
CONFIG = {"alpha": ALPHA, "lr": BETA, "batch_size": B, "local_steps": STEPS}
NAMES = ["head.weight", "head.bias"]


def model() -> SplitModel:
    """logits = W·x + b: the encoder passes x through, the head is the whole model (float64)."""
    torch.manual_seed(0)
    m = SplitModel(nn.Identity(), FEATURES, K).double()
    with torch.no_grad():  # weights large enough that the softmax is far from uniform: a Hessian with some curve
        m.head.weight.mul_(4.0)
        m.head.bias.copy_(torch.tensor([0.5, -0.7, 0.2], dtype=torch.float64))
    return m


def data() -> ClientData:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N, FEATURES))
    y = rng.integers(0, K, size=N)
    return ClientData(ArrayDataset(x, y), ArrayDataset(x[:6], y[:6]), None, K, (FEATURES,), "tiny")


def half(name: str = "perfedavg", **fields: Any) -> PerFedAvgClient:
    spec = get_spec(name)
    ctx = ClientContext(ORG, model(), data(), torch.device("cpu"), spec.config(**{**CONFIG, **fields}), SEED)
    # The sets in float64 on the device (ArrayDataset holds float32 inputs), for the float64 model.
    ds = data()
    ctx.train, ctx.test = (DeviceData(torch.as_tensor(d.x, dtype=torch.float64), torch.as_tensor(d.y))
                           for d in (ds.train, ds.test))
    h = make_client_half(spec, ctx)
    assert isinstance(h, PerFedAvgClient)
    return h


# The maths by hand, in numpy float64: w = (W, b), f(w; X, Y) the mean softmax cross-entropy.
def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)  # type: ignore[no-any-return]


def grad(w: tuple[np.ndarray, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """∇f: G = (softmax(XWᵀ + b) − onehot(Y)) / n, ∂W = GᵀX, ∂b = Σ rows of G."""
    g = (softmax(x @ w[0].T + w[1]) - np.eye(K)[y]) / len(y)
    return g.T @ x, g.sum(axis=0)


def hvp(w: tuple[np.ndarray, np.ndarray], v: tuple[np.ndarray, np.ndarray], x: np.ndarray, y: np.ndarray
        ) -> tuple[np.ndarray, np.ndarray]:
    """∇²f·v exactly: per example, the logits move by dz = V_W·x + v_b, the softmax by J·dz = p∘dz − p(p·dz)."""
    p = softmax(x @ w[0].T + w[1])
    dz = x @ v[0].T + v[1]
    jp = (p * dz - p * (p * dz).sum(axis=1, keepdims=True)) / len(y)
    return jp.T @ x, jp.sum(axis=0)


def hvp_fd(w: tuple[np.ndarray, np.ndarray], v: tuple[np.ndarray, np.ndarray], x: np.ndarray, y: np.ndarray,
           delta: float) -> tuple[np.ndarray, np.ndarray]:
    """[∇f(w + δv) − ∇f(w − δv)] / 2δ."""
    plus = grad((w[0] + delta * v[0], w[1] + delta * v[1]), x, y)
    minus = grad((w[0] - delta * v[0], w[1] - delta * v[1]), x, y)
    return (plus[0] - minus[0]) / (2 * delta), (plus[1] - minus[1]) / (2 * delta)


def start() -> tuple[np.ndarray, np.ndarray]:
    m = model()
    return m.head.weight.detach().numpy().copy(), m.head.bias.detach().numpy().copy()


def reference_round(variant: str, how: str = "autograd", delta: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
    """τ meta-steps, each on 2B (3B) examples drawn without replacement by the round's generator, split in order
    into D, D' (, D''): temp = w − α∇f(w; D); v = ∇f(temp; D'); w ← w − β·v (FO) or w − β(v − α·H(w; D'')v) (HF)."""
    ds = data().train
    rng = np.random.default_rng([SEED, ROUND_SEED, zlib.crc32(ORG.encode())])
    k = 3 if variant == "hf" else 2
    w = start()
    for _ in range(STEPS):
        idx = rng.choice(N, size=k * B, replace=False)
        d, d2, d3 = idx[:B], idx[B:2 * B], idx[2 * B:]
        g = grad(w, ds.x[d], ds.y[d])
        temp = (w[0] - ALPHA * g[0], w[1] - ALPHA * g[1])
        v = grad(temp, ds.x[d2], ds.y[d2])
        if variant == "hf":
            h = hvp(w, v, ds.x[d3], ds.y[d3]) if how == "autograd" else hvp_fd(w, v, ds.x[d3], ds.y[d3], delta)
            v = (v[0] - ALPHA * h[0], v[1] - ALPHA * h[1])
        w = (w[0] - BETA * v[0], w[1] - BETA * v[1])
    return w


def weights(h: PerFedAvgClient) -> tuple[np.ndarray, np.ndarray]:
    return h.ctx.model.head.weight.detach().numpy(), h.ctx.model.head.bias.detach().numpy()


def assert_close(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray], atol: float) -> None:
    for name, a, b in zip(NAMES, got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=name)


def test_the_first_order_round_is_the_float64_meta_step() -> None:
    h = half()
    upload, metrics = h.train(1, ROUND_SEED, NOTHING)
    want = reference_round("fo")
    assert_close(weights(h), want, 1e-13)
    # The meta step moved the model: a plain FedAvg step at β on the same draws would end elsewhere.
    assert not np.allclose(want[0], start()[0])
    assert isinstance(upload, ModelWeights) and list(upload.tensors) == NAMES
    assert_close((upload.tensors["head.weight"], upload.tensors["head.bias"]), want, 1e-13)
    assert isinstance(metrics, EvalMetrics) and np.isfinite(metrics.train_loss)


def test_the_hessian_free_round_with_the_exact_product_is_the_float64_step() -> None:
    h = half("perfedavg", variant="hf", hvp="autograd")
    h.train(1, ROUND_SEED, NOTHING)
    assert_close(weights(h), reference_round("hf", "autograd"), 1e-13)


def test_the_hessian_free_preset_takes_finite_differences_and_they_approach_the_exact_product() -> None:
    h = half("perfedavg_hf")
    assert (h.config.variant, h.config.hvp, h.config.delta) == ("hf", "finite_difference", 1e-3)
    h.train(1, ROUND_SEED, NOTHING)
    assert_close(weights(h), reference_round("hf", "finite_difference", 1e-3), 1e-12)
    # The central difference is within O(δ²) of the exact product, and the HF step differs from the FO step.
    assert_close(weights(h), reference_round("hf", "autograd"), 1e-6)
    assert not np.allclose(weights(h)[0], reference_round("fo")[0], rtol=0, atol=1e-6)


def test_evaluation_scores_and_deploys_the_model_after_one_alpha_step_on_local_data() -> None:
    h = half()
    before = start()
    metrics = h.evaluate(2, NOTHING)
    rng = np.random.default_rng([SEED, 1, zlib.crc32(ORG.encode()), _EVAL_STREAM])
    idx = rng.choice(N, size=B, replace=False)
    ds = data().train
    g = grad(before, ds.x[idx], ds.y[idx])
    deployed = h.deployed_model()
    assert deployed is not h.ctx.model
    assert_close((deployed.head.weight.detach().numpy(), deployed.head.bias.detach().numpy()),
                 (before[0] - ALPHA * g[0], before[1] - ALPHA * g[1]), 1e-14)
    assert_close(weights(h), before, 0.0)  # the model itself (what goes up) is untouched
    test = data().test
    personal = softmax(test.x @ (before[0] - ALPHA * g[0]).T + before[1] - ALPHA * g[1])
    assert metrics.test_accuracy == float(np.mean(personal.argmax(axis=1) == test.y))
    assert metrics.extra["global_model_test_accuracy"] == float(np.mean(
        softmax(test.x @ before[0].T + before[1]).argmax(axis=1) == test.y))


def test_no_personalising_step_scores_the_model_itself() -> None:
    h = half(eval_steps=0)
    metrics = h.evaluate(2, NOTHING)
    assert metrics.test_accuracy == metrics.extra["global_model_test_accuracy"]
    assert_close((h.deployed_model().head.weight.detach().numpy(), h.deployed_model().head.bias.detach().numpy()),
                 start(), 0.0)


def test_epochs_split_each_pass_into_steps_of_two_batches() -> None:
    h = half(local_steps=0, local_epochs=2, batch_size=5)
    steps = list(h.local_batches(np.random.default_rng(0)))
    # 23 examples in batches of 10: 10, 10 and 3 a pass (every one has at least the 2 examples D and D' need).
    assert [int(b.y.shape[0]) for b in steps] == [10, 10, 3] * 2


def test_the_contract_refuses_a_head_payload_and_an_unknown_tensor() -> None:
    spec, h = get_spec("perfedavg"), half()
    schema = schema_from_declared(h.declarations(None), spec)
    assert sorted(schema[ModelWeights.kind]) == sorted(NAMES)
    state = {n: p.detach().numpy().astype(np.float32) for n, p in h.ctx.model.named_parameters()}
    metrics = codec.payload_to_proto(EvalMetrics())
    whole = codec.payload_to_proto(ModelWeights(state, N))
    assert sorted(check_update(spec, Phase.TRAIN, [whole, metrics], schema, 10**6).get(ModelWeights).tensors) \
        == sorted(NAMES)
    head = codec.payload_to_proto(HeadWeights(state["head.weight"], state["head.bias"]))
    with pytest.raises(WireError, match="perfedavg does not accept head_weights") as refused:
        check_update(spec, Phase.TRAIN, [whole, head, metrics], schema, 10**6)
    assert refused.value.reason == "payload_kind_not_allowed"
    extra = codec.payload_to_proto(ModelWeights({**state, "personal.weight": state["head.weight"]}, N))
    with pytest.raises(WireError, match=r"unexpected tensors \['personal.weight'\]"):
        check_update(spec, Phase.TRAIN, [extra, metrics], schema, 10**6)


def test_the_half_does_not_serve_privacy() -> None:
    assert client_half_type(get_spec("perfedavg")).privacy_mechanism is None
    assert client_half_type(get_spec("perfedavg_hf")).privacy_mechanism is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"alpha": 0.0}, "alpha must be a finite number > 0"),
    ({"delta": -1.0}, "delta must be a finite number > 0"),
    ({"variant": "so"}, "variant must be 'fo' or 'hf'"),
    ({"hvp": "exact"}, "hvp must be"),
    ({"eval_steps": -1}, "eval_steps must be >= 0"),
    ({"optimizer": "adam"}, "meta step is a gradient step"),
])
def test_the_config_refuses_what_it_cannot_run(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_spec("perfedavg").config(**fields)


def test_the_defaults() -> None:
    c = get_spec("perfedavg").config()
    assert (c.variant, c.alpha, c.lr, c.momentum, c.batch_size, c.local_steps, c.local_epochs, c.hvp, c.delta,
            c.eval_steps, c.weighting) == ("fo", 0.01, 0.1, 0.0, 40, 0, 2, "finite_difference", 0.001, 1, "uniform")
