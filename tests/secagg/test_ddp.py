"""Distributed DP (hetfed.secagg.ddp): the rotation, the encode/decode round trip, the Skellam shares' sum, the
sensitivity after rounding on neighbouring data sets, the RDP against hand-computed values and dp-accounting,
and the wrap-around bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import GaussianDpEvent, SelfComposedDpEvent
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon
from scipy import stats

from hetfed.secagg import SecAggError
from hetfed.secagg.ddp import (
    ORDERS,
    Plan,
    Rotation,
    choose,
    epsilon_from_rdp,
    hadamard,
    padded,
    rounded_l2_bound,
    skellam_rdp,
    skellam_tail,
)


def plan(**kw: object) -> Plan:
    base: dict[str, object] = {"dim": 10, "clip": 1.0, "scale": 100.0, "local_variance": 0.0, "clients": 4,
                               "honest": 3, "ring_bits": 32}
    base.update(kw)
    return Plan(**base)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ the rotation
def test_walsh_hadamard_is_sylvesters_matrix_exactly() -> None:
    assert hadamard(np.array([1, 2, 3, 4])).tolist() == [10, -2, -4, 0]
    for size in (1, 2, 4, 8, 64, 256):
        h = hadamard(np.eye(size, dtype=np.int64))
        assert set(np.unique(h)) <= {-1, 1}
        assert np.array_equal(h @ h.T, size * np.eye(size, dtype=np.int64))  # orthogonal up to √D, in integers
    with pytest.raises(SecAggError, match="power of two"):
        hadamard(np.zeros(6))


def test_the_rotation_is_orthogonal_and_inverts_exactly_on_integers() -> None:
    rot = Rotation(100, seed=7)
    assert rot.size == padded(100) == 128
    signs = rot.signs()
    assert set(np.unique(signs)) == {-1, 1} and np.array_equal(signs, Rotation(100, seed=7).signs())
    assert not np.array_equal(signs, Rotation(100, seed=8).signs())
    # U = H·diag(ξ)/√D: (H·diag(ξ))ᵀ(H·diag(ξ)) = D·I exactly, in integers.
    m = hadamard(np.eye(128, dtype=np.int64)) * signs
    assert np.array_equal(m.T @ m, 128 * np.eye(128, dtype=np.int64))
    x = np.random.default_rng(0).normal(size=100)
    y = rot.forward(x)
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-14)
    assert np.max(np.abs(rot.inverse(y) - x)) < 1e-14


# ------------------------------------------------------------------------------------------------ round trip
def test_a_vector_the_grid_holds_decodes_exactly() -> None:
    """x = 2·ξ₀·e₀ in 4 dimensions rotates to (1, 1, 1, 1); at scale 3 it is the integers (3, 3, 3, 3), which
    stochastic rounding keeps, so the decoded value is x to the last bit."""
    p = plan(dim=4, clip=2.0, scale=3.0, clients=1, honest=1)
    seed = 11
    x = np.zeros(4)
    x[0] = 2.0 * Rotation(4, seed).signs()[0]
    z = p.rounded(x, seed, np.random.default_rng(0))
    assert z.tolist() == [3, 3, 3, 3]
    assert p.decode(p.encode(x, seed, np.random.default_rng(0)), seed, 1).tolist() == x.tolist()


@pytest.mark.parametrize("beta", [0.0, math.exp(-0.5)])
def test_the_round_trip_error_stays_within_its_bound(beta: float) -> None:
    """Without noise, n vectors decode to the sum of their clipped values within n·√D/s in L2 (each rounding error
    below 1 per coordinate; the rotation keeps norms); and the rounding is unbiased."""
    p = plan(dim=50, clip=2.0, scale=10.0, clients=5, honest=5, beta=beta)
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=50) * 0.5 for _ in range(5)]
    clipped = sum(x * min(1.0, 2.0 / float(np.linalg.norm(x))) for x in xs)
    errors = []
    for trial in range(200):
        total = sum(p.encode(x, 1000 + trial, np.random.default_rng([trial, i])) for i, x in enumerate(xs))
        assert total.dtype == np.uint32 and total.shape == (64,)
        err = p.decode(np.asarray(total, np.uint32), 1000 + trial, 5) - clipped
        assert np.linalg.norm(err) <= 5 * math.sqrt(64) / 10.0
        errors.append(err)
    # unbiased: the mean error over 200 trials is within 5 standard errors (each coordinate's variance <= 5/4/s²)
    assert np.max(np.abs(np.mean(errors, axis=0))) < 5 * math.sqrt(5 / 4) / 10.0 / math.sqrt(200)


def test_conditional_rounding_keeps_the_papers_norm_bound() -> None:
    """rounded_l2_bound(c·s, β, D) = min(cs + √D, √((cs)² + D/4 + √(2 ln 1/β)(cs + √D/2))): every rounded vector
    stays within it, and some draws are refused on the way (β is their probability at most)."""
    assert rounded_l2_bound(10.0, math.exp(-0.5), 4) == pytest.approx(math.sqrt(112), rel=1e-15)
    assert rounded_l2_bound(10.0, 0.0, 4) == 12.0
    # Every coordinate of the rotated, scaled vector at 1/2: each rounds up or down with probability 1/2, the
    # hardest case for the bound (norm² = D/4 + D/4 on average).
    p = plan(dim=256, clip=2.0, scale=4.0, beta=0.9)
    bound = p.norm_bound
    slack = math.sqrt(2 * math.log(1 / 0.9)) * (8 + 8)
    assert bound == pytest.approx(math.sqrt(64 + 64 + slack), rel=1e-15)
    x = Rotation(256, 3).inverse(np.full(256, 0.5)) / 4.0
    refused = 0
    for trial in range(300):
        z = p.rounded(x, 3, np.random.default_rng(trial))
        assert np.linalg.norm(z) <= bound and set(np.unique(z)) <= {0, 1}
        once = np.random.default_rng(trial).random(256) < 0.5
        refused += bool(math.sqrt(once.sum()) > bound)
    assert 0.05 * 300 < refused < 0.9 * 300  # refused at most with probability β


# ------------------------------------------------------------------------------------------------ the noise
def test_the_sum_of_n_skellam_shares_is_skellam_of_n_times_the_share() -> None:
    """16 clients each add Sk(0, 0.75) per coordinate: their sum is Sk(0, 12) (mean 0, variance 12, and its pmf
    by chi-square), over 1,000 seeded rounds of 64 coordinates. A sum drawn at the wrong variance fails it."""
    p = plan(dim=64, local_variance=0.75, clients=16, honest=9)
    draws = np.stack([sum(p.noise(np.random.default_rng([r, c])) for c in range(16)) for r in range(1000)]).ravel()
    assert draws.dtype == np.int64 and draws.size == 64_000
    assert abs(draws.mean()) < 4 * math.sqrt(12 / draws.size)
    assert draws.var() == pytest.approx(12.0, abs=4 * 12 * math.sqrt(2 / draws.size))

    def chi2_p(values: np.ndarray, variance: float) -> float:
        dist = stats.skellam(variance / 2, variance / 2)
        ks = np.arange(-25, 26)
        expected = dist.pmf(ks) * values.size
        expected[0] += dist.cdf(-26) * values.size
        expected[-1] += dist.sf(25) * values.size
        observed = np.array([np.sum(values == k) for k in ks], dtype=np.float64)
        observed[0] += np.sum(values < -25)
        observed[-1] += np.sum(values > 25)
        return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)

    assert chi2_p(draws, 12.0) > 1e-3
    assert chi2_p(draws, 13.0) < 1e-6  # the test can tell


def test_the_accountant_counts_only_the_honest_shares() -> None:
    p = plan(local_variance=5.0, clients=8, honest=5)
    assert p.central_variance == 25.0
    assert p.central_std() == pytest.approx(5.0 / 100.0) and p.local_std() == pytest.approx(math.sqrt(5) / 100)
    assert np.array_equal(p.rdp(), skellam_rdp(*p.sensitivity_bounds(), 25.0))
    with pytest.raises(SecAggError, match="honest"):
        plan(clients=4, honest=5)


def test_numpy_poisson_keeps_its_variance_up_to_the_cap() -> None:
    """MAX_LOCAL_VARIANCE = 2^41: each Poisson of a share has λ = 2^40, where numpy's sampler keeps the variance
    (10^6 draws: within 0.5%); beyond the cap a plan is refused."""
    lam = 2.0**40
    draws = np.random.default_rng(3).poisson(lam, 1_000_000).astype(np.float64)
    assert draws.var() / lam == pytest.approx(1.0, abs=5e-3)
    with pytest.raises(SecAggError, match="local variance"):
        plan(local_variance=2.0**41 * 1.01)


# ------------------------------------------------------------------------------------------------ neighbours
@pytest.mark.parametrize("replace", [False, True], ids=["removed", "replaced"])
def test_one_example_moves_the_pre_noise_integer_sum_by_at_most_the_stated_sensitivity(replace: bool) -> None:
    """Each organization's vector is a sum of per-example terms clipped to C = 0.5; one example of organization 0
    removed (Δ = C) or replaced (Δ = 2C). With the same rounding uniforms (the coupling the proof uses), the sum of
    the rounded vectors moves by at most Δ2 = s·Δ + √D in L2 and Δ1 = Δ2·min(√D, Δ2) in L1, on random and on
    adversarial (grid-straddling) data; and by nearly s·Δ, so the bound is not idle."""
    c_ex, dim, n = 0.5, 30, 3
    delta = 2 * c_ex if replace else c_ex
    p = plan(dim=dim, clip=40.0, scale=7.3, clients=n, honest=2, sensitivity=delta)
    l2, l1 = p.sensitivity_bounds()
    assert l2 == pytest.approx(7.3 * delta + math.sqrt(32)) and l1 == pytest.approx(l2 * math.sqrt(32))
    rng = np.random.default_rng(4)

    def clipped(e: np.ndarray) -> np.ndarray:
        return e * min(1.0, c_ex / float(np.linalg.norm(e)))

    worst2, worst1 = 0.0, 0.0
    for trial in range(200):
        examples = [[clipped(rng.normal(size=dim)) for _ in range(20)] for _ in range(n)]
        if trial % 2:  # an example on the clip, the others straddling the rounding grid
            examples[0][0] = c_ex * np.eye(dim)[trial % dim]
        other = clipped(rng.normal(size=dim)) if replace else np.zeros(dim)
        if replace:
            other *= c_ex / np.linalg.norm(other)
        before = sum(p.rounded(sum(ex), trial, np.random.default_rng([trial, i])) for i, ex in enumerate(examples))
        moved = [list(ex) for ex in examples]
        moved[0][0] = other
        after = sum(p.rounded(sum(ex), trial, np.random.default_rng([trial, i])) for i, ex in enumerate(moved))
        diff = (after - before).astype(np.float64)
        worst2, worst1 = max(worst2, float(np.linalg.norm(diff))), max(worst1, float(np.abs(diff).sum()))
    assert worst2 <= l2 and worst1 <= l1
    assert worst2 > 0.5 * 7.3 * delta  # the move is real


def test_a_whole_vector_neighbour_moves_the_sum_by_at_most_the_rounded_norm_bound() -> None:
    """The paper's unit: organization 0's vector present or absent (an empty data set encodes to zero)."""
    p = plan(dim=100, clip=3.0, scale=20.0, beta=math.exp(-0.5))
    assert p.sensitivity_bounds()[0] == p.norm_bound
    assert p.rounded(np.zeros(100), 5, np.random.default_rng(0)).tolist() == [0] * 128
    rng = np.random.default_rng(6)
    for trial in range(100):
        z = p.rounded(rng.normal(size=100) * 5, trial, np.random.default_rng(trial))
        assert np.linalg.norm(z) <= p.norm_bound and np.abs(z).sum() <= p.sensitivity_bounds()[1]


def test_plans_that_break_the_proofs_assumptions_are_refused() -> None:
    """A per-example sensitivity with conditional rounding (the coupling breaks), a sensitivity beyond the clip, a
    scaled clip past float64's fraction bits."""
    with pytest.raises(SecAggError, match="beta = 0"):
        plan(sensitivity=0.5, beta=0.1)
    with pytest.raises(SecAggError, match="sensitivity"):
        plan(sensitivity=2.0)
    with pytest.raises(SecAggError, match="below 2\\^52"):
        plan(clip=2.0**30, scale=2.0**22)


