"""FedAvg's client half, and the model-averaging client FedProx and Ditto build on."""

from __future__ import annotations

import dataclasses
from typing import Generic, TypeVar

import numpy as np
import torch

from hetfed.client.algorithms.base import ClientHalf
from hetfed.client.training import (
    Batch,
    Forward,
    LossTerm,
    Objective,
    cross_entropy,
    epoch_batches,
    fit,
    plain_forward,
    trainable,
)
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import EvalMetrics, ModelWeights, Payload, PayloadKind, Received
from hetfed.wire.specs import fedavg
from hetfed.wire.specs.fedavg import FedAvgConfig

C = TypeVar("C", bound=FedAvgConfig)


def shared_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The floating-point entries of a model's state (parameters and running statistics) FedAvg averages."""
    return {k: v for k, v in model.state_dict().items() if v.is_floating_point()}


def load_shared_state(model: torch.nn.Module, weights: ModelWeights) -> None:
    """Copy received global weights into ``model`` in place: once, straight into the memory of a model on the
    CPU (the received arrays are read-only views of the message), through a float32 staging copy elsewhere."""
    state = shared_state(model)
    with torch.no_grad():
        for name, arr in weights.tensors.items():
            target = state[name]
            if target.device.type == "cpu":
                np.copyto(target.numpy(), arr, casting="same_kind")
            else:
                target.copy_(torch.from_numpy(np.array(arr, dtype=np.float32)))


def model_weights(model: torch.nn.Module, num_examples: int) -> ModelWeights:
    """The model's shared state as the ModelWeights payload."""
    return ModelWeights({k: v.detach().cpu().numpy() for k, v in shared_state(model).items()}, num_examples)


class ModelAveragingClient(ClientHalf[C], Generic[C]):
    """Load the global model, evaluate it, train it on the local objective, upload it."""

    # Under DP the model trains with DP-SGD; the weights it uploads are post-processing.
    privacy_mechanism = "dp-sgd"

    def optimized(self) -> dict[str, list[torch.nn.Parameter]]:
        """One optimiser over ``parameters()``."""
        return {"optimizer": self.parameters()}

    def parameters(self) -> list[torch.nn.Parameter]:
        """What the local optimiser updates (the model's trainable parameters)."""
        return trainable(self.ctx.model)

    def declarations(self, wire_dtype: str | None) -> list[DeclaredTensor]:
        """Every floating state entry of the model."""
        return [DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, k, v.cpu().numpy(), wire_dtype)
                for k, v in shared_state(self.ctx.model).items()]

    def load(self, received: Received) -> None:
        """Take the global model, when the aggregator sent one (round 1 starts from the run seed)."""
        mw = received.maybe(ModelWeights)
        if mw is not None:
            load_shared_state(self.ctx.model, mw)

    def terms(self) -> list[LossTerm]:
        """The local objective's terms (FedAvg: cross-entropy)."""
        return [cross_entropy]

    def forward(self, model: torch.nn.Module, batch: Batch) -> Forward:
        """The training forward pass (FedAvg: the logits)."""
        return plain_forward(model, batch)

    def measure(self, evaluated_round: int) -> EvalMetrics:
        """The model's metrics on every held-out set (FedAvg: predicted from its logits)."""
        return self.ctx.metrics(0.0, evaluated_round=evaluated_round)

    def upload(self) -> ModelWeights:
        """The trained model's shared state."""
        return model_weights(self.ctx.model, self.ctx.num_examples)

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """Evaluate the received global model, then train on it and upload the result."""
        ctx = self.ctx
        self.load(received)
        before = self.measure(round_ - 1)
        terms = self.terms()
        result = fit([Objective(ctx.model, self.optimizer(), terms, self.forward)],
                     epoch_batches(ctx.train, self.config, ctx.rng(round_seed)))
        return [self.upload(), dataclasses.replace(before, train_loss=result.loss)]

    def evaluate(self, round_: int, received: Received) -> EvalMetrics:
        """The final global model."""
        self.load(received)
        return self.measure(round_ - 1)


@fedavg.SPEC.client_half
class FedAvgClient(ModelAveragingClient[FedAvgConfig]):
    """FedAvg: plain cross-entropy."""
