"""Local training's client half: trains on its own data only and reports metrics of its own model."""

from __future__ import annotations

from hetfed.client.algorithms.base import ClientHalf
from hetfed.client.training import Objective, epoch_batches, fit
from hetfed.wire.payloads import EvalMetrics, Payload, Received
from hetfed.wire.specs import local
from hetfed.wire.specs.local import LocalConfig


@local.SPEC.client_half
class LocalClient(ClientHalf[LocalConfig]):
    """Trains on its own data only; reports metrics of its own model after each round."""

    # Nothing but metrics leaves; under DP the model trains with DP-SGD all the same (a baseline at equal ε).
    privacy_mechanism = "dp-sgd"

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """Train locally, evaluate the result."""
        ctx = self.ctx
        result = fit([Objective(ctx.model, self.optimizer())],
                     epoch_batches(ctx.train, self.config, ctx.rng(round_seed)))
        return [ctx.metrics(result.loss, evaluated_round=round_)]

    def evaluate(self, round_: int, received: Received) -> EvalMetrics:
        """The local model as it stands."""
        return self.ctx.metrics(0.0, evaluated_round=round_ - 1)