# ------------------------------------------------------------------------------------------------ accounting
def test_skellam_rdp_against_hand_computed_values() -> None:
    # α Δ2²/(2μ) + min(((2α-1)Δ2² + 6Δ1)/(4μ²), 3Δ1/(2μ))
    assert skellam_rdp(10.0, 30.0, 100.0, (2, 3)).tolist() == pytest.approx([1 + 480 / 40000, 1.5 + 680 / 40000],
                                                                            rel=1e-15)
    assert skellam_rdp(1.0, 1.0, 1.0, (2,)).tolist() == [1.0 + 1.5]  # the second branch of the min
    # A plan: D = 4, s = 10, Δ = 0.5: Δ2 = 5 + 2 = 7, Δ1 = 7·2 = 14, μ = 2 honest x 25 = 50.
    p = plan(dim=3, scale=10.0, local_variance=25.0, clients=4, honest=2, sensitivity=0.5)
    assert p.sensitivity_bounds() == (7.0, 14.0)
    assert p.rdp((2,)).tolist() == pytest.approx([98 / 100 + 231 / 10000], rel=1e-15)
    with pytest.raises(SecAggError, match="integer"):
        skellam_rdp(1.0, 1.0, 1.0, (2.5,))  # type: ignore[arg-type]


def test_skellam_rdp_bounds_the_exact_renyi_divergence_of_one_coordinate() -> None:
    """One coordinate, an integer shift Δ (Δ2 = Δ1 = Δ): the exact D_α(Sk(Δ, μ) ‖ Sk(0, μ)), summed over the pmf in
    float64, stays below Theorem 3.5's ε(α), and within 1% of it at μ = 1000. Reading μ as each Poisson's mean
    (variance 2μ) instead of the variance would fall below the exact value: the convention is checked."""
    from scipy.special import logsumexp

    for mu in (2.0, 10.0, 100.0, 1000.0):
        dist = stats.skellam(mu / 2, mu / 2)
        for shift in (1, 3):
            reach = int(shift + 25 * math.sqrt(mu) + 40)
            k = np.arange(-reach, reach + 1)
            lp, lq = dist.logpmf(k - shift), dist.logpmf(k)
            assert np.isfinite(lp).all() and np.isfinite(lq).all()
            for a in (2, 4, 16):
                exact = float(logsumexp(a * lp + (1 - a) * lq)) / (a - 1)
                bound = float(skellam_rdp(float(shift), float(shift), mu, (a,))[0])
                assert exact <= bound * (1 + 1e-9)
                if mu == 1000.0:
                    assert bound <= exact * 1.01
                if mu >= 100.0:
                    assert float(skellam_rdp(float(shift), float(shift), 2 * mu, (a,))[0]) < exact


