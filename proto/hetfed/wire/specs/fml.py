"""FML, Federated Mutual Learning (Shen, Zhang et al. 2020, arXiv:2006.16765): the spec and its config.

Each organization keeps its own private model (any architecture, never sent) and a local copy of a shared
"meme" model (one architecture for the run). Each round the meme model starts from the averaged global model,
and on every batch both are trained by deep mutual learning: the private model on α·CE + (1 − α)·KL(p_meme ‖
p_private), the meme model on β·CE + (1 − β)·KL(p_private ‖ p_meme), each with the other's output held fixed.
The server averages the meme models exactly as FedAvg averages its model, so the wire contract is FedAvg's:
the meme model's ModelWeights and the metrics go up, the averaged meme model comes down.

Defaults: the authors' code's (github:ZJU-DAI/Federated-Mutual-Learning) and hetfed's own, each labelled with
its source in docs/algorithms/fml.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs import fedavg
from hetfed.wire.specs.base import Figure
from hetfed.wire.specs.fedavg import FedAvgConfig


@dataclass(frozen=True)
class FMLConfig(FedAvgConfig):
    """FML: the two mutual-learning weights α and β, the meme model's architecture, the reference code's
    training knobs (SGD at lr 0.01, momentum 0.9, weight decay 5e-4, five epochs of batch 128)."""

    # α: the private model's weight on cross-entropy; 1 − α on KL(p_meme ‖ p_private) (Args.py:54).
    alpha: float = 0.5
    # β: the meme model's weight on cross-entropy; 1 − β on KL(p_private ‖ p_meme) (Args.py:56).
    beta: float = 0.5
    # The meme model's architecture, the same in every organization: a registered name or an own builder
    # "package.module:function", at its default latent width. hetfed's own default: "mlp" takes any input.
    meme_model: str = "mlp"
    local_epochs: int = 5  # --E 5 (Args.py:16)
    batch_size: int = 128  # --batchsize 128 (Args.py:32)
    weight_decay: float = 5e-4  # init_optimizer's SGD (Node.py:22)
    # The private model's optimiser is built once per organization (Node.py:43) and kept; the meme model's is
    # built afresh at every fork of the global model (Node.py:49) whatever this says.
    keep_optimizer_state: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check(0 <= self.alpha <= 1, f"alpha must be in [0, 1], got {self.alpha}")
        check(0 <= self.beta <= 1, f"beta must be in [0, 1], got {self.beta}")
        check(bool(self.meme_model.strip()), "meme_model must name an architecture, got ''")


SPEC = fedavg.SPEC.derive(
    name="fml",
    summary="FML (Shen et al. 2020): each organization's private model (any architecture, never sent) and a "
    "shared meme model learn from each other by deep mutual learning; only the meme model is averaged.",
    config_type=FMLConfig,
    own_architectures=True,
    figures=(Figure("meme", "meme_model_test_accuracy"),),
    summed_upload=frozenset({K.MODEL_WEIGHTS}),  # FedAvg's weighted mean of the meme models; private models never leave
)
