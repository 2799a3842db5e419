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
