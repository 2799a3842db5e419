"""The mechanisms that make what an organization sends differentially private (docs/privacy.md).

* **DP-SGD** (Abadi et al. 2016) for every model trained on private examples: batches drawn by Poisson sampling
  at rate q = B/N, each example's gradient clipped to norm C, Gaussian noise of standard deviation σ·C added to
  their sum, divided by the expected batch size qN. Opacus computes the per-example gradients (its hooks,
  ``GradSampleHooks``); hetfed clips and adds the noise itself, so that gradients of data-free terms (a proximal
  or consensus penalty added after the step's gradient) stay outside the clipped sum, and so that a parameter
  whose gradient Opacus did not decompose per example stops the step instead of leaking. What a DP-trained model
  then computes (weights, heads, factors, posteriors, embeddings) is post-processing.
* **Gaussian class sums** for what is computed from the data directly (class counts, class-mean embeddings):
  each embedding clipped to norm C, Gaussian noise σ·C on each class's sum and σ on each count.

Noise and Poisson samples come from a generator the aggregator cannot know (``privacy.noise_seed``).
"""

from __future__ import annotations

import logging
import math
import secrets
import warnings
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from hetfed.client.privacy.config import PrivacyConfig
from hetfed.client.privacy.ledger import Ledger

if TYPE_CHECKING:
    from hetfed.client.training import Batch, DataSource

log = logging.getLogger("hetfed.client")

# Opacus' backward hooks on the first layer fire with no input gradient (inputs need none) and torch says so on
# every step: expected here, not a fault.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to "
                        "module outputs since no inputs require gradients", category=UserWarning)

# Relative tolerance of the check that Opacus' per-example gradients add up to the step's gradient.
_DECOMPOSITION_RTOL = 1e-3


class PrivacyError(ValueError):
    """The mechanism cannot serve this model or algorithm (said in one line, before the organization joins)."""


def prepare_model(model: nn.Module, cfg: PrivacyConfig, who: str) -> nn.Module:
    """``model`` made fit for DP-SGD: BatchNorm replaced by GroupNorm (``batchnorm = "replace"``, logged) or
    refused; any other layer Opacus cannot give per-example gradients for is refused. Returns the model to use."""
    from opacus.validators import ModuleValidator

    batchnorm = [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if batchnorm:
        if cfg.batchnorm == "refuse":
            raise PrivacyError(f"{who}'s model has BatchNorm ({', '.join(batchnorm[:3])}), which mixes the examples of "
                               "a batch so DP-SGD cannot bound one example's influence; set privacy.batchnorm = "
                               "\"replace\" to use GroupNorm instead, or give a model without BatchNorm")
        model = ModuleValidator.fix(model)
        log.info("%s: privacy: replaced BatchNorm by GroupNorm in %s (Opacus ModuleValidator.fix)", who,
                 ", ".join(batchnorm))
    # Opacus' convolution per-example gradients come out wrong on channels-last weights (the decomposition check
    # in PrivateStep caught it on rmnist_cnn), and an in-place activation rewrites what a backward hook saw.
    model = model.to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]
    for m in model.modules():
        if getattr(m, "inplace", False) is True:
            m.inplace = False  # type: ignore[assignment]
    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        raise PrivacyError(f"{who}'s model cannot be trained with DP-SGD: {' '.join(str(errors[0]).split())}")
    return model


