"""The mechanisms that make what an organization sends differentially private (docs/privacy.md).

* **DP-SGD** (Abadi et al. 2016) for every model trained on private examples: batches drawn by Poisson sampling
  at rate q = B/N, each example's gradient clipped to norm C, Gaussian noise of standard deviation σ·C added to
  their sum, divided by the expected batch size qN. Every term of a private objective gives one value per
  example, and the step backpropagates their sum, so example i's gradient is that of its own terms alone,
  whatever else the sample holds. Opacus computes the per-example gradients (its hooks, ``GradSampleHooks``,
  at sum reduction); hetfed clips and adds the noise itself, so that gradients of data-free terms (a proximal
  or consensus penalty added after the step's gradient) stay outside the clipped sum, and so that a parameter
  whose gradient Opacus did not decompose per example stops the step instead of leaking. What a DP-trained model
  then computes (weights, heads, factors, posteriors, embeddings) is post-processing.
* **Gaussian class sums** for what is computed from the data directly (class counts, class-mean embeddings):
  each embedding clipped to norm C, Gaussian noise σ·C on each class's sum and σ on each count.

Under ``privacy.unit = "group"`` DP-SGD samples whole groups (a patient's examples) at rate q, sums each sampled
group's per-example gradients, clips that sum to C and divides by the expected number of groups qG (user-level
DP-SGD: McMahan, Ramage, Talwar and Zhang 2018).

Noise and Poisson samples come from a generator the aggregator cannot know (``privacy.noise_seed``); under
``privacy.secure_mode`` from a ChaCha20 keystream keyed from ``os.urandom`` (``SecureGenerator``).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import warnings
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from hetfed.client.errors import PrivacyError
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


# ------------------------------------------------------------------------------------------------ secure mode
# Opacus' secure mode draws each noise tensor as the sum of 4 Gaussians of the target standard deviation, divided by
# 2 (opacus 1.6.0, optimizers/optimizer.py lines 143-159, ``_generate_noise``), after Holohan and Braghin 2021,
# section 5.1, with n = 2: an attack on the floating-point Gaussian sampler (Mironov 2012) then has to undo 2n
# draws instead of one, which costs 2^(p(2n-1)) work for p = 53 mantissa bits instead of 2^p.
GUARD_DRAWS = 4
# Bytes of ChaCha20 keystream one nonce may give: its block counter has 32 bits of 64-byte blocks.
_CHACHA_LIMIT = 64 << 32


class ChaChaStream:
    """Random bytes from a ChaCha20 keystream (``cryptography``'s, OpenSSL's) under a 256-bit key from os.urandom.

    Every call takes its own nonce (a call counter), so no keystream byte is used twice under one key."""

    def __init__(self) -> None:
        self._key = os.urandom(32)
        self._calls = 0

    def __call__(self, n: int) -> bytes:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

        if n > _CHACHA_LIMIT:
            raise ValueError(f"one draw of {n} random bytes exceeds a ChaCha20 nonce's {_CHACHA_LIMIT}")
        # cryptography's 16-byte ChaCha20 nonce: a 4-byte little-endian block counter (from 0), then 12 bytes.
        nonce = bytes(4) + self._calls.to_bytes(12, "little")
        self._calls += 1
        return Cipher(algorithms.ChaCha20(self._key, nonce), mode=None).encryptor().update(bytes(n))


def uniforms(raw: bytes) -> np.ndarray:
    """Each 8 bytes of ``raw`` as a float64 uniform on (0, 1]: (k + 1)·2^-53 for k the word's top 53 bits. Every
    value is exact in float64 and 0 never comes out, so log(u) is finite."""
    words = np.frombuffer(raw, dtype="<u8") >> np.uint64(11)
    return (words.astype(np.float64) + 1.0) * 2.0**-53


def box_muller(u1: np.ndarray, u2: np.ndarray) -> np.ndarray:
    """Box and Muller (1958): with u1, u2 independent uniforms on (0, 1], √(−2 ln u1)·cos(2πu2) and
    √(−2 ln u1)·sin(2πu2) are independent standard Gaussians (exactly, in real arithmetic). Both halves, in turn."""
    r = np.sqrt(-2.0 * np.log(u1))
    theta = 2.0 * math.pi * u2
    return np.concatenate([r * np.cos(theta), r * np.sin(theta)])


def guarded_gaussian(standard: Callable[[int], np.ndarray], std: float, n: int) -> np.ndarray:
    """``n`` draws of N(0, std²) as Opacus' secure mode makes them: the sum of GUARD_DRAWS = 4 independent
    standard Gaussian draws of ``standard``, times std/2, so the variance is 4·(std/2)² = std² by construction."""
    total = np.zeros(n, dtype=np.float64)
    for _ in range(GUARD_DRAWS):
        total += standard(n)
    return total * (std / math.sqrt(GUARD_DRAWS))


class SecureGenerator:
    """Noise and samples for ``privacy.secure_mode``: uniforms, permutations and guarded Gaussians (float64, on the
    CPU) from a cryptographically secure byte source, by default a fresh ``ChaChaStream``. Not seedable: a test
    passes its own ``source`` of bytes."""

    # Where its draws are made; callers move them to the data's device.
    device = torch.device("cpu")

    def __init__(self, source: Callable[[int], bytes] | None = None) -> None:
        self._bytes = source if source is not None else ChaChaStream()

    def rand(self, n: int) -> torch.Tensor:
        """``n`` uniforms on (0, 1], float64."""
        return torch.from_numpy(uniforms(self._bytes(8 * n)).copy())

    def randperm(self, n: int) -> torch.Tensor:
        """A uniformly random permutation of 0 .. n-1 (the order of n random 64-bit words)."""
        words = np.frombuffer(self._bytes(8 * n), dtype="<u8")
        return torch.from_numpy(np.argsort(words, kind="stable").astype(np.int64))

    def standard_normal(self, n: int) -> np.ndarray:
        """``n`` standard Gaussians by Box-Muller on 53-bit uniforms from the byte source."""
        m = (n + 1) // 2
        u = uniforms(self._bytes(16 * m))
        return box_muller(u[:m], u[m:])[:n]

    def normal(self, std: float, shape: Sequence[int]) -> torch.Tensor:
        """N(0, std²) of ``shape``, float64, with the floating-point guard (``guarded_gaussian``)."""
        n = math.prod(shape)
        if std == 0:
            return torch.zeros(tuple(shape), dtype=torch.float64)
        return torch.from_numpy(guarded_gaussian(self.standard_normal, std, n)).reshape(tuple(shape))


NoiseSource = torch.Generator | SecureGenerator
"""Where noise and Poisson samples come from: torch's generator (seeded, or from OS entropy) or, in secure mode,
a ``SecureGenerator``."""


def gaussian(gen: NoiseSource, std: float, shape: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    """N(0, std²) noise of ``shape`` on the generator's device: torch's ``normal`` (in ``dtype``, default float32),
    or the secure generator's guarded draws (float64)."""
    if isinstance(gen, SecureGenerator):
        return gen.normal(std, shape)
    if dtype is None:
        return torch.normal(0.0, std, size=tuple(shape), generator=gen, device=gen.device)
    return torch.normal(0.0, std, size=tuple(shape), generator=gen, dtype=dtype, device=gen.device)


