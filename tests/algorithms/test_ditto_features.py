"""Features of named layers, the refit schedule, and a drift-constrained step reaching w_L only."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hetfed.client.algorithms.ditto.cosine import CosineDrift
from hetfed.client.algorithms.ditto.features import RefitSchedule, forward_with_features, gather_features
from hetfed.client.algorithms.ditto.mkmmd import (
    MkMmdLoss,
)
from hetfed.client.algorithms.ditto.mmdd import MmdDLoss
from hetfed.client.models import SplitModel


def _split_model(seed: int) -> SplitModel:
    torch.manual_seed(seed)
    return SplitModel(nn.Linear(6, 4), latent_dim=4, num_classes=3)


@pytest.mark.parametrize("measure", ["cos", "mkmmd", "mmdd"])
def test_ditto_local_step_reaches_the_local_model_only(measure: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(10, 6)
    labels = torch.randint(0, 3, (10,))
    w_global = _split_model(1)  # w_G: trained by its own CE step, never by the local loss
    received = copy.deepcopy(w_global).requires_grad_(False).eval()  # the frozen copy θ̄ of w̄
    w_local = copy.deepcopy(w_global)
    with torch.no_grad():  # a local model that has drifted
        for p in w_local.parameters():
            p.add_(0.3 * torch.randn_like(p))
    drift: nn.Module = {"cos": CosineDrift(), "mkmmd": MkMmdLoss(), "mmdd": MmdDLoss(4, sigma_phi_init=1.0)}[measure]
    lam, mu = 0.1, 1.0
    logits, f_local = forward_with_features(w_local, "", x)
    _, f_frozen = forward_with_features(received, "", x)
    prox = sum((p - r).pow(2).sum() for p, r in zip(w_local.parameters(), received.parameters(), strict=True))
    term = mu * drift(f_local, f_frozen)
    loss = F.cross_entropy(logits, labels) + 0.5 * lam * prox + term
    loss.backward()
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in w_local.parameters())
    assert all(p.grad is None for p in w_global.parameters())
    assert all(p.grad is None for p in received.parameters())
    assert all(p.grad is None for p in drift.parameters())
    # the drift term alone reaches the encoder (the constrained layer), not the head
    w_local.zero_grad(set_to_none=True)
    _, f_local = forward_with_features(w_local, "", x)
    (mu * drift(f_local, f_frozen)).backward()
    assert w_local.encoder.weight.grad is not None and float(w_local.encoder.weight.grad.abs().sum()) > 0
    assert w_local.head.weight.grad is None


def test_forward_with_features_by_layer_name_matches_embed() -> None:
    model = _split_model(2)
    x = torch.randn(5, 6)
    out, feats = forward_with_features(model, "encoder", x)
    out2, feats2 = forward_with_features(model, "", x)
    assert torch.equal(out, model(x)) and torch.equal(out, out2)
    assert torch.equal(feats, model.embed(x)) and torch.equal(feats, feats2)
    with pytest.raises(ValueError, match=r"no layer 'linear_9'.*encoder"):
        forward_with_features(model, "linear_9", x)
    with pytest.raises(ValueError, match="embed"):
        forward_with_features(nn.Sequential(nn.Linear(6, 2)), "", x)


def test_gather_features_is_gradient_free_in_eval_mode_and_restores_modes() -> None:
    local = nn.Sequential(nn.Linear(6, 4), nn.Dropout(0.5), nn.Linear(4, 3)).train()
    ref = copy.deepcopy(local).eval()
    batches = [torch.randn(10, 6) for _ in range(5)]
    f_l, f_r = gather_features(local, ref, "1", batches, max_batches=3)
    assert f_l.shape == (30, 4) and not f_l.requires_grad
    assert torch.equal(f_l, f_r)  # eval mode: dropout off, so equal weights give equal features
    assert local.training and not ref.training
    with pytest.raises(ValueError, match="max_batches"):
        gather_features(local, ref, "1", batches, max_batches=0)


def test_refit_schedule() -> None:
    every20 = RefitSchedule(20, 50)
    assert [s for s in range(45) if every20.due(s)] == [0, 20, 40]
    each = RefitSchedule(-1, 1)
    assert each.per_step and not any(each.due(s) for s in range(5))
    for bad in ({"every": 0}, {"every": -2}, {"batches": 0}, {"every": True}):
        with pytest.raises(ValueError, match="refit"):
            RefitSchedule(**bad)  # type: ignore[arg-type]
