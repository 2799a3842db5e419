"""FedGen (Zhu, Hong and Zhou, ICML 2021, "Data-Free Knowledge Distillation for Heterogeneous Federated
Learning"): the spec and its config.

Every round each organization trains its model on its data plus two terms from the server's generator, then
sends its encoder (ModelWeights), its classification head (HeadWeights) and the counts of the labels it trained
on this round (ClassCounts). The server averages encoders and heads FedAvg-style and trains a small conditional
generator G(ε, y) -> latent, in numpy, so that the organizations' heads, weighted per label by those counts,
classify G(ε, y) as y (with a diversity term). It sends the averaged model and the generator's weights down;
each organization then adds the generator's samples as a regulariser of its head (data-free distillation).

Defaults: the authors' code's (github:zhuangdizhu/FedGen, its MNIST settings), labelled in
docs/algorithms/fedgen.md with their file and line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hetfed.wire.config import check
from hetfed.wire.payloads import PayloadKind as K
from hetfed.wire.specs.base import AlgorithmSpec, SharedSpaceConfig
from hetfed.wire.specs.fedavg import FedAvgConfig

# The prefix of the generator's tensors in the ModelWeights the server sends (the averaged encoder's names are
# torch state_dict keys, which never hold a colon).
GENERATOR_PREFIX = "generator:"
# The generator's tensors: Linear(noise + K, hidden), BatchNorm1d(hidden) with its running statistics, ReLU,
# Linear(hidden, latent) (the reference code's Generator, trainmodel/generator.py:34-47).
GENERATOR_TENSORS = ("fc.weight", "fc.bias", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var",
                     "out.weight", "out.bias")


@dataclass(frozen=True)
class FedGenConfig(FedAvgConfig, SharedSpaceConfig):
    """FedGen: the client's regulariser (α, β, their decay, the generated batch), the generator's shape and the
    server's training of it. Local training is the reference code's: plain SGD at lr 0.01, 20 steps of batch 32
    a round, lr ×0.99 a round from round 3."""

    # Whether the encoder is averaged too (FedGen's main setting: every parameter, servers/serverbase.py:90-102),
    # or only the head (FedGenHeadConfig).
    shares_encoder: ClassVar[bool] = True
    # The client's regulariser: α·(B̂/B)·CE(head(G(ε, ŷ)), ŷ) on generated samples and β·KL(softmax(head(G(ε, y)))
    # ‖ model(x)) on the real batch, α and β decayed as max(1e-4, ·0.98^(t−1)) in round t.
    gen_alpha: float = 10.0
    gen_beta: float = 10.0
    gen_decay: float = 0.98
    gen_batch_size: int = 32
    # The generator: uniform noise of noise_dim values and the one-hot label in, hidden_dim units, latent_dim out.
    noise_dim: int = 32
    hidden_dim: int = 256
    # The server's training of the generator each round: steps of Adam (lr, L2 weight decay, lr ×decay a round)
    # on batches of generator_batch_size labels; teacher_weight·L_teacher + diversity_weight·L_diversity.
    generator_steps: int = 50
    generator_batch_size: int = 32
    generator_lr: float = 3e-4
    generator_weight_decay: float = 1e-2
    generator_lr_decay: float = 0.98
    teacher_weight: float = 1.0
    diversity_weight: float = 1.0
    # The client's training: the reference code's.
    local_steps: int = 20
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.0
    lr_decay: float = 0.99
    lr_decay_from: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("gen_alpha", "gen_beta", "teacher_weight", "diversity_weight", "generator_weight_decay"):
            value = getattr(self, name)
            check(value >= 0, f"{name} must be >= 0, got {value}")
        check(0 < self.gen_decay <= 1, f"gen_decay must be in (0, 1], got {self.gen_decay}")
        check(0 < self.generator_lr_decay <= 1, f"generator_lr_decay must be in (0, 1], got {self.generator_lr_decay}")
        check(self.generator_lr > 0, f"generator_lr must be > 0, got {self.generator_lr}")
        for name in ("gen_batch_size", "noise_dim", "hidden_dim", "generator_steps"):
            value = getattr(self, name)
            check(value >= 1, f"{name} must be >= 1, got {value}")
        # The diversity term pairs the batch's samples; a batch of one has no pair (BatchNorm needs two as well).
        check(self.generator_batch_size >= 2, f"generator_batch_size must be >= 2, got {self.generator_batch_size}")


def regulariser_weight(initial: float, decay: float, round_: int) -> float:
    """α_t or β_t in training round ``round_`` (1-based): max(1e-4, initial·decay^(round − 1)), the reference
    code's exp_lr_scheduler with FedGen's glob_iter = round − 1 (users/userpFedGen.py:20-23, 52-53)."""
    return max(1e-4, initial * decay ** (round_ - 1))


SPEC = AlgorithmSpec(
    name="fedgen",
    summary="FedGen (Zhu et al. 2021): FedAvg whose server trains a conditional generator of latents against "
    "the organizations' heads (weighted by their label counts) and sends it down as a regulariser of each head.",
    config_type=FedGenConfig,
    upload=frozenset({K.MODEL_WEIGHTS, K.HEAD_WEIGHTS, K.CLASS_COUNTS, K.EVAL_METRICS}),
    required_upload=frozenset({K.MODEL_WEIGHTS, K.HEAD_WEIGHTS, K.CLASS_COUNTS, K.EVAL_METRICS}),
    download=frozenset({K.MODEL_WEIGHTS, K.HEAD_WEIGHTS}),
    shared_schema=frozenset({K.MODEL_WEIGHTS, K.HEAD_WEIGHTS}),
    unsummed_because="the server trains its generator against each organization's own head",
)


@dataclass(frozen=True)
class FedGenHeadConfig(FedGenConfig):
    """FedGen sharing the head alone: encoders stay with their organizations (and may differ)."""

    shares_encoder: ClassVar[bool] = False


# FedGen as Fed-CMA's Table 2 runs it ("the limited parameter setting", sharing only the classification layer;
# paper 000, the paragraph before Table 2): each organization keeps its encoder; heads, label counts and the
# generator cross.
HEAD_SPEC = SPEC.derive(
    name="fedgen_head",
    summary="FedGen sharing only the classification head (Fed-CMA's comparison): heads averaged, encoders private "
    "and possibly different, the server's generator regularising every head.",
    config_type=FedGenHeadConfig,
    upload=frozenset({K.HEAD_WEIGHTS, K.CLASS_COUNTS, K.EVAL_METRICS}),
    required_upload=frozenset({K.HEAD_WEIGHTS, K.CLASS_COUNTS, K.EVAL_METRICS}),
    shared_schema=frozenset({K.HEAD_WEIGHTS}),
    model_private=True,
)
