"""SimFed's client half: the factorised model it builds, one round's upload, and what a download leaves in the mask."""

from __future__ import annotations

import numpy as np
import torch

from hetfed.client.algorithms import CLIENT_HALVES, ClientContext, client_half_type
from hetfed.client.algorithms.base import ClientHalf
from hetfed.client.algorithms.simfed import SimFedClient, criteria_set_id
from hetfed.client.algorithms.simfed.layers import (
    FactorizedConv2d,
    FactorizedLinear,
    encode_factors,
    factorized_layers,
)
from hetfed.client.data import DataConfig, load_client_data
from hetfed.client.models import build_model
from hetfed.wire.payloads import CriteriaEmbeddings, EvalMetrics, FactorizedWeights, Received
from hetfed.wire.specs import get_spec
from hetfed.wire.specs.simfed import SimFedConfig

CFG = SimFedConfig(local_epochs=1, batch_size=64, mask_threshold=3e-3)


def client(config: SimFedConfig = CFG, index: int = 0) -> SimFedClient:
    data = load_client_data(DataConfig(dataset="digits", partition="dirichlet", num_clients=4, client_index=index,
                                       permute_labels=True))
    half = client_half_type(get_spec("simfed"))
    model = half.make_model("lenet", data.input_shape, data.num_classes, seed=0, latent_dim=None,
                            bounded_latent=False, config=config)
    return SimFedClient(ClientContext(f"org-{index}", model, data, torch.device("cpu"), config, seed=0))


def test_the_half_builds_the_factorised_model_and_others_the_registered_one() -> None:
    assert CLIENT_HALVES["simfed"] is SimFedClient
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
    assert metrics.extra["evaluated_round"] == 1.0 and fw.num_examples == len(c.ctx.train)
    # The same round from the same state uploads the same bytes (seeded batches, seeded factors).
    again = client().train(1, 11, Received([]))[0]
    assert isinstance(again, FactorizedWeights)
    assert all(np.array_equal(a.mask_values, b.mask_values) for a, b in zip(fw.layers, again.layers, strict=True))


def test_a_download_replaces_the_mask_unless_unsent_entries_are_kept() -> None:
    for keep in (False, True):
        c = client(SimFedConfig(local_epochs=1, batch_size=64, keep_unsent_mask=keep))
        c.train(1, 11, Received([]))
        before = [layer.mask.detach().clone() for _, layer in factorized_layers(c.ctx.model)]  # type: ignore[union-attr]
        download = encode_factors(client(index=1).ctx.model, 3e-3)  # another organization's factors
        c.load(Received([download]))
        for (_, layer), sent, old in zip(factorized_layers(c.ctx.model), download.layers, before, strict=True):
            got = layer.mask.detach().numpy().reshape(-1)  # type: ignore[union-attr]
            expected = np.zeros(got.size, np.float32)
            expected[sent.mask_indices] = sent.mask_values
            if keep:  # the entries this organization did not send come back on top of the download
                unsent = old.numpy().reshape(-1) * (np.abs(old.numpy().reshape(-1)) <= 3e-3)
                expected = expected + unsent
            np.testing.assert_array_equal(got, expected)
            np.testing.assert_array_equal(layer.u.detach().numpy(), sent.u)
        assert c.figures["received_mask_density"] > 0
