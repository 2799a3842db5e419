"""FedSR's probabilistic representation, its sampled prediction and its two regularisers (L2R, CMI).

Design of the probabilistic model (any registered architecture can be made probabilistic): an encoder
producing a flat feature of width d feeds ``Linear(d, 2·z_dim)``; the first half of its output is μ, the
second half ``raw`` gives σ = softplus(raw) + ε. z = μ + σ⊙ε' with ε' ~ N(0, I) (one sample in training)
and the classifier is ``Linear(z_dim, num_classes)`` on z. :func:`build_probabilistic_model` builds the
encoder with a registry builder ``(input_shape, latent_dim, bounded)`` and, when that encoder ends in a
bare ``nn.Linear`` (a projection with no activation, as the paper's Rotated MNIST network and the
reference code's backbones do), drops that projection so that the new ``Linear(d, 2·z_dim)`` takes its
place: the probabilistic network then has exactly the deterministic network's depth, the reference
code's construction (atuannguyen/FedSR: src/methods/base.py widens the backbone's last layer to
2·z_dim). An encoder that ends in an activation (ReLU or Sigmoid) keeps it, and the new layer is added on
its latent of width ``latent_dim``. A builder that returns a whole model (an ``encoder`` and its own linear
``head``, as ``build_model`` accepts) keeps its head as the classifier on z (``rmnist_dirt``: DIRT's
classifier on relu(z)); otherwise the classifier is a fresh ``Linear(z_dim, num_classes)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from hetfed.client.models import EncoderBuilder, SplitModel, split_whole

__all__ = [
    "DEFAULT_NUM_SAMPLES",
    "SIGMA_EPS",
    "CMITerm",
    "L2RTerm",
    "ProbabilisticOutput",
    "ProbabilisticSplitModel",
    "build_probabilistic_model",
    "gaussian_kl",
    "l2_norm_penalty",
    "predict_proba",
]

SIGMA_EPS = 1e-4
"""ε in σ = softplus(raw) + ε (and in r_σ): keeps log σ finite; the reference code uses no ε (0)."""

DEFAULT_NUM_SAMPLES = 20
"""z samples averaged at prediction time (the reference code's ``num_samples``)."""


class ProbabilisticOutput(NamedTuple):
    """One stochastic forward pass: logits of the sample z, and the distribution N(μ, σ²) it was drawn from."""

    logits: torch.Tensor
    z: torch.Tensor
    mu: torch.Tensor
    sigma: torch.Tensor


def _positive_sigma(raw: torch.Tensor, eps: float) -> torch.Tensor:
    return F.softplus(raw) + eps


class ProbabilisticSplitModel(SplitModel):
    """Encoder feature (width d) → Linear(d, 2·z_dim) → N(μ, σ²); a linear classifier on z = μ + σ⊙ε.

    A ``SplitModel`` whose ``latent_dim`` is z_dim, whose ``head`` is the classifier on z and whose ``embed``
    is the mean μ(x); its ``encoder`` is the feature trunk before the Gaussian's parameters.
    """

    def __init__(self, encoder: nn.Module, feature_dim: int, z_dim: int, num_classes: int, *,
                 sigma_eps: float = SIGMA_EPS) -> None:
        if feature_dim < 1 or z_dim < 1 or num_classes < 1:
            raise ValueError(f"feature_dim, z_dim and num_classes must be >= 1, got {feature_dim}, {z_dim}, "
                             f"{num_classes}")
        if sigma_eps < 0:
            raise ValueError(f"sigma_eps must be >= 0, got {sigma_eps}")
        super().__init__(encoder, z_dim, num_classes)  # the classifier head: Linear(z_dim, num_classes)
        self.feature_dim = int(feature_dim)
        self.z_dim = int(z_dim)
        self.sigma_eps = float(sigma_eps)
        self.to_params = nn.Linear(self.feature_dim, 2 * self.z_dim)

    def distribution(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(μ, σ) of p(z|x), each of shape (B, z_dim), σ = softplus(raw) + ε."""
        params = self.to_params(self.encoder(x))
        mu, raw = params.split(self.z_dim, dim=1)
        return mu, _positive_sigma(raw, self.sigma_eps)

    def forward_sample(self, x: torch.Tensor, generator: torch.Generator | None = None) -> ProbabilisticOutput:
        """One reparameterised sample z = μ + σ⊙ε per input (ε from ``generator``, else torch's global RNG)."""
        mu, sigma = self.distribution(x)
        noise = torch.randn(mu.shape, generator=generator, dtype=mu.dtype, device=mu.device)
        z = mu + sigma * noise
        return ProbabilisticOutput(self.head(z), z, mu, sigma)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, num_classes) of one sample z per input (use :func:`predict_proba` to predict)."""
        return self.forward_sample(x).logits

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The mean μ(x) of p(z|x), shape (B, z_dim): the deterministic representation for pictures."""
        return self.distribution(x)[0]


def _drop_final_projection(encoder: nn.Module) -> tuple[nn.Module, int] | None:
    if isinstance(encoder, nn.Sequential) and len(encoder) > 1 and type(encoder[-1]) is nn.Linear:
        last = encoder[-1]
        return nn.Sequential(*list(encoder)[:-1]), int(last.in_features)
    return None


def build_probabilistic_model(builder: EncoderBuilder, input_shape: tuple[int, ...], z_dim: int,
                              num_classes: int, *, seed: int = 0,
                              sigma_eps: float = SIGMA_EPS) -> ProbabilisticSplitModel:
    """Make a registry encoder probabilistic (see the module docstring), weights fixed by ``seed``, CPU.

    The global torch RNG state is left as it was.
    """
    shape = tuple(int(s) for s in input_shape)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.default_generator.manual_seed(int(seed))
        encoder, head = split_whole(builder(shape, int(z_dim), False))
        dropped = _drop_final_projection(encoder)
        trunk, width = dropped if dropped is not None else (encoder, int(z_dim))
        model = ProbabilisticSplitModel(trunk, width, z_dim, num_classes, sigma_eps=sigma_eps)
    if head is not None:  # the builder's own classifier on z (drawn before the fresh one it replaces)
        if (head.in_features, head.out_features) != (int(z_dim), int(num_classes)):
            raise ValueError(f"the builder's head is Linear({head.in_features}, {head.out_features}), the "
                             f"probabilistic model needs Linear(z_dim={z_dim}, num_classes={num_classes})")
        model.head = head
    return model


def predict_proba(model: ProbabilisticSplitModel, x: torch.Tensor, *, num_samples: int = DEFAULT_NUM_SAMPLES,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """p̂(y|x) ≈ mean over ``num_samples`` draws z ~ p(z|x) of softmax(head(z)) (eq. 5), shape (B, C).

    The noise is one ``randn((num_samples, B, z_dim), generator=...)`` call, so a seeded generator
    makes the prediction reproducible. Call it in eval mode (batch-norm running statistics).
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    mu, sigma = model.distribution(x)
    noise = torch.randn((num_samples, *mu.shape), generator=generator, dtype=mu.dtype, device=mu.device)
    z = mu.unsqueeze(0) + sigma.unsqueeze(0) * noise
    return F.softmax(model.head(z), dim=-1).mean(dim=0)


def l2_norm_penalty(z: torch.Tensor, *, squared: bool = True) -> torch.Tensor:
    """mean_b ‖z_b‖² (eq. 11), or mean_b ‖z_b‖ with ``squared=False`` (the reference code's form)."""
    if z.dim() != 2:
        raise ValueError(f"z must have shape (batch, z_dim), got {tuple(z.shape)}")
    sq = z.pow(2).sum(dim=1)
    return (sq if squared else sq.sqrt()).mean()


class L2RTerm(nn.Module):
    """FedSR's L2R: α_L2R · mean_b ‖z_b‖² (eq. 11); ``squared=False`` is the reference code's α·mean_b ‖z_b‖."""

    def __init__(self, alpha: float, *, squared: bool = True) -> None:
        super().__init__()
        if alpha < 0:
            raise ValueError(f"alpha_l2r must be >= 0, got {alpha}")
        self.alpha = float(alpha)
        self.squared = bool(squared)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """The weighted penalty of a batch of representations (samples z, or a deterministic encoder's output)."""
        return self.alpha * l2_norm_penalty(z, squared=self.squared)

    def per_example(self, z: torch.Tensor) -> torch.Tensor:
        """Each representation's penalty α·‖z_b‖² (or α·‖z_b‖), a tensor [n] whose mean is ``forward``'s value."""
        if z.dim() != 2:
            raise ValueError(f"z must have shape (batch, z_dim), got {tuple(z.shape)}")
        sq = z.pow(2).sum(dim=1)
        return self.alpha * (sq if self.squared else sq.sqrt())


def gaussian_kl(mu_q: torch.Tensor, sigma_q: torch.Tensor, mu_p: torch.Tensor,
                sigma_p: torch.Tensor) -> torch.Tensor:
    """KL(N(μ_q, σ_q²) ‖ N(μ_p, σ_p²)) of diagonal Gaussians, summed over the last dimension (supp. eq. 46)."""
    per_dim = (torch.log(sigma_p) - torch.log(sigma_q)
               + (sigma_q.pow(2) + (mu_q - mu_p).pow(2)) / (2.0 * sigma_p.pow(2)) - 0.5)
    return per_dim.sum(dim=-1)


class CMITerm(nn.Module):
    """FedSR's CMI bound: α_CMI · mean_b KL(N(μ_b, σ_b²) ‖ N(r_μ[y_b], r_σ[y_b]²)) (eq. 18), r learnable.

    r_μ (C × z_dim, initialised to 0) and r_σ = softplus(r_σ_raw) + ε (r_σ_raw initialised to
    ``r_sigma_raw_init``, 1.0 as in the reference code, so r_σ starts at softplus(1) ≈ 1.313) are this
    module's parameters. ``learnable_scale=True`` adds the reference code's scalar C (initialised to 1)
    that multiplies μ and σ inside the KL only; the paper has no C.
    """

    def __init__(self, alpha: float, num_classes: int, z_dim: int, *, learnable_scale: bool = False,
                 r_sigma_raw_init: float = 1.0, sigma_eps: float = SIGMA_EPS) -> None:
        super().__init__()
        if alpha < 0:
            raise ValueError(f"alpha_cmi must be >= 0, got {alpha}")
        if num_classes < 1 or z_dim < 1:
            raise ValueError(f"num_classes and z_dim must be >= 1, got {num_classes}, {z_dim}")
        if sigma_eps < 0:
            raise ValueError(f"sigma_eps must be >= 0, got {sigma_eps}")
        self.alpha = float(alpha)
        self.num_classes = int(num_classes)
        self.sigma_eps = float(sigma_eps)
        self.r_mu = nn.Parameter(torch.zeros(self.num_classes, int(z_dim)))
        self.r_sigma_raw = nn.Parameter(torch.full((self.num_classes, int(z_dim)), float(r_sigma_raw_init)))
        self.scale: nn.Parameter | None = nn.Parameter(torch.ones(())) if learnable_scale else None

    def r_sigma(self) -> torch.Tensor:
        """The reference standard deviations softplus(r_σ_raw) + ε, shape (C, z_dim)."""
        return _positive_sigma(self.r_sigma_raw, self.sigma_eps)

    def kl(self, mu: torch.Tensor, sigma: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-example KL(N(μ_b, σ_b²) ‖ r(z|y_b)), shape (B,), with the scale C applied when learnable."""
        if mu.shape != sigma.shape or mu.dim() != 2 or mu.shape[1] != self.r_mu.shape[1]:
            raise ValueError(f"mu and sigma must both have shape (batch, {self.r_mu.shape[1]}), "
                             f"got {tuple(mu.shape)} and {tuple(sigma.shape)}")
        if labels.shape != mu.shape[:1]:
            raise ValueError(f"labels must have shape ({mu.shape[0]},), got {tuple(labels.shape)}")
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= self.num_classes):
            raise ValueError(f"labels must lie in [0, {self.num_classes}), got {labels.min()}..{labels.max()}")
        if self.scale is not None:
            mu, sigma = mu * self.scale, sigma * self.scale
        r_mu = self.r_mu[labels].to(mu.dtype)
        r_sigma = self.r_sigma()[labels].to(mu.dtype)
        return gaussian_kl(mu, sigma, r_mu, r_sigma)

    def forward(self, mu: torch.Tensor, sigma: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """α_CMI times the batch mean of the per-example KL."""
        return self.alpha * self.kl(mu, sigma, labels).mean()
