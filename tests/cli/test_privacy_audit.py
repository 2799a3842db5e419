"""benchmarks/privacy_audit.py: the one-run ε lower bound on fixed counts, and a tiny audit through the real step
that tells a doubled sensitivity from hetfed's own."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
import torch

from tests.conftest import load_benchmark

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")


def reference_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """The paper's p-value written out term by term: P[W >= v] + 2mδ·max_i P[v − i <= W < v]/i, each probability
    a difference of scipy's binomial CDF."""
    p = math.exp(eps) / (1 + math.exp(eps))
    w = scipy.stats.binom(r, p)
    tail = 1.0 - float(w.cdf(v - 1))
    spread = max(((float(w.cdf(v - 1)) - float(w.cdf(v - i - 1))) / i for i in range(1, v + 1)), default=0.0)
    return min(1.0, tail + 2 * m * delta * spread)


@pytest.mark.parametrize(("m", "r", "v", "eps", "delta"), [
    (1000, 100, 80, 1.0, 1e-5), (1000, 100, 80, 2.0, 0.0), (5000, 600, 597, 4.0, 1e-5), (200, 20, 20, 1.5, 1e-3),
    (10_000, 600, 536, 1.9, 1e-5), (50, 10, 0, 0.5, 1e-2),
])
def test_p_value_matches_the_binomial_written_out(m: int, r: int, v: int, eps: float, delta: float) -> None:
    audit = load_benchmark("privacy_audit")
    assert audit.p_value(m, r, v, eps, delta) == pytest.approx(reference_p_value(m, r, v, eps, delta), rel=1e-9,
                                                               abs=1e-15)


def test_all_correct_without_delta_is_the_closed_form() -> None:
    """δ = 0 and v = r: P[W >= r] = p^r <= β gives p = β^(1/r) and ε = log(p/(1 − p)) exactly."""
    audit = load_benchmark("privacy_audit")
    for r in (10, 100, 600):
        p = 0.05 ** (1 / r)
        assert audit.epsilon_lower_bound(10_000, r, r, 0.0) == pytest.approx(math.log(p / (1 - p)), abs=1e-5)
    # Without δ, the most m canaries can show is every one of them guessed right.
    p = 0.05 ** (1 / 1000)
    assert audit.reachable(1000, 0.0) == (pytest.approx(math.log(p / (1 - p)), abs=1e-5), 1000)


def test_the_bound_is_the_largest_epsilon_at_level_beta() -> None:
    """On fixed counts: p-value at most β at the bound, above β just past it; δ only lowers the bound; half right
    is no evidence at all."""
    audit = load_benchmark("privacy_audit")
    m, r, v, delta = 10_000, 600, 536, 1e-5
    eps = audit.epsilon_lower_bound(m, r, v, delta)
    assert 1.5 < eps < 2.5
    assert audit.p_value(m, r, v, eps, delta) <= 0.05 < audit.p_value(m, r, v, eps + 1e-5, delta)
    assert eps < audit.epsilon_lower_bound(m, r, v, 0.0)
    assert audit.epsilon_lower_bound(m, r, r // 2, delta) == 0.0


def test_guesses_take_the_extremes() -> None:
    audit = load_benchmark("privacy_audit")
    scores = np.array([5.0, -3.0, 0.0, 4.0, -4.0, 1.0])
    included = np.array([True, False, True, False, False, True])
    # "in": scores 5 and 4 (canaries 0 and 3, one right); "out": -4 and -3 (canaries 4 and 1, both right).
    assert audit.guesses(scores, included, 2) == (4, 3)


def test_a_tiny_audit_tells_a_doubled_sensitivity_from_the_real_step() -> None:
    """Same seed, same canaries: the broken step's canaries stand out by about twice as much (the sum of their
    projections, in units of C, is about q·T for C and 2·q·T for 2C); every canary's gradient is clipped to C, so
    hetfed's own step separates them by about q·T."""
    audit = load_benchmark("privacy_audit")
    torch.set_num_threads(1)
    plan = audit.Plan("fedavg", 8.0, 100, 20, real=50, batch=20, seed=3)
    own = audit.run(plan)
    doubled = audit.run(audit.Plan("fedavg", 8.0, 100, 20, real=50, batch=20, seed=3, broken="sensitivity2"))
    np.testing.assert_array_equal(own.included, doubled.included)
    gap = [o.sums[o.included].mean() - o.sums[~o.included].mean() for o in (own, doubled)]
    q_t = own.q * plan.steps
    assert 0.5 * q_t < gap[0] < 1.5 * q_t
    assert gap[1] > 1.5 * gap[0]
    assert own.ledger_epsilon == pytest.approx(8.0, rel=0.01)  # the ledger spent what σ was solved for


def test_the_neighbour_probe_finds_twice_c_for_the_broken_step() -> None:
    audit = load_benchmark("privacy_audit")
    torch.set_num_threads(1)
    assert audit.neighbour_shift(audit.Plan("fedavg", 8.0, 1, 1, real=50, batch=20)) == pytest.approx(1.0, abs=1e-9)
    broken = audit.Plan("fedavg", 8.0, 1, 1, real=50, batch=20, broken="sensitivity2")
    assert audit.neighbour_shift(broken) == pytest.approx(2.0, abs=1e-9)


def test_the_neighbour_probe_finds_at_most_c_for_fedcma() -> None:
    """Fed-CMA's private objective is per example: one example moves its clipped sum by at most C (at af16776,
    before the step took per-example values at sum reduction, this probe found 2.02·C)."""
    audit = load_benchmark("privacy_audit")
    torch.set_num_threads(1)
    assert audit.neighbour_shift(audit.Plan("fedcma", 8.0, 1, 1, real=50, batch=20)) <= 1.0 + 1e-9


def test_the_script_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    audit = load_benchmark("privacy_audit")
    rows = audit.main(["--epsilons", "8", "--objectives", "fedavg,fedcma", "--break", "none,sensitivity2",
                       "--canaries", "60", "--steps", "10", "--batch", "10", "--real", "30"])
    out = capsys.readouterr().out
    assert "| objective | step | ε declared |" in out
    assert [(r.objective, r.broken) for r in rows] == [("fedavg", "none"), ("fedavg", "sensitivity2"),
                                                       ("fedcma", "none")]
    for r in rows:
        assert f"| {r.objective} | {r.broken} | 8 |" in out
        assert 0 <= r.correct <= r.guesses == 2 * 2 and 0.0 <= r.lower_bound <= r.cap
