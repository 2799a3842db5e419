"""FML's client half (Shen, Zhang et al. 2020): a private model and a meme model that learn from each other.

``ctx.model`` is the organization's private model, of its own architecture; it never leaves. ``meme`` is the
shared meme model (the config's ``meme_model``, one architecture for the run), the only model declared and
uploaded. Round r: meme ← w̄ (the received average; round 1 starts from the run's initial meme weights, the
same in every organization), then for each batch both models run forward once, and each takes a step on its
own loss with the other's output held fixed (the authors' Trainer.py:78-89):

    L_private = α·CE(z_private, y) + (1 − α)·KL(softmax(z_meme) ‖ softmax(z_private))
    L_meme    = β·CE(z_meme, y)    + (1 − β)·KL(softmax(z_private) ‖ softmax(z_meme))

KL is summed over the classes and averaged over the batch (torch's KLDivLoss 'batchmean'), without a
temperature. Upload: the meme model's ModelWeights and the private model's metrics, with the accuracy of the
received meme model (w̄) on the organization's test set.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from hetfed.client.algorithms.base import ClientContext, ClientHalf
from hetfed.client.algorithms.fedavg import check_received, load_shared_state, model_weights, shared_state
from hetfed.client.models import SplitModel, build_model
from hetfed.client.training import (
    Batch,
    Forward,
    Objective,
    PerExample,
    epoch_batches,
    evaluate,
    fit,
    make_optimizer,
    trainable,
)
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import EvalMetrics, ModelWeights, Payload, PayloadKind, Received
from hetfed.wire.specs import fml
from hetfed.wire.specs.fml import FMLConfig

MEME_OPTIMIZER = "meme_optimizer"
# The meme model's initial weights: the run seed's stream for it (the same in every organization, and not the
# private model's when both have one architecture).
_MEME_STREAM = 0xF3E3E


def mutual_values(logits: torch.Tensor, peer_logits: torch.Tensor, labels: torch.Tensor,
                  weight: float) -> torch.Tensor:
    """Per example i: weight·CE(z_i, y_i) + (1 − weight)·Σ_k q_ik·(log q_ik − log p_ik), with p = softmax(z) the
    trained model's probabilities and q = softmax(peer) the other model's, held fixed (no gradient reaches it).
    Their mean over a batch is the reference code's α·CE + (1 − α)·KLDivLoss('batchmean')."""
    log_p = F.log_softmax(logits, dim=1)
    log_q = F.log_softmax(peer_logits.detach(), dim=1)
    ce = F.nll_loss(log_p, labels, reduction="none")
    kl = (log_q.exp() * (log_q - log_p)).sum(dim=1)
    return weight * ce + (1.0 - weight) * kl


def mutual_term(weight: float, name: str) -> PerExample:
    """The loss term of one side of the mutual learning: its forward pass carries the other's logits as ``peer``."""
    return PerExample(lambda batch, out: mutual_values(out.logits, out["peer"], batch.y, weight), name=name)


class MutualForward:
    """One forward pass of each model per batch, shared by the two objectives.

    The private objective (stepped first) runs both models on the batch; the meme objective then takes the meme
    model's logits of that same pass (their graph reaches only the meme model's parameters, which the private
    step leaves alone) and the private model's logits from before its step: both losses are those of the
    reference code, which computes both outputs before either model steps."""

    def __init__(self, meme: nn.Module) -> None:
        self.meme = meme
        self._pending: tuple[Batch, torch.Tensor, torch.Tensor] | None = None

    def private(self, model: nn.Module, batch: Batch) -> Forward:
        """The private model's logits, with the meme model's (fixed) as its peer; the meme's pass is kept."""
        logits = model(batch.x)
        meme_logits = self.meme(batch.x)
        self._pending = (batch, meme_logits, logits.detach())
        return Forward(logits, {"peer": meme_logits.detach()})

    def meme_pass(self, model: nn.Module, batch: Batch) -> Forward:
        """The meme model's logits of the same pass, with the private model's (fixed, before its step)."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not batch or model is not self.meme:
            raise RuntimeError("the meme model's step must follow the private model's on the same batch")
        _, meme_logits, private_logits = pending
        return Forward(meme_logits, {"peer": private_logits})


def build_meme(config: FMLConfig, input_shape: tuple[int, ...], num_classes: int, seed: int) -> SplitModel:
    """The meme model with the run's initial weights (the same in every organization) on CPU."""
    meme_seed = int(np.random.SeedSequence([seed, _MEME_STREAM]).generate_state(1)[0])
    return build_model(config.meme_model, input_shape, num_classes, seed=meme_seed)


