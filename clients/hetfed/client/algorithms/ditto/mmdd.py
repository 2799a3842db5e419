"""MMD-D (§3.4): the deep-kernel MMD drift measure (Liu et al. 2020), its estimate, variance and kernel training.

Paper: Ayromlou & Emerson (shared/papers/001). Public reference code, read for understanding only:
VectorInstitute/FL4Health (fl4health/losses/deep_mmd_loss.py). Where the two differ, the paper's form is the
default and the code's form is a named option. Kernel maths in float64 unless ``dtype`` says float32, the
reference code's (:mod:`hetfed.client.algorithms.ditto.kernels`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from hetfed.client.algorithms.ditto.kernels import (
    KERNEL_DTYPE,
    as_feature_pair,
    check_choice,
    check_kernel_dtype,
    check_positive,
    squared_distances,
)

MMDD_VARIANCE_REG = 1e-8
"""The paper's λ of the regularised variance estimate (§3.4, Liu et al. 2020 eq. 5)."""
DeepKernelForm = Literal["paper", "liu"]
_DEEP_KERNEL_FORMS: tuple[str, ...] = ("paper", "liu")


def _h_matrix(kxx: torch.Tensor, kyy: torch.Tensor, kxy: torch.Tensor) -> torch.Tensor:
    if not (kxx.shape == kyy.shape == kxy.shape) or kxx.dim() != 2 or kxx.shape[0] != kxx.shape[1]:
        raise ValueError(
            f"kernel matrices must be square and of one size, got {kxx.shape}, {kyy.shape}, {kxy.shape}"
        )
    if kxx.shape[0] < 2:
        raise ValueError("MMD estimates need at least 2 rows per sample")
    return kxx + kyy - kxy - kxy.transpose(0, 1)


def mmd2_unbiased(kxx: torch.Tensor, kyy: torch.Tensor, kxy: torch.Tensor) -> torch.Tensor:
    """The unbiased MMD² estimate (Liu et al. 2020 eq. 2): Σ_{i≠j} H_ij / (n(n−1)), H = K_xx + K_yy − K_xy − K_xyᵀ."""
    h = _h_matrix(kxx, kyy, kxy)
    n = h.shape[0]
    return (h.sum() - torch.diagonal(h).sum()) / (n * (n - 1))


def mmd2_variance(
    kxx: torch.Tensor, kyy: torch.Tensor, kxy: torch.Tensor, reg: float = MMDD_VARIANCE_REG
) -> torch.Tensor:
    """The regularised variance estimate σ̂² = (4/n³)‖H𝟙‖² − (4/n⁴)(𝟙ᵀH𝟙)² + reg (Liu et al. 2020 eq. 5)."""
    h = _h_matrix(kxx, kyy, kxy)
    n = h.shape[0]
    row = h.sum(dim=1)
    return (4.0 / n**3) * (row * row).sum() - (4.0 / n**4) * h.sum() ** 2 + reg


def _block_row_sums(m: torch.Tensor, n: int) -> torch.Tensor:
    """(2n, 2): each row's sum over the first n columns and over the last n (the x and the y sample)."""
    return m.view(2 * n, 2, n).sum(dim=2)


