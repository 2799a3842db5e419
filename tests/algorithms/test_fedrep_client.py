"""FedRep's client half: the alternation (head with the body frozen, then body with the head frozen) against a
float64 reference, the steps of each phase, what goes up (the body's bytes, never the head's) and the wire
contract that refuses a head tensor."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import hetfed.client.algorithms.fedrep as fedrep_client
from hetfed.client.algorithms import ClientContext, make_client_half
from hetfed.client.data.core import ArrayDataset, ClientData
from hetfed.client.models import SplitModel
from hetfed.client.training import FitResult
from hetfed.wire import codec
from hetfed.wire.contract import check_update, schema_from_declared
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import EvalMetrics, HeadWeights, ModelWeights, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import get_spec

torch.set_num_threads(1)
NOTHING = Received([], frozenset())
N, FEATURES, LATENT, K = 25, 4, 3, 3
SEED, ROUND_SEED, ORG = 7, 11, "org-0"
# τ_h = 2 and τ_b = 1 epochs of batch 10 over 25 examples: 3 batches an epoch (10, 10, 5), so 6 + 3 steps.
CONFIG = {"local_epochs": 3, "body_epochs": 1, "batch_size": 10, "lr": 0.5, "momentum": 0.0, "weight_decay": 0.0}
HEAD = ["head.weight", "head.bias"]
BODY = ["encoder.0.weight", "encoder.0.bias"]


def model() -> SplitModel:
    torch.manual_seed(0)
    return SplitModel(nn.Sequential(nn.Linear(FEATURES, LATENT), nn.Tanh()), LATENT, K)


def data() -> ClientData:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N, FEATURES)).astype(np.float32)
    y = rng.integers(0, K, size=N)
    return ClientData(ArrayDataset(x, y), ArrayDataset(x[:5], y[:5]), None, K, (FEATURES,), "tiny")


def half(build: Any = model, **fields: Any) -> Any:
    spec = get_spec("fedrep")
    ctx = ClientContext(ORG, build(), data(), torch.device("cpu"), spec.config(**{**CONFIG, **fields}), SEED)
    return make_client_half(spec, ctx)


def params(m: nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in m.named_parameters()}


def changed(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> list[str]:
    return sorted(n for n in before if not np.array_equal(before[n], after[n]))


def test_the_head_phase_moves_only_the_head_and_the_body_phase_only_the_body(monkeypatch: pytest.MonkeyPatch
                                                                             ) -> None:
    h = half()
    phases: list[tuple[list[str], list[str], list[str], int]] = []
    real_fit = fedrep_client.fit
    names = {id(p): n for n, p in h.ctx.model.named_parameters()}

    def recorded_fit(objectives: Any, batches: Any) -> FitResult:
        """Per phase: what the optimiser steps, what takes a gradient, what changed, and the steps taken."""
        (objective,) = objectives
        stepped = sorted(names[id(p)] for g in objective.optimizer.param_groups for p in g["params"])
        grads = sorted(n for n, p in h.ctx.model.named_parameters() if p.requires_grad)
        before = params(h.ctx.model)
        result = real_fit(objectives, batches)
        phases.append((stepped, grads, changed(before, params(h.ctx.model)), result.steps))
        return result

    monkeypatch.setattr(fedrep_client, "fit", recorded_fit)
    before = params(h.ctx.model)
    upload, metrics = h.train(1, ROUND_SEED, NOTHING)
    assert phases == [(sorted(HEAD),) * 3 + (6,), (sorted(BODY),) * 3 + (3,)]
    assert changed(before, params(h.ctx.model)) == sorted(HEAD + BODY)
    # After the round every parameter trains again: the freezing does not outlive its phase.
    assert all(p.requires_grad for p in h.ctx.model.parameters())
    assert isinstance(metrics, EvalMetrics) and np.isfinite(metrics.train_loss)
    assert isinstance(upload, ModelWeights) and list(upload.tensors) == BODY


def reference_round() -> dict[str, np.ndarray]:
    """The round in float64 by hand: plain SGD on the head alone for two epochs, then on the body alone for one,
    over the batches the organization's round generator draws (one permutation per epoch)."""
    ds, m = data().train, model()
    p = {n: t.detach().double().clone() for n, t in m.named_parameters()}
    x, y = torch.as_tensor(ds.x, dtype=torch.float64), torch.as_tensor(ds.y)
    rng = np.random.default_rng([SEED, ROUND_SEED, zlib.crc32(ORG.encode())])
    lr = CONFIG["lr"]
    for part in ("head.", "head.", "encoder."):  # two epochs of the head, then one of the body
        order = torch.as_tensor(rng.permutation(N))
        for start in range(0, N, CONFIG["batch_size"]):
            idx = order[start:start + CONFIG["batch_size"]]
            moving = {n: t.requires_grad_(n.startswith(part)) for n, t in p.items()}
            z = torch.tanh(x[idx] @ moving["encoder.0.weight"].T + moving["encoder.0.bias"])
            loss = F.cross_entropy(z @ moving["head.weight"].T + moving["head.bias"], y[idx])
            names = [n for n in p if n.startswith(part)]
            grads = torch.autograd.grad(loss, [p[n] for n in names])
            with torch.no_grad():
                p = {n: (t - lr * grads[names.index(n)] if n in names else t).detach() for n, t in p.items()}
    return {n: t.numpy() for n, t in p.items()}


