"""Client halves of Local, FedAvg, FedProx and head-only FedAvg."""

from __future__ import annotations

import numpy as np
import torch

from hetfed.client.algorithms.base import ClientContext
from hetfed.client.losses import ProximalTerm
from hetfed.client.training import fit
from hetfed.wire.payloads import EvalMetrics, HeadWeights, ModelWeights, Payload, PayloadKind
from hetfed.wire.specs import FedProxConfig


class LocalClient:
    """Trains on its own data only; reports metrics of its own model after each round."""

    def __init__(self, ctx: ClientContext) -> None:
        self.ctx = ctx

    def declared(self) -> list[tuple[PayloadKind, str, np.ndarray]]:
        """Nothing is uploaded but metrics."""
        return []

    def setup(self, round_seed: int) -> list[Payload]:
        """No setup phase."""
        return []

    def train(self, round_: int, round_seed: int, received: dict[PayloadKind, Payload]) -> list[Payload]:
        """Train locally, evaluate the result."""
        loss = fit(self.ctx.model, self.ctx.train, self.ctx.config, self.ctx.rng(round_seed))
        return [self.ctx.metrics(loss, evaluated_round=round_)]

    def evaluate(self, round_: int, received: dict[PayloadKind, Payload]) -> EvalMetrics:
        """The local model as it stands."""
        return self.ctx.metrics(0.0, evaluated_round=round_ - 1)


def shared_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The floating-point entries of a model's state (parameters and running statistics) FedAvg averages."""
    return {k: v for k, v in model.state_dict().items() if v.is_floating_point()}


class FedAvgClient:
    """FedAvg / FedProx: load the global model, evaluate it, train (with the proximal term), upload it."""

    def __init__(self, ctx: ClientContext) -> None:
        self.ctx = ctx
        self.mu = ctx.config.mu if isinstance(ctx.config, FedProxConfig) else 0.0

    def declared(self) -> list[tuple[PayloadKind, str, np.ndarray]]:
        """Every floating state entry of the model."""
        return [(PayloadKind.MODEL_WEIGHTS, k, v.cpu().numpy()) for k, v in shared_state(self.ctx.model).items()]

    def setup(self, round_seed: int) -> list[Payload]:
        """No setup phase."""
        return []

    def _load(self, received: dict[PayloadKind, Payload]) -> None:
        mw = received.get(PayloadKind.MODEL_WEIGHTS)
        if isinstance(mw, ModelWeights):
            state = shared_state(self.ctx.model)
            with torch.no_grad():
                for name, arr in mw.tensors.items():
                    state[name].copy_(torch.from_numpy(np.array(arr, dtype=np.float32)))

    def train(self, round_: int, round_seed: int, received: dict[PayloadKind, Payload]) -> list[Payload]:
        """Evaluate the received global model, then train on it and upload the result."""
        self._load(received)
        before = self.ctx.metrics(0.0, evaluated_round=round_ - 1)
        params = [p for p in self.ctx.model.parameters() if p.requires_grad]
        extra = None
        if self.mu > 0:
            prox = ProximalTerm(self.mu, params)

            def extra(model, x, y, logits):  # type: ignore[no-untyped-def]
                return prox(params)

        loss = fit(self.ctx.model, self.ctx.train, self.ctx.config, self.ctx.rng(round_seed), extra)
        metrics = EvalMetrics(loss, before.num_train_examples, before.test_accuracy, before.test_loss,
                              before.num_test_examples, before.extra)
        weights = {k: v.detach().cpu().numpy() for k, v in shared_state(self.ctx.model).items()}
        return [ModelWeights(weights, num_examples=len(self.ctx.train)), metrics]

    def evaluate(self, round_: int, received: dict[PayloadKind, Payload]) -> EvalMetrics:
        """The final global model."""
        self._load(received)
        return self.ctx.metrics(0.0, evaluated_round=round_ - 1)


class HeadFedAvgClient:
    """Head-only FedAvg: the encoder stays private; only the classifier head is averaged."""

    def __init__(self, ctx: ClientContext) -> None:
        self.ctx = ctx

    def declared(self) -> list[tuple[PayloadKind, str, np.ndarray]]:
        """The head's weight and bias."""
        head = self.ctx.model.head
        return [
            (PayloadKind.HEAD_WEIGHTS, "weight", head.weight.detach().cpu().numpy()),
            (PayloadKind.HEAD_WEIGHTS, "bias", head.bias.detach().cpu().numpy()),
        ]

    def setup(self, round_seed: int) -> list[Payload]:
        """No setup phase."""
        return []

    def _load(self, received: dict[PayloadKind, Payload]) -> None:
        hw = received.get(PayloadKind.HEAD_WEIGHTS)
        if isinstance(hw, HeadWeights):
            with torch.no_grad():
                self.ctx.model.head.weight.copy_(torch.from_numpy(np.array(hw.weight, dtype=np.float32)))
                self.ctx.model.head.bias.copy_(torch.from_numpy(np.array(hw.bias, dtype=np.float32)))

    def train(self, round_: int, round_seed: int, received: dict[PayloadKind, Payload]) -> list[Payload]:
        """Evaluate own encoder + global head, train the whole model, upload the head."""
        self._load(received)
        before = self.ctx.metrics(0.0, evaluated_round=round_ - 1)
        loss = fit(self.ctx.model, self.ctx.train, self.ctx.config, self.ctx.rng(round_seed))
        head = self.ctx.model.head
        metrics = EvalMetrics(loss, before.num_train_examples, before.test_accuracy, before.test_loss,
                              before.num_test_examples, before.extra)
        return [
            HeadWeights(head.weight.detach().cpu().numpy(), head.bias.detach().cpu().numpy(), len(self.ctx.train)),
            metrics,
        ]

    def evaluate(self, round_: int, received: dict[PayloadKind, Payload]) -> EvalMetrics:
        """Own encoder with the final global head."""
        self._load(received)
        return self.ctx.metrics(0.0, evaluated_round=round_ - 1)
