"""An empirical lower bound on the ε of hetfed's DP-SGD, from one training run (Steinke, Nasr and Jagielski 2023).

    python benchmarks/privacy_audit.py                                 # ε = 1, 4, 8: FedAvg, Fed-CMA, broken
    python benchmarks/privacy_audit.py --epsilons 8 --canaries 500     # a quick look
    python benchmarks/privacy_audit.py --break sensitivity2 --objectives fedavg   # the broken step alone
    python benchmarks/privacy_audit.py --reachable 1000,10000,100000             # the highest bound m can give

m canaries, each put in the training set or left out by a fair coin (a seeded draw); one run of the real training
loop (``fit``) through the real client halves' objectives, the real Poisson sampling (``PrivateData``), Opacus'
hooks, hetfed's clipping and noise (``PrivateStep``) and its ledger. The auditor is white-box with gradient access:
it sees every step's privatised gradient, which DP-SGD's guarantee covers (the sequence of noisy sums, by adaptive
composition). Each canary is a "Dirac" canary: an input with one feature of its own (no other example has it),
so its per-example gradient lives in one column of the encoder's weight that only it touches, clipped to C. Its
score sums over the steps the log-likelihood ratio, "in" against "out", of the privatised sum's projection on that
gradient's direction. The auditor guesses "in" for the k highest scores and "out" for the k lowest; from v correct of r = 2k guesses, the bound is
the largest ε at which (ε, δ)-DP allows v or more correct guesses with probability at most β (the paper's
Theorem with its δ term, Appendix D).

The model is held where it starts (learning rate factor 0), so that every canary's gradient is the same known
vector at every step: DP-SGD's guarantee holds whatever the parameters between two steps, holding them is one
choice of them. The head is frozen and the encoder has no bias, so the privatised parameter is the encoder's weight
alone and a canary's gradient is its own column of it.

A canary's contribution is clipped to C whatever the rest of the batch, so the canaries cannot see a step in which
one example changes the others' contributions (Fed-CMA's alignment term scaled by the batch size). The neighbour
probe (``neighbour_shift``) measures that directly: the clipped sum's largest move, at σ = 0, between a batch and
the same batch less one example, in units of C.

``--break sensitivity2`` runs a ``PrivateStep`` that clips each example to 2C and adds the noise of σ·C, while the
ledger still accounts noise multiplier σ: every example moves the sum by up to twice what is accounted.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import scipy.stats
import torch
from torch import nn

from hetfed.client.algorithms.base import ClientContext
from hetfed.client.algorithms.fedavg import FedAvgClient
from hetfed.client.algorithms.fedcma import FedCMAClient
from hetfed.client.data.core import ArrayDataset, ClientData
from hetfed.client.models import SplitModel
from hetfed.client.privacy.config import PrivacyConfig
from hetfed.client.privacy.ledger import Release, solve_noise_multiplier
from hetfed.client.privacy.mechanisms import PrivateData, PrivateStep
from hetfed.client.privacy.session import PrivacySession
from hetfed.client.training import (
    Batch,
    Forward,
    LossTerm,
    Objective,
    epoch_batches,
    fit,
    plain_forward,
    round_lr_factor,
)
from hetfed.wire.payloads import ClassMeanEmbeddings, Received
from hetfed.wire.specs.fedavg import FedAvgConfig
from hetfed.wire.specs.fedcma import FedCMAConfig

BETA = 0.05  # 1 − the confidence of every bound
DELTA = 1e-5
CLIP = 1.0
CLASSES, LATENT, REAL_FEATURES = 4, 4, 8
# The guesses on each side, as a share of the canaries: fixed before any audit ran, from a simulation of the scores
# a canary clipped to C (and to 2C) would get at the default q, steps and σ (the share that gave the highest bounds).
GUESS_SHARE = 0.03
# A canary's one feature: large enough that its gradient is several times C, so clipping scales it to C exactly.
CANARY_INPUT = 100.0


# ---------------------------------------------------------------------------------------------- the bound
def p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """The probability that an (ε, δ)-DP mechanism lets an auditor make ``v`` or more correct guesses out of ``r``
    on ``m`` canaries, each in or out by a fair coin (Steinke, Nasr and Jagielski 2023, Theorem 3.1 and its
    Appendix D): P[W ≥ v] + 2mδ·max_{1≤i≤v} P[v − i ≤ W < v]/i, W ~ Binomial(r, e^ε/(1 + e^ε))."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    p = 1.0 / (1.0 + math.exp(-eps))
    tail = float(scipy.stats.binom.sf(v - 1, r, p))
    if delta == 0 or v == 0:
        return min(tail, 1.0)
    # P[v − i ≤ W < v] for i = 1..v: the cumulative sum of the pmf downwards from v − 1.
    below = np.cumsum(scipy.stats.binom.pmf(np.arange(v - 1, -1, -1), r, p))
    spread = float(np.max(below / np.arange(1, v + 1)))
    return min(tail + 2 * m * delta * spread, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, beta: float = BETA) -> float:
    """The largest ε (to 1e-6) at which ``v`` correct guesses of ``r`` on ``m`` canaries still have a p-value of at
    most ``beta``: the mechanism is not (ε, δ)-DP for any smaller ε, at confidence 1 − β. 0 when none is."""
    if p_value(m, r, v, 0.0, delta) > beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) <= beta:
        lo, hi = hi, hi * 2
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p_value(m, r, v, mid, delta) <= beta else (lo, mid)
    return lo