def test_the_round_is_the_float64_alternation() -> None:
    h = half()
    h.train(1, ROUND_SEED, NOTHING)
    want = reference_round()
    for name, got in params(h.ctx.model).items():
        np.testing.assert_allclose(got, want[name], rtol=0, atol=2e-6, err_msg=name)


def test_the_upload_carries_the_body_bytes_and_never_the_head_bytes() -> None:
    h = half()
    upload, metrics = h.train(1, ROUND_SEED, NOTHING)
    sent = b"".join(codec.payload_to_proto(p).SerializeToString() for p in (upload, metrics))
    state = {n: p.detach().numpy().astype(np.float32) for n, p in h.ctx.model.named_parameters()}
    assert all(state[n].tobytes() in sent for n in BODY)
    assert not any(state[n].tobytes() in sent for n in HEAD)
    # 12 + 3 body values in float32: what one round sends of the model.
    assert sum(a.nbytes for a in upload.tensors.values()) == (LATENT * FEATURES + LATENT) * 4


def test_the_global_body_is_loaded_and_the_head_is_kept() -> None:
    h = half()
    head = params(h.ctx.model)
    body = {n: np.full((LATENT, FEATURES) if n.endswith("weight") else (LATENT,), 0.25, np.float32) for n in BODY}
    h.evaluate(1, Received([ModelWeights(body, 0)], frozenset()))
    now = params(h.ctx.model)
    assert all(np.array_equal(now[n], body[n]) for n in BODY)
    assert all(np.array_equal(now[n], head[n]) for n in HEAD)


def test_the_contract_refuses_a_head_tensor_and_a_head_payload() -> None:
    spec, h = get_spec("fedrep"), half()
    schema = schema_from_declared(h.declarations(None), spec)
    assert sorted(schema[ModelWeights.kind]) == sorted(BODY)
    state = {n: p.detach().numpy() for n, p in h.ctx.model.named_parameters()}
    metrics = codec.payload_to_proto(EvalMetrics())
    body_only = codec.payload_to_proto(ModelWeights({n: state[n] for n in BODY}, N))
    assert list(check_update(spec, Phase.TRAIN, [body_only, metrics], schema, 10**6).get(ModelWeights).tensors) \
        == BODY
    with_head = codec.payload_to_proto(ModelWeights(state, N))
    with pytest.raises(WireError, match=r"unexpected tensors \['head.bias', 'head.weight'\]") as refused:
        check_update(spec, Phase.TRAIN, [with_head, metrics], schema, 10**6)
    assert refused.value.reason == "shape_mismatch"
    head = codec.payload_to_proto(HeadWeights(state["head.weight"], state["head.bias"]))
    with pytest.raises(WireError, match="fedrep does not accept head_weights") as refused:
        check_update(spec, Phase.TRAIN, [body_only, head, metrics], schema, 10**6)
    assert refused.value.reason == "payload_kind_not_allowed"


@pytest.mark.parametrize(("fields", "message"), [
    ({"local_steps": 5}, "local_steps must be 0"),
    ({"local_epochs": 2, "body_epochs": 2}, "body_epochs must be >= 1"),
    ({"body_epochs": 0}, "body_epochs must be >= 1"),
])
def test_the_config_refuses_phases_it_cannot_run(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_spec("fedrep").config(**fields)


def test_the_defaults_are_the_papers_and_its_codes() -> None:
    c = get_spec("fedrep").config()
    assert (c.head_epochs, c.body_epochs, c.batch_size, c.lr, c.momentum, c.weight_decay, c.weighting) == \
        (10, 1, 10, 0.01, 0.5, 1e-4, "uniform")


@pytest.mark.parametrize(("frozen", "part"), [("head", "head"), ("encoder", "body")])
def test_a_part_with_nothing_to_train_is_refused_when_the_client_starts(frozen: str, part: str) -> None:
    def build() -> SplitModel:
        m = model()
        getattr(m, frozen).requires_grad_(False)
        return m

    with pytest.raises(ValueError, match=f"this organization's {part} has no trainable parameter"):
        half(build)
