"""Per-FedAvg's client half: each local step a MAML meta-step on independent batches; evaluation personalises.

A local step reads one batch of 2B examples (3B under HF) and splits it into D, D' (and D''). The forward pass
takes the inner step ``temp = w − α∇f(w; D)`` with the inner gradient held constant and returns temp's logits on
D': the gradient of their cross-entropy with respect to w is ∇f(temp; D'), and the optimiser (plain SGD at β)
steps w by it: the first-order step. Under HF, before the step, each gradient v = ∇f(temp; D') becomes
v − α·d with d the Hessian of f at w on D'' applied to v, by finite differences or by double backpropagation.
Before each evaluation a copy of the received global model takes ``eval_steps`` α-steps on batches of B of the
organization's training data; that copy is what is scored and deployed. The model sent up is the meta-model w.
"""

from __future__ import annotations

import copy
import dataclasses
import zlib
from collections.abc import Iterator, Sequence
from typing import ClassVar

import numpy as np
import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from hetfed.client.algorithms.base import ClientContext
from hetfed.client.algorithms.fedavg import ModelAveragingClient
from hetfed.client.models import SplitModel
from hetfed.client.training import (
    Batch,
    Forward,
    Objective,
    epoch_batches,
    evaluate,
    fit,
    sampled_batches,
    trainable,
)
from hetfed.wire.payloads import EvalMetrics, Payload, Received
from hetfed.wire.specs import TrainConfig, perfedavg
from hetfed.wire.specs.perfedavg import PerFedAvgConfig

# Distinguishes the evaluation's draws from the round's training draws (``ClientContext.rng``).
_EVAL_STREAM = 0x50455246


def split(batch: Batch, parts: int) -> list[Batch]:
    """The batch's examples in ``parts`` consecutive parts of near-equal size (D, D', D'')."""
    return [Batch(x, y) for x, y in zip(torch.tensor_split(batch.x, parts), torch.tensor_split(batch.y, parts),
                                        strict=True)]


def gradient(model: nn.Module, at: dict[str, torch.Tensor], batch: Batch,
             create_graph: bool = False) -> tuple[torch.Tensor, ...]:
    """∇f(at; batch): the gradient of the mean cross-entropy of ``model`` with its parameters ``at`` (tensors that
    require a gradient, by name; parameters not named are the model's own) with respect to ``at``."""
    loss = F.cross_entropy(functional_call(model, at, (batch.x,)), batch.y)
    return torch.autograd.grad(loss, list(at.values()), create_graph=create_graph)


def hessian_vector(model: nn.Module, params: dict[str, nn.Parameter], batch: Batch, v: Sequence[torch.Tensor],
                   how: str, delta: float) -> list[torch.Tensor]:
    """d = ∇²f(w; batch)·v at the parameters ``params`` (w): by central finite differences of the gradient,
    [∇f(w + δv) − ∇f(w − δv)] / 2δ, or exactly by double backpropagation (``how = "autograd"``)."""
    if how == "autograd":
        grads = gradient(model, dict(params), batch, create_graph=True)
        return [h.detach() for h in torch.autograd.grad(grads, list(params.values()), grad_outputs=list(v))]
    shifted = []
    for sign in (1.0, -1.0):
        at = {n: (p.detach() + sign * delta * g).requires_grad_() for (n, p), g in zip(params.items(), v, strict=True)}
        shifted.append(gradient(model, at, batch))
    return [(plus - minus) / (2 * delta) for plus, minus in zip(*shifted, strict=True)]


def meta_cross_entropy(batch: Batch, out: Forward) -> torch.Tensor:
    """f(temp; D'): the cross-entropy of the inner-stepped model's logits on D' against D''s labels."""
    return F.cross_entropy(out.logits, out["labels"])


