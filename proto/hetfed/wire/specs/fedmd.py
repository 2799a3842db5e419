"""FedMD (Li and Wang, NeurIPS 2019 workshop, "FedMD: Heterogenous Federated Learning via Model Distillation"):
the spec, its config and the public subset of a round.

Each organization keeps its own model (any architecture) and every round sends its class scores (logits) on a
subset of the shared public (seed) set, the same subset for all, drawn from the round seed. The server averages
them into the consensus and sends it back; each organization digests it (trains its logits toward the consensus
on that subset, mean absolute error) and revisits its private data. Only logits on public examples cross the
wire, never a weight.

Defaults: the paper's and its authors' code's (github:diogenes0319/FedMD_clean), labelled in docs/algorithms/fedmd.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs.base import AlgorithmSpec, Optimizer, TrainConfig


@dataclass(frozen=True)
class FedMDConfig(TrainConfig):
    """FedMD: the public subset per round, the digest's epochs and batch, the revisit's (``local_epochs``,
    ``batch_size``).

    Both phases train with Adam at lr 1e-3 (the reference code compiles both models so); each keeps its own
    optimiser for the whole run, as each compiled Keras model keeps its own.
    """

    # Examples of the public set scored each round (the reference code's N_alignment, 5000); 0 or more than
    # the seed set holds: all of it.
    public_subset: int = 5000
    # The digest: epochs and batch over the round's public subset (N_logits_matching_round,
    # logits_matching_batchsize).
    digest_epochs: int = 1
    digest_batch_size: int = 256
    # The revisit: epochs and batch over the private data (N_private_training_round of the FEMNIST configs,
    # private_training_batchsize).
    local_epochs: int = 2
    batch_size: int = 5
    lr: float = 1e-3
    optimizer: Optimizer = "adam"
    momentum: float = 0.0
    keep_optimizer_state: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.public_subset >= 0, f"public_subset must be >= 0, got {self.public_subset}")
        check(self.digest_epochs >= 0, f"digest_epochs must be >= 0, got {self.digest_epochs}")
        check(self.digest_batch_size >= 1, f"digest_batch_size must be >= 1, got {self.digest_batch_size}")


def public_subset(round_seed: int, size: int, subset: int) -> np.ndarray:
    """The sorted indices into a public set of ``size`` that a round with ``round_seed`` scores: ``subset`` of
    them drawn without replacement (all when ``subset`` is 0 or at least ``size``). Both halves call it."""
    if subset <= 0 or subset >= size:
        return np.arange(size, dtype=np.int64)
    rng = np.random.default_rng([round_seed, size])
    return np.sort(rng.choice(size, size=subset, replace=False)).astype(np.int64)


SPEC = AlgorithmSpec(
    name="fedmd",
    summary="FedMD (Li and Wang 2019): private heterogeneous models distilled toward the mean of every "
    "organization's logits on a seeded subset of a shared public set; only those logits cross the wire.",
    config_type=FedMDConfig,
    upload=frozenset({K.SEED_POSTERIORS, K.EVAL_METRICS}),
    required_upload=frozenset({K.SEED_POSTERIORS, K.EVAL_METRICS}),
    download=frozenset({K.SEED_POSTERIORS}),
    model_private=True,
    needs_seed_set=True,
    unsummed_because="its consensus is a mean of the organizations' posteriors, a payload kind with no summed form yet",
)
