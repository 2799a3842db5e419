"""Ditto's client half (Algorithm 1 with eq. 4): a global model w_G that is averaged and a personal model w_L
that never leaves the organization, both stepped on every batch by the one training loop.

Round r: w_G ← w̄ (the received average; round 1 starts from the run's initial weights, and w_L = w̄ then),
θ̄ ← a frozen copy of w̄. For each batch: a step of w_G on cross-entropy, then a step of w_L on cross-entropy
+ (λ/2)·‖w_L − w̄‖² + μ·Σ_ℓ D(f_ℓ(b; θ_L), f_ℓ(b; θ̄)). The drift measure's gradient reaches w_L only (θ̄'s
parameters do not require gradients and its features are computed without a graph; the kernels are held
fixed inside the loss). The weight penalty is added to w_L's gradients before its step (λ·(w_L − w̄), the
same update as autograd through the penalty). Upload: w_G's ModelWeights and the personal model's metrics.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from hetfed.client.algorithms.base import ClientContext
from hetfed.client.algorithms.ditto.cosine import CosineDrift
from hetfed.client.algorithms.ditto.features import RefitSchedule, forward_with_layers, named_layer
from hetfed.client.algorithms.ditto.kernels import KERNEL_DTYPES
from hetfed.client.algorithms.ditto.mkmmd import MkMmdLoss
from hetfed.client.algorithms.ditto.mmdd import MmdDLoss
from hetfed.client.algorithms.ditto.penalty import add_proximal_gradient
from hetfed.client.algorithms.fedavg import ModelAveragingClient, model_weights
from hetfed.client.models import SplitModel
from hetfed.client.training import (
    Batch,
    Forward,
    LossTerm,
    Objective,
    PerExample,
    cross_entropy,
    epoch_batches,
    eval_mode,
    evaluate,
    fit,
    plain_forward,
    trainable,
)
from hetfed.wire.payloads import EvalMetrics, Payload, Received
from hetfed.wire.specs import ditto
from hetfed.wire.specs.ditto import DittoConfig

# Random streams of (run seed, round seed, organization) beside the batch order's: the refit samples' rows and
# the MMD-D kernels' initial weights and pair shuffles. The batch order is FedAvg's, so w_G's trajectory is
# exactly FedAvg's.
_REFIT_STREAM = 0xD177
_KERNEL_STREAM = 0xD1770


def _mean_softmax_cross_entropy(batch: Batch, out: Forward) -> torch.Tensor:
    return F.cross_entropy(torch.softmax(out.logits, dim=1), batch.y)


softmax_cross_entropy = PerExample(
    lambda batch, out: F.cross_entropy(torch.softmax(out.logits, dim=1), batch.y, reduction="none"),
    _mean_softmax_cross_entropy, "softmax_cross_entropy")
"""CrossEntropy(softmax(logits)): the reference code's model ends in a Softmax and trains with CrossEntropyLoss."""