def _by_block(m: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """m_ab·g[a, block(b)] for a (2n, 2n) m and a (2n, 2) g, written into ``out`` (2n, 2n)."""
    n = m.shape[0] // 2
    torch.mul(m.view(2 * n, 2, n), g.view(2 * n, 2, 1), out=out.view(2 * n, 2, n))
    return out


class _Workspace:
    """Four (2n, 2n) buffers and a mask reused by every kernel step of a refit and across refits.

    Each fresh 8 MB matrix of a 1,000-row refit cost page faults on first touch, about as much as the pass that
    filled it (profiled); the buffers live as long as the MmdDLoss (about 33 MB at s = 50).
    """

    def __init__(self) -> None:
        self.key: tuple[int, torch.dtype, torch.device] | None = None
        self.buffers: list[torch.Tensor] = []
        self.mask = torch.empty(0, dtype=torch.bool)

    def get(self, like: torch.Tensor, size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The four buffers and the mask for (size, size) matrices of ``like``'s dtype and device."""
        key = (size, like.dtype, like.device)
        if self.key != key:
            self.buffers = [like.new_empty((size, size)) for _ in range(4)]
            self.mask = torch.empty((size, size), dtype=torch.bool, device=like.device)
            self.key = key
        return self.buffers, self.mask


class _BlockRowSums(torch.autograd.Function):
    """(block row sums of first, of q) for first = k_φ or k_φ·q, k_φ = exp(−‖φ_a − φ_b‖²/σ_φ), q = exp(−d_in/σ_q).

    Autograd through these (2n, 2n) matrices recorded a dozen full-size nodes per kernel step; the backward
    here is the chain rule written out, with a few (2n, 2n) passes and one (2n, 2n) × (2n, width) product. With
    G the gradient of the (2n, 2) sums, E_ab = first_ab·G1[a, block(b)]: ∂/∂σ_φ = ΣE∘D/σ_φ², ∂/∂D = −E/σ_φ
    (zero where the distance was clamped at 0, as autograd's clamp), ∂/∂φ = 2(diag(W𝟙)φ − Wφ) with
    W = ∂/∂D + (∂/∂D)ᵀ, and ∂/∂σ_q = Σ(q∘G2[a, block(b)] + [liu] E)∘d_in/σ_q². Tested against autograd. The
    matrices live in a :class:`_Workspace`; a step's backward must run before the next step's forward.
    """

    @staticmethod
    def forward(ctx: Any, phi: torch.Tensor, sigma_phi: torch.Tensor, sigma_q: torch.Tensor,
                d_in: torch.Tensor, liu: bool, workspace: _Workspace) -> tuple[torch.Tensor, torch.Tensor]:
        """The two (2n, 2) block row sums, saving what the backward reads."""
        n = phi.shape[0] // 2
        (d_phi, first, q, spare), clamped = workspace.get(phi, 2 * n)
        norms = (phi * phi).sum(dim=1, keepdim=True)
        # squared_distances' values, in place
        torch.add(norms, norms.transpose(0, 1), out=d_phi).addmm_(phi, phi.transpose(0, 1), alpha=-2.0)
        torch.lt(d_phi, 0.0, out=clamped)
        d_phi.clamp_min_(0.0)
        torch.div(d_phi, -sigma_phi, out=first).exp_()
        torch.div(d_in, -sigma_q, out=q).exp_()
        if liu:
            first.mul_(q)
        ctx.save_for_backward(phi, sigma_phi, sigma_q, d_in)
        ctx.matrices = (d_phi, first, q, spare, clamped)
        ctx.liu = liu
        return _block_row_sums(first, n), _block_row_sums(q, n)

    @staticmethod
    def backward(ctx: Any, g_first: torch.Tensor, g_q: torch.Tensor) -> tuple[Any, ...]:
        """Gradients for φ, σ_φ and σ_q from those of the two block row sums."""
        phi, sigma_phi, sigma_q, d_in = ctx.saved_tensors
        d_phi, first, q, spare, clamped = ctx.matrices
        e = _by_block(first, g_first, out=first)  # first is not read again
        grad_sigma_phi = torch.dot(e.view(-1), d_phi.view(-1)) / sigma_phi**2
        grad_sigma_q = torch.dot(_by_block(q, g_q, out=spare).view(-1), d_in.view(-1))
        if ctx.liu:
            grad_sigma_q = grad_sigma_q + torch.dot(e.view(-1), d_in.view(-1))
        grad_sigma_q = grad_sigma_q / sigma_q**2
        dd = e.mul_(-1.0 / sigma_phi).masked_fill_(clamped, 0.0)
        w = torch.add(dd, dd.transpose(0, 1), out=d_phi)  # d_phi is not read again
        grad_phi = 2.0 * (w.sum(dim=1, keepdim=True) * phi - w @ phi)
        ctx.matrices = None
        return grad_phi, grad_sigma_phi, grad_sigma_q, None, None, None


class DeepKernelFeaturizer(nn.Sequential):
    """MMD-D's featuriser φ: Linear(in, h) → Softplus → Linear(h, h) → Softplus → Linear(h, h) → Softplus → Linear(h, out).

    The reference code's network (h = 10, out = 50); the paper does not give one.
    """

    def __init__(self, in_features: int, hidden_features: int = 10, out_features: int = 50) -> None:
        for name, v in (("in_features", in_features), ("hidden_features", hidden_features),
                        ("out_features", out_features)):
            if int(v) < 1:
                raise ValueError(f"MMD-D featuriser {name} must be >= 1, got {v}")
        super().__init__(
            nn.Linear(in_features, hidden_features),
            nn.Softplus(),
            nn.Linear(hidden_features, hidden_features),
            nn.Softplus(),
            nn.Linear(hidden_features, hidden_features),
            nn.Softplus(),
            nn.Linear(hidden_features, out_features),
        )


class MmdDLoss(nn.Module):
    """MMD-D: the unbiased MMD² under a trained deep kernel k_ω (§3.4), a module whose state persists across rounds.

    k_ω(a, b) = (1 − ε)·k(φ(a), φ(b)) + ε·q(a, b) with RBF k(u, v) = exp(−‖u − v‖²/σ_φ) and
    q(a, b) = exp(−‖a − b‖²/σ_q) (the paper's γ_k = 1/σ_φ, γ_q = 1/σ_q). ``kernel_form`` "liu" is the
    reference code's (and Liu et al.'s) form [(1 − ε)·k(φ(a), φ(b)) + ε]·q(a, b).

    Trained parameters ω = (φ, ε, σ_φ, σ_q), parameterised as the reference code does: ε = sigmoid(e),
    σ_φ = s_φ², σ_q = s_q², with its initial values ε ≈ 1e-10, σ_φ = 0.005, σ_q = 2·32·32 (the last is a
    leftover of 32×32 images in Liu et al.'s code). :meth:`train_kernel` takes ``train_steps`` AdamW steps
    (lr 1e-3, torch's other defaults) on −MMD²_u/σ̂ with σ̂² clamped at ``MMDD_VARIANCE_REG`` before the square
    root, the second sample shuffled each step (``shuffle_pairs``, reference code) so that no pairing of rows
    is learnt. The AdamW moments live in this object, so keep the object (not only its state_dict) across rounds
    to carry them. ``forward`` holds ω fixed: its gradient reaches the features only.
    """

    def __init__(
        self,
        in_features: int,
        *,
        hidden_features: int = 10,
        out_features: int = 50,
        kernel_form: DeepKernelForm = "paper",
        epsilon_init: float = 1e-10,
        sigma_phi_init: float = 0.005,
        sigma_q_init: float = 2.0 * 32 * 32,
        lr: float = 1e-3,
        train_steps: int = 5,
        shuffle_pairs: bool = True,
        seed: int = 0,
        dtype: torch.dtype = KERNEL_DTYPE,
    ) -> None:
        super().__init__()
        self.dtype = check_kernel_dtype("MMD-D", dtype)
        check_choice("kernel_form", kernel_form, _DEEP_KERNEL_FORMS)
        eps0 = float(epsilon_init)
        if not 0.0 < eps0 < 1.0:
            raise ValueError(f"MMD-D epsilon_init must be in (0, 1), got {epsilon_init!r}")
        sigma_phi = check_positive("MMD-D sigma_phi_init", sigma_phi_init)
        sigma_q = check_positive("MMD-D sigma_q_init", sigma_q_init)
        self.lr = check_positive("MMD-D lr", lr)
        if int(train_steps) < 0:
            raise ValueError(f"MMD-D train_steps must be >= 0, got {train_steps}")
        self.train_steps = int(train_steps)
        self.kernel_form: DeepKernelForm = kernel_form
        self.shuffle_pairs = bool(shuffle_pairs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            # built in float64 then cast: one initial kernel per seed whatever the dtype
            self.featurizer = DeepKernelFeaturizer(in_features, hidden_features, out_features).to(torch.float64)
            self.featurizer.to(dtype)
        self.eps_logit = nn.Parameter(torch.tensor(math.log(eps0 / (1.0 - eps0)), dtype=dtype))
        self.sigma_phi_root = nn.Parameter(torch.tensor(math.sqrt(sigma_phi), dtype=dtype))
        self.sigma_q_root = nn.Parameter(torch.tensor(math.sqrt(sigma_q), dtype=dtype))
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        self._shuffle_rng = torch.Generator().manual_seed(int(seed))
        self._workspace = _Workspace()

    @property
    def epsilon(self) -> float:
        """The current mixing weight ε."""
        return float(torch.sigmoid(self.eps_logit.detach()))

    @property
    def sigmas(self) -> tuple[float, float]:
        """The current (σ_φ, σ_q)."""
        return float(self.sigma_phi_root.detach() ** 2), float(self.sigma_q_root.detach() ** 2)

    def kernel_matrices(
        self, x: torch.Tensor, y: torch.Tensor, *, train: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K_xx, K_yy, K_xy) under k_ω; ω takes gradients only when ``train``."""
        xf, yf = as_feature_pair(x, y, "MMD-D", self.dtype)
        params: dict[str, torch.Tensor] = dict(self.named_parameters())
        if not train:
            params = {k: v.detach() for k, v in params.items()}
        z = torch.cat([xf, yf], dim=0)
        phi = z
        for layer in self.featurizer:
            if isinstance(layer, nn.Linear):
                w, b = layer.weight, layer.bias
                phi = F.linear(phi, w if train else w.detach(), b if train else b.detach())
            else:
                phi = layer(phi)
        eps = torch.sigmoid(params["eps_logit"])
        sigma_phi = params["sigma_phi_root"] ** 2
        sigma_q = params["sigma_q_root"] ** 2
        d_phi = squared_distances(phi, phi)
        d_in = squared_distances(z, z)
        q = torch.exp(-d_in / sigma_q)
        if self.kernel_form == "paper":
            k = (1.0 - eps) * torch.exp(-d_phi / sigma_phi) + eps * q
        else:
            k = ((1.0 - eps) * torch.exp(-d_phi / sigma_phi) + eps) * q
        n = xf.shape[0]
        return k[:n, :n], k[n:, n:], k[:n, n:]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The unbiased MMD²_u(x, y) under the current kernel, in x's dtype; the kernel gets no gradient."""
        return mmd2_unbiased(*self.kernel_matrices(x, y)).to(x.dtype)

    def objective(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(MMD²_u, σ̂²) with gradients into the kernel parameters (in the module's dtype)."""
        kxx, kyy, kxy = self.kernel_matrices(x, y, train=True)
        return mmd2_unbiased(kxx, kyy, kxy), mmd2_variance(kxx, kyy, kxy)

    def shuffled_criterion(self, z: torch.Tensor, d_in: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        """MMD²_u/σ̂ of (x, y[perm]) with gradients into ω, from z = [x; y] and its cached distances d_in.

        The same value as :meth:`objective` on (x, y[perm]) without building a permuted or sliced matrix: every
        term of MMD²_u and σ̂² is a sum of H's rows, and the rows of H for (x, y[perm]) are
        rowsum(K_xx)_i + rowsum(K_yy)_π(i) − rowsum(K_xy)_i − colsum(K_xy)_π(i), read off the (2n, 2) block row
        sums of the kernel matrices (:class:`_BlockRowSums`, whose backward is written out); the trace needs only
        K_xy[i, π(i)]. Profiled: autograd through the (2n, 2n) matrices was most of a refit.
        """
        n = z.shape[0] // 2
        phi = self.featurizer(z)
        eps = torch.sigmoid(self.eps_logit)
        sigma_phi = self.sigma_phi_root**2
        sigma_q = self.sigma_q_root**2
        # The (2n, 2n) matrices see no ε: it multiplies their (2n, 2) block row sums only. K = (1 − ε)·first + ε·q
        # with first = k_φ ("paper") or k_φ·q ("liu").
        first_sums, q_sums = _BlockRowSums.apply(phi, sigma_phi, sigma_q, d_in, self.kernel_form == "liu",
                                                 self._workspace)
        sums = (1.0 - eps) * first_sums + eps * q_sums  # (2n, 2): row sums over the x and the y columns
        pi = perm + n
        rows = sums[:n, 0] + sums[pi, 1] - sums[:n, 1] - sums[pi, 0]  # H·1 for (x, y[perm])

        def entries(r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            # k_ω(z_r, z_c) for listed pairs, from the rows themselves (no gather from, or gradient into, a
            # (2n, 2n) matrix): the diagonal and the pairs (x_i, y_π(i)) of the trace
            e_phi = torch.exp(((phi[r] - phi[c]) ** 2).sum(dim=1) / -sigma_phi)
            e_q = torch.exp(((z[r] - z[c]) ** 2).sum(dim=1) / -sigma_q)
            f = e_phi if self.kernel_form == "paper" else e_phi * e_q
            return (1.0 - eps) * f + eps * e_q

        ar = torch.arange(n, device=z.device)
        trace = (2.0 * entries(ar, ar) - 2.0 * entries(ar, pi)).sum()  # K_xx,ii = K_yy,ii: a point with itself
        total = rows.sum()
        mmd2 = (total - trace) / (n * (n - 1))
        var = (4.0 / n**3) * (rows * rows).sum() - (4.0 / n**4) * total**2 + MMDD_VARIANCE_REG
        return mmd2 / torch.sqrt(var.clamp_min(MMDD_VARIANCE_REG))

    def train_kernel(self, x: torch.Tensor, y: torch.Tensor, steps: int | None = None) -> list[float]:
        """Take ``steps`` (default ``train_steps``) AdamW steps on −MMD²_u/σ̂; returns the criterion MMD²_u/σ̂ before each."""
        n_steps = self.train_steps if steps is None else int(steps)
        xd, yd = as_feature_pair(x.detach(), y.detach(), "MMD-D", self.dtype)
        n = xd.shape[0]
        z = torch.cat([xd, yd], dim=0)
        d_in = squared_distances(z, z)  # the inputs do not change during the refit: computed once
        values: list[float] = []
        with torch.enable_grad():
            for _ in range(n_steps):
                if self.shuffle_pairs:
                    perm = torch.randperm(n, generator=self._shuffle_rng).to(z.device)
                else:
                    perm = torch.arange(n, device=z.device)
                self.optimizer.zero_grad(set_to_none=True)
                criterion = self.shuffled_criterion(z, d_in, perm)
                (-criterion).backward()
                self.optimizer.step()
                values.append(float(criterion.detach()))
        self.optimizer.zero_grad(set_to_none=True)
        return values
