"""SimFed's client half: the factorised model it builds, one round's upload, and what a download leaves in the mask."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hetfed.aggregator.algorithms.base import RunInfo
from hetfed.aggregator.algorithms.simfed import SimFedServer, reflect_factorized
from hetfed.client.algorithms import ClientContext, client_half_type
from hetfed.client.algorithms.base import ClientHalf
from hetfed.client.algorithms.simfed import SimFedClient, criteria_set_id
from hetfed.client.algorithms.simfed.layers import (
    FactorizedConv2d,
    FactorizedLinear,
    encode_factors,
    factorized_layers,
    load_factors,
    unsent_mask,
)
from hetfed.client.data import DataConfig, load_client_data
from hetfed.client.models import build_model
from hetfed.wire.codec import payload_from_proto, payload_to_proto
from hetfed.wire.payloads import CriteriaEmbeddings, EvalMetrics, FactorizedWeights, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import get_spec
from hetfed.wire.specs.simfed import SimFedConfig

CFG = SimFedConfig(local_epochs=1, batch_size=64, mask_threshold=3e-3, mask_init="sparse")


def client(config: SimFedConfig = CFG, index: int = 0) -> SimFedClient:
    data = load_client_data(DataConfig(dataset="digits", partition="dirichlet", num_clients=4, client_index=index,
                                       permute_labels=True))
    half = client_half_type(get_spec("simfed"))
    model = half.make_model("lenet", data.input_shape, data.num_classes, seed=0, latent_dim=None,
                            bounded_latent=False, config=config)
    return SimFedClient(ClientContext(f"org-{index}", model, data, torch.device("cpu"), config, seed=0))


def test_the_half_builds_the_factorised_model_and_others_the_registered_one() -> None:
    assert client_half_type(get_spec("simfed")) is SimFedClient
    c = client()
    kinds = [type(m) for _, m in factorized_layers(c.ctx.model)]
    assert kinds == [FactorizedConv2d, FactorizedConv2d, FactorizedLinear, FactorizedLinear]
    assert isinstance(c.ctx.model.head, torch.nn.Linear)
    nomask = client(SimFedConfig(masks=False))
    assert all(m.mask is None for _, m in factorized_layers(nomask.ctx.model))
    # The default hook builds the architecture as registered, with the same seeded weights.
    plain = ClientHalf.make_model("lenet", (1, 8, 8), 10, seed=3, latent_dim=None, bounded_latent=False, config=CFG)
    ref = build_model("lenet", (1, 8, 8), 10, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), ref.state_dict().values(), strict=True))


def test_a_round_uploads_thresholded_factors_embeddings_and_metrics() -> None:
    c = client()
    up = c.train(1, 11, Received([]))
    fw, ce, metrics = up
    assert isinstance(fw, FactorizedWeights) and isinstance(ce, CriteriaEmbeddings) and isinstance(metrics, EvalMetrics)
    assert ce.criteria_set_id == criteria_set_id(0, 1, (1, 8, 8)) and ce.embeddings.shape == (1, 84)
    for (_, layer), sent in zip(factorized_layers(c.ctx.model), fw.layers, strict=True):
        mask = layer.mask.detach().numpy().reshape(-1)  # type: ignore[union-attr]
        np.testing.assert_array_equal(sent.mask_indices, np.flatnonzero(np.abs(mask) > 3e-3))
    sent = sum(layer.mask_indices.size for layer in fw.layers)
    total = sum(int(np.prod(layer.mask_shape)) for layer in fw.layers)
    assert metrics.extra["mask_density"] == sent / total and 0.0 < sent / total < 0.5
    # The trained mask's density (non-zero entries, sent or not) is reported beside the sent one.
    nonzero = sum(int(torch.count_nonzero(layer.mask)) for _, layer in factorized_layers(c.ctx.model))  # type: ignore[arg-type]
    assert metrics.extra["trained_mask_density"] == nonzero / total > sent / total
    # The authors' count: what their evaluation keeps, |μ| ≥ λ1.
    kept = sum(int(torch.count_nonzero(layer.mask.abs() >= CFG.lambda1))  # type: ignore[union-attr]
               for _, layer in factorized_layers(c.ctx.model))
    assert metrics.extra["kept_mask_density"] == kept / total and sent / total <= kept / total <= nonzero / total
    assert metrics.extra["evaluated_round"] == 1.0 and fw.num_examples == len(c.ctx.train)
    # The same round from the same state uploads the same bytes (seeded batches, seeded factors).
    again = client().train(1, 11, Received([]))[0]
    assert isinstance(again, FactorizedWeights)
    assert all(np.array_equal(a.mask_values, b.mask_values) for a, b in zip(fw.layers, again.layers, strict=True))


def _state(c: SimFedClient) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in c.ctx.model.state_dict().items()}


@pytest.mark.parametrize("shared", ["uvm", "uv", "u"])
def test_a_reflection_of_only_itself_leaves_every_own_parameter_as_before_the_upload(shared: str) -> None:
    c = client(dataclasses.replace(CFG, shared_factors=shared))  # type: ignore[arg-type]
    fw = c.train(1, 11, Received([]))[0]
    assert isinstance(fw, FactorizedWeights)
    before = _state(c)
    masks = [layer.mask.detach() for _, layer in factorized_layers(c.ctx.model)]  # type: ignore[union-attr]
    assert sum(int(((m != 0) & (m.abs() <= 3e-3)).sum()) for m in masks) > 0  # some entries stay off the wire
    if shared == "uvm":
        assert sum(layer.mask_indices.size for layer in fw.layers) > 0
    else:  # unshared factors do not travel
        assert all(layer.mask_indices.size == 0 for layer in fw.layers)
        assert all(layer.v.size == 0 for layer in fw.layers) == (shared == "u")
    # The server's reflection when J_k = {k}, through the wire codec both ways.
    server = SimFedServer(dataclasses.replace(CFG, shared_factors=shared),  # type: ignore[arg-type]
                          RunInfo(seed=0, organizations=("org-0",)))
    up = [fw, CriteriaEmbeddings(c.criteria_id, np.ones((1, 84), np.float32)), EvalMetrics()]
    got = Received([payload_from_proto(payload_to_proto(p)) for p in up])
    server.validate(Phase.TRAIN, "org-0", got)
    server.accumulate(Phase.TRAIN, "org-0", got)
    server.close_round(Phase.TRAIN, 1)
    down = server.payloads_for(Phase.TRAIN, 2, "org-0")
    assert len(down) == 1
    c.load(Received([payload_from_proto(payload_to_proto(p)) for p in down]))
    after = _state(c)
    assert after.keys() == before.keys()
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0)


class _Tiny(torch.nn.Module):
    """One factorised dense layer with three inputs and one output: u and μ have three entries, v one."""

    def __init__(self, u: list[float], v: list[float], mask: list[float]) -> None:
        super().__init__()
        self.layer = FactorizedLinear(3, 1, bias=False)
        with torch.no_grad():
            self.layer.u.copy_(torch.tensor(u))
            self.layer.v.copy_(torch.tensor(v))
            self.layer.mask.copy_(torch.tensor(mask).reshape(3, 1))  # type: ignore[union-attr]


def test_the_reflection_of_two_organizations_keeps_each_ones_unsent_entries_by_hand() -> None:
    a = _Tiny([1.0, 2.0, 3.0], [2.0], [0.5, 0.002, -0.25])  # 0.002 stays home (threshold 3e-3)
    b = _Tiny([3.0, 2.0, 1.0], [4.0], [-0.001, 0.75, 0.25])  # -0.001 stays home
    up_a, up_b = encode_factors(a, 3e-3), encode_factors(b, 3e-3)
    assert up_a.layers[0].mask_indices.tolist() == [0, 2] and up_b.layers[0].mask_indices.tolist() == [1, 2]
    rest_a, rest_b = unsent_mask(a, 3e-3), unsent_mask(b, 3e-3)
    # Weights (3/4 own, 1/4 the other), as softmax(α·σ) gives them for σ = (1, 0.96), exp(α·0.04) = 3.
    load_factors(a, reflect_factorized(up_a, [up_a, up_b], np.array([0.75, 0.25])), unsent=rest_a)
    load_factors(b, reflect_factorized(up_b, [up_a, up_b], np.array([0.25, 0.75])), unsent=rest_b)
    # u: 3/4·[1, 2, 3] + 1/4·[3, 2, 1] = [1.5, 2, 2.5]; v: 3/4·2 + 1/4·4 = 2.5 (b: mirrored, 3.5).
    np.testing.assert_array_equal(a.layer.u.detach().numpy(), [1.5, 2.0, 2.5])
    np.testing.assert_array_equal(a.layer.v.detach().numpy(), [2.5])
    np.testing.assert_array_equal(b.layer.u.detach().numpy(), [2.5, 2.0, 1.5])
    np.testing.assert_array_equal(b.layer.v.detach().numpy(), [3.5])
    # μ_a: sent [0.5, 0, -0.25] + 1/4·([0, 0.75, 0.25] − [0.5, 0, -0.25]) = [0.375, 0.1875, -0.125], plus its
    # unsent 0.002 in the middle; μ_b: [0.125, 0.5625, 0.125] plus its unsent -0.001 first.
    f32 = np.float32
    np.testing.assert_array_equal(a.layer.mask.detach().numpy().reshape(-1),  # type: ignore[union-attr]
                                  np.array([0.375, f32(0.1875) + f32(0.002), -0.125], np.float32))
    np.testing.assert_array_equal(b.layer.mask.detach().numpy().reshape(-1),  # type: ignore[union-attr]
                                  np.array([f32(0.125) + f32(-0.001), 0.5625, 0.125], np.float32))
    # Without the unsent part (what the client did before) the entries it kept home would be lost.
    c = _Tiny([1.0, 2.0, 3.0], [2.0], [0.5, 0.002, -0.25])
    load_factors(c, reflect_factorized(up_a, [up_a, up_b], np.array([0.75, 0.25])))
    np.testing.assert_array_equal(c.layer.mask.detach().numpy().reshape(-1), [0.375, 0.1875, -0.125])  # type: ignore[union-attr]


@pytest.mark.parametrize(("mask_init", "dense_share", "conv_share"), [
    ("reference", 0.0, 0.0),  # the authors' encoder: every mask starts at zero
    ("zero", 0.0, 0.0),
    ("dense", 1.0, 0.0),  # dense layers' masks drawn in full, convolutions' zero
])
def test_masks_start_as_the_named_start_says(mask_init: str, dense_share: float, conv_share: float) -> None:
    config = SimFedConfig(mask_init=mask_init)  # type: ignore[arg-type]
    model = SimFedClient.make_model("lenet", (1, 28, 28), 10, seed=0, latent_dim=None, bounded_latent=False,
                                    config=config)
    shares = {type(layer).__name__: float(torch.count_nonzero(layer.mask)) / layer.mask.numel()  # type: ignore[union-attr]
              for _, layer in factorized_layers(model)}
    assert shares == {"FactorizedConv2d": conv_share, "FactorizedLinear": dense_share}
    assert SimFedConfig().mask_init == "reference"
