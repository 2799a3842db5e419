"""What Ditto's kernel drift measures share: the paper's bandwidth grid, the RBF map, float64 throughout."""

from __future__ import annotations

import math

import pytest
import torch

from hetfed.client.algorithms.ditto import kernels
from hetfed.client.algorithms.ditto.kernels import KERNEL_DTYPE, paper_gammas
from hetfed.client.algorithms.ditto.mmdd import MmdDLoss


def test_paper_gammas_are_the_19_powers_of_two_from_minus_3_5_to_1() -> None:
    g = paper_gammas()
    assert g.dtype == torch.float64 and g.numel() == 19
    assert float(g[0]) == pytest.approx(2.0**-3.5, rel=1e-15) and float(g[-1]) == 2.0
    assert torch.allclose(g[1:] / g[:-1], torch.full((18,), 2.0**0.25, dtype=torch.float64), rtol=0, atol=1e-15)


@pytest.mark.parametrize("form", ["rate", "scale"])
def test_rbf_squaring_path_equals_exp_on_three_distances(form: str) -> None:
    # k_{j+4} = k_j² on the 2^{p/4} grid: the squared values against math.exp on three hand-picked distances.
    sq = torch.tensor([0.0, 0.5, 3.0], dtype=torch.float64).repeat(2000)  # over the size threshold
    got = kernels.rbf(sq, paper_gammas(), form)
    assert kernels.doubling_period(paper_gammas() if form == "rate" else 1.0 / paper_gammas()) == 4
    for j, g in enumerate(paper_gammas().tolist()):
        for i, d in enumerate((0.0, 0.5, 3.0)):
            want = math.exp(-g * d) if form == "rate" else math.exp(-d / g)
            assert float(got[j, i]) == pytest.approx(want, rel=1e-14, abs=0.0)


def test_kernel_dtype_is_float64() -> None:
    assert KERNEL_DTYPE is torch.float64
    assert MmdDLoss(3).featurizer[0].weight.dtype == torch.float64