def reachable(m: int, delta: float, beta: float = BETA) -> tuple[float, int]:
    """The highest bound ``m`` canaries can give, and the guesses it takes: every guess right, r from 100 up to
    m (a grid of about three per decade; more guesses raise the binomial term's bound and the δ term's cost)."""
    grid = sorted({min(m, int(g)) for g in np.logspace(2, math.log10(max(m, 100)), 13)} | {m})
    return max((epsilon_lower_bound(m, r, r, delta, beta), r) for r in grid)


def guesses(scores: np.ndarray, included: np.ndarray, k: int) -> tuple[int, int]:
    """(r, v): "in" for the ``k`` highest scores, "out" for the ``k`` lowest (ties broken by the canary's index),
    and how many of the 2k guesses are right."""
    order = np.argsort(scores, kind="stable")
    low, high = order[:k], order[len(order) - k:]
    return 2 * k, int(included[high].sum() + (~included[low]).sum())


# ---------------------------------------------------------------------------------------------- the broken step
class DoubledStep(PrivateStep):
    """A deliberately wrong DP-SGD step: each example clipped to 2C, noise σ·C (as ``PrivateStep`` with C' = 2C and
    σ' = σ/2), while the ledger accounts σ: twice the sensitivity the accounting assumes."""

    def backward(self, model: nn.Module, params: Sequence[nn.Parameter], loss: torch.Tensor, size: int,
                 groups: torch.Tensor | None = None) -> None:
        """``PrivateStep.backward`` at 2C and σ/2, then the step's own C and σ back for the ledger."""
        sigma, clip = self.sigma, self.clip_norm
        self.sigma, self.clip_norm = sigma / 2, clip * 2
        try:
            super().backward(model, params, loss, size, groups)
        finally:
            self.sigma, self.clip_norm = sigma, clip


BREAKS = {"none": PrivateStep, "sensitivity2": DoubledStep}


# ---------------------------------------------------------------------------------------------- the audit
@dataclass(frozen=True)
class Plan:
    """One audit: which objective, at which ε, with how many canaries and steps."""

    objective: str  # "fedavg" or "fedcma"
    epsilon: float
    canaries: int
    steps: int
    real: int = 1000  # real (non-canary) examples
    batch: int = 120  # expected batch: q = batch / training set size
    guesses_per_side: int = 0  # k; 0: GUESS_SHARE of the canaries
    broken: str = "none"
    seed: int = 0

    @property
    def k(self) -> int:
        """The guesses on each side."""
        return self.guesses_per_side or max(1, round(GUESS_SHARE * self.canaries))


