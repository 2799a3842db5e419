"""Fixed-point encoding into Z_{2^b}: the round-trip error bound, clipping or refusal, and no wrap-around."""

from __future__ import annotations

import numpy as np
import pytest

from hetfed.secagg import Encoding, Field, SecAggError, ring_bits_for

W = (Field("w", (1000,), 2.0),)


def test_ring_bits_hold_the_largest_sum_and_no_less() -> None:
    assert ring_bits_for(1, 16) == 16  # |z| <= 32767: 16 bits in two's complement
    assert ring_bits_for(2, 16) == 17  # 65534 = 2^16 - 2 < 2^16
    assert ring_bits_for(3, 16) == 18
    assert ring_bits_for(32, 32) == 37
    Encoding(W, 16, 18, 3)
    with pytest.raises(SecAggError, match="could wrap around") as err:
        Encoding(W, 16, 17, 3)
    assert err.value.reason == "bad_parameters"
    with pytest.raises(SecAggError, match="could wrap around"):
        Encoding.for_inputs(W, 2**20, value_bits=45)
    assert Encoding.for_inputs(W, 32, 16).ring_bits == 32 and Encoding.for_inputs(W, 32, 30).ring_bits == 64


def test_the_largest_sum_decodes_exactly_at_the_edge_of_the_ring() -> None:
    enc = Encoding((Field("w", (2,), 1.0),), 16, 18, 3, stochastic=False)
    one = enc.encode({"w": np.array([1.0, -1.0])})
    total = (one + one + one) & np.uint32(2**18 - 1)
    np.testing.assert_array_equal(enc.signed(total), [3 * 32767, -3 * 32767])
    np.testing.assert_array_equal(enc.decode_sum(total, 3)["w"], [3.0, -3.0])


@pytest.mark.parametrize("stochastic", [False, True])
def test_round_trip_error_is_within_one_grid_step(stochastic: bool) -> None:
    enc = Encoding.for_inputs(W, 1, 16, stochastic)
    x = np.random.default_rng(0).uniform(-2, 2, 1000)
    back = enc.decode_sum(enc.encode({"w": x}, np.random.default_rng(1)), 1)["w"]
    step = 2.0 / enc.level
    assert np.max(np.abs(back - x)) <= (step if stochastic else step / 2) + 1e-12


def test_stochastic_rounding_is_unbiased_and_seeded() -> None:
    enc = Encoding.for_inputs((Field("w", (20000,), 1.0),), 1, 4)  # a coarse grid: steps of 1/7
    x = np.full(20000, 0.05)
    a = enc.decode_sum(enc.encode({"w": x}, np.random.default_rng(3)), 1)["w"]
    b = enc.decode_sum(enc.encode({"w": x}, np.random.default_rng(3)), 1)["w"]
    np.testing.assert_array_equal(a, b)
    assert set(np.round(a * 7).astype(int)) == {0, 1} and abs(a.mean() - 0.05) < 0.005
    with pytest.raises(SecAggError, match="seeded generator"):
        enc.encode({"w": x})


def test_out_of_range_values_are_clipped_or_refused_in_strict_mode() -> None:
    enc = Encoding.for_inputs((Field("w", (3,), 1.0),), 1, 16, stochastic=False)
    x = {"w": np.array([3.0, -0.5, -7.0])}
    np.testing.assert_array_equal(enc.decode_sum(enc.encode(x), 1)["w"], [1.0, -16384 / 32767, -1.0])
    with pytest.raises(SecAggError, match="out_of_range"):
        enc.encode(x, strict=True)
    with pytest.raises(SecAggError, match="not finite"):
        enc.encode({"w": np.array([np.nan, 0, 0])})


def test_the_norm_bound_scales_down_or_refuses() -> None:
    enc = Encoding.for_inputs((Field("w", (2,), 10.0, norm_bound=5.0),), 1, 20, stochastic=False)
    x = {"w": np.array([6.0, 8.0])}  # norm 10
    np.testing.assert_allclose(enc.decode_sum(enc.encode(x), 1)["w"], [3.0, 4.0], atol=1e-4)
    with pytest.raises(SecAggError, match="L2 norm"):
        enc.encode(x, strict=True)


def test_fields_shapes_and_names_are_checked() -> None:
    enc = Encoding.for_inputs((Field("a", (), 1.0), Field("b", (0,), 1.0), Field("c", (2, 2), 1.0)), 1, 16,
                              stochastic=False)
    assert enc.length == 5
    out = enc.decode_sum(enc.encode({"a": np.array(0.5), "b": np.zeros(0), "c": np.eye(2)}), 1)
    assert out["a"].shape == () and out["b"].shape == (0,) and out["c"].shape == (2, 2)
    with pytest.raises(SecAggError, match="malformed"):
        enc.encode({"a": np.array(0.5), "b": np.zeros(0)})
    with pytest.raises(SecAggError, match="shape"):
        enc.encode({"a": np.zeros(1), "b": np.zeros(0), "c": np.eye(2)})


@pytest.mark.parametrize("ring_bits", [18, 32, 64])
def test_a_sum_beyond_n_times_the_bound_is_refused(ring_bits: int) -> None:
    enc = Encoding((Field("w", (3,), 1.0),), 16, ring_bits, 3)
    fine = np.array([3 * 32767, 0, 2**ring_bits - 3 * 32767], dtype=enc.dtype)
    enc.decode_sum(fine, 3)
    with pytest.raises(SecAggError, match="sum_out_of_range"):
        enc.decode_sum(fine, 2)
    worst = np.array([0, 0, 2 ** (ring_bits - 1)], dtype=enc.dtype)  # the most negative signed value
    with pytest.raises(SecAggError, match="sum_out_of_range"):
        enc.decode_sum(worst, 3)
