"""Only what trains crosses: the model-averaging halves (FedAvg, FedProx, FedAvg of the body, FedSR, Ditto) declare,
upload and load the trainable tensors of a model with a frozen backbone, and never a frozen one; the run's schema
refuses an organization whose trainable set differs (a real Join to a real aggregator)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from torch import nn

from hetfed.client.algorithms import ClientContext, make_client_half
from hetfed.client.algorithms.ditto import DittoClient
from hetfed.client.algorithms.fedavg import ModelAveragingClient, shared_state
from hetfed.client.algorithms.fedsr import REFERENCE_PREFIX, FedSRClient
from hetfed.client.data import ClientData, DataConfig, load_client_data
from hetfed.client.models import SplitModel, build_model
from hetfed.client.training import trainable
from hetfed.wire import codec
from hetfed.wire.payloads import ModelWeights, PayloadKind, Received
from hetfed.wire.specs import get_spec
from tests.conftest import RawClient, run_config

torch.set_num_threads(1)
NOTHING = Received([], frozenset())


class Adapted(nn.Module):
    """A frozen linear layer plus a trainable rank-2 update (LoRA's shape)."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(2, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.zeros(base.out_features, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + x @ self.a.T @ self.b.T
        return out


def adapted_model(seed: int = 0, frozen: str = "backbone") -> SplitModel:
    """Conv + BatchNorm (a "pretrained" backbone), an adapted linear layer, a parameter-free BatchNorm, the head.

    ``frozen``: "backbone" (the conv, its BatchNorm and the adapted layer's base), "conv" (the conv alone) or
    "nothing" (every tensor trains, the adapter's base included)."""
    torch.manual_seed(seed)
    encoder = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                            Adapted(nn.Linear(3 * 6 * 6, 5)), nn.BatchNorm1d(5, affine=False))
    model = SplitModel(encoder, 5, 10)
    if frozen == "nothing":
        model.requires_grad_(True)
    elif frozen == "conv":
        encoder[4].base.requires_grad_(True)
        encoder[0].requires_grad_(False)
    else:
        encoder[:2].requires_grad_(False)
    return model


SHARED_WHEN_BACKBONE_FROZEN = ["encoder.4.a", "encoder.4.b", "head.weight", "head.bias"]
FLOATING = ["encoder.0.weight", "encoder.0.bias", "encoder.1.weight", "encoder.1.bias", "encoder.1.running_mean",
            "encoder.1.running_var", "encoder.4.a", "encoder.4.b", "encoder.4.base.weight", "encoder.4.base.bias",
            "encoder.5.running_mean", "encoder.5.running_var", "head.weight", "head.bias"]


@functools.lru_cache(maxsize=1)
def digits() -> ClientData:
    return load_client_data(DataConfig(dataset="digits", partition="iid", num_clients=2, client_index=0, seed=0))


def half(algorithm: str, build: Callable[[], SplitModel] = adapted_model, **fields: Any) -> Any:
    """The algorithm's real client half on organization 0's digits, one local step of batch 16 a round."""
    spec = get_spec(algorithm)
    config = spec.config(**{"local_epochs": 1, "local_steps": 1, "batch_size": 16, **fields})
    return make_client_half(spec, ClientContext("org-0", build(), digits(), torch.device("cpu"), config, 0,
                                                build_model=build))


def frozen_entries(model: nn.Module) -> dict[str, bytes]:
    """The bytes of every floating state entry that is not shared."""
    shared = shared_state(model)
    return {k: v.numpy().tobytes() for k, v in model.state_dict().items()
            if v.is_floating_point() and k not in shared}


# ------------------------------------------------------------------------------------------------ the rule
@pytest.mark.parametrize(("frozen", "shared"), [
    ("backbone", SHARED_WHEN_BACKBONE_FROZEN),
    # The BatchNorm after the frozen conv trains, so its statistics go with it; the parameter-free one goes with
    # the encoder, which holds a frozen conv: it stays.
    ("conv", [n for n in FLOATING if not n.startswith(("encoder.0.", "encoder.5."))]),
    ("nothing", FLOATING),
])
def test_shared_state_is_what_trains_and_the_statistics_of_modules_that_all_train(frozen: str,
                                                                                  shared: list[str]) -> None:
    model = adapted_model(frozen=frozen)
    assert list(shared_state(model)) == shared
    # The parameter-free BatchNorm goes with the encoder above it: shared only when all of the encoder trains.
    assert ("encoder.5.running_mean" in shared) == all(p.requires_grad for p in model.encoder.parameters())