def audit_model(features: int, seed: int) -> SplitModel:
    """sigmoid(W x) into [0, 1]^d_e (bias-free, so a canary's gradient is its column of W alone) and a frozen head.
    The canaries' columns start at 0, so every canary has the same latent and the same gradient."""
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(features, LATENT, bias=False)
    model = SplitModel(nn.Sequential(linear, nn.Sigmoid()), LATENT, CLASSES)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(LATENT, features, generator=gen) / math.sqrt(REAL_FEATURES))
        linear.weight[:, REAL_FEATURES:] = 0.0
        model.head.weight.copy_(torch.randn(CLASSES, LATENT, generator=gen))
        model.head.bias.copy_(torch.randn(CLASSES, generator=gen) * 0.1)
    model.head.requires_grad_(False)
    return model


def encoder_weight(model: SplitModel) -> torch.Tensor:
    """W, the one privatised parameter of ``audit_model``."""
    return cast(nn.Linear, model.encoder.get_submodule("0")).weight


def audit_data(plan: Plan, included: np.ndarray) -> tuple[ClientData, np.ndarray]:
    """Real examples (Gaussian in the first features, random labels) and the included canaries: canary i is
    ``CANARY_INPUT`` in feature ``REAL_FEATURES + i`` and 0 elsewhere, of class 0. Returns the data and the
    canary inputs' columns."""
    rng = np.random.default_rng([plan.seed, 1])
    features = REAL_FEATURES + plan.canaries
    real_x = np.zeros((plan.real, features), dtype=np.float32)
    real_x[:, :REAL_FEATURES] = rng.normal(size=(plan.real, REAL_FEATURES))
    real_y = rng.integers(0, CLASSES, size=plan.real)
    chosen = np.flatnonzero(included)
    canary_x = np.zeros((chosen.size, features), dtype=np.float32)
    canary_x[np.arange(chosen.size), REAL_FEATURES + chosen] = CANARY_INPUT
    x = np.concatenate([real_x, canary_x])
    y = np.concatenate([real_y, np.zeros(chosen.size, dtype=np.int64)])
    train = ArrayDataset(x, y)
    test = ArrayDataset(real_x[:10], real_y[:10])
    return ClientData(train, test, None, CLASSES, (features,), "audit"), REAL_FEATURES + np.arange(plan.canaries)


def declared_size(plan: Plan) -> int:
    """The training set size the audited organization declares: its real examples and half its canaries."""
    return plan.real + plan.canaries // 2


def sigma_for(plan: Plan, q: float) -> float:
    """hetfed's own σ for the planned steps at q, ε and δ (the RDP accountant, as a client solves it)."""
    return solve_noise_multiplier([Release(q, 1.0, plan.steps)], plan.epsilon, DELTA)


@dataclass
class Outcome:
    """What one audit measured."""

    scores: np.ndarray  # the log-likelihood ratio, what the auditor guesses from
    sums: np.ndarray  # the plain sum of the projections, in units of C
    included: np.ndarray
    sigma: float
    q: float
    ledger_epsilon: float
    seconds: float


@dataclass
class Half:
    """A client half's objective under DP, built as the half builds it for a round."""

    ctx: ClientContext  # type: ignore[type-arg]
    session: PrivacySession
    private: PrivateData
    terms: list[LossTerm]
    forward: Callable[[nn.Module, Batch], Forward]
    optimizer: torch.optim.Optimizer


