"""The ledger's distributed releases (distributed DP under secure aggregation): what one records (the t-of-n
assumption, the ring, the sensitivities after rounding), ε alone and composed with Gaussian releases against a
float64 reference, continued across restarts, and refused where the accountant cannot compose it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hetfed.client.privacy.ledger import (
    FILE_NAME,
    DistributedRelease,
    Ledger,
    LedgerError,
    Release,
    epsilon_of,
    epsilon_with_distributed,
)
from hetfed.secagg.ddp import ORDERS, Plan, epsilon_from_rdp, skellam_rdp

# Fed-CMA's class sums for K = 10 classes of latent 64: d = 650 (D = 1024), each organization's vector clipped to
# 1,000, one example moving it by at most √2; 8 organizations, 5 assumed honest, a 32-bit ring.
PLAN = Plan(dim=650, clip=1000.0, scale=2e5, local_variance=(2e5 * 3.0) ** 2, clients=8, honest=5, ring_bits=32,
            sensitivity=2**0.5)
DELTA = 1e-5


def open_ledger(state: Path | None, accountant: str = "rdp") -> Ledger:
    return Ledger.open(str(state) if state is not None else None, "run-a", "org-1", delta=DELTA,
                       accountant=accountant, noise_multiplier=1.0, clip_norm=1.0)


def test_a_distributed_release_records_the_assumption_and_the_parameters() -> None:
    r = DistributedRelease.of(PLAN, count=3)
    l2 = 2e5 * 2**0.5 + 32  # s·Δ + √D
    assert r.l2 == pytest.approx(l2, rel=1e-15) and r.l1 == pytest.approx(l2 * 32, rel=1e-15)
    assert r.variance == 5 * (2e5 * 3.0) ** 2  # the 5 honest shares, not the 8
    assert (r.honest, r.clients, r.ring_bits, r.scale, r.count) == (5, 8, 32, 2e5, 3)
    assert r.wrap == PLAN.wrap_bound() < 1e-6
    assert np.array_equal(r.rdp(), 3 * skellam_rdp(l2, l2 * 32, 5 * (2e5 * 3.0) ** 2))


def test_epsilon_of_distributed_rounds_alone_is_the_plans(tmp_path: Path) -> None:
    led = open_ledger(tmp_path)
    for round_ in range(1, 51):
        led.record_distributed(DistributedRelease.of(PLAN))
        assert led.epsilon() == pytest.approx(PLAN.epsilon(round_ - 1, DELTA) if round_ > 1 else 0.0, rel=1e-12)
        led.close_round(round_)
    assert led.distributed == [DistributedRelease.of(PLAN, count=50)]
    assert led.epsilon() == pytest.approx(PLAN.epsilon(50, DELTA), rel=1e-12)
    # Assuming more honest organizations counts more noise: a lower ε for the same shares.
    trusting = Plan(**{**PLAN.__dict__, "honest": 8})
    assert trusting.epsilon(50, DELTA) < led.epsilon()


def test_distributed_and_gaussian_releases_compose_in_rdp_against_a_float64_reference() -> None:
    """50 rounds of the Skellam sum and 1 Gaussian release of noise multiplier 20 (the example count): RDP adds
    order by order, the Gaussian's α/(2σ²) at each integer order, then one conversion."""
    led = open_ledger(None)
    led.record(1.0, 20.0)
    led.record_distributed(DistributedRelease.of(PLAN, count=50))
    led.close_round(1)
    a = np.asarray(ORDERS, np.float64)
    reference = a / (2 * 20.0**2) + 50 * skellam_rdp(*PLAN.sensitivity_bounds(), PLAN.central_variance)
    assert led.epsilon() == pytest.approx(epsilon_from_rdp(reference, DELTA), rel=1e-12)
    assert led.epsilon() > PLAN.epsilon(50, DELTA)
    # Without distributed releases the helper is the ledger's Gaussian composition, at the integer orders.
    assert epsilon_with_distributed([Release(1.0, 2.0, 10)], [], DELTA) == pytest.approx(
        epsilon_of([Release(1.0, 2.0, 10)], DELTA), rel=2e-3)
    # What a next round would cost, asked without spending it.
    assert led.epsilon(extra_distributed=[DistributedRelease.of(PLAN)]) > led.epsilon()
    assert led.distributed == [DistributedRelease.of(PLAN, count=50)]


def test_distributed_releases_are_kept_on_disk_and_continued(tmp_path: Path) -> None:
    led = open_ledger(tmp_path)
    led.record_distributed(DistributedRelease.of(PLAN, count=2))
    path = tmp_path / "run-a" / FILE_NAME
    assert not path.exists()  # pending until the round closes
    eps = led.close_round(1)
    on_disk = json.loads(path.read_text())
    assert on_disk["format"] == 3 and on_disk["epsilon"] == eps
    [entry] = on_disk["distributed"]
    assert entry["honest"] == 5 and entry["clients"] == 8 and entry["ring_bits"] == 32 and entry["count"] == 2
    again = open_ledger(tmp_path)
    assert again.distributed == led.distributed and again.epsilon() == eps
    again.record_distributed(DistributedRelease.of(PLAN))
    assert again.close_round(2) > eps


def test_a_format_2_ledger_is_continued_without_distributed_releases(tmp_path: Path) -> None:
    led = open_ledger(tmp_path)
    led.record(1.0, 20.0)
    eps = led.close_round(1)
    path = tmp_path / "run-a" / FILE_NAME
    raw = json.loads(path.read_text())
    del raw["distributed"]
    path.write_text(json.dumps({**raw, "format": 2}))
    again = open_ledger(tmp_path)
    assert again.distributed == [] and again.epsilon() == eps


def test_a_pld_ledger_refuses_a_distributed_release() -> None:
    led = open_ledger(None, accountant="pld")
    with pytest.raises(LedgerError, match="Rényi DP"):
        led.record_distributed(DistributedRelease.of(PLAN))
