"""SimFed's factorised layers (eqs. 4-6), the mask's L1 term (eq. 7), the sparse mask codec and criteria inputs.

What the paper defines and how it is read here:

* Dense (eq. 5): W = u × v ⊕ μ with u ∈ R^{I×1}, v ∈ R^{1×O}, μ ∈ R^{I×O}. ⊕ is elementwise
  **addition**: the paper "add[s] the light-weighted sparse mask μ to the weights to additionally capture
  non-linearity", so W = u vᵀ + μ (a rank-1 matrix plus a sparse one; no multiplicative mask). The
  parameters keep the paper's orientation (μ is [I, O]); torch's nn.Linear weight is Wᵀ ([O, I]).
* Convolution (eq. 6): W = π(u′ × v′ ⊕ μ′) with u′ ∈ R^{I·F×1}, v′ ∈ R^{1×O·F}, μ′ ∈ R^{I·F×O·F} and
  π: R^{I·F×O·F} → R^{F×F×I×O}. The paper does not spell π out; here row index i·F_h + f_h and column
  index o·F_w + f_w of the matrix go to kernel entry (f_h, f_w, i, o), i.e. torch's kernel is
  ``M.reshape(I, F_h, O, F_w).permute(2, 0, 1, 3)`` ([O, I, F_h, F_w]). With this π the rank-1 part gives
  every (input, output) channel pair the rank-1 F_h×F_w filter a_i ⊗ b_o (a_i = u′[i·F_h : (i+1)·F_h],
  b_o = v′[o·F_w : (o+1)·F_w]); a plain row-major reshape would scramble channel and tap indices.
  Non-square kernels use F_h for u′ and F_w for v′; grouped convolutions use I = in_channels / groups.
* What is factorised: the paper factorises the weights of "its layers", every fully-connected and
  convolution layer of its ResNet-9; biases, normalisation layers and the head are not discussed. Here the
  encoder's nn.Linear and nn.Conv2d weights are factorised; their biases stay ordinary parameters, and
  BatchNorm layers stay as they are (both are local: the ``FactorizedLayer`` payload carries no bias). The
  head stays a dense nn.Linear: it never leaves the organization (paper §3.2, §5.1), so factorising it
  would change neither what is sent nor what is reflected.
* Initialisation: the paper factorises "before training" and says nothing about the initial values. Here
  every entry of W = u × v ⊕ μ starts with mean 0 and the variance s² of the replaced layer's initial
  weights (torch's default U(-1/√fan_in, 1/√fan_in) has s² = 1/(3·fan_in)); only these two moments match,
  the entries are neither uniform nor independent. u, v are uniform; the mask is sparse from the start:
  a share ρ (``mask_density``, default 0.1) of its entries is non-zero, and u × v and μ carry s²/2 each.
  ρ = 0 (μ = 0, u × v carries all of s²) is the most literal reading, but it starts every layer at rank 1
  (every hidden unit a multiple of one vector), and that trained markedly slower (see _init_factors).
* The L1 term λ₁·Σ_l ‖μ_l‖₁ (eq. 7) is computed on the mask parameters, so it adds λ₁·sign(μ) to their
  gradient (0 where μ = 0).
* Sending: mask entries with |μ| ≤ threshold are left off the wire (threshold 0 keeps exactly the
  non-zeros); the rest travel as flat int64 indices (row-major, strictly increasing) into the mask's shape
  plus float32 values. Decoding scatters them into zeros exactly. The sender keeps its unsent entries
  (``unsent_mask``) and adds them back to the mask it receives, so they are never lost.
* Criteria inputs (eqs. 1-2): x_N ~ N(0, 1) elementwise with the model's input shape, drawn with numpy's
  PCG64 from a seed (identical in every process and platform), never sent; z_N = E(x_N) in eval mode.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from hetfed.client.models import SplitModel, build_model
from hetfed.wire.payloads import FactorizedLayer, FactorizedWeights
from hetfed.wire.specs.simfed import decode_mask

__all__ = [
    "FactorizedConv2d",
    "FactorizedLinear",
    "MaskL1",
    "build_factorized_model",
    "criteria_embeddings",
    "criteria_inputs",
    "encode_factors",
    "encode_mask",
    "factorize_model",
    "factorized_layers",
    "load_factors",
    "mask_density",
    "trained_mask_density",
    "unsent_mask",
]

# Independent numpy streams derived from a seed: default_rng([seed, stream, ...]).
CRITERIA_STREAM = 0x51F
FACTOR_INIT_STREAM = 0x51E
# Share of each mask's entries that start non-zero (see _init_factors); 0 starts every layer at rank 1,
# which trained markedly slower in the tuning prototype (benchmarks/prototypes/simfed_tuning.py).
MASK_INIT_DENSITY = 0.1


def _init_variance(weight: torch.Tensor) -> float:
    """Variance of the replaced layer's initial weight entries (torch's default 1/(3·fan_in) if they are equal)."""
    w = weight.detach().to(torch.float64)
    var = float(w.var(unbiased=False)) if w.numel() > 1 else 0.0
    if not var > 0.0:  # a constant (e.g. zero) initial weight: fall back to torch's default U(±1/√fan_in)
        fan_in = w[0].numel() if w.ndim > 1 else 1
        var = 1.0 / (3.0 * fan_in)
    return var


def _uniform(rng: np.random.Generator, bound: float, n: int) -> torch.Tensor:
    return torch.from_numpy(rng.uniform(-bound, bound, size=n).astype(np.float32))


def _init_factors(
    layer: FactorizedLinear | FactorizedConv2d,
    weight: torch.Tensor,
    rng: np.random.Generator,
    mask_density: float,
) -> None:
    """Draw u, v (and μ) so that the entries of W = u × v ⊕ μ have mean 0 and ``weight``'s variance s².

    With ``mask_density`` ρ = 0: μ = 0 and u, v ~ U(±b), b = (3·s)^{1/2}, so Var(u_i·v_j) = s². With ρ > 0
    the variance is split in halves: u, v get b·2^{-1/4} (Var(u_i·v_j) = s²/2) and each μ entry is non-zero
    with probability ρ, drawn from U(±(3·s²/(2ρ))^{1/2}) (Var = s²/2). One numpy stream per layer.
    """
    if not 0.0 <= mask_density <= 1.0:
        raise ValueError(f"mask_density must lie in [0, 1], got {mask_density}")
    var = _init_variance(weight)
    uv_var = var if mask_density == 0.0 or layer.mask is None else var / 2.0
    bound = math.sqrt(3.0 * math.sqrt(uv_var))
    with torch.no_grad():
        layer.u.copy_(_uniform(rng, bound, layer.u.numel()))
        layer.v.copy_(_uniform(rng, bound, layer.v.numel()))
        if layer.mask is not None and mask_density > 0.0:
            shape = layer.mask_shape
            b_mu = math.sqrt(3.0 * (var - uv_var) / mask_density)
            mu = rng.uniform(-b_mu, b_mu, size=shape) * (rng.random(shape) < mask_density)
            layer.mask.copy_(torch.from_numpy(mu.astype(np.float32)))


class _Factors(nn.Module):
    """What both factorised layers hold: u (rows), v (columns), an optional mask μ [rows, columns] and an
    optional bias, with their factor matrix u × v ⊕ μ."""

    def _make_factors(self, rows: int, cols: int, outputs: int, *, bias: bool, mask: bool) -> None:
        self.u = nn.Parameter(torch.zeros(rows))
        self.v = nn.Parameter(torch.zeros(cols))
        self.mask: nn.Parameter | None
        if mask:
            self.mask = nn.Parameter(torch.zeros(rows, cols))
        else:
            self.register_parameter("mask", None)
        self.bias: nn.Parameter | None
        if bias:
            self.bias = nn.Parameter(torch.zeros(outputs))
        else:
            self.register_parameter("bias", None)

    @property
    def mask_shape(self) -> tuple[int, ...]:
        """Shape of μ: (I, O) for a dense layer, (I·F_h, O·F_w) for a convolution."""
        return (self.u.numel(), self.v.numel())

    def factor_matrix(self) -> torch.Tensor:
        """u × v ⊕ μ as a [rows, columns] matrix (the paper's W, before π for a convolution)."""
        m = torch.outer(self.u, self.v)
        return m if self.mask is None else m + self.mask

    def _take_bias(self, layer: nn.Linear | nn.Conv2d) -> None:
        """Copy the replaced layer's bias, if both have one."""
        with torch.no_grad():
            if layer.bias is not None and self.bias is not None:
                self.bias.copy_(layer.bias.detach().to(torch.float32))


class FactorizedLinear(_Factors):
    """A dense layer whose weight is W = u vᵀ + μ (eq. 5, paper orientation [I, O]); y = x W + b."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, mask: bool = True) -> None:
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self._make_factors(self.in_features, self.out_features, self.out_features, bias=bias, mask=mask)

    def dense_weight(self) -> torch.Tensor:
        """The weight in nn.Linear's layout [O, I]."""
        return self.factor_matrix().t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ-style affine map, exactly as the nn.Linear with weight :meth:`dense_weight` would compute."""
        return F.linear(x, self.dense_weight(), self.bias)

    @classmethod
    def from_linear(
        cls, layer: nn.Linear, rng: np.random.Generator, *, mask: bool = True, mask_density: float = 0.0
    ) -> FactorizedLinear:
        """Replace ``layer``: same shape and bias; u, v, μ drawn to match its weight's variance (see _init_factors)."""
        out = cls(layer.in_features, layer.out_features, bias=layer.bias is not None, mask=mask)
        _init_factors(out, layer.weight, rng, mask_density)
        out._take_bias(layer)
        return out.to(device=layer.weight.device)

    def extra_repr(self) -> str:
        """Shapes and options shown by print(model)."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, mask={self.mask is not None}"
        )


class FactorizedConv2d(_Factors):
    """A 2-D convolution whose kernel is W = π(u′ × v′ ⊕ μ′) (eq. 6), π as in the module docstring."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: tuple[int, int],
        *,
        stride: tuple[int, int] = (1, 1),
        padding: tuple[int, int] | str = (0, 0),
        dilation: tuple[int, int] = (1, 1),
        groups: int = 1,
        bias: bool = True,
        mask: bool = True,
    ) -> None:
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"channels ({in_channels}, {out_channels}) must be divisible by groups={groups}")
        self.in_channels = int(in_channels)
        self.out_channels = int(out_channels)
        self.kernel_size = (int(kernel_size[0]), int(kernel_size[1]))
        self.stride = stride
        self.padding = padding
        self.dilation = dilation
        self.groups = int(groups)
        fh, fw = self.kernel_size
        # u′ has I·F_h entries, v′ has O·F_w.
        self._make_factors((self.in_channels // self.groups) * fh, self.out_channels * fw, self.out_channels,
                           bias=bias, mask=mask)

    def dense_weight(self) -> torch.Tensor:
        """π of the factor matrix: the kernel in nn.Conv2d's layout [O, I/groups, F_h, F_w]."""
        fh, fw = self.kernel_size
        i = self.in_channels // self.groups
        return self.factor_matrix().reshape(i, fh, self.out_channels, fw).permute(2, 0, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The convolution nn.Conv2d with kernel :meth:`dense_weight` (zero padding) would compute."""
        return F.conv2d(
            x, self.dense_weight(), self.bias, self.stride, self.padding, self.dilation, self.groups
        )

    @classmethod
    def from_conv(
        cls, layer: nn.Conv2d, rng: np.random.Generator, *, mask: bool = True, mask_density: float = 0.0
    ) -> FactorizedConv2d:
        """Replace ``layer``: same geometry and bias; u′, v′, μ′ drawn to match its kernel's variance."""
        if layer.padding_mode != "zeros":
            raise ValueError(
                f"only zero-padded convolutions can be factorised, got padding_mode={layer.padding_mode!r}"
            )
        ks = layer.kernel_size
        out = cls(
            layer.in_channels,
            layer.out_channels,
            (int(ks[0]), int(ks[1])),
            stride=layer.stride,  # type: ignore[arg-type]
            padding=layer.padding,  # type: ignore[arg-type]
            dilation=layer.dilation,  # type: ignore[arg-type]
            groups=layer.groups,
            bias=layer.bias is not None,
            mask=mask,
        )
        _init_factors(out, layer.weight, rng, mask_density)
        out._take_bias(layer)
        return out.to(device=layer.weight.device)

    def extra_repr(self) -> str:
        """Geometry and options shown by print(model)."""
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, "
            f"bias={self.bias is not None}, mask={self.mask is not None}"
        )


FactorizedModule = FactorizedLinear | FactorizedConv2d


def _replace(
    module: nn.Module, prefix: str, seed: int, masks: bool, density: tuple[float, float], counter: list[int]
) -> None:
    for child_name, child in module.named_children():
        new: nn.Module | None = None
        if isinstance(child, (nn.Linear, nn.Conv2d)):
            rng = np.random.default_rng([int(seed), FACTOR_INIT_STREAM, counter[0]])
            counter[0] += 1
            if isinstance(child, nn.Linear):
                new = FactorizedLinear.from_linear(child, rng, mask=masks, mask_density=density[0])
            else:
                new = FactorizedConv2d.from_conv(child, rng, mask=masks, mask_density=density[1])
            setattr(module, child_name, new)
        elif isinstance(child, nn.modules.conv._ConvNd):
            raise ValueError(
                f"{prefix}{child_name}: only nn.Linear and nn.Conv2d can be factorised, got {type(child).__name__}"
            )
        else:
            _replace(child, f"{prefix}{child_name}.", seed, masks, density, counter)


def factorize_model(
    model: SplitModel, *, seed: int, masks: bool = True, mask_density: float = MASK_INIT_DENSITY,
    conv_mask_density: float | None = None,
) -> SplitModel:
    """A copy of ``model`` whose encoder's nn.Linear and nn.Conv2d layers are factorised; the head stays dense.

    Each replaced layer keeps its bias; u, v and μ are drawn from ``seed`` (one numpy stream per layer, in
    module order), so every process builds the same factors; ``mask_density`` is the share of μ's entries
    that start non-zero (0: μ = 0, the factorised weight starts at rank 1), in convolutions
    ``conv_mask_density`` when given (the authors' layers.py: dense masks drawn in full, convolution masks
    zero, i.e. 1 and 0). ``masks=False`` builds the
    paper's "w/o masks φ" ablation (W = u × v only). ``model`` itself is left unchanged.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    out = copy.deepcopy(model)
    counter = [0]
    conv = mask_density if conv_mask_density is None else conv_mask_density
    _replace(out.encoder, "encoder.", seed, masks, (float(mask_density), float(conv)), counter)
    if counter[0] == 0:
        raise ValueError("the model's encoder has no nn.Linear or nn.Conv2d layer to factorise")
    return out


def build_factorized_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    latent_dim: int | None = None,
    bounded_latent: bool = False,
    seed: int = 0,
    masks: bool = True,
    mask_density: float = MASK_INIT_DENSITY,
    conv_mask_density: float | None = None,
) -> SplitModel:
    """:func:`hetfed.client.models.build_model` with the encoder factorised (same seed for weights and factors)."""
    dense = build_model(
        name, input_shape, num_classes, latent_dim=latent_dim, bounded_latent=bounded_latent, seed=seed
    )
    return factorize_model(dense, seed=seed, masks=masks, mask_density=mask_density,
                           conv_mask_density=conv_mask_density)


def _densify(module: nn.Module) -> None:
    for child_name, child in module.named_children():
        if isinstance(child, (FactorizedLinear, FactorizedConv2d)):
            with torch.no_grad():
                weight = child.dense_weight().detach().clone()
                new: nn.Module
                if isinstance(child, FactorizedLinear):
                    new = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                else:
                    new = nn.Conv2d(child.in_channels, child.out_channels, child.kernel_size, stride=child.stride,
                                    padding=child.padding, dilation=child.dilation, groups=child.groups,
                                    bias=child.bias is not None)
                new = new.to(device=weight.device, dtype=weight.dtype)
                new.weight.copy_(weight)
                if child.bias is not None and new.bias is not None:
                    new.bias.copy_(child.bias.detach())
            setattr(module, child_name, new)
        else:
            _densify(child)


def densify_model(model: SplitModel) -> SplitModel:
    """A copy of ``model`` with every factorised layer replaced by the nn.Linear or nn.Conv2d of its weight W.

    The inverse of :func:`factorize_model` up to the factors: the copy computes the same function and has the
    registered architecture's parameter names, so anything that rebuilds a model by name (local snapshots, the
    gauss4 picture) loads it. ``model`` itself is left unchanged.
    """
    out = copy.deepcopy(model)
    _densify(out.encoder)
    return out


def factorized_layers(model: nn.Module) -> list[tuple[str, FactorizedModule]]:
    """The factorised layers of ``model`` with their qualified names, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (FactorizedLinear, FactorizedConv2d))]


