"""Local training's client half: trains on its own data only and reports metrics of its own model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hetfed.client.algorithms.base import ClientContext, ClientHalf
from hetfed.client.training import Objective, epoch_batches, fit, make_optimizer, trainable
from hetfed.wire.payloads import EvalMetrics, Payload, Received
from hetfed.wire.specs import local
from hetfed.wire.specs.local import LocalConfig


@local.SPEC.client_half
class LocalClient(ClientHalf[LocalConfig]):
    """Trains on its own data only; reports metrics of its own model after each round."""

    # Nothing but metrics leaves; under DP the model trains with DP-SGD all the same (a baseline at equal ε).
    privacy_mechanism = "dp-sgd"

    def __init__(self, ctx: ClientContext[LocalConfig]) -> None:
        super().__init__(ctx)
        self._optimizer: torch.optim.Optimizer | None = None

    def optimizer(self) -> torch.optim.Optimizer:
        """This round's optimiser: a fresh one every round, or the same one throughout with
        ``keep_optimizer_state`` (its momentum carries over)."""
        if self._optimizer is None or not self.config.keep_optimizer_state:
            self._optimizer = make_optimizer(trainable(self.ctx.model), self.config)
        return self._optimizer

    def private_state(self) -> dict[str, Any]:
        """The model's state, and the optimiser's when it carries over rounds (``keep_optimizer_state``)."""
        state = super().private_state()
        if self.config.keep_optimizer_state and self._optimizer is not None:
            state["optimizer"] = self._optimizer.state_dict()
        return state

    def load_private_state(self, state: Mapping[str, Any]) -> None:
        """Resume the model (and the optimiser it kept)."""
        super().load_private_state(state)
        if "optimizer" in state:
            self.optimizer().load_state_dict(state["optimizer"])

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """Train locally, evaluate the result."""
        ctx = self.ctx
        result = fit([Objective(ctx.model, self.optimizer())],
                     epoch_batches(ctx.train, self.config, ctx.rng(round_seed)))
        return [ctx.metrics(result.loss, evaluated_round=round_)]

    def evaluate(self, round_: int, received: Received) -> EvalMetrics:
        """The local model as it stands."""
        return self.ctx.metrics(0.0, evaluated_round=round_ - 1)