@fml.SPEC.client_half
class FMLClient(ClientHalf[FMLConfig]):
    """FML: the private model ``ctx.model`` (never sent) and the meme model ``meme`` (declared and uploaded)."""

    # The meme model trained on the private data goes up with no DP mechanism: FML does not serve [privacy].
    privacy_mechanism = None
    private_attributes = ("meme",)

    def __init__(self, ctx: ClientContext[FMLConfig]) -> None:
        super().__init__(ctx)
        self.meme: SplitModel = build_meme(ctx.config, ctx.data.input_shape, ctx.data.num_classes,
                                           ctx.seed).to(ctx.device)  # type: ignore[assignment]
        self.private_term = mutual_term(self.config.alpha, "private_mutual")
        self.meme_term = mutual_term(self.config.beta, "meme_mutual")

    def optimized(self) -> dict[str, list[nn.Parameter]]:
        """The private model's optimiser and the meme model's."""
        return {"optimizer": trainable(self.ctx.model), MEME_OPTIMIZER: trainable(self.meme)}

    def optimizer(self, name: str = "optimizer") -> torch.optim.Optimizer:
        """The private model's optimiser as the config keeps it; the meme model's afresh every round, as the
        reference code builds it at each fork of the global model (Node.py:47-49)."""
        if name == MEME_OPTIMIZER:
            opt = self._optimizers[name] = make_optimizer(self.optimized()[name], self.optimizer_config(name))
            return opt
        return super().optimizer(name)

    def private_state(self) -> dict[str, Any]:
        """The private model, the meme model and the private model's kept optimiser (the meme's is rebuilt)."""
        state = super().private_state()
        state.pop(MEME_OPTIMIZER, None)
        return state

    def declarations(self, wire_dtype: str | None) -> list[DeclaredTensor]:
        """The meme model's shared state: the private model is never declared, so its tensors are refused."""
        return [DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, k, v.cpu().numpy(), wire_dtype)
                for k, v in shared_state(self.meme).items()]

    def load(self, received: Received) -> None:
        """meme ← w̄, when the aggregator sent it (round 1 starts from the run's initial meme weights)."""
        mw = received.maybe(ModelWeights)
        if mw is not None:
            check_received(self.meme, mw)
            load_shared_state(self.meme, mw)

    def meme_accuracy(self) -> dict[str, float]:
        """The meme model's accuracy on the organization's test set, in the rounds the round loop evaluates."""
        return {"meme_model_test_accuracy": evaluate(self.meme, self.ctx.test)[0]} if self.ctx.evaluates else {}

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """Take w̄ as the meme model, train both models mutually, upload the meme model; report the private
        model's metrics after training and w̄'s accuracy before it."""
        ctx = self.ctx
        self.load(received)
        meme_before = self.meme_accuracy()
        forward = MutualForward(self.meme)
        result = fit([Objective(ctx.model, self.optimizer(), [self.private_term], forward.private),
                      Objective(self.meme, self.optimizer(MEME_OPTIMIZER), [self.meme_term], forward.meme_pass)],
                     epoch_batches(ctx.train, self.config, ctx.rng(round_seed)))
        metrics = ctx.metrics(result.losses[0], evaluated_round=round_,
                              extra={**meme_before, "meme_train_loss": result.losses[1]})
        return [model_weights(self.meme, ctx.num_examples), metrics]

    def evaluate(self, round_: int, received: Received) -> EvalMetrics:
        """The final private model on every test set, and the final averaged meme model's accuracy."""
        self.load(received)
        return self.ctx.metrics(0.0, evaluated_round=round_ - 1, extra=self.meme_accuracy())