def half_for(plan: Plan, model: SplitModel, data: ClientData, sigma: float) -> Half:
    """The objective of FedAvg's or Fed-CMA's client half (the latter with the server's class means received, so
    its private alignment term is active), over ``data`` read through DP-SGD at noise multiplier ``sigma``."""
    n = len(data.train.y)
    cfg = PrivacyConfig(noise_multiplier=sigma, clip_norm=CLIP, delta=DELTA, noise_seed=plan.seed,
                        ephemeral_ledger=True)
    session = PrivacySession(cfg, "audit", "org", None, n, torch.device("cpu"))
    # The count the organization declares, held as a restarted client holds its released N̂: the expected size
    # (the real examples and half the canaries), so q = B/N̂ does not depend on which canaries the coin put in.
    session.ledger.released["examples"] = declared_size(plan)
    session.release_examples()
    session.set_batch_size(plan.batch)
    cpu = torch.device("cpu")
    if plan.objective == "fedavg":
        ctx: ClientContext = ClientContext(  # type: ignore[type-arg]
            "org", model, data, cpu, FedAvgConfig(local_steps=plan.steps, batch_size=plan.batch), seed=plan.seed,
            privacy=session)
        avg = FedAvgClient(ctx)
        terms, forward, optimizer = avg.terms(), avg.forward, avg.optimizer()
    elif plan.objective == "fedcma":
        config = FedCMAConfig(latent_dim=LATENT, num_classes=CLASSES, local_steps=plan.steps, batch_size=plan.batch)
        ctx = ClientContext("org", model, data, cpu, config, seed=plan.seed, privacy=session)
        cma = FedCMAClient(ctx)
        # The server's class means, taken as a round's download takes them (the half's own ``_receive``), so that
        # the private alignment term is active.
        means = np.random.default_rng([plan.seed, 2]).uniform(0.2, 0.8, size=(CLASSES, LATENT)).astype(np.float32)
        totals = np.bincount(data.train.y, minlength=CLASSES).astype(np.int64)
        cma._receive(Received([ClassMeanEmbeddings(np.arange(CLASSES), means, totals, np.ones(CLASSES, bool))]))
        if not cma.alignment_active():
            raise RuntimeError("Fed-CMA's alignment term is not active: the audit would miss it")
        terms, forward, optimizer = cma.terms(), plain_forward, cma.optimizer()  # Fed-CMA steps the plain forward
    else:
        raise ValueError(f"unknown objective {plan.objective!r} (fedavg or fedcma)")
    private = ctx.train
    assert isinstance(private, PrivateData)
    session.begin_round(1, plan.seed)
    step = private.step
    private.step = BREAKS[plan.broken](step.sigma, step.clip_norm, step.q, step.expected_batch, step.generator,
                                       step.ledger, session.hooked)
    return Half(ctx, session, private, terms, forward, optimizer)


def run(plan: Plan) -> Outcome:
    """Train once with the canaries the seeded coin put in, and score every canary."""
    start = time.perf_counter()
    torch.manual_seed(plan.seed)
    included = np.random.default_rng([plan.seed, 0]).random(plan.canaries) < 0.5
    data, columns = audit_data(plan, included)
    q = min(1.0, plan.batch / declared_size(plan))
    sigma = sigma_for(plan, q)
    model = audit_model(REAL_FEATURES + plan.canaries, plan.seed)
    half = half_for(plan, model, data, sigma)
    weight = encoder_weight(model)
    direction = canary_direction(model, half.terms, half.forward, int(columns[0]))
    sums = torch.zeros(plan.canaries, dtype=torch.float64)
    scores = torch.zeros(plan.canaries, dtype=torch.float64)
    log_out, log_q, var = math.log1p(-half.private.step.q), math.log(half.private.step.q), sigma**2

    def observe() -> None:
        # The privatised sum (the step divides it by the expected batch), projected on each canary's direction.
        assert weight.grad is not None
        released = weight.grad.detach().double()[:, columns] * half.private.step.expected_batch
        x = direction @ released / CLIP
        sums.add_(x)
        # The log-likelihood ratio of this step's projection between "in" (a Poisson-sampled shift of C) and
        # "out": log(1 − q + q·exp((x − 1/2)/σ²)). Summed over the steps it is the optimal test of one canary
        # when the steps are independent; the plain sum loses most of the power at small q.
        scores.add_(torch.logaddexp(torch.full_like(x, log_out), log_q + (x - 0.5) / var))

    objective = Objective(model, half.optimizer, half.terms, half.forward, before_step=observe)
    with round_lr_factor(0.0):
        fit([objective], epoch_batches(half.private, half.ctx.config, half.ctx.rng(plan.seed)))
    spent = half.session.close_round(1).epsilon
    half.session.release()
    return Outcome(scores.numpy(), sums.numpy(), included, sigma, q, spent, time.perf_counter() - start)


