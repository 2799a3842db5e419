"""FedAvg of the body: FedAvg's client with the classifier head left out of what is shared."""

from __future__ import annotations

import dataclasses

from hetfed.client.algorithms.fedavg import ModelAveragingClient
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import ModelWeights, Payload, Received
from hetfed.wire.specs import fedavg_body
from hetfed.wire.specs.fedavg_body import FedAvgBodyConfig

HEAD = "head."


@fedavg_body.SPEC.client_half
class FedAvgBodyClient(ModelAveragingClient[FedAvgBodyConfig]):
    """Shares FedAvg's shared state (what trains) but the head's; loading takes only what arrives, so the head
    stays local."""

    def declarations(self, wire_dtype: str | None) -> list[DeclaredTensor]:
        """The encoder's shared state entries (its frozen tensors stay local, as under FedAvg)."""
        return [d for d in super().declarations(wire_dtype) if not d.name.startswith(HEAD)]

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """FedAvg's round, uploading the encoder only."""
        return [dataclasses.replace(p, tensors={k: v for k, v in p.tensors.items() if not k.startswith(HEAD)})
                if isinstance(p, ModelWeights) else p for p in super().train(round_, round_seed, received)]
