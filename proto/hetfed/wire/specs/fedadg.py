"""FedADG (Zhang, Lei, Shi, Huang and Chen, arXiv:2111.10487): federated adversarial domain generalisation.

Each organization holds a feature extractor F and a classifier C (the model), a distribution generator G that
maps uniform noise and a scaled one-hot label to a reference feature, and a discriminator D that tells the
reference features from F's, class by class (both read the label). Each round: E0 epochs of F and C on the
label-smoothed cross-entropy alone, then E1 epochs of three steps per batch: D on the least-squares loss
(reference → 1, features → 0), F and C on α·CE + (1 − α)·mean (1 − D(F(x), y))², G on mean D(G(ξ, y), y)².
F, C and G go up as one ModelWeights (G's tensors named ``generator.*``) and the server averages them
uniformly; D and its optimiser never leave the organization. The defaults are the authors' code's
(wzml/FedADG, pacs-ours/) but G's and D's sizes; docs/algorithms/fedadg.md labels each with its source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs import fedavg
from hetfed.wire.specs.base import Figure
from hetfed.wire.specs.fedavg import FedAvgConfig

GENERATOR_PREFIX = "generator."
"""Names of G's tensors inside the ModelWeights an organization sends (F's and C's keep the model's names)."""


@dataclass(frozen=True)
class FedADGConfig(FedAvgConfig):
    """FedADG: E0 classifier epochs, then E1 adversarial epochs (D step, F+C step, G step per batch); uniform
    FedAvg of F, C and G; D kept."""

    # E1, the adversarial epochs of a round (README's PACS command, --epochs 7).
    local_epochs: int = 7
    # E0, the epochs of F and C on the classification loss alone that open each round (--i-epochs 3).
    classifier_epochs: int = 3
    batch_size: int = 10  # pacs-ours/train.py:15
    lr: float = 0.01  # lr0, F and C's SGD (README's PACS command)
    momentum: float = 0.9  # pacs-ours/train.py:20, every optimiser
    weight_decay: float = 1e-5  # pacs-ours/train.py:21, every optimiser
    # lr1, G's and D's SGD (README's PACS command).
    adversarial_lr: float = 0.007
    # The server's mean is unweighted (models/Fed.py:20-27 divides by the number of clients).
    weighting: Literal["examples", "uniform"] = "uniform"
    # α: F and C minimise α·CE + (1 − α)·adversarial (pacs-ours/localTrain.py:66).
    alpha: float = 0.85
    # ε of the label smoothing: the true class gets 1 − ε, each other ε/(K − 1) (utils/utilss.py:6-21; README).
    label_smoothing: float = 0.01
    # The value of the label's entry in the one-hot code G and D read (pacs-ours/localTrain.py:81).
    label_value: float = 0.7
    # The sizes of G and D are hetfed's own, for a 64-wide feature on a CPU budget: the reference code's
    # (noise 2048, hidden 4096, projection and hidden 1024; pacs-ours/train.py:30, Nets.py:12, README --rp-size,
    # Nets.py:114) were sized for AlexNet's 4096-wide features and make G 8.7 M values on the wire each way.
    noise_dim: int = 64  # G's noise width; the noise is uniform on [0, 1) (localTrain.py:70)
    generator_hidden: int = 256
    # G ends in a ReLU in the reference (Nets.py:16), as its AlexNet features do; hetfed's encoders may end in a
    # bare Linear (signed features, rmnist_cnn), so G's output is bare unless this is set.
    generator_relu: bool = False
    projection_dim: int = 256  # D's random projection width
    discriminator_hidden: int = 256
    # Figures: the held-out target is evaluated every round (a few hundred images).
    eval_every: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        # local_steps > 0 runs exactly that many adversarial batches a round (in place of local_epochs), so that a
        # grid can give FedADG the same step budget as its other methods; the E0 phase is counted in epochs only,
        # so the two cannot be mixed.
        check(self.local_steps == 0 or self.classifier_epochs == 0,
              f"fedadg counts its classifier phase in epochs; local_steps (the adversarial batches of a round) needs "
              f"classifier_epochs = 0, got local_steps = {self.local_steps}, classifier_epochs = "
              f"{self.classifier_epochs}")
        check(self.classifier_epochs >= 0, f"classifier_epochs must be >= 0, got {self.classifier_epochs}")
        check(self.adversarial_lr > 0, f"adversarial_lr must be > 0, got {self.adversarial_lr}")
        check(0 <= self.alpha <= 1, f"alpha must be in [0, 1], got {self.alpha}")
        check(0 <= self.label_smoothing < 1, f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        check(self.label_value > 0, f"label_value must be > 0, got {self.label_value}")
        for name in ("noise_dim", "generator_hidden", "projection_dim", "discriminator_hidden"):
            value = getattr(self, name)
            check(value >= 1, f"{name} must be >= 1, got {value}")


SPEC = fedavg.SPEC.derive(
    name="fedadg",
    summary="FedADG (Zhang et al. 2021): per-class adversarial alignment of features to a reference distribution "
            "from a federated generator; uniform FedAvg of extractor, classifier and generator, discriminator "
            "kept; domain generalisation.",
    config_type=FedADGConfig,
    figures=(Figure("target", "target_test_accuracy"), Figure("source_val", "test_accuracy")),
    summed_upload=frozenset({K.MODEL_WEIGHTS}),  # FedAvg's uniform mean of extractor, classifier and generator
)
