"""FedSR's client half (Nguyen, Torr and Lim, NeurIPS 2022): simple representations for federated domain
generalisation, through FedAvg's client and the shared training loop.

A probabilistic encoder p(z|x) = N(μ(x), σ(x)²) with a linear classifier on a reparameterised sample z,
trained with cross-entropy plus an L2 penalty on z (L2R, eq. 11) and an upper bound of the conditional
mutual information I(x; z | y) (CMI, eq. 18: the analytic KL to a learnable per-class Gaussian r(z|y)).
``losses`` holds the model wrapper, the sampled prediction and the two terms.

Each round: load the global model (and, with ``shared_reference``, the global r), evaluate it, take E
local SGD steps on the objective, upload the whole model's floating state (batch-norm statistics
included) and, with ``shared_reference``, r_μ, r_σ's raw parameter and C as further tensors of the same
``ModelWeights``. Predictions average the softmax over ``num_samples`` draws of z (eq. 5). The noise of
training and prediction comes from generators seeded by the run, the round and the organization.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
from torch import nn

from hetfed.client.algorithms.base import ClientContext
from hetfed.client.algorithms.fedavg import ModelAveragingClient, shared_state
from hetfed.client.algorithms.fedsr.losses import (
    CMITerm,
    L2RTerm,
    ProbabilisticSplitModel,
    build_probabilistic_model,
    predict_proba,
)
from hetfed.client.models import SplitModel, default_latent_dim, make_built
from hetfed.client.training import Batch, Forward, LossTerm, PerExample, cross_entropy, trainable
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import EvalMetrics, ModelWeights, Payload, PayloadKind, Received
from hetfed.wire.specs import fedsr
from hetfed.wire.specs.fedsr import FedSRConfig

REFERENCE_PREFIX = "reference."
"""Names of r's tensors in ``ModelWeights`` when the reference distribution is shared."""