class LayerDrift:
    """The drift measure D of one feature layer: its module (kept across rounds) and how it is refit."""

    def __init__(self, config: DittoConfig, width: int, seed: int) -> None:
        self.measure = config.measure
        self.module: nn.Module
        if config.measure == "cosine":
            self.module = CosineDrift()
        elif config.measure == "mkmmd":
            self.module = MkMmdLoss(epsilon=config.qp_epsilon, normalize_features=config.mkmmd_normalize,
                                    bandwidth_form=config.mkmmd_bandwidth, estimator=config.mkmmd_estimator,
                                    qp_form=config.mkmmd_qp, beta_init=config.mkmmd_beta_init, seed=seed,
                                    dtype=KERNEL_DTYPES[config.kernel_dtype])
        elif config.measure == "mmdd":
            self.module = MmdDLoss(width, kernel_form=config.mmdd_kernel, lr=config.mmdd_lr,
                                   train_steps=config.mmdd_steps, seed=seed, dtype=KERNEL_DTYPES[config.kernel_dtype])
        else:
            raise ValueError(f"no drift measure for measure {config.measure!r}")
        self.width = width
        self.refits = 0

    @property
    def adaptive(self) -> bool:
        """Whether the measure has a kernel to refit (MK-MMD's β, MMD-D's deep kernel)."""
        return self.measure in ("mkmmd", "mmdd")

    def refit(self, local: torch.Tensor, reference: torch.Tensor) -> None:
        """Refit the kernel on two same-size, gradient-free feature samples (nothing to refit for the cosine)."""
        if not self.adaptive or local.shape[0] < 2:
            return
        if isinstance(self.module, MkMmdLoss):
            self.module.refit(local, reference)
        elif isinstance(self.module, MmdDLoss):
            self.module.train_kernel(local, reference)
        self.refits += 1

    def refit_and_measure(self, local: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        """Refit on this batch's features (gradient-free), then D on them: the every-step schedule."""
        if self.adaptive and local.shape[0] < 2:
            return local.new_zeros(())
        if isinstance(self.module, MkMmdLoss):  # the pair statistics computed once for both
            self.refits += 1
            return self.module.refit_and_forward(local, reference)
        self.refit(local.detach(), reference)
        return self(local, reference)

    def __call__(self, local: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        """D(local, reference); zero for an MMD on a batch of fewer than 2 rows (no unbiased estimate)."""
        if self.adaptive and local.shape[0] < 2:
            return local.new_zeros(())
        value: torch.Tensor = self.module(local, reference)
        return value


@ditto.SPEC.client_half
class DittoClient(ModelAveragingClient[DittoConfig]):
    """Ditto: ``ctx.model`` is the global model w_G (declared and uploaded); ``personal`` is w_L (never sent)."""

    private_attributes = ("personal",)
    # w_L, the model this organization deploys, trains outside DP-SGD: it never leaves, but it is not DP either.
    deployed_under_dp = False

    def __init__(self, ctx: ClientContext[DittoConfig]) -> None:
        super().__init__(ctx)
        if ctx.build_model is None:
            raise ValueError("Ditto needs a second model of the organization's architecture (ClientContext.build_model)")
        # w_L = w̄ at the start: the same initial weights as w_G (the run's seed fixes them).
        self.personal: SplitModel = ctx.build_model()
        # θ̄: a frozen copy of the received global model, whose features the constraint compares with w_L's.
        self.reference: SplitModel = ctx.build_model()
        self.reference.requires_grad_(False)
        self.reference.eval()
        self.layers = tuple(self.config.feature_layers)
        for layer in self.layers:
            if layer:
                named_layer(self.personal, layer)  # a clear error naming the model's layers
        self.schedule = RefitSchedule(self.config.refit_every, self.config.refit_batches)
        self.drifts: dict[str, LayerDrift] = {}

    # ------------------------------------------------------------------ private state
    def optimized(self) -> dict[str, list[nn.Parameter]]:
        """w_G's optimiser (FedAvg's) and w_L's."""
        return {**super().optimized(), "personal_optimizer": trainable(self.personal)}

    def private_state(self) -> dict[str, Any]:
        """FedAvg's state, w_L, w_L's optimiser when kept, and each layer's drift measure (kernel and its optimiser)."""
        state = super().private_state()
        drifts: dict[str, Any] = {}
        for layer, d in self.drifts.items():
            entry: dict[str, Any] = {"width": d.width, "refits": d.refits, "module": d.module.state_dict()}
            if isinstance(d.module, MmdDLoss):
                entry["optimizer"] = d.module.optimizer.state_dict()
                entry["shuffle_rng"] = d.module._shuffle_rng.get_state()
            drifts[layer] = entry
        state["drifts"] = drifts
        return state

    def load_private_state(self, state: Mapping[str, Any]) -> None:
        """Resume w_G, w_L, their optimisers and the drift measures."""
        super().load_private_state(state)
        for layer, entry in state.get("drifts", {}).items():
            d = self.drift_for(layer, int(entry["width"]))
            d.module.load_state_dict(entry["module"])
            d.refits = int(entry["refits"])
            if isinstance(d.module, MmdDLoss):
                d.module.optimizer.load_state_dict(entry["optimizer"])
                d.module._shuffle_rng.set_state(entry["shuffle_rng"])

    # ------------------------------------------------------------------ the personal objective
    @property
    def constrained(self) -> bool:
        """Whether the drift term is on (a measure and μ > 0)."""
        return self.config.measure != "none" and self.config.mu > 0

    def classification(self) -> LossTerm:
        """Cross-entropy on the logits (the paper's formula), or on their softmax (``double_softmax``)."""
        return softmax_cross_entropy if self.config.double_softmax else cross_entropy

    def personal_forward(self, model: nn.Module, batch: Batch) -> Forward:
        """w_L's logits and the constrained layers' features, with θ̄'s features of the same batch (no graph)."""
        logits, feats = forward_with_layers(model, self.layers, batch.x)
        with torch.no_grad():
            _, ref = forward_with_layers(self.reference, self.layers, batch.x)
        extras = {f"local:{k}": v for k, v in feats.items()}
        extras.update({f"reference:{k}": v for k, v in ref.items()})
        return Forward(logits, extras)

    def drift_for(self, layer: str, width: int) -> LayerDrift:
        """The layer's drift measure, built on first use and kept for the whole run (kernels persist)."""
        if layer not in self.drifts:
            seq = np.random.SeedSequence([self.ctx.seed, _KERNEL_STREAM, zlib.crc32(f"{self.ctx.organization}/{layer}".encode())])
            drift = LayerDrift(self.config, width, int(seq.generate_state(1)[0]))
            # On the features' device: MMD-D's deep kernel and MK-MMD's bandwidths and weights are built on the
            # CPU (a CUDA client failed with "mat1 is on cuda:0, different from other tensors on cpu"). Module.to
            # keeps the Parameter objects, so the kernel's AdamW, built with them, keeps working.
            drift.module.to(self.ctx.device)
            self.drifts[layer] = drift
        return self.drifts[layer]

    @torch.no_grad()
    def refit_sample(self, rng: np.random.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Features of w_L and θ̄ on s batches of training rows (drawn without replacement), in eval mode."""
        data = self.ctx.train
        n = len(data)
        rows = rng.choice(n, size=min(n, self.config.refit_batches * self.config.batch_size), replace=False)
        x = data.take(np.sort(rows)).x
        with eval_mode(self.personal):
            _, local = forward_with_layers(self.personal, self.layers, x)
            _, ref = forward_with_layers(self.reference, self.layers, x)
        return {layer: (local[layer], ref[layer]) for layer in self.layers}

    def drift_term(self, round_seed: int) -> LossTerm:
        """μ·Σ_ℓ D_ℓ, refitting kernels on the schedule: before steps 0, every, 2·every, … on s batches, or on
        each step's own batch (refit_every = −1)."""
        mu = float(self.config.mu)
        rng = np.random.default_rng([self.ctx.seed, round_seed, zlib.crc32(self.ctx.organization.encode()),
                                     _REFIT_STREAM])
        step = [0]

        def term(batch: Batch, out: Forward) -> torch.Tensor:
            locals_ = {layer: out[f"local:{layer}"] for layer in self.layers}
            refs = {layer: out[f"reference:{layer}"] for layer in self.layers}
            drifts = {layer: self.drift_for(layer, locals_[layer].shape[1]) for layer in self.layers}
            if self.schedule.due(step[0]) and any(d.adaptive for d in drifts.values()):
                sample = self.refit_sample(rng)
                for layer, d in drifts.items():
                    d.refit(*sample[layer])
            step[0] += 1
            total = locals_[self.layers[0]].new_zeros(())
            for layer, d in drifts.items():
                f_local, f_ref = locals_[layer], refs[layer]
                total = total + (d.refit_and_measure(f_local, f_ref) if self.schedule.per_step else d(f_local, f_ref))
            return mu * total

        return term

    def personal_objective(self, round_seed: int) -> Objective:
        """w_L's objective: cross-entropy, the drift term, and the weight penalty as a gradient before each step."""
        params = trainable(self.personal)
        # w̄'s parameters at the places of w_L's trainable ones (a frozen parameter is the same in both).
        reference = [r.detach() for p, r in zip(self.personal.parameters(), self.reference.parameters(), strict=True)
                     if p.requires_grad]
        lam = float(self.config.lam)
        terms: list[LossTerm] = [self.classification()]
        forward: Callable[[nn.Module, Batch], Forward] = plain_forward
        if self.constrained:
            terms.append(self.drift_term(round_seed))
            forward = self.personal_forward

        def penalty() -> None:
            add_proximal_gradient(params, reference, lam)

        # w_L never leaves the organization (only its metrics do), so DP-SGD leaves it alone.
        return Objective(self.personal, self.optimizer("personal_optimizer"), terms, forward,
                         before_step=penalty if lam > 0 else None, kept=True)

    # ------------------------------------------------------------------ hooks
    def global_accuracy(self) -> float:
        """The global model w_G's accuracy on this organization's test set."""
        return evaluate(self.ctx.model, self.ctx.test)[0]

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """Take w̄, step w_G and w_L on every batch, upload w_G; report w_L's metrics and w̄'s accuracy."""
        ctx = self.ctx
        self.load(received)
        self.reference.load_state_dict(ctx.model.state_dict())  # θ̄ ← w̄, copied in place (stays frozen)
        # w̄ is scored before training, in the rounds the round loop evaluates (others resend the last figures).
        global_before = {"global_model_test_accuracy": self.global_accuracy()} if ctx.evaluates else {}
        global_objective = Objective(ctx.model, self.optimizer(), [self.classification()])
        result = fit([global_objective, self.personal_objective(round_seed)],
                     epoch_batches(ctx.train, self.config, ctx.rng(round_seed)))
        losses = {"global_train_loss": result.losses[0]}
        metrics = ctx.metrics(result.losses[1], evaluated_round=round_, extra={**global_before, **losses},
                              model=self.personal)
        return [model_weights(ctx.model, ctx.num_examples), metrics]

    def evaluate(self, round_: int, received: Received) -> EvalMetrics:
        """The final personal model w_L on the organization's own test set, and the final global model w̄'s accuracy."""
        self.load(received)
        return self.ctx.metrics(0.0, evaluated_round=round_ - 1, model=self.personal,
                                extra={"global_model_test_accuracy": self.global_accuracy()})

    def deployed_model(self) -> SplitModel:
        """What this organization deploys: its personal model w_L."""
        return self.personal