def neighbour_shift(plan: Plan) -> float:
    """The largest move of the clipped sum, in units of C, between a batch and the same batch less one example,
    through the objective's real private step at σ = 0. Every example of a batch is the same: a real example or a
    canary, at input scales from 10^-3 to 10^2 (from gradients far below C to far above it), in batches of 10, 100
    and 1,000. DP-SGD's accounting assumes at most 1: one example moves the sum by at most C."""
    base = Plan(plan.objective, plan.epsilon, 1, 1, plan.real, plan.batch, broken=plan.broken, seed=plan.seed)
    data, columns = audit_data(base, np.zeros(1, dtype=bool))
    # In float64: a sum over 1,000 examples in float32 is off by about 1e-4 of C, enough to blur "at most C".
    model = audit_model(REAL_FEATURES + 1, plan.seed).double()
    half = half_for(base, model, data, 1.0)
    step = half.private.step  # the same step at σ = 0: the clipped sum itself
    half.private.step = type(step)(0.0, step.clip_norm, step.q, step.expected_batch, step.generator, step.ledger,
                                   half.session.hooked)
    weight = encoder_weight(model)
    sums: list[torch.Tensor] = []

    def observe() -> None:
        assert weight.grad is not None
        sums.append(weight.grad.detach().double() * half.private.step.expected_batch)

    objective = Objective(model, half.optimizer, half.terms, half.forward, before_step=observe)
    canary = torch.zeros(REAL_FEATURES + 1, dtype=torch.float64)
    canary[int(columns[0])] = 1.0
    worst = 0.0
    for x0, size, scale in itertools.product((torch.as_tensor(cast(ArrayDataset, data.train).x[0]).double(), canary), (10, 100, 1000),
                                             np.logspace(-3, 2, 26)):
        x = (x0 * float(scale)).expand(size, -1).contiguous()
        y = torch.zeros(size, dtype=torch.int64)
        batches = [Batch(x, y, private=half.private.step), Batch(x[1:], y[1:], private=half.private.step)]
        sums.clear()
        with round_lr_factor(0.0):
            fit([objective], batches)
        worst = max(worst, float((sums[0] - sums[1]).norm()) / CLIP)
    half.session.release()
    return worst


def canary_direction(model: SplitModel, terms: Sequence[LossTerm], forward: Callable[[nn.Module, Batch], Forward],
                     column: int) -> torch.Tensor:
    """The unit direction of a canary's gradient on its own column, computed apart from the step under audit: the
    objective's terms on a batch of that one canary (each term is a mean or a sum over the batch, equal on one
    example), by plain autograd; its norm must exceed C so that clipping scales it to C."""
    features = encoder_weight(model).shape[1]
    x = torch.zeros(1, features)
    x[0, column] = CANARY_INPUT
    batch = Batch(x, torch.zeros(1, dtype=torch.int64))
    weight = encoder_weight(model)
    out = forward(model, batch)
    loss = sum((term(batch, out) for term in terms), torch.zeros(()))
    (grad,) = torch.autograd.grad(loss, [weight])
    full_norm = float(grad.norm())
    col = grad[:, column].double()
    if float(col.norm()) < 0.999 * full_norm or full_norm < 2 * CLIP:
        raise RuntimeError(f"the canary's gradient is not a Dirac of norm >= 2C (norm {full_norm:.3g}, on its column "
                           f"{float(col.norm()):.3g}): the audit's design assumption fails")
    return col / col.norm()