def _seed(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


@fedsr.SPEC.client_half
class FedSRClient(ModelAveragingClient[FedSRConfig]):
    """FedAvg's client with a probabilistic model, the L2R and CMI terms and sampled predictions."""

    def check_privacy(self) -> None:
        """The CMI term learns r(z|y) in parameters outside the model, which Opacus' per-example gradients do not
        reach: refused under DP (the L2R term and the probabilistic model are served)."""
        if self.cmi is not None:
            from hetfed.client.privacy.mechanisms import PrivacyError

            raise PrivacyError("fedsr's CMI term learns r(z|y) in parameters outside the model, whose gradient Opacus "
                               "cannot split by example; set fedsr.alpha_cmi = 0 to run FedSR under DP")

    # r(z|y) of the CMI term: private unless shared_reference (then it is loaded each round anyway).
    private_attributes = ("cmi",)

    @classmethod
    def make_model(cls, name: str, input_shape: tuple[int, ...], num_classes: int, *, seed: int,
                   latent_dim: int | None, bounded_latent: bool, config: FedSRConfig) -> SplitModel:
        """The registered architecture, made probabilistic (its final projection widened to 2·z; a whole model's
        own head kept as the classifier on z) unless the config asks for the deterministic network."""
        if not config.probabilistic:
            return super().make_model(name, input_shape, num_classes, seed=seed, latent_dim=latent_dim,
                                      bounded_latent=bounded_latent, config=config)
        z_dim = latent_dim or default_latent_dim(name)

        def encoder(shape: tuple[int, ...], dim: int, bounded: bool) -> nn.Module:
            return make_built(name, shape, dim, bounded, num_classes)

        return build_probabilistic_model(encoder, input_shape, z_dim, num_classes, seed=seed,
                                         sigma_eps=config.sigma_eps)

    def __init__(self, ctx: ClientContext[FedSRConfig]) -> None:
        super().__init__(ctx)
        cfg, model = self.config, ctx.model
        if cfg.probabilistic != isinstance(model, ProbabilisticSplitModel):
            raise TypeError(f"FedSR with probabilistic = {cfg.probabilistic} got a {type(model).__name__}")
        self.l2r = L2RTerm(cfg.alpha_l2r, squared=cfg.l2r_squared) if cfg.alpha_l2r > 0 else None
        self.cmi = (CMITerm(cfg.alpha_cmi, model.num_classes, model.latent_dim, learnable_scale=cfg.cmi_scale,
                            sigma_eps=cfg.sigma_eps).to(ctx.device) if cfg.alpha_cmi > 0 else None)
        self._noise: torch.Generator | None = None

    # ------------------------------------------------------------------------------------------- the wire
    def reference_state(self) -> dict[str, torch.Tensor]:
        """r's parameters by wire name when they are shared (empty otherwise)."""
        if self.cmi is None or not self.config.shared_reference:
            return {}
        return {REFERENCE_PREFIX + k: v for k, v in self.cmi.state_dict().items()}

    def declarations(self, wire_dtype: str | None) -> list[DeclaredTensor]:
        """The model's floating state, and r's parameters when shared."""
        return [*super().declarations(wire_dtype),
                *(DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, k, v.detach().cpu().numpy(), wire_dtype)
                  for k, v in self.reference_state().items())]

    def load(self, received: Received) -> None:
        """Take the global model (and the global r when shared), when the aggregator sent one."""
        mw = received.maybe(ModelWeights)
        if mw is None:
            return
        targets = {**shared_state(self.ctx.model), **self.reference_state()}
        unexpected = sorted(set(mw.tensors) - set(targets))
        if unexpected:
            raise ValueError(f"the global model carries tensors this organization does not have: {unexpected}")
        with torch.no_grad():
            for name, arr in mw.tensors.items():
                targets[name].copy_(torch.from_numpy(np.array(arr, dtype=np.float32)))

    def upload(self) -> ModelWeights:
        """The trained model's floating state, and r's parameters when shared."""
        tensors = {k: v.detach().cpu().numpy() for k, v in {**shared_state(self.ctx.model),
                                                             **self.reference_state()}.items()}
        return ModelWeights(tensors, self.ctx.num_examples)

    # ------------------------------------------------------------------------------------------ training
    def parameters(self) -> list[nn.Parameter]:
        """The model's trainable parameters and r's (one optimiser, as in the reference code)."""
        return [*trainable(self.ctx.model), *(self.cmi.parameters() if self.cmi is not None else ())]

    def forward(self, model: nn.Module, batch: Batch) -> Forward:
        """Logits of one reparameterised sample z (extras z, mu, sigma); deterministic: z = the encoder's output."""
        if isinstance(model, ProbabilisticSplitModel):
            out = model.forward_sample(batch.x, self._noise)
            return Forward(out.logits, {"z": out.z, "mu": out.mu, "sigma": out.sigma})
        assert isinstance(model, SplitModel)
        z = model.embed(batch.x)
        return Forward(model.head(z), {"z": z})

    def terms(self) -> list[LossTerm]:
        """Cross-entropy + α_L2R·L2R(z) + α_CMI·KL(N(μ, σ²) ‖ r(z|y)) (eq. 9; a term with α = 0 is left out)."""
        terms: list[LossTerm] = [cross_entropy]
        l2r, cmi = self.l2r, self.cmi
        if l2r is not None:
            terms.append(PerExample(lambda batch, out: l2r.per_example(out["z"]), lambda batch, out: l2r(out["z"]),
                                    "l2r"))
        if cmi is not None:
            terms.append(lambda batch, out: cmi(out["mu"], out["sigma"], batch.y))
        return terms

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """FedAvg's round with this round's noise generator for the samples of z."""
        self._noise = torch.Generator(device=self.ctx.device)
        self._noise.manual_seed(_seed(self.ctx.seed, round_seed, self.ctx.organization, "z"))
        return super().train(round_, round_seed, received)

    # --------------------------------------------------------------------------------------- prediction
    def measure(self, evaluated_round: int) -> EvalMetrics:
        """Metrics of the model on every held-out set; a probabilistic model predicts by the mean softmax over
        ``num_samples`` draws of z, from a generator seeded by the run and the round (the same in every
        organization, which all hold the same global model)."""
        model = self.ctx.model
        if not isinstance(model, ProbabilisticSplitModel):
            return super().measure(evaluated_round)
        gen = torch.Generator(device=self.ctx.device)
        gen.manual_seed(_seed(self.ctx.seed, evaluated_round, "predict"))
        samples = self.config.num_samples

        def predict(x: torch.Tensor) -> torch.Tensor:
            probs = predict_proba(model, x, num_samples=samples, generator=gen)
            return torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny))

        return self.ctx.metrics(0.0, evaluated_round=evaluated_round, predict=predict)
