"""DP-SGD's sensitivity on neighbouring data sets, for every algorithm and constraint that trains under DP.

Each case builds the algorithm's real client half under a privacy session and runs its own round (``train``,
or FedH2L's local step) through ``fit`` and the private step: σ = 0, q = 1 (the Poisson sample is the whole
training set), expected batch 1 and plain SGD at rate 1, so the step moves the private model's weights by
minus Σ_i clip_C(g_i). Adding or removing one example must move that sum by at most C; with every example's
gradient that of its own terms alone, it moves by exactly the added example's clipped gradient.
All in float64, from fixed seeds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from hetfed.client.algorithms import ClientContext, ClientHalf, client_half_type
from hetfed.client.algorithms.fedcma import FedCMAClient
from hetfed.client.algorithms.fedh2l import FedH2LClient
from hetfed.client.algorithms.simfed import SimFedClient
from hetfed.client.data import ArrayDataset, ClientData
from hetfed.client.data.seedset import SeedSet
from hetfed.client.privacy.config import PrivacyConfig
from hetfed.client.privacy.mechanisms import PrivateData, PrivateStep, prepare_model
from hetfed.client.privacy.session import PrivacySession
from hetfed.client.training import Batch, DeviceData, Forward, PerExample, trainable
from hetfed.wire.payloads import ClassMeanEmbeddings, EvalMetrics, HeadWeights, Received
from hetfed.wire.specs import get_spec

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

CPU = torch.device("cpu")
K, SHAPE, CLIP = 3, (1, 4, 4), 1.0
NOTHING = Received([], frozenset())
PLAIN_SGD = {"local_steps": 1, "batch_size": 4, "lr": 1.0, "momentum": 0.0, "weight_decay": 0.0}
# Fed-CMA: the federation's class totals make class 2 the one whose alignment weight N/Σ_j n_j^k is largest;
# this organization works with its released counts, the same on every neighbouring set.
TOTALS, COUNTS = np.array([40, 25, 3]), np.array([3, 2, 1])
MEANS = np.array([[0.9, 0.1], [0.1, 0.9], [0.95, 0.95]], np.float32)

FEDCMA = {"latent_dim": 2, "num_classes": K, "lambda2": 4.0, "server_lr": 0.2}

# name: (algorithm, config fields, model latent width).
CASES: dict[str, tuple[str, dict[str, Any], int | None]] = {
    "fedavg": ("fedavg", {}, None),
    "fedprox": ("fedprox", {"mu": 0.5}, None),
    "local": ("local", {}, None),
    "fedavg_head": ("fedavg_head", {}, None),
    "fedavg_body": ("fedavg_body", {}, None),
    "ditto": ("ditto", {"lam": 0.1}, None),
    "ditto_double_softmax": ("ditto", {"lam": 0.1, "double_softmax": True}, None),
    "ditto_cosine": ("ditto", {"lam": 0.1, "measure": "cosine", "mu": 0.5}, None),
    "ditto_mkmmd": ("ditto", {"lam": 0.1, "measure": "mkmmd", "mu": 0.5, "refit_every": -1}, None),
    "ditto_mmdd": ("ditto", {"lam": 0.1, "measure": "mmdd", "mu": 0.5, "refit_every": 1, "refit_batches": 1,
                             "mmdd_steps": 2}, None),
    "fedcma_paper": ("fedcma_paper", {**FEDCMA, "alignment": "paper"}, 2),
    "fedcma_reference": ("fedcma_paper", {**FEDCMA, "alignment": "reference"}, 2),
    "fedh2l": ("fedh2l", {"optimizer": "sgd"}, None),
    "simfed": ("simfed", {"mask_init": "sparse", "lambda1": 0.01}, None),
    # z of width 16: torch draws the reparameterisation noise of a batch row by row when a row is a multiple of
    # 16 values, so each example keeps its noise when one is added after it.
    "fedsr": ("fedsr", {"alpha_cmi": 0.0, "alpha_l2r": 0.5}, 16),
}


def examples(n: int, seed: int, labels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *SHAPE, generator=g, dtype=torch.float64), torch.tensor(labels, dtype=torch.int64)


BASE = examples(6, 1, [0, 0, 0, 1, 1, 2])
# Adversarial additions: an input a thousand times the usual norm (misclassified: its gradient is huge too), and
# an example of the class with the largest alignment weight.
HUGE = (examples(1, 2, [0])[0] * 1e3, torch.tensor([0]))
RARE = examples(1, 3, [2])
# Cross-entropy on the softmax of saturated logits has no gradient left: the huge example moves nothing there.
VANISHING = {"ditto_double_softmax"}


def seed_set() -> SeedSet:
    rng = np.random.default_rng(4)
    return SeedSet("toy-seed", rng.integers(0, 256, size=(6, *SHAPE), dtype=np.uint8), np.arange(6) % K,
                   np.zeros(6, dtype=np.int64))


def private_half(case: str, x: torch.Tensor, y: torch.Tensor,
                 clip: float = CLIP) -> ClientHalf:  # type: ignore[type-arg]
    """The case's client half on training set (x, y) under DP: σ = 0, C = ``clip``, q = 1, expected batch 1."""
    algorithm, fields, latent = CASES[case]
    spec = get_spec(algorithm)
    config = spec.config(**{**PLAIN_SGD, **fields})
    test = ArrayDataset(BASE[0][:2].numpy(), BASE[1][:2].numpy())
    data = ClientData(ArrayDataset(x.numpy(), y.numpy()), test, None, K, SHAPE, "toy",
                      public=seed_set() if algorithm == "fedh2l" else None, domain=0)
    half_type = client_half_type(spec)
    privacy_cfg = PrivacyConfig(noise_multiplier=1.0, clip_norm=clip)

    def build() -> Any:
        model = half_type.make_model("mlp", SHAPE, K, seed=5, latent_dim=latent,
                                     bounded_latent=spec.latent_bounded(config), config=config)
        return prepare_model(model, privacy_cfg, "org").double()

    session = PrivacySession(privacy_cfg, "run", "org", None, 1, CPU)
    # N̂ = 1 (expected batch qN̂ = 1), held as a restarted client holds it: the same on every neighbouring set.
    session.ledger.released["examples"] = 1
    assert session.release_examples() == 1
    session.q = 1.0
    session.ledger.noise_multiplier = 0.0
    half = half_type(ClientContext("org", build(), data, CPU, config, 5, build_model=build, privacy=session))
    half.check_privacy()
    # The training set in float64 (ArrayDataset holds float32), read through the session's Poisson sampling.
    assert isinstance(half.ctx.train, PrivateData)
    half.ctx.train.data = DeviceData(x, y)
    if isinstance(half, SimFedClient):  # its criteria inputs too
        half.criteria = half.criteria.double()
    # Skip the held-out evaluation, as in a round the round loop does not evaluate.
    half.ctx.evaluating, half.ctx.last_evaluation = False, EvalMetrics()
    return half