def included(gen: NoiseSource, n: int, q: float) -> torch.Tensor:
    """A Poisson sample of ``n`` items: each in it with probability q, independently (a boolean mask)."""
    if isinstance(gen, SecureGenerator):
        return gen.rand(n) <= q  # uniforms on (0, 1]: P(u <= q) = q to 2^-53
    return torch.rand(n, generator=gen, device=gen.device) < q


def permutation(gen: NoiseSource, n: int) -> torch.Tensor:
    """A uniformly random permutation of 0 .. n-1 from ``gen``."""
    if isinstance(gen, SecureGenerator):
        return gen.randperm(n)
    return torch.randperm(n, generator=gen, device=gen.device)


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
                 generator: NoiseSource, ledger: Ledger,
                 hooked: dict[int, tuple[nn.Module, object]] | None = None, grouped: bool = False) -> None:
        self.sigma, self.clip_norm = float(sigma), float(clip_norm)
        # Group-level DP: every private batch must say each example's group (a batch that lost them would be
        # clipped per example while the ledger counts groups).
        self.grouped = grouped
        self.q, self.expected_batch = float(sample_rate), float(expected_batch)
        self.generator, self.ledger = generator, ledger
        # Opacus' hooks by model, shared by the rounds' steps (the session removes them before an export).
        self._hooks: dict[int, tuple[nn.Module, object]] = {} if hooked is None else hooked
        # Objectives privatised on the batch being stepped (k objectives on one sample: one release of
        # sensitivity √k·C, accounted as noise multiplier σ/√k).
        self._on_batch = 0
        # The stepped model's floating-point buffers before the step's forward pass (see check_buffers).
        self._buffers: list[tuple[str, torch.Tensor]] = []

    def _hooks_for(self, model: nn.Module) -> object:
        from opacus.grad_sample import GradSampleHooks

        key = id(model)
        if key not in self._hooks:
            try:
                # Sum reduction: the loss is a sum of per-example values, and each example's gradient is that of
                # its own value. Mean reduction multiplies every one by the realised batch size, so adding an
                # example would change the others' gradients too.
                hooks = GradSampleHooks(model, batch_first=True, loss_reduction="sum", strict=True)
            except (NotImplementedError, ValueError) as exc:
                raise PrivacyError(f"Opacus cannot give this model per-example gradients: "
                                   f"{' '.join(str(exc).split())}") from None
            hooks.disable_hooks()
            self._hooks[key] = (model, hooks)
        return self._hooks[key][1]

    def begin(self, model: nn.Module) -> None:
        """Before the forward pass of a private step: capture activations for per-example gradients, and keep
        the model's floating-point buffers to check after the step."""
        self._hooks_for(model).enable_hooks()  # type: ignore[attr-defined]
        self._buffers = [(name, b.detach().clone()) for name, b in model.named_buffers() if b.is_floating_point()]

    def check_buffers(self, model: nn.Module) -> None:
        """After the step: a floating-point buffer the step changed (a running mean of the batch) is computed from
        the examples without clipping or noise, and would leave with the model; refused."""
        if not self._buffers:
            return
        now = dict(model.named_buffers())
        for name, before in self._buffers:
            if not torch.equal(now[name], before):
                raise PrivacyError(f"buffer {name!r} changed in a private step: a buffer a private step changes "
                                   "would leave unnoised; keep it constant in training (or out of the model)")

    def end(self, model: nn.Module) -> None:
        """After the step: stop capturing (evaluation and public-data steps keep no activations)."""
        self._buffers = []
        hooks = self._hooks_for(model)
        hooks.disable_hooks()  # type: ignore[attr-defined]
        for p in model.parameters():
            p.grad_sample = None  # type: ignore[attr-defined]

    def backward(self, model: nn.Module, params: Sequence[nn.Parameter], loss: torch.Tensor, size: int,
                 groups: torch.Tensor | None = None) -> None:
        """Set each parameter's ``grad`` to the DP-SGD estimate of the objective's gradient. ``loss`` is the sum
        over the batch's ``size`` examples of each one's value: their gradients clipped to C, summed, plus
        N(0, σ²C²), over qN. With ``groups`` (each example's group in the batch, 0 .. g-1) each group's summed
        gradient is clipped instead."""
        for p in params:
            p.grad = None
            p.grad_sample = None  # type: ignore[attr-defined]
        if size > 0:
            with warnings.catch_warnings():  # see the filter at the top: expected with Opacus' hooks
                warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
                loss.backward()
        if self.grouped and size > 0 and groups is None:
            raise PrivacyError("a private batch carries no group ids under privacy.unit = \"group\"; DP-SGD cannot "
                               "bound one group's influence")
        grads = self._per_example(model, params, size)
        clipped = clip_and_sum(grads, self.clip_norm, groups)
        for p, total in zip(params, clipped, strict=True):
            noise = gaussian(self.generator, self.sigma * self.clip_norm, p.shape)
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
                err = float((gs.sum(0) - p.grad).norm())
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


