"""Head-only FedAvg's server half: average the classifier head; encoders never leave the organizations."""

from __future__ import annotations

import numpy as np

from hetfed.aggregator.algorithms.fedavg import AveragingServer
from hetfed.wire.payloads import HeadWeights, Payload, PayloadKind, Received
from hetfed.wire.specs import fedavg_head
from hetfed.wire.specs.fedavg_head import HeadFedAvgConfig


@fedavg_head.SPEC.server_half
class HeadFedAvgServer(AveragingServer[HeadFedAvgConfig]):
    """Averages the head Linear(d_e, K), weighted by example counts."""

    summed_kind = PayloadKind.HEAD_WEIGHTS

    def arrays(self, update: Received) -> tuple[dict[str, np.ndarray], int] | None:
        """The head's weight and bias and the example count."""
        hw = update.maybe(HeadWeights)
        return None if hw is None else ({"weight": hw.weight, "bias": hw.bias}, hw.num_examples)

    def payload(self, arrays: dict[str, np.ndarray]) -> Payload:
        """The global head."""
        return HeadWeights(arrays["weight"], arrays["bias"])