@dataclass
class Row:
    """One line of the table."""

    objective: str
    broken: str
    epsilon: float
    sigma: float
    q: float
    steps: int
    canaries: int
    guesses: int
    correct: int
    lower_bound: float
    cap: float
    separation: float
    ledger_epsilon: float
    neighbour_shift: float
    seconds: float


def audit(plan: Plan, shift: float) -> Row:
    """One run, its guesses and its bound."""
    out = run(plan)
    r, v = guesses(out.scores, out.included, plan.k)
    # The score's mean gap between canaries in and out, in units of C: q·T for a canary clipped to C.
    separation = float(out.sums[out.included].mean() - out.sums[~out.included].mean())
    return Row(plan.objective, plan.broken, plan.epsilon, out.sigma, out.q, plan.steps, plan.canaries, r, v,
               epsilon_lower_bound(plan.canaries, r, v, DELTA), epsilon_lower_bound(plan.canaries, r, r, DELTA),
               separation, out.ledger_epsilon, shift, out.seconds)


def table(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table."""
    lines = ["| objective | step | ε declared | σ | ε of the ledger | canaries | guesses | correct | ε lower bound "
             "| bound if all correct | score gap / C | neighbour shift / C | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.objective} | {r.broken} | {r.epsilon:g} | {r.sigma:.3f} | {r.ledger_epsilon:.3f} | "
                     f"{r.canaries} | {r.guesses} | {r.correct} | {r.lower_bound:.2f} | {r.cap:.2f} | "
                     f"{r.separation:.1f} | {r.neighbour_shift:.2f} | {r.seconds:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilons", default="1,4,8", help="the declared ε of each audit")
    parser.add_argument("--objectives", default="fedavg,fedcma", help="fedavg, fedcma or both")
    parser.add_argument("--break", dest="broken", default="none,sensitivity2",
                        help="the steps to audit: none (hetfed's), sensitivity2 (each example clipped to 2C), or both; "
                             "the broken step runs on the first objective only")
    parser.add_argument("--canaries", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=120, help="expected batch (q = batch / training set size)")
    parser.add_argument("--real", type=int, default=1000, help="real (non-canary) examples")
    parser.add_argument("--guesses-per-side", type=int, default=0, help="k (default: 3%% of the canaries)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    parser.add_argument("--reachable", default="",
                        help="only print the highest bound these numbers of canaries can give (every guess right)")
    args = parser.parse_args(argv)
    if args.reachable:
        print("| canaries | highest ε lower bound | with guesses |\n|---|---|---|")
        for m in (int(x) for x in args.reachable.split(",")):
            bound, r = reachable(m, DELTA)
            print(f"| {m} | {bound:.2f} | {r} |")
        return []
    torch.set_num_threads(1)
    objectives = args.objectives.split(",")
    broken = args.broken.split(",")
    k = args.guesses_per_side or max(1, round(GUESS_SHARE * args.canaries))
    started = time.perf_counter()
    shifts: dict[tuple[str, str], float] = {}
    rows = []
    for eps in (float(e) for e in args.epsilons.split(",")):
        for objective in objectives:
            for step in broken:
                if step != "none" and objective != objectives[0]:
                    continue
                plan = Plan(objective, eps, args.canaries, args.steps, args.real, args.batch, k, step, args.seed)
                if (objective, step) not in shifts:
                    shifts[(objective, step)] = neighbour_shift(plan)
                rows.append(audit(plan, shifts[(objective, step)]))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    print(f"\nβ = {BETA}, δ = {DELTA:g}, C = {CLIP:g}, k = {k} guesses a side; {time.perf_counter() - started:.0f} s in all")
    if args.json:
        print(json.dumps([r.__dict__ for r in rows]))
    return rows


if __name__ == "__main__":
    main()