def test_epsilon_from_rdp_is_dp_accountings_conversion() -> None:
    rng = np.random.default_rng(7)
    for _ in range(50):
        curve = np.exp(rng.uniform(-6, 3)) * np.asarray(ORDERS, np.float64) ** rng.uniform(0.5, 1.5)
        delta = float(10 ** rng.uniform(-9, -3))
        theirs, _ = compute_epsilon(ORDERS, curve, delta)
        assert epsilon_from_rdp(curve, delta) == pytest.approx(float(theirs), rel=1e-12, abs=1e-15)


def test_skellam_converges_to_dp_accountings_gaussian_as_the_scale_grows() -> None:
    """Δ = 1, central noise σ·s·Δ in the integer domain: as s grows, the rounding's √D and the Skellam terms fade,
    and ε over 50 rounds falls to dp-accounting's for 50 Gaussian releases of noise multiplier σ, from above."""
    sigma, rounds, delta = 4.0, 50, 1e-5
    acc = RdpAccountant(orders=[float(a) for a in ORDERS])
    acc.compose(SelfComposedDpEvent(GaussianDpEvent(sigma), rounds))
    gaussian = float(acc.get_epsilon(delta))
    gaps = []
    for scale in (10.0, 1e2, 1e3, 1e4, 1e5, 1e6):
        p = plan(dim=64, clip=1.0, scale=scale, local_variance=(sigma * scale) ** 2 / 16, clients=16, honest=16,
                 sensitivity=1.0)
        gaps.append(p.epsilon(rounds, delta) / gaussian - 1)
    assert all(g > 0 for g in gaps) and gaps == sorted(gaps, reverse=True)
    assert gaps[-1] < 2e-5 and gaps[0] > 0.5
    # and the per-order RDP itself: α/(2σ²) to 1e-4
    assert np.allclose(p.rdp(), np.asarray(ORDERS) / (2 * sigma**2), rtol=2e-5)


