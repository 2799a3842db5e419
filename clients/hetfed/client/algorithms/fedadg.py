"""FedADG's client half (Zhang et al., arXiv:2111.10487): per-class adversarial alignment of the features to a
reference distribution that a federated generator produces from noise.

The organization's model is F (its encoder, the features z) and C (its head). Beside it the half keeps G, the
distribution generator ``Linear(noise + K, h) → LeakyReLU → Linear(h, d) [→ ReLU]`` whose weights are federated,
and D, the discriminator ``Linear(d, p, no bias)``, the label code appended, ``→ Linear(p + K, q) → LeakyReLU →
Linear(q, 1) → Sigmoid``, that never leaves. G and D read the label as a one-hot code scaled by
``label_value``; the noise is uniform on [0, 1).

A round, as the authors' code runs it (wzml/FedADG, pacs-ours/localTrain.py): take the global F, C and G; E0
epochs of F and C on the label-smoothed cross-entropy; then E1 epochs in which every batch takes three steps in
order, on one draw of noise ξ:

1. D: mean (1 − D(G(ξ, y), y))² + D(F(x), y)², with F in eval mode and neither F nor G moved (lines 77-87);
2. F and C: α·CE_ε(C(F(x)), y) + (1 − α)·mean (1 − D(F(x), y))², against the D just stepped (lines 89-98);
3. G: mean D(G(ξ, y), y)², the same ξ (lines 100-106).

Then F, C and G go up in one ModelWeights (G's tensors under ``generator.*``); D and its optimiser stay.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections import OrderedDict
from typing import ClassVar

import torch
from torch import nn

from hetfed.client.algorithms.base import ClientContext
from hetfed.client.algorithms.fedavg import ModelAveragingClient, shared_state
from hetfed.client.training import (
    Batch,
    Forward,
    LossTerm,
    Objective,
    epoch_batches,
    eval_mode,
    fit,
    make_optimizer,
    plain_forward,
    trainable,
)
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import ModelWeights, Payload, PayloadKind, Received
from hetfed.wire.specs import TrainConfig, fedadg
from hetfed.wire.specs.fedadg import GENERATOR_PREFIX, FedADGConfig

__all__ = ["Discriminator", "DistributionGenerator", "FedADGClient", "alignment_loss", "discriminator_loss",
           "generator_loss", "label_code", "smoothed_cross_entropy"]


def _seed(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


# ------------------------------------------------------------------------------------------------ the losses
def label_code(y: torch.Tensor, num_classes: int, value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The one-hot code of ``y`` with ``value`` at the label (pacs-ours/localTrain.py:80-81: 0.7)."""
    code = torch.zeros(y.shape[0], num_classes, dtype=dtype, device=y.device)
    return code.scatter_(1, y.view(-1, 1), value)


def smoothed_cross_entropy(logits: torch.Tensor, y: torch.Tensor, smoothing: float) -> torch.Tensor:
    """mean_b −Σ_k q_bk log softmax(logits_b)_k with q_b,y = 1 − ε and q_b,k = ε/(K − 1) elsewhere: the reference
    code's LabelSmoothingLoss (utils/utilss.py:6-21), whose true class gets 1 − ε (torch's gets 1 − ε + ε/K)."""
    k = logits.shape[1]
    if k < 2:
        raise ValueError(f"label smoothing needs at least 2 classes, got {k}")
    log_p = torch.log_softmax(logits, dim=1)
    q = torch.full_like(log_p, smoothing / (k - 1)).scatter_(1, y.view(-1, 1), 1.0 - smoothing)
    return -(q * log_p).sum(dim=1).mean()


def discriminator_loss(d_reference: torch.Tensor, d_features: torch.Tensor) -> torch.Tensor:
    """D's least-squares loss, mean (1 − D(reference))² + D(features)²: the reference is D's "real" (1), the
    features its "fake" (0) (pacs-ours/localTrain.py:84)."""
    return torch.mean((1 - d_reference) ** 2 + d_features ** 2)


def alignment_loss(d_features: torch.Tensor) -> torch.Tensor:
    """F's adversarial term, mean (1 − D(features))²: features D takes for the reference (localTrain.py:95)."""
    return torch.mean((1 - d_features) ** 2)


def generator_loss(d_reference: torch.Tensor) -> torch.Tensor:
    """G's term, mean D(reference)²: a reference D takes for the features, so the reference moves toward the
    organizations' features as they move toward it (localTrain.py:104)."""
    return torch.mean(d_reference ** 2)