def clipped_sum(case: str, x: torch.Tensor, y: torch.Tensor, clip: float = CLIP,
                sample_rate: float = 1.0) -> torch.Tensor:
    """Σ_i clip_C(g_i) on (x, y), read off the step of the case's own round, flat over the private model; at
    ``sample_rate`` 0 the Poisson sample is empty (the step on no example: the data-free terms alone)."""
    half = private_half(case, x, y, clip)
    session = half.ctx.privacy
    assert session is not None
    received = NOTHING
    if isinstance(half, FedCMAClient):
        half.setup(7)
        half.counts = COUNTS.copy()
        received = Received([ClassMeanEmbeddings(np.arange(K), MEANS, TOTALS, np.ones(K, dtype=bool)),
                             HeadWeights(np.full((K, 2), 0.2, np.float32), np.zeros(K, np.float32))])
    session.begin_round(1, 11)
    assert isinstance(half.ctx.train, PrivateData)
    step = half.ctx.train.step
    half.ctx.train.step = PrivateStep(0.0, clip, sample_rate, 1.0, step.generator, step.ledger, session.hooked)
    model = half.ctx.model
    before = torch.cat([p.detach().reshape(-1) for p in trainable(model)])
    if isinstance(half, FedH2LClient):
        half.local(half.ctx.rng(11))
    else:
        half.train(1, 11, received)
    return before - torch.cat([p.detach().reshape(-1) for p in trainable(model)])


