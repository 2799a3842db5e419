"""Ditto with latent-space drift constraints (Ayromlou & Emerson, "Adaptive Latent-Space Constraints in
Personalized FL"): the spec, its config and the named variants ``ditto_cos``, ``ditto_mkmmd``, ``ditto_mmdd``.

Each organization keeps a global model w_G, averaged by the server exactly as FedAvg averages its model, and
a personal model w_L that never leaves it, trained on cross-entropy + (λ/2)·‖w_L − w̄‖² + μ·Σ_ℓ D(f_ℓ(b; θ_L),
f_ℓ(b; θ̄)) (eq. 4). The wire contract is FedAvg's: only w_G's ModelWeights and EvalMetrics go up. The
variants are presets of Ditto's config (the paper's Table 3 for Synthetic(0.5, 0.5)); one client half serves
them all, and constraint-only (λ = 0) or Ditto-only (μ = 0) are configurations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs import fedavg
from hetfed.wire.specs.base import Figure
from hetfed.wire.specs.fedavg import FedAvgConfig

Measure = Literal["none", "cosine", "mkmmd", "mmdd"]
MEASURES: tuple[str, ...] = ("none", "cosine", "mkmmd", "mmdd")


@dataclass(frozen=True)
class DittoConfig(FedAvgConfig):
    """Ditto (eq. 4): λ, the drift measure and its weight μ, where features are taken, when kernels are refit."""

    # λ: weight of (λ/2)·‖w_L − w̄‖² in the personal objective (0: the constraint alone, the paper's Table 1).
    lam: float = 0.1
    # The drift measure D between the personal model's and the frozen global model's features.
    measure: Measure = "none"
    # μ: weight of the drift measure (0: plain Ditto).
    mu: float = 0.0
    # Layers whose features are constrained, by `named_modules` name; "" is the encoder's output (the latent z,
    # the layer before the head; for the `linear` model the paper's "first layer").
    feature_layers: tuple[str, ...] = ("",)
    # MK-MMD and MMD-D: refit the kernel every this many local steps on features of `refit_batches` batches
    # (eval mode, no gradient), or on every step's own batch (-1; the paper's MK-MMD₋₁).
    refit_every: int = 20
    # s: batches of the refit sample (the paper's 50).
    refit_batches: int = 50
    # MMD-D: AdamW steps on −MMD²/σ̂ per refit, and their learning rate.
    mmdd_steps: int = 5
    mmdd_lr: float = 0.001
    # MMD-D kernel: "paper" (1 − ε)·k(φa, φb) + ε·q(a, b); "liu" [(1 − ε)·k(φa, φb) + ε]·q(a, b) (reference code).
    mmdd_kernel: Literal["paper", "liu"] = "paper"
    # MK-MMD: the QP's stabilising shift ε of Q̂ + εI (the paper's 1e-3).
    qp_epsilon: float = 0.001
    # MK-MMD kernels: "rate" exp(−γ‖a − b‖²) (paper) or "scale" exp(−‖a − b‖²/γ) (reference code).
    mkmmd_bandwidth: Literal["rate", "scale"] = "rate"
    # MK-MMD estimate: "unbiased" U-statistic over pairs i ≠ k, or the reference code's "biased" mean of all pairs.
    mkmmd_estimator: Literal["unbiased", "biased"] = "unbiased"
    # MK-MMD's QP: "paper" β minimising βᵀ(Q̂ + qp_epsilon·I)β; "fl4health" the reference code's ½βᵀ(2Q̂ + 1e-5·I)β
    # and its fallback kernel d̂_j/(2Q̂_jj + 1e-5) when no d̂_j is positive.
    mkmmd_qp: Literal["paper", "fl4health"] = "paper"
    # MK-MMD's β before the first refit: "uniform" 1/d each, or the reference code's "random" start (seeded).
    mkmmd_beta_init: Literal["uniform", "random"] = "uniform"
    # MK-MMD: divide each feature row by its L2 norm first (reference code; the γ grid assumes unit rows).
    mkmmd_normalize: bool = True
    # Train both models on CrossEntropy(softmax(logits)) instead of CrossEntropy(logits): the reference code's
    # model ends in a Softmax and is trained with CrossEntropyLoss, which reproduces the paper's magnitudes.
    double_softmax: bool = False
    # MK-MMD and MMD-D kernel maths: "float64" (hetfed's own choice: their estimates are differences of nearly
    # equal sums) or "float32" (the reference code's: torch's default dtype). The cosine always runs in float64.
    kernel_dtype: Literal["float64", "float32"] = "float64"

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.lam >= 0, f"lam must be >= 0, got {self.lam}")
        check(self.mu >= 0, f"mu must be >= 0, got {self.mu}")
        check(self.measure in MEASURES, f"measure must be one of {', '.join(MEASURES)}, got {self.measure!r}")
        check(self.mu == 0 or self.measure != "none",
              f"mu = {self.mu} needs a measure (cosine, mkmmd or mmdd), got measure 'none'")
        check(len(self.feature_layers) >= 1 and len(set(self.feature_layers)) == len(self.feature_layers),
              f"feature_layers must name at least one layer, each once, got {list(self.feature_layers)}")
        check(self.refit_every == -1 or self.refit_every >= 1,
              f"refit_every must be -1 (every step, on its batch) or >= 1, got {self.refit_every}")
        check(self.refit_batches >= 1, f"refit_batches must be >= 1, got {self.refit_batches}")
        check(self.mmdd_steps >= 0, f"mmdd_steps must be >= 0, got {self.mmdd_steps}")
        check(self.mmdd_lr > 0, f"mmdd_lr must be > 0, got {self.mmdd_lr}")
        check(self.qp_epsilon > 0, f"qp_epsilon must be > 0, got {self.qp_epsilon}")


SPEC = fedavg.SPEC.derive(
    name="ditto",
    summary="Ditto with latent drift constraints: a personal model per organization, never sent, held near the "
    "averaged global model (Li et al. 2021; Ayromlou and Emerson); only the global model crosses the wire.",
    config_type=DittoConfig,
    figures=(Figure("global", "global_model_test_accuracy"),),
    summed_upload=frozenset({K.MODEL_WEIGHTS}),  # FedAvg's weighted mean of the global models; personal models never leave
)

# The paper's Table 3 values for Synthetic(0.5, 0.5): λ = 0.01 and μ = 1 with each drift measure.
COS_SPEC = SPEC.preset("ditto_cos", "Ditto + cosine drift: ditto with measure cosine, lam 0.01, mu 1",
                       lam=0.01, measure="cosine", mu=1.0)
# MK-MMD refit every 20 steps on s = 50 batches (MK-MMD₂₀).
MKMMD_SPEC = SPEC.preset("ditto_mkmmd",
                         "Ditto + MK-MMD drift: ditto with measure mkmmd refit every 20 steps, lam 0.01, mu 1",
                         lam=0.01, measure="mkmmd", mu=1.0)
# MMD-D refit every 20 steps on s = 50 batches.
MMDD_SPEC = SPEC.preset("ditto_mmdd",
                        "Ditto + MMD-D drift: ditto with measure mmdd (a deep kernel) refit every 20 steps, lam 0.01, "
                        "mu 1", lam=0.01, measure="mmdd", mu=1.0)
