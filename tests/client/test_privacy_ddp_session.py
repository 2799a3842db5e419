"""An organization's privacy session under distributed DP (Fed-CMA's class sums in a secure round): σ is solved
with the run's distributed releases in the plan, ε after each round is the accountant's composition (dp-accounting's
RDP of the Gaussian releases plus Theorem 3.5's of the Skellam sums, float64), the budget check counts the next
round's distributed release, a restart continues the ledger (ε is not restarted), and a plan whose distributed
releases alone exceed the target is refused in one line."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from hetfed.client.privacy.config import PrivacyConfig
from hetfed.client.privacy.ledger import DistributedRelease, Release, epsilon_with_distributed
from hetfed.client.privacy.mechanisms import PrivacyError
from hetfed.client.privacy.session import PrivacySession
from hetfed.secagg import ddp

N, B, ROUNDS, STEPS = 1000, 50, 6, 20
COUNT = Release(1.0, 20.0)
SETUP = Release(1.0, 10.0)  # Fed-CMA's noisy setup counts, a multiple of σ


def _plan(epsilon: float = 1.0) -> ddp.Plan:
    return ddp.choose(epsilon=epsilon, delta=1e-6, rounds=ROUNDS, dim=330, clip=1e5 * math.sqrt(33), clients=4,
                      honest=2, ring_bits=32, sensitivity=math.sqrt(33))


def _session(cfg: PrivacyConfig, state: Path | None = None) -> PrivacySession:
    s = PrivacySession(cfg, "run", "org", str(state) if state else None, N, torch.device("cpu"))
    s.release_examples()
    s.set_batch_size(B)
    return s


def _planned(s: PrivacySession, plan: ddp.Plan) -> float:
    return s.plan("dp-sgd+distributed-skellam", [SETUP], [Release(s.q, 1.0, STEPS)], ROUNDS,
                  distributed=[DistributedRelease.of(plan)])


def _round(s: PrivacySession, plan: ddp.Plan, round_: int) -> float:
    s.ledger.record(s.q, s.sigma, STEPS)
    s.ledger.record_distributed(DistributedRelease.of(plan))
    return s.close_round(round_).epsilon


def test_sigma_is_solved_with_the_distributed_rounds_and_every_round_is_the_accountants(tmp_path: Path) -> None:
    plan = _plan()
    s = _session(PrivacyConfig(epsilon_budget=3.0, noise_seed=1), tmp_path)
    sigma = _planned(s, plan)
    delta = s.delta
    d = DistributedRelease.of(plan)
    gaussian = [COUNT, Release(1.0, 10 * sigma), Release(s.q, sigma, STEPS * ROUNDS)]
    total = epsilon_with_distributed(gaussian, [dataclasses.replace(d, count=ROUNDS)], delta)
    assert s.planned_epsilon == pytest.approx(total, rel=1e-12) and total <= 3.0
    # 0.1% less noise would spend more than the budget: σ is the smallest that fits (to the solver's 0.1%).
    tighter = [COUNT, Release(1.0, 10 * sigma / 1.001), Release(s.q, sigma / 1.001, STEPS * ROUNDS)]
    assert epsilon_with_distributed(tighter, [dataclasses.replace(d, count=ROUNDS)], delta) > 3.0
    s.ledger.record(1.0, 10 * sigma)
    s.close_round(0)
    for r in range(1, ROUNDS + 1):
        assert s.exhausted_before(setup=False) is None
        eps = _round(s, plan, r)
        expected = epsilon_with_distributed([COUNT, Release(1.0, 10 * sigma), Release(s.q, sigma, STEPS * r)],
                                            [dataclasses.replace(d, count=r)], delta)
        assert eps == pytest.approx(expected, rel=1e-12)
    # The ledger holds one distributed event, counted once per round, with the assumption and the ring.
    (kept,) = s.ledger.distributed
    assert (kept.count, kept.honest, kept.clients, kept.ring_bits) == (ROUNDS, 2, 4, 32)
    # The budget check counts the next round's distributed release: without it the next round would fit.
    why = s.exhausted_before(setup=False)
    assert why is not None and "would be exceeded by the next round" in why
    assert s.ledger.epsilon([Release(s.q, sigma, STEPS)]) < s.ledger.epsilon([Release(s.q, sigma, STEPS)], [d])


def test_a_restart_continues_the_distributed_ledger(tmp_path: Path) -> None:
    plan = _plan()
    cfg = PrivacyConfig(epsilon_budget=3.0, noise_seed=2)
    first = _session(cfg, tmp_path)
    sigma = _planned(first, plan)
    _round(first, plan, 1)
    spent = _round(first, plan, 2)
    again = _session(cfg, tmp_path)
    assert again.sigma == sigma and _planned(again, plan) == sigma  # the ledger's σ wins
    assert again.spent() == spent > 0
    assert again.ledger.distributed == first.ledger.distributed and again.ledger.distributed[0].count == 2
    assert _round(again, plan, 3) > spent
    assert again.ledger.distributed[0].count == 3


def test_distributed_releases_that_alone_spend_the_target_are_refused_in_one_line() -> None:
    s = _session(PrivacyConfig(epsilon_budget=1.0, noise_seed=3))
    with pytest.raises(ValueError, match=r"the run's distributed class sums \(the run's ddp_epsilon\), with the "
                                         r"releases made before the plan, already spend ε=\d+\.\d+ of this "
                                         r"organization's target ε=1\.0"):
        _planned(s, _plan(epsilon=2.0))


def test_a_pld_accountant_refuses_a_distributed_plan() -> None:
    s = _session(PrivacyConfig(epsilon_budget=3.0, noise_seed=4, accountant="pld"))
    with pytest.raises(PrivacyError, match="accounted in Rényi DP"):
        _planned(s, _plan())
    assert np.isfinite(s.delta)