def cat(*parts: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def norm(v: torch.Tensor) -> float:
    return float(v.norm())


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_example_added_or_removed_moves_the_clipped_sum_by_at_most_c(case: str) -> None:
    """D: six examples. D + a huge-norm example, D + an example of the largest-weight class, D without its last
    example, and a batch of one against the empty sample: each pair's sums differ by at most C. The sum on D is
    no trivial zero, and the huge example's gradient is clipped to exactly C."""
    on_d = clipped_sum(case, *BASE)
    assert norm(on_d) > 0.05
    last = (BASE[0][-1:], BASE[1][-1:])
    pairs = {
        "D + huge": (clipped_sum(case, *cat(BASE, HUGE)), on_d),
        "D + rare": (clipped_sum(case, *cat(BASE, RARE)), on_d),
        "D - last": (on_d, clipped_sum(case, BASE[0][:-1], BASE[1][:-1])),
        "one - none": (clipped_sum(case, *last), clipped_sum(case, *last, sample_rate=0.0)),
    }
    for what, (bigger, smaller) in pairs.items():
        assert norm(bigger - smaller) <= CLIP + 1e-9, what
    if case not in VANISHING:
        moved = pairs["D + huge"][0] - on_d
        assert norm(moved) == pytest.approx(CLIP, abs=1e-9)  # far beyond C before clipping


@pytest.mark.parametrize("case", sorted(set(CASES) - {"fedsr"}))
def test_the_sum_moves_by_exactly_the_added_examples_own_clipped_gradient(case: str) -> None:
    """Every other example's clipped gradient is unchanged by the addition (to 1e-10): Σ(D + e) − Σ(D) equals
    Σ({e}) − Σ(∅), the step on e alone less the data-free part. FedSR's z noise depends on a row's place, so
    it is left out here (its bound is checked above)."""
    on_d = clipped_sum(case, *BASE)
    for extra in (HUGE, RARE):
        moved = clipped_sum(case, *cat(BASE, extra)) - on_d
        alone = clipped_sum(case, *extra) - clipped_sum(case, *extra, sample_rate=0.0)
        assert torch.allclose(moved, alone, rtol=0, atol=1e-10)
        assert norm(alone) <= CLIP + 1e-12
        assert norm(alone) > 0.05 or (extra is HUGE and case in VANISHING)


# ---------------------------------------------------------------------------------------------- the regression
def test_fedcma_alignment_gradient_does_not_scale_with_the_realised_batch() -> None:
    """Fed-CMA's private alignment on n = 30 copies of one example against 31. Each example's gradient here is
    g = g_ce + g_align. Scaled by the realised batch size (Opacus' mean reduction on a summed term) it would be
    g_ce + n·g_align, and at C = ‖g_ce + 31·g_align‖ the pair's sums would differ by nearly 2·C: asserted from
    the terms' own gradients, and measured at 1.97·C through this same step on the code that scaled so. The
    real step moves by g alone: to 1e-10, and far below C."""
    n = 30
    x, y = examples(1, 6, [2])
    x = x * 3.0
    half = private_half("fedcma_paper", x, y)
    assert isinstance(half, FedCMAClient)
    half.setup(7)
    half.counts = COUNTS.copy()
    half._receive(Received([ClassMeanEmbeddings(np.arange(K), MEANS, TOTALS, np.ones(K, dtype=bool)),
                            HeadWeights(np.full((K, 2), 0.2, np.float32), np.zeros(K, np.float32))]))
    ce, _, align = half.terms()
    assert isinstance(align, PerExample)
    model = half.ctx.model
    params = trainable(model)
    one = Batch(x, y)
    def flat_grad(value: torch.Tensor) -> torch.Tensor:
        grads = torch.autograd.grad(value, params, allow_unused=True)
        return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                          for g, p in zip(grads, params, strict=True)])

    g_ce = flat_grad(ce(one, Forward(model(x))))
    g_align = flat_grad(align.per_example(one, Forward(model(x))).sum())
    assert norm(g_align) > 4 * norm(g_ce)  # the alignment dominates

    def clip(g: torch.Tensor, c: float) -> torch.Tensor:
        return g * min(1.0, c / norm(g))

    c = norm(g_ce + (n + 1) * g_align)
    scaled = (n + 1) * clip(g_ce + (n + 1) * g_align, c) - n * clip(g_ce + n * g_align, c)
    assert norm(scaled) > 1.9 * c

    def real_step(copies: int) -> torch.Tensor:
        return clipped_sum("fedcma_paper", x.expand(copies, *SHAPE).clone(), y.expand(copies).clone(), c)

    moved = real_step(n + 1) - real_step(n)
    assert torch.allclose(moved, g_ce + g_align, rtol=0, atol=1e-10)
    assert norm(moved) < c / 10