class MaskL1(nn.Module):
    """λ₁·Σ_l ‖μ_l‖₁ over every mask of a model (eq. 7), computed on the parameters so that it has a gradient."""

    def __init__(self, lambda1: float) -> None:
        super().__init__()
        if not (lambda1 >= 0.0 and math.isfinite(lambda1)):
            raise ValueError(f"lambda1 must be a finite number >= 0, got {lambda1}")
        self.lambda1 = float(lambda1)

    def forward(self, model: nn.Module) -> torch.Tensor:
        """The penalty (a 0-dim tensor; 0 for a model without masks)."""
        masks = [layer.mask for _, layer in factorized_layers(model) if layer.mask is not None]
        if not masks:
            return torch.zeros(())
        total = masks[0].abs().sum()
        for m in masks[1:]:
            total = total + m.abs().sum()
        return self.lambda1 * total


# ------------------------------------------------------------------------------------------------------
# The sparse mask codec and the FactorizedWeights payload
# ------------------------------------------------------------------------------------------------------


def encode_mask(mask: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Flat int64 row-major indices (increasing) and float32 values of the entries with |μ| > threshold."""
    if not (threshold >= 0.0 and math.isfinite(threshold)):
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold}")
    flat = np.asarray(mask).reshape(-1)
    if not np.all(np.isfinite(flat)):
        raise ValueError("mask holds non-finite values")
    indices = np.flatnonzero(np.abs(flat) > threshold).astype(np.int64)
    return indices, flat[indices].astype(np.float32)


def mask_density(weights: FactorizedWeights) -> float:
    """Sent mask entries over all mask entries of a payload (0 when it has no mask entries)."""
    sent = sum(int(layer.mask_indices.size) for layer in weights.layers)
    total = sum(math.prod(layer.mask_shape) for layer in weights.layers)
    return sent / total if total else 0.0


def trained_mask_density(model: nn.Module, at_least: float = 0.0) -> float:
    """Mask entries that count over all mask entries of the model's factorised layers (0 without masks): the
    non-zero ones, or with ``at_least`` > 0 those with |μ| ≥ ``at_least`` (the authors' evaluation keeps those
    with |μ| ≥ λ1 and zeroes the rest, Factorized-FL modules/layers.py:32-37)."""
    masks = [layer.mask.detach() for _, layer in factorized_layers(model) if layer.mask is not None]
    total = sum(m.numel() for m in masks)
    if not total:
        return 0.0
    if at_least > 0.0:
        return sum(int(torch.count_nonzero(m.abs() >= at_least)) for m in masks) / total
    return sum(int(torch.count_nonzero(m)) for m in masks) / total


def encode_factors(model: nn.Module, threshold: float, num_examples: int = 0,
                   shared: str = "uvm") -> FactorizedWeights:
    """The ``FactorizedWeights`` payload of a model: u, v (float32) and the thresholded sparse mask of each layer.

    ``shared`` names the factors that travel ("u", "uv" or "uvm"); v is left empty and the mask without
    entries when they are not shared (the organization keeps its own).
    """
    if shared not in ("u", "uv", "uvm"):
        raise ValueError(f"shared factors must be 'u', 'uv' or 'uvm', got {shared!r}")
    layers = []
    for name, layer in factorized_layers(model):
        if layer.mask is None or "m" not in shared:
            idx, val = np.zeros(0, np.int64), np.zeros(0, np.float32)
        else:
            idx, val = encode_mask(layer.mask.detach().cpu().numpy(), threshold)
        v = layer.v.detach().cpu().to(torch.float32).numpy().copy() if "v" in shared else np.zeros(0, np.float32)
        layers.append(
            FactorizedLayer(
                name=name,
                u=layer.u.detach().cpu().to(torch.float32).numpy().copy(),
                v=v,
                mask_indices=idx,
                mask_values=val,
                mask_shape=layer.mask_shape,
            )
        )
    return FactorizedWeights(layers=tuple(layers), num_examples=int(num_examples))


def unsent_mask(model: nn.Module, threshold: float) -> list[torch.Tensor | None]:
    """Per factorised layer, the mask entries ``encode_factors`` leaves out (|μ| ≤ threshold), zeros elsewhere."""
    return [None if layer.mask is None else
            torch.where(layer.mask.detach().abs() > threshold, torch.zeros_like(layer.mask), layer.mask.detach())
            for _, layer in factorized_layers(model)]


def load_factors(model: nn.Module, weights: FactorizedWeights, shared: str = "uvm",
                 unsent: Sequence[torch.Tensor | None] | None = None) -> None:
    """Set every factorised layer's shared factors from a payload; all or nothing.

    u always; v and μ when ``shared`` names them (else the model keeps its own). The received mask is
    zero off its entries; ``unsent`` (from :func:`unsent_mask` at the last upload) is added to it, so that
    the entries this organization did not send survive the round.
    """
    if shared not in ("u", "uv", "uvm"):
        raise ValueError(f"shared factors must be 'u', 'uv' or 'uvm', got {shared!r}")
    own = dict(factorized_layers(model))
    got = {layer.name: layer for layer in weights.layers}
    if len(got) != len(weights.layers):
        raise ValueError("factorised weights name a layer twice")
    missing, unexpected = sorted(set(own) - set(got)), sorted(set(got) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"factorised weights do not match the model: missing {missing}, unexpected {unexpected}"
        )
    rests = list(unsent) if unsent is not None else [None] * len(own)
    if len(rests) != len(own):
        raise ValueError(f"{len(rests)} unsent masks for {len(own)} factorised layers")
    staged: list[tuple[FactorizedModule, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
    for (name, layer), rest in zip(own.items(), rests, strict=True):
        sent = got[name]
        u, v = np.asarray(sent.u), np.asarray(sent.v)
        v_shape = tuple(layer.v.shape) if "v" in shared else (0,)
        if u.shape != tuple(layer.u.shape) or v.shape != v_shape:
            raise ValueError(
                f"{name}: u, v have shapes {u.shape}, {v.shape}; expected {tuple(layer.u.shape)}, {v_shape}"
            )
        if not (np.all(np.isfinite(u)) and np.all(np.isfinite(v))):
            raise ValueError(f"{name}: u or v holds non-finite values")
        if tuple(sent.mask_shape) != layer.mask_shape:
            raise ValueError(f"{name}: mask shape {tuple(sent.mask_shape)}, expected {layer.mask_shape}")
        mask: torch.Tensor | None = None
        if layer.mask is not None and "m" in shared:
            mask = torch.from_numpy(decode_mask(sent.mask_indices, sent.mask_values, layer.mask_shape))
            if rest is not None:
                mask = mask + rest.to(mask.device)
        elif np.asarray(sent.mask_indices).size:
            raise ValueError(
                f"{name}: the model takes no mask but {np.asarray(sent.mask_indices).size} mask entries came"
            )
        v_t = torch.from_numpy(v.astype(np.float32)) if "v" in shared else None
        staged.append((layer, torch.from_numpy(u.astype(np.float32)), v_t, mask))
    with torch.no_grad():
        for layer, u_t, v_t, m_t in staged:
            layer.u.copy_(u_t)
            if v_t is not None:
                layer.v.copy_(v_t)
            if layer.mask is not None and m_t is not None:
                layer.mask.copy_(m_t)


# ------------------------------------------------------------------------------------------------------
# Criteria inputs (eqs. 1-2)
# ------------------------------------------------------------------------------------------------------


def criteria_inputs(seed: int, input_shape: Sequence[int], count: int = 1) -> torch.Tensor:
    """x_N: ``count`` float32 inputs of ``input_shape`` with N(0, 1) entries, the same in every process for a seed."""
    shape = tuple(int(s) for s in input_shape)
    if seed < 0:
        raise ValueError(f"criteria seed must be >= 0, got {seed}")
    if count < 1 or not shape or any(s < 1 for s in shape):
        raise ValueError(f"need count >= 1 and a positive input shape, got {count} and {shape}")
    rng = np.random.default_rng([int(seed), CRITERIA_STREAM])
    return torch.from_numpy(rng.standard_normal((count, *shape)).astype(np.float32))


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def criteria_embeddings(model: SplitModel, inputs: torch.Tensor) -> np.ndarray:
    """z_N = E(x_N) as float32 [B, D], computed in eval mode without gradient (the model's mode is restored)."""
    device = next(model.parameters()).device
    with _eval_mode(model), torch.no_grad():
        z = model.embed(inputs.to(device))
    return z.detach().cpu().to(torch.float32).reshape(z.shape[0], -1).numpy().copy()
