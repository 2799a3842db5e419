"""benchmarks/ddp_noise.py: one small cell, its measured noise against the plan's and today's local Gaussian."""

from __future__ import annotations

import math

import pytest

from tests.conftest import load_benchmark


def test_a_cell_measures_the_noise_the_plan_says_and_less_per_organization_than_today() -> None:
    bench = load_benchmark("ddp_noise")
    row = bench.cell(4, 3.0, trials=2)
    assert row["plan_epsilon"] <= 3.0 and row["honest"] == 3
    # The decoded sum's error is the n shares' noise (the rounding adds 1/s): 4 x 330 x 2 draws, within 10%.
    assert row["measured_sum_std"] == pytest.approx(row["sum_std_ddp"], rel=0.1)
    # The accountant counts t = 3 shares: about today's noise (within 1%), each share 1/√3 of it.
    assert row["counted_std"] == pytest.approx(row["local_gaussian_std"], rel=0.01)
    assert row["share_std"] == pytest.approx(row["counted_std"] / math.sqrt(3), rel=1e-9)
    assert row["wrap_bound"] <= 1e-6 and row["rounding_inflation"] < 1e-3
    assert bench.wrap(0.0) == "< 1e-300" and "| 4 | 3 | 3 |" in bench.table([row])


def test_the_whole_vector_rows_need_the_gaussians_noise_for_one_organizations_vector() -> None:
    """--whole-vector: one organization's clipped vector (c = 1) the unit. The counted noise is what the local
    Gaussian of sensitivity c needs at the same ε (within 1%: Skellam and integer orders), and the ratio is that
    noise over c/√d."""
    bench = load_benchmark("ddp_noise")
    (row,) = bench.whole_vector_rows([4], [8.0], 10, [7850])
    z = bench.local_multiplier(8.0, 1e-5, 10)
    assert row["central_std"] == pytest.approx(z, rel=0.01)
    assert row["ratio"] == pytest.approx(row["central_std"] * math.sqrt(7850), rel=1e-12)
    assert row["ratio"] > 100  # one organization's update is drowned: why FedAvg keeps DP-SGD
