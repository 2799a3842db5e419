"""SimFed (paper 004: similarity matching and kernel factorization), the client half.

``layers`` holds the factorised dense and convolution layers of eqs. 4-6, the function that builds any
hetfed model with a factorised encoder, the mask's L1 term of eq. 7, the sparse mask codec of the
``FactorizedWeights`` payload, and the criteria inputs x_N with their embeddings z_N = E(x_N) (eqs. 1-2).
The server's similarity matching and reflection (eqs. 3 and 8) are numpy functions in
``hetfed.aggregator.algorithms.simfed``.

A round (Algorithm 1, ``RunClient``): take the personalised factors the aggregator sent (none in round 1:
every organization starts from the run seed's factors) and add back the mask entries it did not send,
train E local epochs on cross-entropy plus λ₁·Σ‖μ‖₁, then upload the shared factors (u, v and the mask
entries with |μ| > ``mask_threshold``) and the embeddings z_N of the criteria inputs. The head is a dense layer that never leaves the organization, so
organizations may name and count their classes differently. The criteria inputs are drawn once from the
run seed (Algorithm 1 initialises x_N once) and never sent.
"""

from __future__ import annotations

import torch

from hetfed.client.algorithms.base import ClientContext, ClientHalf
from hetfed.client.algorithms.simfed.layers import (
    MaskL1,
    build_factorized_model,
    criteria_embeddings,
    criteria_inputs,
    densify_model,
    encode_factors,
    load_factors,
    mask_density,
    trained_mask_density,
    unsent_mask,
)
from hetfed.client.models import SplitModel
from hetfed.client.training import (
    LossTerm,
    Objective,
    cross_entropy,
    data_free,
    epoch_batches,
    fit,
)
from hetfed.wire.payloads import CriteriaEmbeddings, EvalMetrics, FactorizedWeights, Payload, Received
from hetfed.wire.specs import simfed
from hetfed.wire.specs.simfed import SimFedConfig

__all__ = ["SimFedClient", "criteria_set_id"]


def criteria_set_id(seed: int, count: int, input_shape: tuple[int, ...]) -> str:
    """The name of the criteria inputs every organization derives from the run seed (checked by the server)."""
    return f"normal(0,1) seed={seed} count={count} shape={'x'.join(map(str, input_shape))}"


@simfed.SPEC.client_half
class SimFedClient(ClientHalf[SimFedConfig]):
    """Trains the factorised model from its personalised factors; uploads factors and criteria embeddings.

    What the organization did not send it keeps: factors outside ``shared_factors`` are never replaced,
    and the mask entries under the send threshold are added back to the mask it receives. The server
    reflects the sent copies, so the result is θ_k + Σ_j w_kj·(θ_j,sent − θ_k,sent): eq. 8 applied to
    what the server holds, as a delta on the organization's full parameters.
    """

    # Under DP the factorised model trains with DP-SGD (the L1 penalty on the masks is data-free); its factors,
    # masks and embeddings of the criteria inputs are post-processing.
    privacy_mechanism = "dp-sgd"

    # The mask entries the last upload left out (added back after the download) and the last reported figures.
    private_attributes = ("unsent", "figures")

    @classmethod
    def make_model(cls, name: str, input_shape: tuple[int, ...], num_classes: int, *, seed: int,
                   latent_dim: int | None, bounded_latent: bool, config: SimFedConfig) -> SplitModel:
        """The registered architecture with its encoder's dense and convolution layers factorised (same seed)."""
        dense, conv = {"reference": (0.0, 0.0), "zero": (0.0, 0.0), "dense": (1.0, 0.0),
                       "sparse": (config.mask_init_density, config.mask_init_density)}[config.mask_init]
        return build_factorized_model(name, input_shape, num_classes, latent_dim=latent_dim,
                                      bounded_latent=bounded_latent, seed=seed, masks=config.masks,
                                      mask_density=dense, conv_mask_density=conv)

    def __init__(self, ctx: ClientContext[SimFedConfig]) -> None:
        super().__init__(ctx)
        shape = tuple(ctx.data.input_shape)
        self.criteria = criteria_inputs(ctx.seed, shape, self.config.criteria_inputs)
        self.criteria_id = criteria_set_id(ctx.seed, self.config.criteria_inputs, shape)
        self.l1 = MaskL1(self.config.lambda1)
        # The mask entries the last upload left out (|μ| ≤ mask_threshold), added back after a download so
        # that the organization never loses its own parameters.
        self.unsent: list[torch.Tensor | None] | None = None
        self.figures: dict[str, float] = {}

    def load(self, received: Received) -> None:
        """Take the personalised factors, when the aggregator sent some (never in round 1)."""
        fw = received.maybe(FactorizedWeights)
        if fw is None:
            return
        load_factors(self.ctx.model, fw, self.config.shared_factors, self.unsent)
        self.figures["received_mask_density"] = mask_density(fw)

    def terms(self) -> list[LossTerm]:
        """Cross-entropy plus λ₁·Σ‖μ‖₁ over every mask (eq. 7)."""
        if not self.config.masks or self.config.lambda1 == 0:
            return [cross_entropy]
        model = self.ctx.model
        return [cross_entropy, data_free(lambda batch, out: self.l1(model))]

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """Load the reflection, train, upload the factors, the criteria embeddings and the metrics."""
        ctx = self.ctx
        self.load(received)
        result = fit([Objective(ctx.model, self.optimizer(), self.terms())],
                     epoch_batches(ctx.train, self.config, ctx.rng(round_seed)))
        factors = encode_factors(ctx.model, self.config.mask_threshold, ctx.num_examples, self.config.shared_factors)
        self.unsent = unsent_mask(ctx.model, self.config.mask_threshold)
        self.figures["mask_density"] = mask_density(factors)
        self.figures["trained_mask_density"] = trained_mask_density(ctx.model)
        # The authors' count: what their evaluation keeps, |μ| ≥ λ1 (Factorized-FL modules/layers.py:32-37).
        self.figures["kept_mask_density"] = trained_mask_density(ctx.model, self.config.lambda1)
        z = criteria_embeddings(ctx.model, self.criteria)
        metrics = ctx.metrics(result.loss, evaluated_round=round_, extra=self.figures)
        return [factors, CriteriaEmbeddings(self.criteria_id, z), metrics]

    def deployed_model(self) -> SplitModel:
        """The model with each factorised weight W = u × v ⊕ μ written as the dense layer it computes: the
        registered architecture, so local snapshots load into it by name."""
        return densify_model(self.ctx.model)

    def evaluate(self, round_: int, received: Received) -> EvalMetrics:
        """The organization's model after its last local training."""
        return self.ctx.metrics(0.0, evaluated_round=round_ - 1, extra=self.figures)