# ------------------------------------------------------------------------------------------------ the modules
class DistributionGenerator(nn.Module):
    """G: ``Linear(noise + K, hidden) → LeakyReLU → Linear(hidden, feature) [→ ReLU]`` on [ξ, code]; its weights
    Xavier-uniform with gain 0.5, its biases PyTorch's default (pacs-ours/Nets.py:7-30)."""

    def __init__(self, noise_dim: int, num_classes: int, hidden: int, feature_dim: int, *, relu: bool) -> None:
        super().__init__()
        layers: list[tuple[str, nn.Module]] = [("fc1", nn.Linear(noise_dim + num_classes, hidden)),
                                               ("relu1", nn.LeakyReLU()), ("fc2", nn.Linear(hidden, feature_dim))]
        if relu:
            layers.append(("relu2", nn.ReLU()))
        self.net = nn.Sequential(OrderedDict(layers))
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                nn.init.xavier_uniform_(layer.weight, 0.5)

    def forward(self, noise: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        """Reference features of shape (B, feature_dim)."""
        out: torch.Tensor = self.net(torch.cat([noise, code], dim=1))
        return out


class Discriminator(nn.Module):
    """D: ``Linear(feature, projection, no bias)`` on z, the label code appended to its output, then
    ``Linear(projection + K, hidden) → LeakyReLU → Linear(hidden, 1) → Sigmoid`` (pacs-ours/Nets.py:109-133).
    Every weight is Kaiming-uniform (``initialize_params``, Nets.py:135-140, which also overwrites the
    projection's division by its norm at Nets.py:121-122), the biases PyTorch's default; the projection trains
    with the rest, as D's optimiser there takes every parameter (train.py:70)."""

    def __init__(self, feature_dim: int, num_classes: int, projection_dim: int, hidden: int) -> None:
        super().__init__()
        self.projection = nn.Linear(feature_dim, projection_dim, bias=False)
        self.net = nn.Sequential(nn.Linear(projection_dim + num_classes, hidden), nn.LeakyReLU(), nn.Linear(hidden, 1),
                                 nn.Sigmoid())
        for layer in self.modules():
            if isinstance(layer, nn.Linear):
                nn.init.kaiming_uniform_(layer.weight)

    def forward(self, z: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        """The probability that each (z, y) comes from the reference distribution, shape (B,)."""
        out: torch.Tensor = self.net(torch.cat([self.projection(z.flatten(1)), code], dim=1))
        return out.squeeze(1)


def _seeded(seed: int, build: type[nn.Module], *args: object, **kwargs: object) -> nn.Module:
    """``build(*args, **kwargs)`` with PyTorch's CPU generator seeded by ``seed`` (and restored after)."""
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.default_generator.manual_seed(seed)
        return build(*args, **kwargs)


# ------------------------------------------------------------------------------------------------ the half
@fedadg.SPEC.client_half
class FedADGClient(ModelAveragingClient[FedADGConfig]):
    """E0 epochs of F and C, then E1 epochs of the D, F+C and G steps per batch; F, C and G sent, D kept."""

    # The discriminator and the generator's reference train outside DP-SGD's per-example clipping, and the
    # generator's weights are sent: this half does not serve [privacy].
    privacy_mechanism: ClassVar[str | None] = None  # type: ignore[assignment]  # FedAvg's half types it str
    # G is loaded from the global model each round but is kept for a restart before round 1's download; D and
    # its optimiser are the organization's own from round to round (pacs-ours/train.py:67-72, 90).
    private_attributes = ("generator", "discriminator", "discriminator_optimizer")

    def __init__(self, ctx: ClientContext[FedADGConfig]) -> None:
        super().__init__(ctx)
        cfg, model = self.config, ctx.model
        k, d = model.num_classes, model.latent_dim
        # G starts the same in every organization (the run's seed alone), as the global model does; each D its own.
        self.generator = _seeded(_seed(ctx.seed, "generator"), DistributionGenerator, cfg.noise_dim, k,
                                 cfg.generator_hidden, d, relu=cfg.generator_relu).to(ctx.device)
        self.discriminator = _seeded(_seed(ctx.seed, ctx.organization, "discriminator"), Discriminator, d, k,
                                     cfg.projection_dim, cfg.discriminator_hidden).to(ctx.device)
        # D's SGD is built once and kept, momentum included, whatever keep_optimizer_state says (train.py:70-72).
        self.discriminator_optimizer = make_optimizer(list(self.discriminator.parameters()),
                                                      self.optimizer_config("discriminator"))
        self._noise: torch.Tensor | None = None
        self._noise_source: torch.Generator | None = None

    # ------------------------------------------------------------------------------------------- the wire
    def generator_state(self) -> dict[str, torch.Tensor]:
        """G's tensors by wire name."""
        return {GENERATOR_PREFIX + k: v for k, v in self.generator.state_dict().items()}

    def declarations(self, wire_dtype: str | None) -> list[DeclaredTensor]:
        """F's and C's shared state, and G's tensors: the schema fixed at Join (no D tensor, so none can go up)."""
        return [*super().declarations(wire_dtype),
                *(DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, k, v.detach().cpu().numpy(), wire_dtype)
                  for k, v in self.generator_state().items())]

    def load(self, received: Received) -> None:
        """Take the global F, C and G, when the aggregator sent them (round 1 starts from the run seed)."""
        mw = received.maybe(ModelWeights)
        if mw is None:
            return
        targets = {**shared_state(self.ctx.model), **self.generator_state()}
        unexpected = sorted(set(mw.tensors) - set(targets))
        if unexpected:
            raise ValueError(f"the global model carries tensors this organization does not have: {unexpected[:5]}")
        with torch.no_grad():
            for name, arr in mw.tensors.items():
                targets[name].copy_(torch.from_numpy(arr.astype("float32", copy=True)))

    def upload(self) -> ModelWeights:
        """The trained F's and C's shared state and G's tensors."""
        tensors = {k: v.detach().cpu().numpy() for k, v in {**shared_state(self.ctx.model),
                                                             **self.generator_state()}.items()}
        return ModelWeights(tensors, self.ctx.num_examples)

    # ------------------------------------------------------------------------------------------ training
    def optimized(self) -> dict[str, list[nn.Parameter]]:
        """``task`` over F's and C's trainable parameters, ``generator_optimizer`` over G's (D's is kept apart)."""
        return {"task": trainable(self.ctx.model), "generator_optimizer": list(self.generator.parameters())}

    def optimizer_config(self, name: str) -> TrainConfig:
        """F and C step at ``lr`` (lr0), G and D at ``adversarial_lr`` (lr1); one momentum and decay for all."""
        if name == "task":
            return self.config
        return dataclasses.replace(self.config, lr=self.config.adversarial_lr)

    def code(self, y: torch.Tensor) -> torch.Tensor:
        """The label code G and D read."""
        return label_code(y, self.ctx.model.num_classes, self.config.label_value)

    def discriminator_forward(self, discriminator: nn.Module, batch: Batch) -> Forward:
        """Draw this batch's ξ; D on G(ξ, y) and on F(x), neither of them moved by D's step (F in eval mode)."""
        assert self._noise_source is not None
        code = self.code(batch.y)
        self._noise = torch.rand(batch.y.shape[0], self.config.noise_dim, generator=self._noise_source,
                                 device=self._noise_source.device)
        with torch.no_grad(), eval_mode(self.ctx.model):
            features = self.ctx.model.embed(batch.x)
            reference = self.generator(self._noise, code)
        d_reference = discriminator(reference, code)
        return Forward(d_reference, {"d_reference": d_reference, "d_features": discriminator(features, code)})

    def task_forward(self, model: nn.Module, batch: Batch) -> Forward:
        """C's logits on F(x), and D's output on F(x) (D in eval mode)."""
        features = self.ctx.model.embed(batch.x)
        with eval_mode(self.discriminator):
            d_features = self.discriminator(features, self.code(batch.y))
        return Forward(self.ctx.model.head(features), {"d_features": d_features})

    def generator_forward(self, generator: nn.Module, batch: Batch) -> Forward:
        """D's output on G(ξ, y), on the ξ the batch's D step drew."""
        assert self._noise is not None
        code = self.code(batch.y)
        with eval_mode(self.discriminator):
            d_reference = self.discriminator(generator(self._noise, code), code)
        return Forward(d_reference, {"d_reference": d_reference})

    def classification(self) -> LossTerm:
        """CE_ε: the label-smoothed cross-entropy."""
        smoothing = self.config.label_smoothing
        return lambda batch, out: smoothed_cross_entropy(out.logits, batch.y, smoothing)

    def task_terms(self) -> list[LossTerm]:
        """α·CE_ε + (1 − α)·mean (1 − D(F(x), y))²."""
        alpha, ce = self.config.alpha, self.classification()
        return [lambda batch, out: alpha * ce(batch, out),
                lambda batch, out: (1 - alpha) * alignment_loss(out["d_features"])]

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """Evaluate the received global model, then E0 classifier epochs and E1 adversarial epochs; upload F, C
        and G. The reported loss is F and C's objective, averaged over every step of the round."""
        ctx, cfg = self.ctx, self.config
        self.load(received)
        before = self.measure(round_ - 1)
        rng = ctx.rng(round_seed)
        self._noise_source = torch.Generator(device=ctx.device)
        self._noise_source.manual_seed(_seed(ctx.seed, round_seed, ctx.organization, "noise"))
        task = self.optimizer("task")  # one SGD for both phases, its momentum carried from E0 into E1
        warm = None
        if cfg.classifier_epochs:
            schedule = TrainConfig(local_epochs=cfg.classifier_epochs, batch_size=cfg.batch_size)
            warm = fit([Objective(ctx.model, task, [self.classification()], plain_forward)],
                       epoch_batches(ctx.train, schedule, rng))
        adversarial = fit([
            Objective(self.discriminator, self.discriminator_optimizer,
                      [lambda batch, out: discriminator_loss(out["d_reference"], out["d_features"])],
                      self.discriminator_forward, kept=True),
            Objective(ctx.model, task, self.task_terms(), self.task_forward),
            Objective(self.generator, self.optimizer("generator_optimizer"),
                      [lambda batch, out: generator_loss(out["d_reference"])], self.generator_forward),
        ], epoch_batches(ctx.train, cfg, rng))
        steps = adversarial.steps + (warm.steps if warm is not None else 0)
        total = adversarial.losses[1] * adversarial.steps + (warm.loss * warm.steps if warm is not None else 0.0)
        self._noise = self._noise_source = None
        return [self.upload(), dataclasses.replace(before, train_loss=total / steps if steps else 0.0)]
