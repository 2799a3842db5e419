"""FedProto's client half: cross-entropy plus λ times the distance of each embedding to its class's global
prototype, then the organization's class prototypes up.

The model (encoder f_i and head g_i, any architecture whose latent has the run's width d_e) never leaves the
organization. Each round: take the global prototypes C̄ (none in round 1, which trains on cross-entropy alone),
train with L_S + λ·L_R for the round's local epochs, then send C_i^(j), the mean of f_i(x) over the training
examples of each class j it holds (eval mode, no gradient, after training), with the counts |D_i,j|; a class it
lacks is absent. Its figures: the local model (encoder and head) on its own test set, and the prototype
inference of the paper (the nearest global prototype among the classes the organization holds).
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch
from torch import nn

from hetfed.client.algorithms.base import ClientContext, ClientHalf
from hetfed.client.data import class_counts
from hetfed.client.models import SplitModel
from hetfed.client.training import (
    Batch,
    Forward,
    LossTerm,
    Objective,
    PerExample,
    cross_entropy,
    epoch_batches,
    eval_mode,
    fit,
)
from hetfed.wire.payloads import ClassMeanEmbeddings, EvalMetrics, Payload, Received
from hetfed.wire.specs import fedproto
from hetfed.wire.specs.fedproto import FedProtoConfig


class PrototypeDistance(nn.Module):
    """λ·L_R per example: λ·‖z − C̄_y‖² (``squared_l2``) or that over d_e (``mse``), 0 where C̄_y is not set.

    The mean over a batch of the ``mse`` values is the reference code's λ·MSELoss(C̄_y, z) exactly (its rows
    of classes without a global prototype are z itself, so they add 0 and count in the mean). C̄ is a constant.
    """

    def __init__(self, weight: float, prototypes: torch.Tensor, present: torch.Tensor, distance: str) -> None:
        super().__init__()
        self.scale = float(weight) / (prototypes.shape[1] if distance == "mse" else 1)
        self.prototypes = prototypes.detach().clone()
        self.present = present.detach().clone().to(torch.bool)

    def forward(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The values, a tensor [n]."""
        sq = (z - self.prototypes[labels].to(z.dtype)).pow(2).sum(dim=1)
        return self.scale * torch.where(self.present[labels], sq, torch.zeros_like(sq))


def embedding_forward(model: nn.Module, batch: Batch) -> Forward:
    """One pass: the latent z and the head's logits on it."""
    split = cast(SplitModel, model)
    z = split.embed(batch.x)
    return Forward(split.head(z), {"z": z})


@fedproto.SPEC.client_half
class FedProtoClient(ClientHalf[FedProtoConfig]):
    """FedProto worker: a private model, trained toward the global prototypes; its class prototypes go up."""

    # The last global prototypes received (the targets of the next round and of the prototype inference).
    private_attributes = ("prototypes", "present")
    # Under DP nothing would bound the embeddings whose class means go up (FedProto's latents are unbounded),
    # so this half does not serve [privacy].
    privacy_mechanism = None

    def __init__(self, ctx: ClientContext[FedProtoConfig]) -> None:
        super().__init__(ctx)
        self.cfg = ctx.config
        self.counts = class_counts(ctx.data.train.y, ctx.data.num_classes)
        self.prototypes: torch.Tensor | None = None
        self.present: torch.Tensor | None = None

    def _check_model(self) -> None:
        model, k = self.ctx.model, self.ctx.data.num_classes
        if model.latent_dim != self.cfg.latent_dim or k != self.cfg.num_classes:
            raise ValueError(
                f"FedProto run expects latent_dim={self.cfg.latent_dim} and num_classes={self.cfg.num_classes}; "
                f"this organization's model has latent_dim={model.latent_dim} and its data {k} classes "
                "(set model.latent_dim in the client config, or latent_dim/num_classes in the run's config)"
            )

    def _receive(self, received: Received) -> None:
        cme = received.maybe(ClassMeanEmbeddings)
        if cme is not None:
            dev = self.ctx.device
            self.prototypes = torch.as_tensor(np.array(cme.means, dtype=np.float32), device=dev)
            self.present = torch.as_tensor(np.array(cme.presence, dtype=bool), device=dev)

    def terms(self) -> list[LossTerm]:
        """L_S, and λ·L_R once a global prototype is set and λ > 0."""
        terms: list[LossTerm] = [cross_entropy]
        if self.prototypes is not None and self.present is not None and bool(self.present.any()) \
                and self.cfg.proto_weight > 0:
            distance = PrototypeDistance(self.cfg.proto_weight, self.prototypes, self.present, self.cfg.proto_distance)
            terms.append(PerExample(lambda batch, out: distance(out["z"], batch.y), name="prototype_distance"))
        return terms

    @torch.no_grad()
    def local_prototypes(self) -> ClassMeanEmbeddings:
        """C_i^(j): the mean of f_i(x) over the training examples of class j, in eval mode (float64 sums)."""
        model, k, train = self.ctx.model, self.ctx.data.num_classes, self.ctx.train
        sums = torch.zeros(k, self.cfg.latent_dim, dtype=torch.float64, device=self.ctx.device)
        with eval_mode(model):
            for batch in train.batches(slice(s, s + 1024) for s in range(0, len(train), 1024)):
                sums.index_add_(0, batch.y, model.embed(batch.x).double())
        counts = self.counts.copy()
        means = (sums / torch.as_tensor(np.maximum(counts, 1), dtype=torch.float64, device=sums.device)[:, None])
        return ClassMeanEmbeddings(np.arange(k, dtype=np.int64), means.cpu().numpy().astype(np.float32), counts,
                                   counts > 0)

    def prototype_accuracy(self) -> float:
        """The paper's prototype inference on the own test set: argmin_j ‖f_i(x) − C̄^(j)‖ over the classes this
        organization holds whose C̄^(j) is set (the reference code's classes_list); 0 before any is set."""
        test = self.ctx.test
        if self.prototypes is None or self.present is None or len(test) == 0:
            return 0.0
        allowed = self.present & torch.as_tensor(self.counts > 0, device=self.present.device)
        if not bool(allowed.any()):
            return 0.0
        correct = 0
        with eval_mode(self.ctx.model), torch.no_grad():
            for batch in test.batches(slice(s, s + 1024) for s in range(0, len(test), 1024)):
                dist = torch.cdist(self.ctx.model.embed(batch.x).float(), self.prototypes)
                dist = dist.masked_fill(~allowed, float("inf"))
                correct += int((dist.argmin(dim=1) == batch.y).sum())
        return correct / len(test)

    def _metrics(self, loss: float, evaluated_round: int) -> EvalMetrics:
        extra = {"prototype_test_accuracy": self.prototype_accuracy()} if self.ctx.evaluates else {}
        return self.ctx.metrics(loss, evaluated_round=evaluated_round, extra=extra)

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """Train on L_S + λ·L_R toward the prototypes received, then send the class prototypes and metrics."""
        ctx = self.ctx
        self._check_model()
        self._receive(received)
        objective = Objective(ctx.model, self.optimizer(), self.terms(), forward=embedding_forward)
        result = fit([objective], epoch_batches(ctx.train, self.cfg, ctx.rng(round_seed)))
        return [self.local_prototypes(), self._metrics(result.loss, round_)]

    def evaluate(self, round_: int, received: Received) -> EvalMetrics:
        """The local model, and the prototype inference against the last global prototypes."""
        self._receive(received)
        return self._metrics(0.0, round_ - 1)