class MetaStep:
    """One Per-FedAvg local step as ``fit`` runs it: ``forward`` (the inner α-step on D, then temp's logits on
    D') and, under HF, ``before_step`` (the Hessian-vector correction on D'')."""

    def __init__(self, model: nn.Module, config: PerFedAvgConfig) -> None:
        self.model, self.config = model, config
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self._third: Batch | None = None

    def forward(self, model: nn.Module, batch: Batch) -> Forward:
        """temp = w − α∇f(w; D), the inner gradient a constant (no graph through it), and temp's logits on D'."""
        parts = split(batch, self.config.batches_per_step)
        inner = gradient(model, dict(self.params), parts[0])
        temp = {n: p - self.config.alpha * g for (n, p), g in zip(self.params.items(), inner, strict=True)}
        self._third = parts[2] if len(parts) > 2 else None
        return Forward(functional_call(model, temp, (parts[1].x,)), {"labels": parts[1].y})

    def before_step(self) -> None:
        """HF: every gradient v = ∇f(temp; D') becomes v − α·∇²f(w; D'')·v."""
        if self._third is None:
            return
        params = list(self.params.values())
        v = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        d = hessian_vector(self.model, self.params, self._third, v, self.config.hvp, self.config.delta)
        with torch.no_grad():
            for p, g, h in zip(params, v, d, strict=True):
                p.grad = g - self.config.alpha * h


@perfedavg.SPEC.client_half
class PerFedAvgClient(ModelAveragingClient[PerFedAvgConfig]):
    """Per-FedAvg: the meta-step each local step; the received model evaluated after its α-step(s)."""

    # A meta-step's gradient is taken at a point an inner step on other examples moved: DP-SGD's per-example
    # clipping bounds neither batch's influence, so this half does not serve [privacy].
    privacy_mechanism: ClassVar[str | None] = None

    def __init__(self, ctx: ClientContext[PerFedAvgConfig]) -> None:
        super().__init__(ctx)
        self._personal: SplitModel | None = None

    def local_batches(self, rng: np.random.Generator) -> Iterator[Batch]:
        """The round's steps, each one batch of k·B examples (k = 2, or 3 under HF) to split: ``local_steps``
        independent draws, or ``local_epochs`` shuffled passes; a batch of fewer than k examples is skipped."""
        cfg, k = self.config, self.config.batches_per_step
        size = k * cfg.batch_size
        if cfg.local_steps > 0:
            batches = sampled_batches(self.ctx.train, size, cfg.local_steps, rng)
        else:
            batches = epoch_batches(self.ctx.train, TrainConfig(local_epochs=cfg.local_epochs, batch_size=size), rng)
        return (b for b in batches if b.y.shape[0] >= k)

    def personalised(self, rng: np.random.Generator) -> SplitModel:
        """A copy of the model after ``eval_steps`` plain α-steps on independent batches of B training examples."""
        model = copy.deepcopy(self.ctx.model)
        if self.config.eval_steps:
            optimizer = torch.optim.SGD(trainable(model), lr=self.config.alpha)
            fit([Objective(model, optimizer)],
                sampled_batches(self.ctx.train, self.config.batch_size, self.config.eval_steps, rng))
        return model

    def eval_rng(self, evaluated_round: int) -> np.random.Generator:
        """The draws of the personalising steps before evaluating the model of ``evaluated_round``."""
        return np.random.default_rng([self.ctx.seed, evaluated_round, zlib.crc32(self.ctx.organization.encode()),
                                      _EVAL_STREAM])

    def measure(self, evaluated_round: int) -> EvalMetrics:
        """The personalised copy's metrics, and the unpersonalised model's test accuracy beside them."""
        ctx = self.ctx
        if not ctx.evaluates:
            return ctx.metrics(0.0, evaluated_round=evaluated_round)
        self._personal = self.personalised(self.eval_rng(evaluated_round))
        global_accuracy, _ = evaluate(ctx.model, ctx.test)
        return ctx.metrics(0.0, evaluated_round=evaluated_round, model=self._personal,
                           extra={"global_model_test_accuracy": global_accuracy})

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """Evaluate the received model personalised, then take the round's meta-steps and upload the meta-model."""
        ctx = self.ctx
        self.load(received)
        before = self.measure(round_ - 1)
        step = MetaStep(ctx.model, self.config)
        objective = Objective(ctx.model, self.optimizer(), [meta_cross_entropy], step.forward,
                              before_step=step.before_step if self.config.variant == "hf" else None)
        result = fit([objective], self.local_batches(ctx.rng(round_seed)))
        return [self.upload(), dataclasses.replace(before, train_loss=result.loss)]

    def deployed_model(self) -> SplitModel:
        """The last evaluated personalised model (the global model after its α-steps), else the model."""
        return self._personal if self._personal is not None else self.ctx.model