# ---------------------------------------------------------------------------------------------- the reported loss
def test_the_reported_loss_is_the_batch_mean_of_the_per_example_objective() -> None:
    """Fed-CMA's reported training loss under DP: mean cross-entropy plus the mean of the alignment's
    per-example values plus the head consensus (data-free), as the step saw them."""
    half = private_half("fedcma_reference", *BASE)
    assert isinstance(half, FedCMAClient)
    half.setup(7)
    half.counts = COUNTS.copy()
    received = Received([ClassMeanEmbeddings(np.arange(K), MEANS, TOTALS, np.ones(K, dtype=bool)),
                         HeadWeights(np.full((K, 2), 0.3, np.float32), np.zeros(K, np.float32))])
    half._receive(received)
    model = half.ctx.model
    with torch.no_grad():
        model.head.weight.fill_(0.1)  # away from v̄, so the consensus is not zero
    _, consensus, align = half.terms()
    assert isinstance(align, PerExample)
    batch = Batch(*BASE)
    with torch.no_grad():
        out = Forward(model(BASE[0]))
        z = model.embed(BASE[0])
        # By hand: each example's alignment λ2·(N/n_i^k)/d_e·Σ_dims (g(x) − ē^k)² (reference form, N = 1).
        by_hand = [4.0 * (1.0 / COUNTS[k]) / 2 * float(((z[i] - torch.as_tensor(MEANS[k]).double()) ** 2).sum())
                   for i, k in enumerate(BASE[1].tolist())]
        want = float(F.cross_entropy(out.logits, BASE[1])) + float(np.mean(by_hand)) + float(consensus(batch, out))
        assert torch.allclose(align.per_example(batch, out), torch.tensor(by_hand, dtype=torch.float64),
                              rtol=1e-6, atol=0)  # the weights are float32
    session = half.ctx.privacy
    assert session is not None
    session.begin_round(1, 11)
    assert isinstance(half.ctx.train, PrivateData) and isinstance(half.ctx.train.step, PrivateStep)
    half.ctx.last_evaluation = EvalMetrics()
    upload = half.train(1, 11, NOTHING)  # nothing new received: the same ē, v̄ and head as above
    metrics = next(p for p in upload if isinstance(p, EvalMetrics))
    assert metrics.train_loss == pytest.approx(want, rel=1e-6)