class PrivateStep:
    """DP-SGD for the objectives of one round: per-example clipping and noise, and the ledger entry of each batch."""

    def __init__(self, sigma: float, clip_norm: float, sample_rate: float, expected_batch: float,
                 generator: torch.Generator, ledger: Ledger,
                 hooked: dict[int, tuple[nn.Module, object]] | None = None) -> None:
        self.sigma, self.clip_norm = float(sigma), float(clip_norm)
        self.q, self.expected_batch = float(sample_rate), float(expected_batch)
        self.generator, self.ledger = generator, ledger
        # Opacus' hooks by model, shared by the rounds' steps (the session removes them before an export).
        self._hooks: dict[int, tuple[nn.Module, object]] = {} if hooked is None else hooked
        # Objectives privatised on the batch being stepped (k objectives on one sample: one release of
        # sensitivity √k·C, accounted as noise multiplier σ/√k).
        self._on_batch = 0

    def _hooks_for(self, model: nn.Module) -> object:
        from opacus.grad_sample import GradSampleHooks

        key = id(model)
        if key not in self._hooks:
            try:
                hooks = GradSampleHooks(model, batch_first=True, loss_reduction="mean", strict=True)
            except (NotImplementedError, ValueError) as exc:
                raise PrivacyError(f"Opacus cannot give this model per-example gradients: "
                                   f"{' '.join(str(exc).split())}") from None
            hooks.disable_hooks()
            self._hooks[key] = (model, hooks)
        return self._hooks[key][1]

    def begin(self, model: nn.Module) -> None:
        """Before the forward pass of a private step: capture activations for per-example gradients."""
        self._hooks_for(model).enable_hooks()  # type: ignore[attr-defined]

    def end(self, model: nn.Module) -> None:
        """After the step: stop capturing (evaluation and public-data steps keep no activations)."""
        hooks = self._hooks_for(model)
        hooks.disable_hooks()  # type: ignore[attr-defined]
        for p in model.parameters():
            p.grad_sample = None  # type: ignore[attr-defined]

    def backward(self, model: nn.Module, params: Sequence[nn.Parameter], loss: torch.Tensor, size: int) -> None:
        """Set each parameter's ``grad`` to the DP-SGD estimate of ``loss``'s gradient (a mean over the batch's
        ``size`` examples): per-example gradients clipped to C, summed, plus N(0, σ²C²), over qN."""
        for p in params:
            p.grad = None
            p.grad_sample = None  # type: ignore[attr-defined]
        if size > 0:
            with warnings.catch_warnings():  # see the filter at the top: expected with Opacus' hooks
                warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
                loss.backward()
        grads = self._per_example(model, params, size)
        clipped = clip_and_sum(grads, self.clip_norm)
        for p, total in zip(params, clipped, strict=True):
            noise = torch.normal(0.0, self.sigma * self.clip_norm, size=p.shape, generator=self.generator,
                                 device=self.generator.device)
            p.grad = ((total + noise.to(total.device)) / self.expected_batch).to(p.dtype)
        self._on_batch += 1

    def _per_example(self, model: nn.Module, params: Sequence[nn.Parameter], size: int) -> list[torch.Tensor]:
        out = []
        names = {id(p): n for n, p in model.named_parameters()}
        # The per-example gradients must add up to the step's gradient: measured over all parameters, so a layer
        # whose gradient is nought up to rounding (a bias before a normalisation) does not fail it alone.
        err2, norm2, worst = 0.0, 0.0, ("", 0.0)
        for p in params:
            gs = getattr(p, "grad_sample", None)
            if size == 0:
                out.append(torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device))
                continue
            if gs is None:
                if p.grad is None:  # no gradient at all this step (a parameter the loss does not use)
                    out.append(torch.zeros((size, *p.shape), dtype=p.dtype, device=p.device))
                    continue
                raise PrivacyError(f"parameter {names.get(id(p), '?')!r} got a gradient that Opacus did not split by "
                                   "example (it is used outside its module's forward); DP-SGD cannot bound it")
            if p.grad is not None:
                err = float((gs.mean(0) - p.grad).norm())
                err2, norm2 = err2 + err**2, norm2 + float(p.grad.norm()) ** 2
                worst = max(worst, (names.get(id(p), "?"), err), key=lambda w: w[1])
            out.append(gs.detach())
        if math.sqrt(err2) > _DECOMPOSITION_RTOL * math.sqrt(norm2) + 1e-7:
            raise PrivacyError(f"parameter {worst[0]!r}: Opacus' per-example gradients do not add up to its gradient (a "
                               "term uses the parameter outside its module's forward, or a layer's hooks saw "
                               "rewritten tensors); DP-SGD cannot bound one example's influence")
        return out

    def end_batch(self) -> None:
        """After every objective stepped on a batch: account it, one Poisson-sampled Gaussian release."""
        if self._on_batch:
            self.ledger.record(self.q, self.sigma / math.sqrt(self._on_batch))
        self._on_batch = 0


def clip_and_sum(grads: Sequence[torch.Tensor], clip_norm: float) -> list[torch.Tensor]:
    """Σ_i g_i·min(1, C/‖g_i‖) per parameter, where ‖g_i‖ is example i's gradient norm over all parameters."""
    if not grads or grads[0].shape[0] == 0:
        return [torch.zeros(g.shape[1:], dtype=g.dtype, device=g.device) for g in grads]
    norms = torch.stack([g.reshape(g.shape[0], -1).norm(dim=1) for g in grads]).norm(dim=0)
    factor = (clip_norm / (norms + 1e-12)).clamp(max=1.0)
    return [torch.einsum("i,i...->...", factor.to(g.dtype), g) for g in grads]


