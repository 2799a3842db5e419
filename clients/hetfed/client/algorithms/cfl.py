"""Clustered Federated Learning's client half: send the initial model once, then each round take the cluster's
model, train it on cross-entropy and send the weight update Δθ_i = θ_i − θ_c (trained minus received).

The reference code's client keeps its weights before training (W_old), trains, sends dW = W − W_old and resets to
W_old, then adds its cluster's mean update; here the aggregator keeps the cluster models and sends the model
itself, which is the same sequence of weights. The model is the whole shared state (trainable parameters and the
running statistics of modules that train), as FedAvg shares it.
"""

from __future__ import annotations

import dataclasses

import torch

from hetfed.client.algorithms.base import ClientHalf
from hetfed.client.algorithms.fedavg import check_received, load_shared_state, model_weights, shared_state
from hetfed.client.training import Objective, cross_entropy, epoch_batches, fit
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import EvalMetrics, ModelWeights, Payload, PayloadKind, Received
from hetfed.wire.specs import cfl
from hetfed.wire.specs.cfl import CFLConfig


def weight_update(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor], num_examples: int) -> ModelWeights:
    """Δθ = after − before for every shared tensor, as the ModelWeights payload (float32 on the host)."""
    return ModelWeights({k: (v.detach() - before[k]).cpu().numpy() for k, v in after.items()}, num_examples)


@cfl.SPEC.client_half
class CFLClient(ClientHalf[CFLConfig]):
    """CFL organization: FedAvg's local training on its cluster's model; the update goes up, not the model."""

    # The paper has no DP mechanism; this half does not serve [privacy].
    privacy_mechanism = None

    def declarations(self, wire_dtype: str | None) -> list[DeclaredTensor]:
        """The model's shared state: the initial model and every update have its tensors."""
        return [DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, k, v.cpu().numpy(), wire_dtype)
                for k, v in shared_state(self.ctx.model).items()]

    def setup(self, round_seed: int) -> list[Payload]:
        """The initial model θ_0 (built from the run seed, the same at every organization)."""
        return [model_weights(self.ctx.model, self.ctx.num_examples)]

    def load(self, received: Received) -> None:
        """Take the cluster's model, when one was sent."""
        mw = received.maybe(ModelWeights)
        if mw is not None:
            check_received(self.ctx.model, mw)
            load_shared_state(self.ctx.model, mw)

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """Evaluate the cluster's model, train it for ``local_epochs`` of cross-entropy, send the update."""
        ctx = self.ctx
        self.load(received)
        before = ctx.metrics(0.0, evaluated_round=round_ - 1)
        start = {k: v.detach().clone() for k, v in shared_state(ctx.model).items()}
        result = fit([Objective(ctx.model, self.optimizer(), [cross_entropy])],
                     epoch_batches(ctx.train, self.config, ctx.rng(round_seed)))
        update = weight_update(shared_state(ctx.model), start, ctx.num_examples)
        return [update, dataclasses.replace(before, train_loss=result.loss)]

    def evaluate(self, round_: int, received: Received) -> EvalMetrics:
        """The cluster's final model on every held-out set."""
        self.load(received)
        return self.ctx.metrics(0.0, evaluated_round=round_ - 1)