def clip_and_sum(grads: Sequence[torch.Tensor], clip_norm: float,
                 groups: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Σ_i g_i·min(1, C/‖g_i‖) per parameter, where ‖g_i‖ is example i's gradient norm over all parameters.

    With ``groups`` (example i's group, 0 .. g-1) the g_i are first summed per group, so each group's summed
    gradient is clipped to C: adding or removing a whole group moves the result by at most C."""
    if not grads or grads[0].shape[0] == 0:
        return [torch.zeros(g.shape[1:], dtype=g.dtype, device=g.device) for g in grads]
    if groups is not None:
        index = groups.to(grads[0].device, torch.int64)
        count = int(index.max()) + 1
        grads = [torch.zeros((count, *g.shape[1:]), dtype=g.dtype, device=g.device).index_add_(0, index, g)
                 for g in grads]
    norms = torch.stack([g.reshape(g.shape[0], -1).norm(dim=1) for g in grads]).norm(dim=0)
    factor = (clip_norm / (norms + 1e-12)).clamp(max=1.0)
    return [torch.einsum("i,i...->...", factor.to(g.dtype), g) for g in grads]


def gaussian_class_sums(z: torch.Tensor, y: torch.Tensor, num_classes: int, clip_norm: float, sigma: float,
                        generator: NoiseSource) -> tuple[torch.Tensor, torch.Tensor]:
    """(noisy per-class sums [K, d], noisy per-class counts [K]), float64: each row of ``z`` clipped to norm C,
    N(0, σ²C²) on every sum entry and N(0, σ²) on every count. One example added or removed moves its class's
    sum by at most C and its count by 1: L2 sensitivity √2 in units of (C, 1), so the release is a Gaussian
    mechanism of noise multiplier σ/√2."""
    z = z.double()
    norms = z.norm(dim=1, keepdim=True)
    clipped = z * (clip_norm / (norms + 1e-12)).clamp(max=1.0)
    sums = torch.zeros(num_classes, z.shape[1], dtype=torch.float64, device=z.device).index_add_(0, y, clipped)
    counts = torch.bincount(y, minlength=num_classes).double()
    sums = sums + gaussian(generator, sigma * clip_norm, sums.shape, torch.float64).to(z.device)
    counts = counts + gaussian(generator, sigma, counts.shape, torch.float64).to(z.device)
    return sums, counts


def noisy_counts(counts: np.ndarray, sigma: float, generator: NoiseSource) -> np.ndarray:
    """Class counts with N(0, σ²) each (L2 sensitivity 1), rounded and floored at 0 (post-processing)."""
    noise = gaussian(generator, sigma, (len(counts),), torch.float64).cpu().numpy()
    return np.maximum(np.rint(np.asarray(counts, dtype=np.float64) + noise), 0).astype(np.int64)


def secret_generator(seed: int, parts: Sequence[int | str], device: torch.device,
                     secure: bool = False) -> NoiseSource:
    """A generator for noise and Poisson samples: from ``seed`` and ``parts`` (a repeatable experiment), or from
    fresh OS entropy when ``seed`` is -1; with ``secure``, a ``SecureGenerator`` keyed from fresh OS entropy (a
    seed is refused: the point is that nobody can predict the noise)."""
    if secure:
        if seed >= 0:
            raise PrivacyError(f"secure_mode refuses a fixed noise_seed ({seed}): the noise must be unpredictable")
        return SecureGenerator()
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
    on them. Any other read (``take``) is the algorithm's own, and its mechanism's business.

    With ``groups`` (one group id per example: ``privacy.unit = "group"``) it samples groups instead: each group
    is in a batch with probability q = B/Ĝ and brings all its examples, or ``max_per_group`` of them drawn from
    the secret generator; each batch carries every example's group (0 .. g-1 in the batch) for the per-group
    clip."""

    def __init__(self, data: DataSource, step: PrivateStep, groups: np.ndarray | None = None,
                 max_per_group: int = 64, *, num_examples: int | None = None) -> None:
        self.data = data
        self.step = step
        self.max_per_group = int(max_per_group)
        # The examples of each group, in data order (None: record-level sampling).
        self.members: list[np.ndarray] | None = None
        if groups is not None:
            _, inverse, counts = np.unique(np.asarray(groups), return_inverse=True, return_counts=True)
            order = np.argsort(inverse.reshape(-1), kind="stable")
            self.members = np.split(order, np.cumsum(counts)[:-1])
        # Û, the released count (examples, or groups): a round's number of steps is planned from it, as the
        # ledger's plan was (None: the true count, where nothing was released).
        self.num_examples = self.num_groups if num_examples is None else int(num_examples)

    def __len__(self) -> int:
        return len(self.data)

    @property
    def num_groups(self) -> int:
        """G: the number of groups (the number of examples under record-level sampling)."""
        return len(self.data) if self.members is None else len(self.members)

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
        """``steps`` Poisson-sampled batches (of examples, or of groups), each marked for DP-SGD."""
        # Every one of the real examples (or groups) is drawn at rate q = B/Û. q is a public parameter chosen from
        # a DP release, and the sampled Gaussian's guarantee holds at that q whatever the true count is.
        n = len(self.data)
        gen = self.step.generator
        members = self.members
        # Each batch's group index, in the order of the draws (a streamed set reads every draw before its batches).
        pending: deque[torch.Tensor] = deque()

        def draws() -> Iterator[torch.Tensor]:
            for _ in range(steps):
                if members is None:
                    yield included(gen, n, self.step.q).nonzero().reshape(-1).to(self.data.device)
                    continue
                rows, index = [], []
                for j, g in enumerate(included(gen, len(members), self.step.q).nonzero().reshape(-1).tolist()):
                    m = members[g]
                    if len(m) > self.max_per_group:
                        m = np.sort(m[permutation(gen, len(m))[: self.max_per_group].cpu().numpy()])
                    rows.append(m)
                    index.append(np.full(len(m), j, dtype=np.int64))
                pending.append(torch.as_tensor(np.concatenate(index) if index else np.zeros(0, np.int64),
                                               device=self.data.device))
                yield torch.as_tensor(np.concatenate(rows) if rows else np.zeros(0, np.int64), device=self.data.device)

        for batch in self.data.batches(draws()):
            batch.private = self.step
            if members is not None:
                batch.groups = pending.popleft()
            yield batch