@pytest.mark.parametrize("name", ["mlp", "lenet", "fedgen_cnn", "rmnist_cnn", "cnn_small"])
def test_with_nothing_frozen_every_floating_state_entry_is_shared(name: str) -> None:
    model = build_model(name, (1, 28, 28), 10, seed=0)
    state = model.state_dict()
    assert list(shared_state(model)) == [k for k, v in state.items() if v.is_floating_point()]


# ------------------------------------------------------------------------------------------------ FedAvg
def test_fedavg_declares_and_uploads_the_trainable_tensors_and_no_frozen_byte() -> None:
    fedavg = half("fedavg")
    assert [d.name for d in fedavg.declarations(None)] == SHARED_WHEN_BACKBONE_FROZEN
    assert all(d.kind == PayloadKind.MODEL_WEIGHTS for d in fedavg.declarations(None))
    upload, _ = fedavg.train(1, 11, NOTHING)
    assert isinstance(upload, ModelWeights) and list(upload.tensors) == SHARED_WHEN_BACKBONE_FROZEN
    wire = codec.payload_to_proto(upload).SerializeToString()
    state = fedavg.ctx.model.state_dict()
    for name in FLOATING:
        if name not in SHARED_WHEN_BACKBONE_FROZEN:
            assert name.encode() not in wire
            if state[name].numel() >= 16:  # long enough that its bytes cannot appear by chance
                assert state[name].numpy().tobytes() not in wire, name
    for name in SHARED_WHEN_BACKBONE_FROZEN:
        assert state[name].numpy().tobytes() in wire


def test_a_download_writes_the_trainable_tensors_and_leaves_frozen_ones_bit_for_bit() -> None:
    fedavg = half("fedavg")
    model = fedavg.ctx.model
    fedavg.train(1, 11, NOTHING)  # the frozen BatchNorm's statistics moved locally (train mode)
    before = frozen_entries(model)
    assert set(before) == set(FLOATING) - set(SHARED_WHEN_BACKBONE_FROZEN)
    rng = np.random.default_rng(5)
    sent = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in shared_state(model).items()}
    fedavg.load(Received([ModelWeights(sent, 0)], frozenset()))
    assert frozen_entries(model) == before
    state = model.state_dict()
    for name, array in sent.items():
        assert state[name].numpy().tobytes() == array.tobytes()


def test_a_download_naming_a_frozen_tensor_is_refused_and_changes_nothing() -> None:
    fedavg = half("fedavg")
    model = fedavg.ctx.model
    before = {k: v.numpy().tobytes() for k, v in model.state_dict().items()}
    sent = {k: np.zeros(tuple(v.shape), np.float32) for k, v in model.state_dict().items() if v.is_floating_point()}
    with pytest.raises(ValueError, match=r"does not share \(frozen or not in its model\): \['encoder.0.bias', "
                                         r"'encoder.0.weight', 'encoder.1.bias', 'encoder.1.running_mean', "
                                         r"'encoder.1.running_var'\]"):
        fedavg.load(Received([ModelWeights(sent, 0)], frozenset()))
    assert {k: v.numpy().tobytes() for k, v in model.state_dict().items()} == before


def test_fedavg_of_the_body_shares_the_trainable_tensors_but_the_head() -> None:
    body = half("fedavg_body")
    assert [d.name for d in body.declarations(None)] == ["encoder.4.a", "encoder.4.b"]
    upload, _ = body.train(1, 11, NOTHING)
    assert list(upload.tensors) == ["encoder.4.a", "encoder.4.b"]


def test_head_only_fedavg_refuses_a_frozen_head() -> None:
    def frozen_head() -> SplitModel:
        model = adapted_model()
        model.head.requires_grad_(False)
        return model

    with pytest.raises(ValueError, match=r"head has frozen parameters \['weight', 'bias'\]"):
        half("fedavg_head", frozen_head)


# ------------------------------------------------------------------------------------------------ FedProx
def test_fedprox_pulls_only_the_trainable_tensors_toward_the_global_model() -> None:
    mu = 0.5
    prox = half("fedprox", mu=mu)
    model = prox.ctx.model
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    term = prox.terms()[-1]
    params = trainable(model)
    assert [id(p) for p in params] == [id(p) for n, p in model.named_parameters()
                                       if n in SHARED_WHEN_BACKBONE_FROZEN]
    with torch.no_grad():
        for i, p in enumerate(params):
            p.add_(0.1 * (i + 1))  # moved away from the global weights by 0.1, 0.2, ...
    expected = 0.5 * mu * sum(p.numel() * (0.1 * (i + 1)) ** 2 for i, p in enumerate(params))
    assert float(term(None, None).detach()) == pytest.approx(expected, rel=1e-5)
    prox.train(1, 11, NOTHING)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n


