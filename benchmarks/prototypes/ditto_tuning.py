"""IN-PROCESS PROTOTYPE, NOT A RESULT: tuning sketch for Ditto with latent drift constraints, written before the algorithm was.

Every organization of several federations (hyperparameter configs × data seeds × clients) is simulated in ONE
process, the models stacked along a leading "member" axis so that one batched step trains all of them; there is
no gRPC, no aggregator service and no client runtime here. The numbers it prints choose hyperparameters on
tuning seeds and preview whether the paper's claim is likely to hold; the reproduction is phase 2's real-process
run (``hetfed run``/bench), never this script.

The algorithm is ALGORITHMS.md §2 / the paper's Algorithm 1 with eq. (4): per batch, a global step of w_G on
cross-entropy and a local step of w_L on CE + (λ/2)·‖w_L − w̄‖² + μ·D(f(b; θ_L), f(b; θ̄)) with θ̄ the frozen
received global model; w_G averaged by example counts after each round; w_L = w_G = w̄ at the start of round 1.
FedAvg needs no run of its own: w_G's trajectory never depends on w_L, so the global model of a Ditto run IS
FedAvg at that learning rate (the "global" column). Setup of Appendix C: Synthetic(α, β) from hetfed's own
generator (8 clients, hetfed's 80/20 stratified split), Linear(60, 20) → Linear(20, 10) with no activation (the
reference code's model), feature = the first layer's output, 15 rounds × 5 epochs, batch 10, SGD momentum 0.9,
weight decay 1e-3. Evaluation as the paper: each client's final w_L on its own test split, averaged uniformly
over clients; the final aggregated w̄ likewise.

The drift measures are batched re-writes of hetfed.client.algorithms.ditto's loss modules (same maths, float64, the
same defaults); ``--selfcheck`` compares them with the modules on random data. ``--timing`` instead runs ONE
client's round with the real modules and plain torch optimisers to measure what each variant adds per round.

    nice -n 10 python benchmarks/prototypes/ditto_tuning.py --measure mmdd --lam 0.01,0.1 --mu 1,0.1 \\
        --seeds 100,101,102 [--rounds 15] [--refit-every 20 --refit-batches 50] [--device cuda]
    python benchmarks/prototypes/ditto_tuning.py --selfcheck
    nice -n 10 python benchmarks/prototypes/ditto_tuning.py --timing [--timing-epochs 1]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[2]
if os.environ.get("DITTO_PROTO_STANDALONE"):  # a machine without hetfed installed: its folders on the path
    sys.path[:0] = [str(ROOT / "proto"), str(ROOT / "clients")]
# The drift measures, one module each (hetfed.client.algorithms.ditto.{cosine,features,kernels,mkmmd,mmdd}).
from types import SimpleNamespace  # noqa: E402

from hetfed.client.algorithms.ditto import cosine, features, kernels, mkmmd, mmdd  # noqa: E402

L = SimpleNamespace(**{k: v for m in (cosine, features, kernels, mkmmd, mmdd) for k, v in vars(m).items()
                       if not k.startswith("__")})
from hetfed.client.data import DataConfig, load_client_data  # noqa: E402

F64 = torch.float64
HIDDEN, CLASSES, FEATURES = 20, 10, 60


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """What is shared by every member of one run."""

    measure: str  # none | cos | mkmmd | mmdd
    rounds: int
    epochs: int
    batch: int
    clients: int
    momentum: float
    weight_decay: float
    refit_every: int
    refit_batches: int
    mmdd_steps: int
    mmdd_form: str
    mkmmd_estimator: str
    mkmmd_form: str
    mkmmd_normalize: bool
    qp_eps: float
    keep_momentum: bool


@dataclass(frozen=True)
class Config:
    """One hyperparameter point (varies along the member axis)."""

    lam: float
    mu: float
    lr: float
    double_softmax: bool
    alpha_beta: float = 0.5


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def load_seed(seed: int, ab: float, clients: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """hetfed's own Synthetic(ab, ab) clients for one data seed: (x_train, y_train, x_test, y_test) each."""
    out = []
    for i in range(clients):
        cd = load_client_data(DataConfig(dataset="synthetic", partition="natural", num_clients=clients, client_index=i,
                                         seed=seed, synthetic_alpha=ab, synthetic_beta=ab))
        out.append((cd.train.x, cd.train.y, cd.test.x, cd.test.y))
    return out


