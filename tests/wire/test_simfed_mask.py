"""SimFed's sparse-mask decode, shared by the client (float32 masks) and the aggregator (float64 reflection)."""

from __future__ import annotations

import numpy as np
import pytest

from hetfed.wire.specs.simfed import decode_mask


def test_values_land_at_their_flat_row_major_indices() -> None:
    idx, val = np.array([0, 4, 5], np.int64), np.array([0.5, -0.25, 3.0], np.float32)
    dense = decode_mask(idx, val, (2, 3))
    assert dense.dtype == np.float32 and dense.shape == (2, 3)
    assert dense.tolist() == [[0.5, 0.0, 0.0], [0.0, -0.25, 3.0]]


def test_float64_keeps_float32_values_bit_for_bit() -> None:
    val = np.array([0.1, -1e-3], np.float32)
    dense = decode_mask(np.array([1, 2], np.int64), val, (4,), np.float64)
    assert dense.dtype == np.float64 and dense.shape == (4,)
    assert dense.tolist() == [0.0, float(val[0]), float(val[1]), 0.0]  # float32's 0.1, not float64's


def test_no_entries_is_an_all_zero_mask() -> None:
    dense = decode_mask(np.zeros(0, np.int64), np.zeros(0, np.float32), (2, 2))
    assert dense.tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert decode_mask(np.zeros(0, np.int64), np.zeros(0, np.float32), (0,), np.float64).shape == (0,)


@pytest.mark.parametrize(("idx", "val", "shape", "message"), [
    ([1, 1], [1.0, 2.0], (3,), r"strictly increasing \(so distinct\) within \[0, 3\)"),
    ([2, 0], [1.0, 2.0], (3,), "strictly increasing"),
    ([0, 3], [1.0, 2.0], (3,), r"within \[0, 3\) for shape \(3,\)"),
    ([-1], [1.0], (3,), "strictly increasing"),
    ([0, 1], [1.0], (3,), "1-D of one length"),
    ([0.0], [1.0], (3,), "must be integers"),
    ([0], [float("nan")], (3,), "non-finite"),
    ([0], [1.0], (-1, 2), "non-negative"),
])
def test_malformed_masks_are_refused(idx: list[float], val: list[float], shape: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_mask(np.array(idx), np.array(val), shape)
