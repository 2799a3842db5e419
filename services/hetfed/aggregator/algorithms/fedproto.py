"""FedProto's server half (numpy only): the global prototype of each class over the organizations that hold it.

Each round every organization sends its prototypes C_i^(j) (K × d_e, a presence mask and the counts |D_i,j|);
a class it lacks is absent, never a zero row. At the round's close, for each class j reported by the set N_j:

    uniform: C̄^(j) = (1/|N_j|)·Σ_{i∈N_j} C_i^(j)                       (the reference code)
    count:   C̄^(j) = Σ_{i∈N_j} (|D_i,j|/N_j)·C_i^(j),  N_j = Σ_{i∈N_j} |D_i,j|   (the paper's q weights)
    paper:   C̄^(j) = (1/|N_j|)·Σ_{i∈N_j} (|D_i,j|/N_j)·C_i^(j)           (the aggregation equation as printed)

A class nobody reported this round keeps its last global prototype (absent until first reported). The
prototypes of a round are kept by organization and summed in sorted order at the close, in float64, so the
result does not depend on arrival order.
"""

from __future__ import annotations

import numpy as np

from hetfed.aggregator.algorithms.base import RunInfo, ServerHalf
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import ClassMeanEmbeddings, Payload, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import fedproto
from hetfed.wire.specs.fedproto import FedProtoConfig


def global_prototypes(uploads: list[tuple[np.ndarray, np.ndarray]], weighting: str
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(C̄ [K, d_e] float64, N_j [K] int64) from each organization's (means [K, d_e], counts [K]), summed in the
    order given. A class with count 0 at an organization is absent there (its row is never read); a class nobody
    holds has N_j = 0 and a zero row."""
    means = np.stack([np.asarray(m, dtype=np.float64) for m, _ in uploads])
    counts = np.stack([np.asarray(c, dtype=np.int64) for _, c in uploads])
    holds = counts > 0
    holders = holds.sum(axis=0)
    totals = counts.sum(axis=0).astype(np.float64)
    if weighting == "uniform":
        weight = holds / np.maximum(holders, 1)
    else:
        weight = np.where(holds, counts / np.maximum(totals, 1.0), 0.0)
        if weighting == "paper":
            weight = weight / np.maximum(holders, 1)
    total = np.zeros(means.shape[1:])
    for w, m in zip(weight, means, strict=True):
        total = total + w[:, None] * np.where(w[:, None] > 0, m, 0.0)
    return total, counts.sum(axis=0)


@fedproto.SPEC.server_half
class FedProtoServer(ServerHalf[FedProtoConfig]):
    """FedProto's server: the global prototype of each class, over the organizations that report it."""

    def __init__(self, config: FedProtoConfig, run: RunInfo) -> None:
        super().__init__(config, run)
        k, d = config.num_classes, config.latent_dim
        self.prototypes = np.zeros((k, d))
        self.present = np.zeros(k, dtype=bool)
        # N_j of the round that last set C̄^(j): the examples of class j over the organizations that reported it.
        self.support = np.zeros(k, dtype=np.int64)
        self._round: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def payloads_for(self, phase: Phase, round_: int, organization: str) -> list[Payload]:
        """The global prototypes once any class has one (nothing before the first close: round 1 trains on
        cross-entropy alone), with N_j as counts; presence marks the classes set at least once."""
        if phase not in (Phase.TRAIN, Phase.EVALUATE) or not self.present.any():
            return []
        k = self.config.num_classes
        return [ClassMeanEmbeddings(labels=np.arange(k, dtype=np.int64), means=self.prototypes.astype(np.float32),
                                    counts=self.support.copy(), presence=self.present.copy())]

    def validate(self, phase: Phase, organization: str, update: Received) -> None:
        """Labels 0..K-1, means K × d_e and finite where present, counts >= 0 and presence exactly counts > 0."""
        if phase is not Phase.TRAIN:
            return
        k, d = self.config.num_classes, self.config.latent_dim
        cme = update.get(ClassMeanEmbeddings)
        if cme.labels.dtype.kind not in "iu" or not np.array_equal(cme.labels, np.arange(k)):
            raise WireError("invalid_value", f"class_mean_embeddings.labels must be the integers 0..{k - 1} in order")
        if cme.means.dtype.kind != "f" or cme.means.shape != (k, d):
            raise WireError("shape_mismatch", f"class_mean_embeddings.means must be a floating tensor of shape "
                                              f"[{k}, {d}] (K, d_e of the run), got {cme.means.dtype}"
                                              f"{list(cme.means.shape)}")
        if cme.counts.dtype.kind not in "iu" or cme.counts.shape != (k,):
            raise WireError("shape_mismatch", f"class_mean_embeddings.counts must be an integer tensor of shape "
                                              f"[{k}], got {cme.counts.dtype}{list(cme.counts.shape)}")
        if cme.presence.dtype != np.bool_ or cme.presence.shape != (k,):
            raise WireError("shape_mismatch", f"class_mean_embeddings.presence must be bool [{k}], got "
                                              f"{cme.presence.dtype}{list(cme.presence.shape)}")
        if (cme.counts < 0).any() or not np.array_equal(cme.presence, cme.counts > 0):
            raise WireError("invalid_value", "class_mean_embeddings.counts must be >= 0 and presence exactly "
                                             "counts > 0")
        if not np.isfinite(np.asarray(cme.means, dtype=np.float64)[cme.presence]).all():
            raise WireError("invalid_value", "class_mean_embeddings.means must be finite for every present class")

    def accumulate(self, phase: Phase, organization: str, update: Received) -> None:
        """Keep the organization's prototypes and counts until the round closes."""
        if phase is not Phase.TRAIN:
            return
        cme = update.get(ClassMeanEmbeddings)
        self._round[organization] = (np.asarray(cme.means, dtype=np.float64).copy(),
                                     np.asarray(cme.counts, dtype=np.int64).copy())

    def close_round(self, phase: Phase, round_: int) -> None:
        """The global prototype of every class reported this round, over the organizations in sorted order."""
        if phase is Phase.TRAIN and self._round:
            uploads = [self._round[o] for o in sorted(self._round)]
            total, support = global_prototypes(uploads, self.config.prototype_weighting)
            reported = support > 0
            self.prototypes[reported] = total[reported]
            self.support[reported] = support[reported]
            self.present |= reported
        self._round = {}

    def state(self) -> dict[str, np.ndarray]:
        """The global prototypes, their presence and their N_j."""
        return {"prototypes": self.prototypes.copy(), "present": self.present.copy(), "support": self.support.copy()}

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore from ``state()``."""
        if not arrays:
            return
        self.prototypes = np.asarray(arrays["prototypes"], dtype=np.float64).copy()
        self.present = np.asarray(arrays["present"], dtype=bool).copy()
        self.support = np.asarray(arrays["support"], dtype=np.int64).copy()
        self._round = {}
