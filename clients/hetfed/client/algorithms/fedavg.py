"""FedAvg's client half, and the model-averaging client FedProx and Ditto build on."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Generic, TypeVar

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


def _trains(module: torch.nn.Module) -> bool | None:
    """Whether every parameter of ``module`` (its submodules' included) trains; None when it has none."""
    flags = [p.requires_grad for p in module.parameters()]
    return all(flags) if flags else None


def _buffer_trains(model: torch.nn.Module, owner: str) -> bool:
    """Whether the buffers of module ``owner`` follow the training: the nearest module on the path from ``owner``
    up to ``model`` that has parameters has every one of them training (a model without any: True)."""
    parts = owner.split(".") if owner else []
    for depth in range(len(parts), -1, -1):
        verdict = _trains(model.get_submodule(".".join(parts[:depth])))
        if verdict is not None:
            return verdict
    return True


def shared_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The entries of a model's state FedAvg averages, in ``state_dict`` order: its trainable parameters
    (``requires_grad``), and the floating buffers (running statistics) of modules whose parameters all train.

    A frozen parameter never crosses, and a frozen module's running statistics stay local; a buffer of a
    module without parameters (a BatchNorm without affine weights) goes with the nearest module above it that
    has some. With nothing frozen this is every floating entry of the state."""
    params = dict(model.named_parameters(remove_duplicate=False))
    owners: dict[str, bool] = {}
    shared: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if not value.is_floating_point():
            continue
        param = params.get(name)
        if param is not None:
            trains = param.requires_grad
        else:
            owner = name.rpartition(".")[0]
            if owner not in owners:
                owners[owner] = _buffer_trains(model, owner)
            trains = owners[owner]
        if trains:
            shared[name] = value
    return shared


def check_received(model: torch.nn.Module, weights: ModelWeights) -> None:
    """Refuse global weights that name a tensor this organization does not share (a frozen or unknown one):
    a download never overwrites what does not train here."""
    unexpected = sorted(set(weights.tensors) - set(shared_state(model)))
    if unexpected:
        raise ValueError(f"the global model carries tensors this organization does not share (frozen or not in "
                         f"its model): {unexpected[:5]}")


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
    privacy_mechanism: ClassVar[str | None] = "dp-sgd"

    def optimized(self) -> dict[str, list[torch.nn.Parameter]]:
        """One optimiser over ``parameters()``."""
        return {"optimizer": self.parameters()}

    def parameters(self) -> list[torch.nn.Parameter]:
        """What the local optimiser updates (the model's trainable parameters)."""
        return trainable(self.ctx.model)

    def declarations(self, wire_dtype: str | None) -> list[DeclaredTensor]:
        """The model's shared state (``shared_state``: what trains), as the run's schema fixes it at Join."""
        return [DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, k, v.cpu().numpy(), wire_dtype)
                for k, v in shared_state(self.ctx.model).items()]

    def load(self, received: Received) -> None:
        """Take the global model, when the aggregator sent one (round 1 starts from the run seed)."""
        mw = received.maybe(ModelWeights)
        if mw is not None:
            check_received(self.ctx.model, mw)
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