def test_the_solved_plan_spends_its_target_and_fits_the_ring() -> None:
    p = choose(epsilon=3.0, delta=1e-5, rounds=50, dim=650, clip=100.0, clients=8, honest=5, ring_bits=32,
               sensitivity=1.0)
    assert 2.99 < p.epsilon(50, 1e-5) <= 3.0
    assert p.wrap_bound() <= 1e-6
    assert p.honest == 5 and p.size == 1024
    tighter = Plan(**{**p.__dict__, "local_variance": p.local_variance * 0.99})
    assert tighter.epsilon(50, 1e-5) > 3.0  # the noise is the least that reaches the target (to 1%)
    # The paper's rule (k = 3) gives a larger scale and a wrap bound that covers one coordinate only.
    loose = choose(epsilon=3.0, delta=1e-5, rounds=50, dim=650, clip=100.0, clients=8, honest=5, ring_bits=20,
                   sensitivity=1.0, k=3.0)
    assert 2.99 < loose.epsilon(50, 1e-5) <= 3.0
    with pytest.raises(SecAggError, match="cannot hold"):
        choose(epsilon=3.0, delta=1e-5, rounds=50, dim=650, clip=100.0, clients=8, honest=5, ring_bits=4)


# ------------------------------------------------------------------------------------------------ wrap-around
def test_the_tail_bound_against_its_closed_forms() -> None:
    a, v = 40.0, 100.0
    closed = math.exp(-a * math.asinh(a / v) + v * (math.sqrt(1 + (a / v) ** 2) - 1))
    assert skellam_tail(a, v) == pytest.approx(closed, rel=1e-9)
    assert skellam_tail(a, 0.0, 100.0) == pytest.approx(math.exp(-(a**2) / 200), rel=1e-9)  # Gaussian Chernoff
    assert skellam_tail(0.0, v) == 1.0 and skellam_tail(1.0, 0.0, 0.0) == 0.0
    # Chernoff bounds the real tail: Sk(0, 100) beyond 40
    assert stats.skellam(50, 50).sf(40) <= closed


