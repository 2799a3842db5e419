"""FedH2L (Li et al., Algorithm 1, eqs. 1-14): peer-to-peer mutual distillation on a shared seed set.

Only posteriors on seed batches and teaching confidences cross the wire, relayed (never aggregated) by the
aggregator. Every organization holds the run's seed set; its id, SHA-256, size and each organization's
domain part are the run's ``seed_set`` (checked at Join and on every upload).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs.base import AlgorithmSpec, Figure, Optimizer, PeriodicEvalConfig


@dataclass(frozen=True)
class FedH2LConfig(PeriodicEvalConfig):
    """FedH2L: mutual distillation on a shared seed set, relayed by the aggregator.

    ``lr`` is the local step size β and ``global_lr`` the mutual-learning step size η (0: same as lr); each
    step has its own optimiser (AMSGrad by default) with ``weight_decay``. ``batch_size`` is the size of the
    private batch and of every seed batch. ``local_steps`` is E: local steps per iteration, after which one
    global step uses g_loc = the displacement over those E steps (E = 1: the local gradient, eq. 2).
    The seed-set fraction α belongs to the data (``data.public_fraction``).
    """

    local_steps: int = 1
    lr: float = 1e-3
    weight_decay: float = 1e-4
    optimizer: Optimizer = "amsgrad"
    # AMSGrad keeps its own moment estimates: no SGD momentum, whatever the shared default.
    momentum: float = 0.0
    global_lr: float = 0.0
    # Project g_pub against g_loc when they conflict (eq. 14); False is the paper's "no project" ablation.
    project: bool = True
    # Use the seed set's labels: ℓ_CE on the peers' seed batches and Acc_j as teaching confidence.
    # False: unlabelled seed data, KL only (the paper's Further Studies 2).
    labelled_seed: bool = True
    # Teachers per node and round: 0 = every peer; k > 0 = a seeded random subset of k peers (bounds traffic).
    peers_per_round: int = 0
    # Evaluate on the test sets every this many rounds (and in the final round); others resend the last figures.
    eval_every: int = 50
    # Both optimisers live for the whole run (Algorithm 1 builds them once); false: fresh ones every round.
    keep_optimizer_state: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.local_steps >= 1, f"local_steps (E) must be >= 1, got {self.local_steps}")
        check(self.global_lr >= 0, f"global_lr must be >= 0, got {self.global_lr}")
        check(self.peers_per_round >= 0, f"peers_per_round must be >= 0, got {self.peers_per_round}")


SPEC = AlgorithmSpec(
    name="fedh2l",
    summary="FedH2L: peer-to-peer mutual distillation on a shared seed set; only posteriors on seed "
    "batches and teaching confidences cross the wire, relayed (never aggregated) by the aggregator.",
    config_type=FedH2LConfig,
    upload=frozenset({K.SEED_POSTERIORS, K.EVAL_METRICS}),
    required_upload=frozenset({K.SEED_POSTERIORS, K.EVAL_METRICS}),
    download=frozenset({K.SEED_POSTERIORS}),
    repeated_download=frozenset({K.SEED_POSTERIORS}),
    model_private=True,
    needs_seed_set=True,
    figures=(Figure("wdp", "test_accuracy"), Figure("cdp", "cross_test_accuracy"),
             Figure("acc", "global_test_accuracy")),
    unsummed_because="the server relays each organization's posteriors to its peers",
)
