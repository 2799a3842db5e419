"""The cosine drift baseline by hand."""

from __future__ import annotations

import pytest
import torch

from hetfed.client.algorithms.ditto.cosine import CosineDrift


def test_cosine_drift_by_hand() -> None:
    f_l = torch.tensor([[1.0, 0.0], [1.0, 1.0], [2.0, 0.0]])
    f_g = torch.tensor([[0.0, 1.0], [2.0, 2.0], [-1.0, 0.0]])
    # cos = 0, 1, −1: mean 0, so the term is 1
    assert float(CosineDrift()(f_l, f_g)) == pytest.approx(1.0, abs=1e-7)
    assert float(CosineDrift()(f_l[:2], f_g[:2])) == pytest.approx(0.5, abs=1e-7)
    with pytest.raises(ValueError, match="one shape"):
        CosineDrift()(f_l, f_g[:2])