def test_wraps_happen_no_more_often_than_the_bound_and_otherwise_the_sum_decodes() -> None:
    """A 12-bit ring, 4 clients, D = 16: over 400 seeded rounds the centred sum differs from the unreduced sum
    (a wrap) in at most the bounded share of rounds, and equals it in every other round."""
    p = plan(dim=16, clip=1.0, scale=300.0, local_variance=300.0**2, clients=4, honest=3, ring_bits=12)
    bound = p.wrap_bound()
    assert 0.01 < bound < 1
    rng = np.random.default_rng(8)
    wrapped = 0
    for r in range(400):
        xs = [rng.normal(size=16) for _ in range(4)]
        parts, total = [], np.zeros(16, p.dtype)
        for i, x in enumerate(xs):
            g = np.random.default_rng([r, i])
            parts.append(p.rounded(x, r, g) + p.noise(g))
            encoded = p.encode(x, r, np.random.default_rng([r, i]))  # the same draws, reduced mod 2^12
            assert np.array_equal(encoded, parts[-1] & ((1 << 12) - 1)) and encoded.max() < 1 << 12
            total = (total + encoded) & p.dtype((1 << 12) - 1)
        plain = sum(parts)
        same = np.array_equal(p.centred(total), plain)
        wrapped += not same
        if same:
            assert np.allclose(p.decode(total, r, 4), Rotation(16, r).inverse(plain.astype(np.float64)) / 300.0)
    assert 0 < wrapped <= bound * 400  # 4 of 400 rounds wrap; the bound allows 124


def test_a_sum_of_fewer_inputs_than_the_honest_count_is_refused() -> None:
    p = plan(dim=4, clients=4, honest=3)
    total = np.zeros(4, np.uint32)
    with pytest.raises(SecAggError, match="2 inputs; the plan counts the noise of 3 honest") as err:
        p.decode(total, 1, 2)
    assert err.value.reason == "below_threshold"
    assert p.decode(total, 1, 3).tolist() == [0.0] * 4
    with pytest.raises(SecAggError, match="5 inputs"):
        p.decode(total, 1, 5)