# ------------------------------------------------------------------------------------------------ FedSR
def test_fedsr_shares_the_trainable_tensors_of_its_probabilistic_model_and_r_when_shared() -> None:
    data = digits()
    spec = get_spec("fedsr")
    config = spec.config(local_steps=1, batch_size=16, shared_reference=True)

    def build() -> SplitModel:
        model = FedSRClient.make_model("mlp", data.input_shape, data.num_classes, seed=0, latent_dim=8,
                                       bounded_latent=False, config=config)
        next(m for m in model.modules() if isinstance(m, nn.Linear)).requires_grad_(False)  # the first layer
        return model

    sr = make_client_half(spec, ClientContext("org-0", build(), data, torch.device("cpu"), config, 0,
                                              build_model=build))
    model = sr.ctx.model
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert len(frozen) == 2
    names = [n for n, v in model.state_dict().items() if v.is_floating_point() and n not in frozen]
    references = [REFERENCE_PREFIX + k for k in sr.cmi.state_dict()]
    assert [d.name for d in sr.declarations(None)] == names + references
    upload, _ = sr.train(1, 11, NOTHING)
    assert list(upload.tensors) == names + references
    before = frozen_entries(model)
    sr.load(Received([ModelWeights({k: v + 1 for k, v in upload.tensors.items()}, 0)], frozenset()))
    assert frozen_entries(model) == before


# ------------------------------------------------------------------------------------------------ Ditto
def test_ditto_shares_the_global_models_trainable_tensors_and_penalises_the_trainable_ones() -> None:
    lam = 0.3
    ditto = half("ditto", lam=lam, mu=0.0)
    assert isinstance(ditto, DittoClient)
    frozen = {n: p.detach().clone() for model in (ditto.ctx.model, ditto.personal)
              for n, p in model.named_parameters() if not p.requires_grad}
    assert len(frozen) == 6
    assert [d.name for d in ditto.declarations(None)] == SHARED_WHEN_BACKBONE_FROZEN
    rng = np.random.default_rng(2)
    sent = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in shared_state(ditto.ctx.model).items()}
    upload, _ = ditto.train(2, 11, Received([ModelWeights(sent, 0)], frozenset()))
    assert list(upload.tensors) == SHARED_WHEN_BACKBONE_FROZEN
    for model in (ditto.ctx.model, ditto.personal):
        for n, p in model.named_parameters():
            if not p.requires_grad:
                assert torch.equal(p, frozen[n]), n
    # The weight penalty pairs w_L's trainable tensors with w̄'s at the same places: one more step from here adds
    # λ·(w_L − w̄) to exactly those gradients.
    objective = ditto.personal_objective(12)
    for p in trainable(ditto.personal):
        p.grad = None
    assert objective.before_step is not None
    objective.before_step()
    reference = dict(ditto.reference.named_parameters())
    for n, p in ditto.personal.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p.grad, lam * (p.detach() - reference[n]), atol=1e-7), n


def test_every_model_averaging_half_trains_only_what_requires_grad() -> None:
    for algorithm in ("fedavg", "fedprox", "fedavg_body", "ditto"):
        h = half(algorithm)
        assert isinstance(h, ModelAveragingClient)
        assert [id(p) for p in h.parameters()] == [id(p) for p in trainable(h.ctx.model)]
        assert len(h.parameters()) == 2 + 2  # the adapter's a and b, the head's weight and bias


# ------------------------------------------------------------------------------------------------ the schema
def declared(model: nn.Module) -> list[tuple[PayloadKind, str, np.ndarray]]:
    """What FedAvg's half of ``model`` declares at Join, as RawClient sends it."""
    return [(PayloadKind.MODEL_WEIGHTS, k, v.numpy()) for k, v in shared_state(model).items()]


@pytest.mark.parametrize(("first", "second", "details"), [
    ("backbone", "nothing", "model_weights: tensors differ from the run's (missing [], unexpected "
                            "['encoder.0.bias', 'encoder.0.weight', 'encoder.1.bias', 'encoder.1.running_mean', "
                            "'encoder.1.running_var'])"),
    ("nothing", "backbone", "model_weights: tensors differ from the run's (missing ['encoder.0.bias', "
                            "'encoder.0.weight', 'encoder.1.bias', 'encoder.1.running_mean', "
                            "'encoder.1.running_var'], unexpected [])"),
])
def test_an_organization_whose_trainable_set_differs_is_refused_at_join(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient], first: str, second: str,
        details: str) -> None:
    agg = aggregator(run_config())
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a.join(declared(adapted_model(frozen=first)))
    with pytest.raises(grpc.RpcError) as err:
        b.join(declared(adapted_model(frozen=second)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details in err.value.details()
    assert set(agg.service.runs["r"].refused) == {"b"}
    b.join(declared(adapted_model(frozen=first)))  # the same trainable set: accepted
    assert agg.service.runs["r"].refused == {}
