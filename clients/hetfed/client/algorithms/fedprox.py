"""FedProx's client half: FedAvg's, with the proximal term (mu/2)·||w - w_global||² added to the objective."""

from __future__ import annotations

from hetfed.client.algorithms.fedavg import ModelAveragingClient
from hetfed.client.losses import ProximalTerm
from hetfed.client.training import LossTerm, data_free, trainable
from hetfed.wire.specs import fedprox
from hetfed.wire.specs.fedprox import FedProxConfig


@fedprox.SPEC.client_half
class FedProxClient(ModelAveragingClient[FedProxConfig]):
    """FedAvg's client with the proximal term toward the received global weights."""

    def terms(self) -> list[LossTerm]:
        """Cross-entropy plus (mu/2)·||w - w_global||² (the global weights as received this round)."""
        if self.config.mu <= 0:
            return super().terms()
        params = trainable(self.ctx.model)
        prox = ProximalTerm(self.config.mu, params)
        return [*super().terms(), data_free(lambda batch, out: prox(params))]