def gaussian_class_sums(z: torch.Tensor, y: torch.Tensor, num_classes: int, clip_norm: float, sigma: float,
                        generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(noisy per-class sums [K, d], noisy per-class counts [K]), float64: each row of ``z`` clipped to norm C,
    N(0, σ²C²) on every sum entry and N(0, σ²) on every count. One example added or removed moves its class's
    sum by at most C and its count by 1: L2 sensitivity √2 in units of (C, 1), so the release is a Gaussian
    mechanism of noise multiplier σ/√2."""
    z = z.double()
    norms = z.norm(dim=1, keepdim=True)
    clipped = z * (clip_norm / (norms + 1e-12)).clamp(max=1.0)
    sums = torch.zeros(num_classes, z.shape[1], dtype=torch.float64, device=z.device).index_add_(0, y, clipped)
    counts = torch.bincount(y, minlength=num_classes).double()
    dev = generator.device
    sums = sums + torch.normal(0.0, sigma * clip_norm, size=sums.shape, generator=generator, dtype=torch.float64,
                               device=dev).to(z.device)
    counts = counts + torch.normal(0.0, sigma, size=counts.shape, generator=generator, dtype=torch.float64,
                                   device=dev).to(z.device)
    return sums, counts


def noisy_counts(counts: np.ndarray, sigma: float, generator: torch.Generator) -> np.ndarray:
    """Class counts with N(0, σ²) each (L2 sensitivity 1), rounded and floored at 0 (post-processing)."""
    noise = torch.normal(0.0, sigma, size=(len(counts),), generator=generator, dtype=torch.float64,
                         device=generator.device).cpu().numpy()
    return np.maximum(np.rint(np.asarray(counts, dtype=np.float64) + noise), 0).astype(np.int64)


def secret_generator(seed: int, parts: Sequence[int | str], device: torch.device) -> torch.Generator:
    """A generator for noise and Poisson samples: from ``seed`` and ``parts`` (a repeatable experiment), or from
    fresh OS entropy when ``seed`` is -1."""
    if seed < 0:
        value = secrets.randbits(63)
    else:
        words = [int(seed)] + [zlib.crc32(p.encode()) if isinstance(p, str) else int(p) for p in parts]
        value = int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0]) & ((1 << 63) - 1)
    gen = torch.Generator(device=device if device.type == "cuda" else "cpu")
    gen.manual_seed(value)
    return gen


class PrivateData:
    """The organization's training set under DP-SGD: the training loop draws its batches by Poisson sampling
    (each example in each batch with probability q = B/N̂, from the secret generator) and privatises every step
    on them. Any other read (``take``) is the algorithm's own, and its mechanism's business."""

    def __init__(self, data: DataSource, step: PrivateStep, num_examples: int | None = None) -> None:
        self.data = data
        self.step = step
        # N̂, the released example count: a round's number of steps is planned from it, as the ledger's plan
        # was (None: the true count, where nothing was released).
        self.num_examples = len(data) if num_examples is None else int(num_examples)

    def __len__(self) -> int:
        return len(self.data)

    @property
    def device(self) -> torch.device:
        """Where the batches are."""
        return self.data.device

    @property
    def y(self) -> torch.Tensor:
        """The labels, as the wrapped set holds them."""
        return self.data.y

    def take(self, idx: np.ndarray) -> Batch:
        """The examples at ``idx`` (not privatised: for what stays in the organization or goes through a
        mechanism of its own)."""
        return self.data.take(idx)

    def take_at(self, idx: torch.Tensor) -> Batch:
        """The examples at ``idx`` (an index tensor), as ``take``."""
        return self.data.take_at(idx)

    def batches(self, indices: Iterable[torch.Tensor | slice]) -> Iterator[Batch]:
        """Batches at ``indices``, not privatised (evaluation reads)."""
        return self.data.batches(indices)

    def poisson_batches(self, steps: int) -> Iterator[Batch]:
        """``steps`` Poisson-sampled batches, each marked for DP-SGD."""
        # Every one of the N real examples is drawn at rate q = B/N̂. q is a public parameter chosen from a DP
        # release, and the sampled Gaussian's guarantee holds at that q whatever N is.
        n = len(self.data)
        gen = self.step.generator

        def draws() -> Iterator[torch.Tensor]:
            for _ in range(steps):
                mask = torch.rand(n, generator=gen, device=gen.device) < self.step.q
                yield mask.nonzero().reshape(-1).to(self.data.device)

        for batch in self.data.batches(draws()):
            batch.private = self.step
            yield batch
