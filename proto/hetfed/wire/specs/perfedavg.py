"""Per-FedAvg (Fallah, Mokhtari and Ozdaglar, NeurIPS 2020): FedAvg of a model meant to be personalised by one
gradient step, a MAML meta-step per local update; the spec, its config and the Hessian-free preset.

Each local step draws independent batches D and D' (and D'' for HF) and takes, at the model w,
``temp = w − α∇f(w; D)`` then ``w ← w − β∇f(temp; D')`` (first order, FO), or
``w ← w − β(I − α·d)∇f(temp; D')`` with d the Hessian of f at w on D'' applied to ∇f(temp; D') (Hessian-free,
HF). The server averages the models as FedAvg does; an organization evaluates (and deploys) the global model
after ``eval_steps`` α-steps on its own training data. The wire is FedAvg's: whole models up and down.
docs/algorithms/perfedavg.md labels each default with its source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs import fedavg
from hetfed.wire.specs.base import Figure
from hetfed.wire.specs.fedavg import FedAvgConfig

Variant = Literal["fo", "hf"]
Hvp = Literal["finite_difference", "autograd"]


@dataclass(frozen=True)
class PerFedAvgConfig(FedAvgConfig):
    """Per-FedAvg: α (``alpha``) the personalisation step, β the meta step (``lr``), τ local steps
    (``local_steps``, else ``local_epochs`` passes of 2B or 3B examples a step), batches of B (``batch_size``)."""

    # "fo": the first-order step; "hf": the Hessian-free step (needs a third batch D'').
    variant: Variant = "fo"
    # α: the step of the inner (personalisation) update, in training and at evaluation.
    alpha: float = 0.01
    # β, the meta step: TrainConfig's lr, a plain gradient step (no momentum, no decay).
    lr: float = 0.1
    momentum: float = 0.0
    # B = |D| = |D'| (= |D''| under HF).
    batch_size: int = 40
    # τ: when > 0, exactly this many local steps a round, each on a fresh independent draw; 0 (the default):
    # ``local_epochs`` shuffled passes a round, a step taking the next 2B (3B) examples of the pass.
    local_steps: int = 0
    local_epochs: int = 2
    # How HF gets d: "finite_difference", [∇f(w + δv; D'') − ∇f(w − δv; D'')] / 2δ, or "autograd", the exact
    # product by double backpropagation.
    hvp: Hvp = "finite_difference"
    delta: float = 0.001
    # α-steps on batches of B of the organization's training data before each evaluation (and before deploying).
    eval_steps: int = 1
    # The server's average: Algorithm 1 averages the returned models uniformly, 1/(rn)·Σ w_i.
    weighting: Literal["examples", "uniform"] = "uniform"

    @property
    def batches_per_step(self) -> int:
        """How many batches of B one local step reads: D and D', and D'' under HF."""
        return 3 if self.variant == "hf" else 2

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.variant in ("fo", "hf"), f"variant must be 'fo' or 'hf', got {self.variant!r}")
        check(self.hvp in ("finite_difference", "autograd"),
              f"hvp must be 'finite_difference' or 'autograd', got {self.hvp!r}")
        check(math.isfinite(self.alpha) and self.alpha > 0, f"alpha must be a finite number > 0, got {self.alpha}")
        check(math.isfinite(self.delta) and self.delta > 0, f"delta must be a finite number > 0, got {self.delta}")
        check(self.eval_steps >= 0, f"eval_steps must be >= 0, got {self.eval_steps}")
        check(self.optimizer == "sgd",
              f"perfedavg's meta step is a gradient step (optimizer 'sgd'), got {self.optimizer!r}")


SPEC = fedavg.SPEC.derive(
    name="perfedavg",
    summary="Per-FedAvg (Fallah et al. 2020): FedAvg of a meta-model, each local step a first-order MAML step; "
            "each organization evaluates the global model after one α-step on its own data.",
    config_type=PerFedAvgConfig,
    figures=(Figure("global", "global_model_test_accuracy"),),
    summed_upload=frozenset({K.MODEL_WEIGHTS}),  # FedAvg's uniform mean of the meta-models
)
# The Hessian-free variant: the meta step corrected by α times a Hessian-vector product on a third batch.
HF_SPEC = SPEC.preset("perfedavg_hf", "Per-FedAvg (HF): perfedavg with variant hf (Hessian-vector product by "
                                      "finite differences on a third batch)", variant="hf")
