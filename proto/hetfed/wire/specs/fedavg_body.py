"""FedAvg of the body: every encoder weight is averaged, the classifier head stays with its organization.

The paper of SimFed (004, §5.1) compares with FedAvg this way under permuted labels ("the classifier layers
are not aggregated"): organizations that name their classes differently share a feature extractor only.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs import fedavg
from hetfed.wire.specs.fedavg import FedAvgConfig


@dataclass(frozen=True)
class FedAvgBodyConfig(FedAvgConfig):
    """FedAvg of everything but the head: the server averages the encoders, heads stay local."""


SPEC = fedavg.SPEC.derive(
    name="fedavg_body",
    summary="FedAvg of the body: encoders averaged, classifier heads kept local (FedPer style).",
    config_type=FedAvgBodyConfig,
    shared_label_space=False,  # heads stay local: organizations may name and count their classes differently
    summed_upload=frozenset({K.MODEL_WEIGHTS}),  # FedAvg's weighted mean of the bodies; heads never leave
)
# FedPer (Arivazhagan et al. 2019) is this algorithm with one personalization layer, the head: base layers
# trained with the head each round and averaged by example counts (docs/algorithms/fedavg_body.md).
FEDPER = SPEC.preset(
    "fedper",
    "FedPer (Arivazhagan et al. 2019): FedAvg of the body under its paper's name; base and personalization "
    "layer (the head) trained together, the base averaged by example counts, the head kept.",
)
