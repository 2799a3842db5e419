"""The finiteness check every received tensor passes: one sum in the usual case, each value when it is in doubt."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hetfed.wire.contract import all_finite, check_finite
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import ModelWeights, PayloadKind


@pytest.mark.parametrize(("values", "dtype", "finite"), [
    ([], np.float32, True),
    ([1.0, -2.5, 0.0], np.float32, True),
    ([3e38, 3e38, 3e38], np.float32, True),  # the sum overflows to inf: settled value by value, all finite
    ([-6e4, -6e4], np.float16, True),  # float16 overflows at 65504
    ([1e308, 1e308], np.float64, True),
    ([1.0, np.nan, 3.0], np.float32, False),
    ([np.inf, 1.0], np.float32, False),
    ([-np.inf], np.float16, False),
    ([np.inf, -np.inf], np.float64, False),  # the sum is NaN
    ([3e38, 3e38, np.nan], np.float32, False),
])
def test_hand_picked_arrays(values: list[float], dtype: type[np.floating], finite: bool) -> None:
    assert all_finite(np.array(values, dtype)) is finite


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(st.sampled_from([np.float16, np.float32, np.float64]), hnp.array_shapes(max_dims=3, max_side=40),
                  elements={"allow_nan": True, "allow_infinity": True}))
def test_agrees_with_numpy_elementwise(a: np.ndarray) -> None:
    assert all_finite(a) is bool(np.isfinite(a).all())


def test_a_large_tensor_with_one_bad_value_anywhere() -> None:
    a = np.random.default_rng(3).standard_normal(1 << 20).astype(np.float32)
    assert all_finite(a)
    for i in (0, 65_535, 65_536, (1 << 20) - 1):
        for bad in (np.nan, np.inf, -np.inf):
            b = a.copy()
            b[i] = bad
            assert not all_finite(b)


def test_check_finite_counts_the_bad_values() -> None:
    ok = ModelWeights({"w": np.full(4, 3e38, np.float32)}, 1)
    check_finite(PayloadKind.MODEL_WEIGHTS, ok)
    bad = ModelWeights({"w": np.array([1.0, np.nan, np.inf, -np.inf], np.float32)}, 1)
    with pytest.raises(WireError) as err:
        check_finite(PayloadKind.MODEL_WEIGHTS, bad)
    assert (err.value.reason, err.value.message) == ("non_finite", "model_weights.w holds 3 NaN or infinite values")