def pad_stack(arrays: list[np.ndarray], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack variable-length arrays along a new first axis, zero-padded; also their lengths."""
    n = max(a.shape[0] for a in arrays)
    out = np.zeros((len(arrays), n, *arrays[0].shape[1:]), dtype=arrays[0].dtype)
    for k, a in enumerate(arrays):
        out[k, : a.shape[0]] = a
    lengths = torch.tensor([a.shape[0] for a in arrays], device=device)
    return torch.as_tensor(out, dtype=dtype, device=device), lengths


# --------------------------------------------------------------------------------------------------
# Batched model, SGD and measures
# --------------------------------------------------------------------------------------------------


P_SIZE = HIDDEN * FEATURES + HIDDEN + CLASSES * HIDDEN + CLASSES  # 1430 parameters per model, one flat row


def init_model(seeds_of_group: list[int], device: torch.device) -> torch.Tensor:
    """nn.Linear's default initialisation (U(±1/√fan_in)), fixed by the data seed: one flat w̄ row per federation."""
    rows = []
    for seed in seeds_of_group:
        gen = torch.Generator().manual_seed(1_000_003 * seed + 17)
        b1, b2 = 1 / math.sqrt(FEATURES), 1 / math.sqrt(HIDDEN)
        rows.append(torch.cat([(torch.rand(HIDDEN * FEATURES, generator=gen) * 2 - 1) * b1,
                               (torch.rand(HIDDEN, generator=gen) * 2 - 1) * b1,
                               (torch.rand(CLASSES * HIDDEN, generator=gen) * 2 - 1) * b2,
                               (torch.rand(CLASSES, generator=gen) * 2 - 1) * b2]))
    return torch.stack(rows).to(device)


def forward(p: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first-layer features [K,B,20], logits [K,B,10]) of K flat Linear(60,20) → Linear(20,10) rows [K, 1430]."""
    k = p.shape[0]
    o1, o2, o3 = HIDDEN * FEATURES, HIDDEN * FEATURES + HIDDEN, HIDDEN * FEATURES + HIDDEN + CLASSES * HIDDEN
    w1 = p[:, :o1].view(k, HIDDEN, FEATURES)
    w2 = p[:, o2:o3].view(k, CLASSES, HIDDEN)
    h = torch.baddbmm(p[:, o1:o2].unsqueeze(1), x, w1.transpose(1, 2))
    return h, torch.baddbmm(p[:, o3:].unsqueeze(1), h, w2.transpose(1, 2))


def masked_ce(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, ds: torch.Tensor) -> torch.Tensor:
    """Per-row mean CE over valid examples; ``ds`` rows feed softmax(logits) to CE (the reference's double softmax)."""
    out = torch.where(ds.view(-1, 1, 1), torch.softmax(logits, dim=-1), logits)
    ce = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none").view_as(mask)
    return (ce * mask).sum(1) / mask.sum(1).clamp_min(1)


def sgd_step(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, lr: torch.Tensor, active: torch.Tensor | None,
             momentum: float, wd: float) -> None:
    """torch.optim.SGD (momentum, weight decay, no dampening) per row; inactive rows do not move."""
    with torch.no_grad():
        new_buf = torch.addcmul(g, p, torch.tensor(wd, device=p.device)).add_(buf, alpha=momentum)
        if active is None:
            buf.copy_(new_buf)
            p.sub_(lr.view(-1, 1) * new_buf)
        else:
            a = active.view(-1, 1)
            buf.copy_(torch.where(a, new_buf, buf))
            p.copy_(torch.where(a, p - lr.view(-1, 1) * new_buf, p))


def sq_dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched pairwise squared distances [M, n, m], clamped at 0."""
    aa = (a * a).sum(-1, keepdim=True)
    bb = (b * b).sum(-1, keepdim=True)
    return (aa + bb.transpose(1, 2) - 2 * a @ b.transpose(1, 2)).clamp_min(0)


def pair_weights(mask: torch.Tensor, estimator: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of the pairs each estimator averages [M,1,B,B] and their count N [M]."""
    pm = mask.unsqueeze(2) * mask.unsqueeze(1)
    nb = mask.sum(1)
    if estimator == "unbiased":
        pm = pm * (1 - torch.eye(mask.shape[1], dtype=mask.dtype, device=mask.device))
        return pm.unsqueeze(1), nb * (nb - 1)
    return pm.unsqueeze(1), nb * nb


def _step_max(z: torch.Tensor, dz: torch.Tensor, sl: torch.Tensor, ds: torch.Tensor) -> torch.Tensor:
    inf = torch.full_like(z, math.inf)
    rz = torch.where(dz < 0, -z / dz, inf).amin(1, keepdim=True)
    rs = torch.where(ds < 0, -sl / ds, inf).amin(1, keepdim=True)
    return torch.minimum(rz, rs)


def batched_nnqp(a: torch.Tensor, b: torch.Tensor, iters: int = 80, tol: float = 1e-11) -> tuple[torch.Tensor, torch.Tensor]:
    """argmin ½zᵀAz − bᵀz s.t. z ≥ 0 for a batch of SPD A (Mehrotra predictor-corrector interior point, float64).

    The prototype's stand-in for losses.nonnegative_qp (an exact CPU active set, one problem at a time), so that
    MK-MMD₋₁'s QP on every step of every member runs batched on the device; --selfcheck compares the two.
    Returns (z, ok) with ok False where the Cholesky factorisation failed.
    """
    z = torch.ones_like(b)
    sl = torch.ones_like(b)
    ok = torch.ones(b.shape[0], dtype=torch.bool, device=b.device)
    for it in range(iters):
        rd = (a @ z.unsqueeze(-1)).squeeze(-1) - b - sl
        mu = (z * sl).mean(1, keepdim=True)
        chol, info = torch.linalg.cholesky_ex(a + torch.diag_embed(sl / z))
        ok = ok & (info == 0)
        dz_a = torch.cholesky_solve((-rd - sl).unsqueeze(-1), chol).squeeze(-1)
        ds_a = -sl - sl / z * dz_a
        al = _step_max(z, dz_a, sl, ds_a).clamp(max=1.0)
        mu_a = ((z + al * dz_a) * (sl + al * ds_a)).mean(1, keepdim=True)
        sigma = (mu_a / mu).clamp(0.0, 1.0) ** 3
        rc = -z * sl - dz_a * ds_a + sigma * mu
        dz = torch.cholesky_solve((-rd + rc / z).unsqueeze(-1), chol).squeeze(-1)
        ds = (rc - sl * dz) / z
        alpha = (0.995 * _step_max(z, dz, sl, ds)).clamp(max=1.0)
        z = torch.where(ok.unsqueeze(1), z + alpha * dz, z)
        sl = torch.where(ok.unsqueeze(1), sl + alpha * ds, sl)
        if it >= 9 and it % 5 == 4:
            gap = (z * sl).amax(1) + rd.abs().amax(1)
            if bool(((gap < tol) | ~ok).all()):
                break
    return z, ok


def batched_kernel_weights(d: torch.Tensor, q: torch.Tensor, prev: torch.Tensor, valid: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """losses.choose_kernel_weights for a batch: (β [M,k], outcome counts [qp, single_kernel, kept, skipped])."""
    finite = torch.isfinite(d).all(1) & torch.isfinite(q).all(2).all(1)
    usable = valid & finite
    d0 = torch.where(usable.unsqueeze(1), d, torch.zeros_like(d))
    q0 = torch.where(usable.view(-1, 1, 1), q, torch.zeros_like(q))
    anypos = (d0 > 0).any(1)
    sigma = torch.sqrt(torch.diagonal(q0, dim1=1, dim2=2).clamp_min(0) + eps)
    single = F.one_hot((d0 / sigma).argmax(1), d.shape[1]).to(d.dtype)
    eye = torch.eye(d.shape[1], dtype=d.dtype, device=d.device)
    a = 0.5 * (q0 + q0.transpose(1, 2)) + eps * eye
    scale = d0.amax(1, keepdim=True).clamp_min(1e-300)
    z, chol_ok = batched_nnqp(a, d0 / scale)
    t = (d0 * z).sum(1, keepdim=True)
    bq = (z / t).clamp_min(0)
    bq = bq / bq.sum(1, keepdim=True)
    qp_ok = usable & anypos & chol_ok & (t.squeeze(1) > 0) & torch.isfinite(bq).all(1)
    use_single = usable & ~anypos
    new = torch.where(qp_ok.unsqueeze(1), bq, torch.where(use_single.unsqueeze(1), single, prev))
    counts = torch.stack([qp_ok.sum(), use_single.sum(), (valid & ~qp_ok & ~use_single).sum(), (~valid).sum()])
    return new, counts


class BatchedMkMmd:
    """MK-MMD for every member at once (losses.MkMmdLoss's maths); β per member, refit per member by the QP."""

    def __init__(self, s: Setup, members: int, device: torch.device) -> None:
        self.s = s
        self.gammas = L.paper_gammas().to(device)
        self.beta = torch.full((members, self.gammas.numel()), 1 / self.gammas.numel(), dtype=F64, device=device)
        self.counts = torch.zeros(4, dtype=torch.long, device=device)  # qp, single_kernel, kept, skipped

    @property
    def outcomes(self) -> dict[str, int]:
        """How often each refit path was taken (summed over members and refits)."""
        return dict(zip(("qp", "single_kernel", "kept", "skipped"), self.counts.tolist(), strict=True))

    def _h(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y = x.to(F64), y.to(F64)
        if self.s.mkmmd_normalize:
            x, y = F.normalize(x, dim=-1), F.normalize(y, dim=-1)
        g = self.gammas.view(1, -1, 1, 1)

        def k(sq: torch.Tensor) -> torch.Tensor:
            sq = sq.unsqueeze(1)
            return torch.exp(-g * sq) if self.s.mkmmd_form == "rate" else torch.exp(-sq / g)

        kxy = k(sq_dist(x, y))
        return k(sq_dist(x, x)) + k(sq_dist(y, y)) - kxy - kxy.transpose(2, 3)

    def estimates(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """d̂ [M, d] over the valid rows of each member."""
        pm, n_pairs = pair_weights(mask.to(F64), self.s.mkmmd_estimator)
        return (self._h(x, y) * pm).sum((-1, -2)) / n_pairs.clamp_min(1).unsqueeze(1)

    def loss(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Σ_j β_j·d̂_j per member (float64)."""
        return (self.beta * self.estimates(x, y, mask)).sum(1)

    @torch.no_grad()
    def refit(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, chunk: int = 16) -> None:
        """New β per member from d̂ and Q̂ (losses.choose_kernel_weights); members with < 2 valid rows keep β."""
        m_total = x.shape[0]
        for lo in range(0, m_total, chunk):
            sl = slice(lo, min(lo + chunk, m_total))
            mk = mask[sl].to(F64)
            h = self._h(x[sl], y[sl])
            pm, n_pairs = pair_weights(mk, self.s.mkmmd_estimator)
            d_hat = (h * pm).sum((-1, -2)) / n_pairs.clamp_min(1).unsqueeze(1)
            centred = (h - d_hat[:, :, None, None]) * pm
            flat = centred.flatten(2)
            q_hat = flat @ flat.transpose(1, 2) / (n_pairs - 1).clamp_min(1).view(-1, 1, 1)
            new, counts = batched_kernel_weights(d_hat, q_hat, self.beta[sl], mk.sum(1) >= 2, self.s.qp_eps)
            self.beta[sl] = new
            self.counts += counts


class BatchedMmdD:
    """MMD-D for every member at once (losses.MmdDLoss's maths and defaults); stacked parameters, one AdamW."""

    def __init__(self, s: Setup, members: int, seeds_of_member: list[int], device: torch.device) -> None:
        self.s = s
        sizes = [(10, HIDDEN), (10, 10), (10, 10), (50, 10)]
        self.params: list[torch.Tensor] = []
        per_seed: dict[int, list[torch.Tensor]] = {}
        for seed in sorted(set(seeds_of_member)):
            gen = torch.Generator().manual_seed(7_000_001 * seed + 5)
            layer: list[torch.Tensor] = []
            for out_f, in_f in sizes:
                bound = 1 / math.sqrt(in_f)
                layer.append((torch.rand(out_f, in_f, generator=gen, dtype=F64) * 2 - 1) * bound)
                layer.append((torch.rand(out_f, generator=gen, dtype=F64) * 2 - 1) * bound)
            per_seed[seed] = layer
        for t in range(8):
            self.params.append(torch.stack([per_seed[sd][t] for sd in seeds_of_member]).to(device).requires_grad_())
        eps0 = 1e-10
        self.eps_logit = torch.full((members,), math.log(eps0 / (1 - eps0)), dtype=F64, device=device).requires_grad_()
        self.sphi = torch.full((members,), math.sqrt(0.005), dtype=F64, device=device).requires_grad_()
        self.sq = torch.full((members,), math.sqrt(2.0 * 32 * 32), dtype=F64, device=device).requires_grad_()
        self.opt = torch.optim.AdamW([*self.params, self.eps_logit, self.sphi, self.sq], lr=1e-3)
        self.gen = torch.Generator(device=device).manual_seed(11 + seeds_of_member[0])

    def kernel(self, x: torch.Tensor, y: torch.Tensor, train: bool) -> torch.Tensor:
        """The full [M, 2n, 2n] k_ω matrix of cat(x, y)."""
        ps = [p if train else p.detach() for p in self.params]
        eps_logit, sphi, sq = ((t if train else t.detach()) for t in (self.eps_logit, self.sphi, self.sq))
        z = torch.cat([x, y], dim=1).to(F64)
        phi = z
        for i in range(4):
            phi = torch.baddbmm(ps[2 * i + 1].unsqueeze(1), phi, ps[2 * i].transpose(1, 2))
            if i < 3:
                phi = F.softplus(phi)
        eps = torch.sigmoid(eps_logit).view(-1, 1, 1)
        d_phi, d_in = sq_dist(phi, phi), sq_dist(z, z)
        q = torch.exp(-d_in / (sq * sq).view(-1, 1, 1))
        deep = torch.exp(-d_phi / (sphi * sphi).view(-1, 1, 1))
        return (1 - eps) * deep + eps * q if self.s.mmdd_form == "paper" else ((1 - eps) * deep + eps) * q

    @staticmethod
    def h_matrix(k: torch.Tensor, n: int) -> torch.Tensor:
        """H = K_xx + K_yy − K_xy − K_xyᵀ per member."""
        kxy = k[:, :n, n:]
        return k[:, :n, :n] + k[:, n:, n:] - kxy - kxy.transpose(1, 2)

    def loss(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Unbiased MMD² per member over its valid rows, kernel fixed (float64)."""
        n = x.shape[1]
        h = self.h_matrix(self.kernel(x, y, train=False), n)
        pm, n_pairs = pair_weights(mask.to(F64), "unbiased")
        return (h * pm[:, 0]).sum((1, 2)) / n_pairs.clamp_min(1)

    def train(self, x: torch.Tensor, y: torch.Tensor, steps: int, shuffle: bool = True) -> float:
        """``steps`` AdamW steps on −Σ_m MMD²_u/σ̂ (y shuffled per member per step); the mean criterion at the end."""
        x, y = x.detach().to(F64), y.detach().to(F64)
        m, n = x.shape[0], x.shape[1]
        crit = torch.zeros(m, dtype=F64, device=x.device)
        with torch.enable_grad():
            for _ in range(steps):
                ys = y
                if shuffle:
                    perm = torch.rand(m, n, generator=self.gen, device=x.device).argsort(dim=1)
                    ys = torch.gather(y, 1, perm.unsqueeze(-1).expand_as(y))
                h = self.h_matrix(self.kernel(x, ys, train=True), n)
                mmd2 = (h.sum((1, 2)) - torch.diagonal(h, dim1=1, dim2=2).sum(1)) / (n * (n - 1))
                row = h.sum(2)
                var = 4.0 / n**3 * (row * row).sum(1) - 4.0 / n**4 * h.sum((1, 2)) ** 2 + L.MMDD_VARIANCE_REG
                crit = mmd2 / torch.sqrt(var.clamp_min(L.MMDD_VARIANCE_REG))
                self.opt.zero_grad(set_to_none=True)
                (-crit.sum()).backward()
                self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(crit.detach().mean())


def batched_cos(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 − masked mean cosine per member (float64)."""
    cos = F.cosine_similarity(x.to(F64), y.to(F64), dim=-1, eps=1e-8)
    m = mask.to(F64)
    return 1 - (cos * m).sum(1) / m.sum(1).clamp_min(1)


# --------------------------------------------------------------------------------------------------
# The simulation
# --------------------------------------------------------------------------------------------------


def run(s: Setup, configs: list[Config], seeds: list[int], device: torch.device, log: bool = True) -> dict[str, Any]:
    """Simulate every (config, seed) federation; per config and seed the mean local and global test accuracy.

    Rows 0..M−1 of the parameter block are the members' global models w_G, rows M..2M−1 their local models w_L;
    one forward and one backward per batch serve both steps, since their losses share no parameter.
    """
    t0 = time.perf_counter()
    C = s.clients
    keys = sorted({(c.alpha_beta, sd) for c in configs for sd in seeds})
    data = {key: load_seed(key[1], key[0], C) for key in keys}
    # data rows are indexed by (α=β, seed, client); members by (config, seed, client)
    order = [(key, i) for key in keys for i in range(C)]
    x_tr, n_tr = pad_stack([data[k][i][0] for k, i in order], torch.float32, device)
    y_tr, _ = pad_stack([data[k][i][1] for k, i in order], torch.long, device)
    x_te, n_te = pad_stack([data[k][i][2] for k, i in order], torch.float32, device)
    y_te, _ = pad_stack([data[k][i][3] for k, i in order], torch.long, device)
    groups = [(c, sd) for c in range(len(configs)) for sd in seeds]
    G, M = len(groups), len(groups) * C
    member_data = torch.tensor([keys.index((configs[c].alpha_beta, sd)) * C + i for (c, sd) in groups
                                for i in range(C)], device=device)
    member_group = torch.arange(G, device=device).repeat_interleave(C)
    cfg_of = [configs[c] for (c, _) in groups for _ in range(C)]
    lam = torch.tensor([c.lam for c in cfg_of], dtype=torch.float32, device=device)
    mu = torch.tensor([c.mu for c in cfg_of], dtype=F64, device=device)
    lr = torch.tensor([c.lr for c in cfg_of], dtype=torch.float32, device=device).repeat(2)
    ds = torch.tensor([c.double_softmax for c in cfg_of], device=device).repeat(2)
    n_m = n_tr[member_data]
    weights = n_m.float().view(G, C)
    weights = weights / weights.sum(1, keepdim=True)
    B = s.batch
    steps_per_epoch = math.ceil(int(n_m.max()) / B)
    full_steps = int(n_m.min()) // B  # steps in which every member has a full batch
    pad = steps_per_epoch * B - x_tr.shape[1]
    if pad > 0:  # room for the last (partial) batch of the longest client
        x_tr = F.pad(x_tr, (0, 0, 0, pad))
        y_tr = F.pad(y_tr, (0, pad))
    n_max = x_tr.shape[1]

    wbar = init_model([sd for (_, sd) in groups], device)  # [G, P]
    params = torch.zeros(2 * M, P_SIZE, device=device)  # [w_G rows; w_L rows]
    bufs = torch.zeros_like(params)
    gen = torch.Generator(device=device).manual_seed(12345 + seeds[0])
    mk = BatchedMkMmd(s, M, device) if s.measure == "mkmmd" else None
    md = BatchedMmdD(s, M, [sd for (_, sd) in groups for _ in range(C)], device) if s.measure == "mmdd" else None
    refit = L.RefitSchedule(s.refit_every, s.refit_batches) if s.measure in ("mkmmd", "mmdd") else None
    refit_time = 0.0
    ones = torch.ones(M, B, device=device)
    for rnd in range(s.rounds):
        frozen = wbar[member_group].clone()
        with torch.no_grad():
            params[:M] = frozen
            if rnd == 0:
                params[M:] = frozen
        if not s.keep_momentum:
            bufs.zero_()
        step = 0
        for _ep in range(s.epochs):
            r = torch.rand(M, n_max, generator=gen, device=device)
            r[torch.arange(n_max, device=device).unsqueeze(0) >= n_m.unsqueeze(1)] = 2.0
            perm = r.argsort(dim=1)
            for b in range(steps_per_epoch):
                if b < full_steps:
                    mask, active = ones, None
                else:
                    pos = torch.arange(b * B, (b + 1) * B, device=device)
                    mask = (pos.unsqueeze(0) < n_m.unsqueeze(1)).float()
                    active = (mask.sum(1) > 0).repeat(2)
                idx = perm[:, b * B : (b + 1) * B]
                xb = x_tr[member_data.unsqueeze(1), idx]
                yb = y_tr[member_data.unsqueeze(1), idx]
                if refit is not None and refit.due(step):
                    tr = time.perf_counter()
                    with torch.no_grad():
                        sample = s.refit_batches * B
                        rr = torch.rand(M, n_max, generator=gen, device=device)
                        rr[torch.arange(n_max, device=device).unsqueeze(0) >= n_m.unsqueeze(1)] = 2.0
                        ridx = rr.argsort(dim=1)[:, :sample]
                        xs = x_tr[member_data.unsqueeze(1), ridx]
                        f_l, _ = forward(params[M:], xs)
                        f_g, _ = forward(frozen, xs)
                    if mk is not None:
                        mk.refit(f_l, f_g, torch.ones(M, sample, device=device))
                    if md is not None:
                        md.train(f_l, f_g, s.mmdd_steps)
                    refit_time += time.perf_counter() - tr
                p = params.requires_grad_()
                feats, logits = forward(p, xb.repeat(2, 1, 1))
                mask2 = mask.repeat(2, 1)
                ce = masked_ce(logits, yb.repeat(2, 1), mask2, ds)  # [2M]: global CE, then local CE
                loss = ce.sum() + (0.5 * lam * ((p[M:] - frozen) ** 2).sum(1)).sum()
                if s.measure != "none":
                    f_l = feats[M:]
                    with torch.no_grad():
                        f_g, _ = forward(frozen, xb)
                    if s.measure == "cos":
                        drift = batched_cos(f_l, f_g, mask)
                    elif mk is not None:
                        if refit is not None and refit.per_step:
                            tr = time.perf_counter()
                            mk.refit(f_l.detach(), f_g, mask)
                            refit_time += time.perf_counter() - tr
                        drift = mk.loss(f_l, f_g, mask)
                    else:
                        assert md is not None
                        if refit is not None and refit.per_step:
                            md.train(f_l.detach(), f_g, s.mmdd_steps)
                        drift = md.loss(f_l, f_g, mask)
                    if active is not None:
                        drift = torch.where(mask.sum(1) >= 2, drift, torch.zeros_like(drift))
                    loss = loss + (mu * drift).sum().float()
                (grad,) = torch.autograd.grad(loss, p)
                params = params.detach()
                sgd_step(params, grad, bufs, lr, active, s.momentum, s.weight_decay)
                step += 1
        with torch.no_grad():  # FedAvg of w_G by example counts, per federation
            wbar = (params[:M].view(G, C, P_SIZE) * weights.unsqueeze(-1)).sum(1)
        if log:
            acc_l, acc_g = evaluate(params[M:], wbar, member_group, member_data, x_te, y_te, n_te, G, C)
            print(f"  round {rnd + 1:2d}/{s.rounds}: local {100 * acc_l.mean():6.2f}  global {100 * acc_g.mean():6.2f}"
                  f"  ({time.perf_counter() - t0:6.1f} s)", flush=True)
    acc_l, acc_g = evaluate(params[M:], wbar, member_group, member_data, x_te, y_te, n_te, G, C)
    results = []
    for ci, c in enumerate(configs):
        rows = [gi for gi, (cj, _) in enumerate(groups) if cj == ci]
        loc = [100 * float(acc_l[g]) for g in rows]
        glo = [100 * float(acc_g[g]) for g in rows]
        results.append({"config": asdict(c), "seeds": seeds, "local": loc, "global": glo,
                        "local_mean": float(np.mean(loc)), "local_std": float(np.std(loc, ddof=1)) if len(loc) > 1
                        else 0.0, "global_mean": float(np.mean(glo)),
                        "global_std": float(np.std(glo, ddof=1)) if len(glo) > 1 else 0.0})
    extra: dict[str, Any] = {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time(),
                             "refit_seconds": refit_time, "members": M}
    if mk is not None:
        extra["refit_outcomes"] = dict(mk.outcomes)
    if md is not None:
        extra["mmdd_final"] = {"eps_mean": float(torch.sigmoid(md.eps_logit.detach()).mean()),
                               "sigma_phi_mean": float((md.sphi.detach() ** 2).mean()),
                               "sigma_q_mean": float((md.sq.detach() ** 2).mean())}
    return {"setup": asdict(s), "results": results, **extra}


@torch.no_grad()
def evaluate(w_local: torch.Tensor, wbar: torch.Tensor, member_group: torch.Tensor, member_data: torch.Tensor,
             x_te: torch.Tensor, y_te: torch.Tensor, n_te: torch.Tensor, G: int, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per federation: mean over clients of each client's accuracy on its own test split (local w_L, global w̄)."""
    xt, yt, nt = x_te[member_data], y_te[member_data], n_te[member_data]
    valid = torch.arange(xt.shape[1], device=xt.device).unsqueeze(0) < nt.unsqueeze(1)

    def acc(p: torch.Tensor) -> torch.Tensor:
        _, logits = forward(p.detach(), xt)
        right = ((logits.argmax(-1) == yt) & valid).sum(1).double() / nt.double()
        return right.view(G, C).mean(1)

    return acc(w_local), acc(wbar[member_group])


# --------------------------------------------------------------------------------------------------
# Self-check of the batched measures against the modules, and per-round timing with the modules
# --------------------------------------------------------------------------------------------------


def selfcheck() -> None:
    """The batched measures equal hetfed.client.algorithms.ditto's loss modules on random data (float64 tolerances)."""
    torch.manual_seed(0)
    s = Setup("mkmmd", 1, 1, 10, 2, 0.9, 1e-3, 20, 2, 5, "paper", "unbiased", "rate", True, 1e-3, False)
    x = torch.randn(3, 10, HIDDEN, dtype=F64)
    y = x + 0.5 * torch.randn(3, 10, HIDDEN, dtype=F64)
    mask = torch.ones(3, 10)
    mask[2, 7:] = 0  # a partial last batch
    mk = BatchedMkMmd(s, 3, torch.device("cpu"))
    est = mk.estimates(x, y, mask)
    mk.refit(x, y, mask)
    for m in range(3):
        n = int(mask[m].sum())
        ref = L.MkMmdLoss()
        np.testing.assert_allclose(est[m].numpy(), ref.per_kernel(x[m, :n], y[m, :n]).detach().numpy(), rtol=1e-10)
        ref.refit(x[m, :n], y[m, :n])
        np.testing.assert_allclose(mk.beta[m].numpy(), ref.beta.numpy(), rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(batched_cos(x, y, mask)[2].item(), float(L.CosineDrift()(x[2, :7], y[2, :7])), rtol=1e-12)
    rng = np.random.default_rng(1)
    ds_, qs_ = [], []
    for case in range(40):
        basis = rng.normal(size=(19, int(rng.integers(1, 25))))
        qs_.append(basis @ basis.T * 10.0 ** rng.uniform(-5, 0))
        d = rng.normal(size=19) * 10.0 ** rng.uniform(-4, 0)
        if case % 10 == 0:
            d = -np.abs(d)  # the single-kernel fallback
        ds_.append(d)
    d_t, q_t = torch.tensor(np.array(ds_)), torch.tensor(np.array(qs_))
    prev = torch.full((40, 19), 1 / 19, dtype=F64)
    got, counts = batched_kernel_weights(d_t, q_t, prev, torch.ones(40, dtype=torch.bool), 1e-3)
    for c in range(40):
        want, _ = L.choose_kernel_weights(ds_[c], qs_[c], prev[c].numpy(), 1e-3)
        obj = lambda b, c=c: float(b @ (qs_[c] + 1e-3 * np.eye(19)) @ b)  # noqa: E731
        np.testing.assert_allclose(got[c].numpy(), want, atol=1e-6)
        assert abs(obj(got[c].numpy()) - obj(want)) <= 1e-7 * max(1.0, obj(want))
    assert counts.tolist() == [36, 4, 0, 0], counts
    md = BatchedMmdD(s, 3, [0, 0, 0], torch.device("cpu"))
    ref_d = L.MmdDLoss(HIDDEN, shuffle_pairs=False)
    with torch.no_grad():
        layers = [m for m in ref_d.featurizer if isinstance(m, torch.nn.Linear)]
        for i, lin in enumerate(layers):
            lin.weight.copy_(md.params[2 * i][0])
            lin.bias.copy_(md.params[2 * i + 1][0])
    np.testing.assert_allclose(md.loss(x, y, mask)[0].item(), float(ref_d(x[0], y[0])), rtol=1e-10)
    np.testing.assert_allclose(md.loss(x, y, mask)[2].item(), float(ref_d(x[2, :7], y[2, :7])), rtol=1e-10)
    md.train(x, y, 3, shuffle=False)
    ref_d.train_kernel(x[0], y[0], steps=3)
    np.testing.assert_allclose(md.params[0][0].detach().numpy(), layers[0].weight.detach().numpy(), rtol=1e-9)
    np.testing.assert_allclose(md.sphi[0].item(), ref_d.sigma_phi_root.item(), rtol=1e-9)
    np.testing.assert_allclose(md.loss(x, y, mask)[0].item(), float(ref_d(x[0], y[0])), rtol=1e-9)
    print("selfcheck: batched MK-MMD (d̂, β; interior-point QP on 40 random cases), cosine and MMD-D (MMD²_u, "
          "AdamW steps) match the losses modules")


def time_variants(seed: int, epochs: int, ab: float, s_list: list[int]) -> None:
    """One client's local training with the real modules and torch optimisers: CPU seconds per round per variant.

    CPU time (time.process_time, one thread) rather than wall time, since the machine may be shared.
    """
    import copy

    torch.set_num_threads(1)
    xtr, ytr, _, _ = load_seed(seed, ab, 8)[0]
    x, y = torch.as_tensor(xtr), torch.as_tensor(ytr)
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Linear(HIDDEN, CLASSES))
    variants: list[tuple[str, str | None, int, int]] = [
        ("fedavg", None, 0, 0), ("ditto", "none", 0, 0), ("ditto+cos", "cos", 0, 0), ("ditto+mkmmd-1", "mkmmd", -1, 1)]
    for sb in s_list:
        variants += [(f"ditto+mkmmd20 s={sb}", "mkmmd", 20, sb), (f"ditto+mmdd20 s={sb}", "mmdd", 20, sb)]
    rows = []
    for name, measure, every, s_batches in variants:
        g = copy.deepcopy(base)
        loc = copy.deepcopy(base)
        frozen = copy.deepcopy(base).requires_grad_(False)
        opt_g = torch.optim.SGD(g.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-3)
        opt_l = torch.optim.SGD(loc.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-3)
        drift: torch.nn.Module | None = {"cos": L.CosineDrift(), "mkmmd": L.MkMmdLoss(), "mmdd": L.MmdDLoss(HIDDEN),
                                         "none": None, None: None}[measure]
        sched = L.RefitSchedule(every, s_batches) if every else None
        rng = np.random.default_rng(0)
        t_refit = 0.0
        t0 = time.process_time()
        step = 0
        for _ in range(epochs):
            order = rng.permutation(len(y))
            for lo in range(0, len(y), 10):
                idx = torch.as_tensor(order[lo : lo + 10])
                xb, yb = x[idx], y[idx]
                opt_g.zero_grad()
                F.cross_entropy(g(xb), yb).backward()
                opt_g.step()
                if measure is None:
                    step += 1
                    continue
                if sched is not None and sched.due(step) and drift is not None:
                    tr = time.process_time()
                    batches = (x[torch.as_tensor(rng.permutation(len(y))[k * 10 : (k + 1) * 10])]
                               for k in range(s_batches))
                    f_l, f_g = L.gather_features(loc, frozen, "0", batches, s_batches)
                    if isinstance(drift, L.MkMmdLoss):
                        drift.refit(f_l, f_g)
                    elif isinstance(drift, L.MmdDLoss):
                        drift.train_kernel(f_l, f_g)
                    t_refit += time.process_time() - tr
                opt_l.zero_grad()
                logits, f_l = L.forward_with_features(loc, "0", xb)
                loss = F.cross_entropy(logits, yb) + 0.05 * sum(
                    (p - r).pow(2).sum() for p, r in zip(loc.parameters(), frozen.parameters(), strict=True))
                if drift is not None and xb.shape[0] >= 2:
                    with torch.no_grad():
                        _, f_g = L.forward_with_features(frozen, "0", xb)
                    if sched is not None and sched.per_step and isinstance(drift, L.MkMmdLoss):
                        tr = time.process_time()
                        drift.refit(f_l.detach(), f_g)
                        t_refit += time.process_time() - tr
                    loss = loss + drift(f_l, f_g)
                loss.backward()
                opt_l.step()
                step += 1
        cpu = time.process_time() - t0
        rows.append((name, cpu, t_refit))
        print(f"  {name:22s} {cpu:8.2f} CPU s for {epochs} epoch(s) of one client; refits {t_refit:7.2f} s", flush=True)
    base_cpu = rows[0][1]
    print(f"\nper round (5 epochs, one client, 1 thread, CPU seconds; scaled from {epochs} epoch(s)):")
    for name, cpu, t_refit in rows:
        print(f"  {name:22s} {cpu * 5 / epochs:8.2f} s/round  (+{(cpu - base_cpu) * 5 / epochs:7.2f} s over FedAvg; "
              f"refits {t_refit * 5 / epochs:7.2f} s)")


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def floats(text: str) -> list[float]:
    """'0.1,0.01' → [0.1, 0.01]."""
    return [float(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and run the prototype, the self-check or the timing."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--measure", choices=["none", "cos", "mkmmd", "mmdd"], default="none")
    ap.add_argument("--lam", type=floats, default=[0.1])
    ap.add_argument("--mu", type=floats, default=[1.0])
    ap.add_argument("--lr", type=floats, default=[0.01])
    ap.add_argument("--double-softmax", choices=["0", "1", "both"], default="0")
    ap.add_argument("--seeds", default="100,101,102")
    ap.add_argument("--alpha-beta", type=floats, default=[0.5])
    ap.add_argument("--configs", default="", help="explicit list 'lam:mu:lr:ab[:double_softmax];...' instead of the grid")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--refit-every", type=int, default=20)
    ap.add_argument("--refit-batches", type=int, default=50)
    ap.add_argument("--mmdd-steps", type=int, default=5)
    ap.add_argument("--mmdd-form", choices=["paper", "liu"], default="paper")
    ap.add_argument("--mkmmd-estimator", choices=["unbiased", "biased"], default="unbiased")
    ap.add_argument("--mkmmd-form", choices=["rate", "scale"], default="rate")
    ap.add_argument("--mkmmd-raw", action="store_true", help="do not L2-normalise feature rows for MK-MMD")
    ap.add_argument("--qp-eps", type=float, default=1e-3)
    ap.add_argument("--keep-momentum", action="store_true", help="keep SGD momentum across rounds (reference code)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--selfcheck", action="store_true")
    ap.add_argument("--timing", action="store_true")
    ap.add_argument("--timing-epochs", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.selfcheck:
        selfcheck()
        return 0
    if a.timing:
        time_variants(100, a.timing_epochs, a.alpha_beta[0], sorted({5, a.refit_batches}))
        return 0
    s = Setup(a.measure, a.rounds, a.epochs, a.batch, a.clients, 0.9, 1e-3, a.refit_every,
              a.refit_batches, a.mmdd_steps, a.mmdd_form, a.mkmmd_estimator, a.mkmmd_form, not a.mkmmd_raw,
              a.qp_eps, a.keep_momentum)
    ds = {"0": [False], "1": [True], "both": [False, True]}[a.double_softmax]
    configs = [Config(lam, mu if a.measure != "none" else 0.0, lr, d, ab) for lam, mu, lr, d, ab in
               itertools.product(a.lam, a.mu if a.measure != "none" else [0.0], a.lr, ds, a.alpha_beta)]
    if a.configs:
        configs = []
        for item in a.configs.split(";"):
            fields = [float(v) for v in item.split(":")]
            lam, mu, lr, ab = fields[:4]
            configs += [Config(lam, mu, lr, bool(fields[4]), ab)] if len(fields) > 4 else [
                Config(lam, mu, lr, d, ab) for d in ds]
    seeds = [int(v) for v in a.seeds.split(",")]
    print(f"IN-PROCESS PROTOTYPE (not a result): measure={a.measure} "
          f"seeds={seeds} configs={len(configs)} device={a.device} refit={a.refit_every}/{a.refit_batches}", flush=True)
    out = run(s, configs, seeds, torch.device(a.device), log=not a.quiet)
    for r in out["results"]:
        c = r["config"]
        print(f"  ab={c['alpha_beta']:<4g} lam={c['lam']:<6g} mu={c['mu']:<6g} lr={c['lr']:<7g} "
              f"ds={int(c['double_softmax'])}  "
              f"local {r['local_mean']:6.2f} ± {r['local_std']:5.2f}  global {r['global_mean']:6.2f} ± "
              f"{r['global_std']:5.2f}   per seed local {' '.join(f'{v:.2f}' for v in r['local'])}")
    extras = {k: v for k, v in out.items() if k not in ("setup", "results")}
    print(f"  {extras}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
