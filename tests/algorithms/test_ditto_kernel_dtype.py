"""``kernel_dtype = "float32"``: the reference code's float32 kernel maths for MK-MMD and MMD-D, against float64."""

from __future__ import annotations

import pytest
import torch

from hetfed.client.algorithms.ditto.mkmmd import MkMmdLoss
from hetfed.client.algorithms.ditto.mmdd import MmdDLoss
from hetfed.wire.config import ConfigError
from hetfed.wire.specs import get_spec


def _samples(n: int = 40, width: int = 20, shift: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, width, generator=g)
    return x, x + shift * torch.randn(n, width, generator=g) + shift


@pytest.mark.parametrize(("estimator", "form"), [("unbiased", "rate"), ("biased", "scale")])
def test_mkmmd_in_float32_matches_float64_to_float32_precision(estimator: str, form: str) -> None:
    x, y = _samples()
    kw = {"estimator": estimator, "bandwidth_form": form, "beta_init": "random", "seed": 3}
    m64, m32 = MkMmdLoss(**kw), MkMmdLoss(**kw, dtype=torch.float32)  # type: ignore[arg-type]
    assert m32.gammas.dtype == m32.beta.dtype == torch.float32
    torch.testing.assert_close(m32.beta.double(), m64.beta, rtol=1e-6, atol=0.0)  # one random start per seed
    d64, q64 = m64.statistics(x, y)
    d32, q32 = m32.statistics(x, y)
    assert d32.dtype == q32.dtype == torch.float32
    torch.testing.assert_close(d32.double(), d64, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(q32.double(), q64, rtol=1e-3, atol=1e-6)
    assert m64.refit(x, y) == m32.refit(x, y) == "qp"
    torch.testing.assert_close(m32.beta.double(), m64.beta, rtol=0.0, atol=1e-3)
    xg = x.clone().requires_grad_(True)
    value = m32(xg, y)
    assert value.dtype == torch.float32  # the input's dtype
    value.backward()
    x64 = x.clone().requires_grad_(True)
    m64(x64, y).backward()
    assert xg.grad is not None and x64.grad is not None
    torch.testing.assert_close(xg.grad.double(), x64.grad.double(), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("form", ["paper", "liu"])
def test_mmdd_in_float32_starts_from_the_float64_kernel_and_trains_alike(form: str) -> None:
    x, y = _samples(n=60, width=10)
    k64 = MmdDLoss(10, kernel_form=form, seed=5)  # type: ignore[arg-type]
    k32 = MmdDLoss(10, kernel_form=form, seed=5, dtype=torch.float32)  # type: ignore[arg-type]
    for (name, p64), (_, p32) in zip(k64.named_parameters(), k32.named_parameters(), strict=True):
        assert p32.dtype == torch.float32, name
        torch.testing.assert_close(p32.double(), p64.detach(), rtol=1e-6, atol=1e-7)
    v64, v32 = k64.train_kernel(x, y), k32.train_kernel(x, y)
    assert len(v32) == 5
    # σ_φ starts at 0.005, so float32's rounding of ‖φ_a‖² + ‖φ_b‖² − 2φ_a·φ_b (about 1e-6) moves k_φ by about
    # 1e-4 relative, and the criterion, a ratio of nearly cancelling sums, by a few 1e-3: the reference code's own
    # numerics (it computes the distances the same way in float32).
    for a, b in zip(v32, v64, strict=True):
        assert a == pytest.approx(b, rel=1e-2)
    m64, m32 = k64(x, y), k32(x, y)
    assert m32.dtype == torch.float32
    assert float(m32) == pytest.approx(float(m64), rel=1e-2)


def test_kernel_dtype_is_a_checked_config_field_that_reaches_the_modules() -> None:
    spec = get_spec("ditto_mmdd")
    assert spec.config().kernel_dtype == "float64"
    with pytest.raises(ConfigError, match="kernel_dtype: must be one of 'float64', 'float32', got 'float16'"):
        spec.parse({"kernel_dtype": "float16"}, "ditto_mmdd config")
    from hetfed.client.algorithms.ditto.client import LayerDrift

    for name, module in (("ditto_mmdd", MmdDLoss), ("ditto_mkmmd", MkMmdLoss)):
        cfg = get_spec(name).config(kernel_dtype="float32")
        drift = LayerDrift(cfg, 20, seed=0)
        assert isinstance(drift.module, module) and drift.module.dtype == torch.float32
    with pytest.raises(ValueError, match=r"MMD-D dtype must be torch\.float64 or torch\.float32"):
        MmdDLoss(4, dtype=torch.float16)
