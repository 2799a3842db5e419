"""SimFed's sparse masks: the decode shared by the client (float32) and the aggregator (float64 reflection), and
the wire forms a mask travels in (positions, gaps, bitmap, dense)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetfed.v1 import payloads_pb2 as pb
from hetfed.v1 import tensor_pb2 as tpb
from hetfed.wire import codec
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import FactorizedLayer, FactorizedWeights
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


# ------------------------------------------------------------------ how a mask travels: the smallest form


def _layer(idx: list[int] | np.ndarray, val: list[float] | np.ndarray, shape: tuple[int, ...]) -> FactorizedWeights:
    rows = shape[0]
    return FactorizedWeights((FactorizedLayer("l", np.ones(rows, np.float32), np.ones(math.prod(shape) // rows,
                                                                                      np.float32),
                                              np.asarray(idx, np.int64), np.asarray(val, np.float32), shape),), 3)


def _sent(fw: FactorizedWeights, wire_dtype: str | None = None) -> pb.FactorizedLayer:
    return codec.payload_to_proto(fw, wire_dtype).factorized_weights.layers[0]


def _back(layer: pb.FactorizedLayer) -> tuple[np.ndarray, np.ndarray]:
    msg = pb.FactorizedWeights()
    msg.layers.add().CopyFrom(layer)
    for factor in (msg.layers[0].u, msg.layers[0].v):
        if not factor.dtype:  # a hand-built layer: the factors do not matter here
            factor.CopyFrom(codec.tensor_to_proto(np.zeros(0, np.float32)))
    decoded = codec.factorized_weights_from_proto(msg, None).layers[0]
    return decoded.mask_indices, decoded.mask_values


@pytest.mark.parametrize(("idx", "shape", "form", "position_bytes", "dtype"), [
    ([], (10, 100), pb.MASK_ENCODING_GAPS, 0, tpb.DTYPE_UINT8),
    ([0, 255, 511], (10, 100), pb.MASK_ENCODING_GAPS, 3, tpb.DTYPE_UINT8),  # gaps 0, 254, 255
    ([0, 301], (10, 100), pb.MASK_ENCODING_GAPS, 4, tpb.DTYPE_UINT16),  # gap 300
    ([0, 70_000], (100, 1000), pb.MASK_ENCODING_GAPS, 8, tpb.DTYPE_UINT32),  # gap 69,999
    (list(range(0, 64, 3)), (8, 8), pb.MASK_ENCODING_BITMAP, 8, tpb.DTYPE_UINT8),  # 22 of 64: 22 gaps > 8 bytes
    (list(range(64)), (8, 8), pb.MASK_ENCODING_DENSE, 0, None),  # 256 bytes against a bitmap's 8 + 256
    (list(range(63)), (8, 8), pb.MASK_ENCODING_DENSE, 0, None),  # 256 against 8 + 252
    (list(range(1, 57)), (8, 8), pb.MASK_ENCODING_BITMAP, 8, tpb.DTYPE_UINT8),  # 8 + 224 against 256
])
def test_each_mask_takes_its_smallest_form_and_comes_back_exact(
        idx: list[int], shape: tuple[int, ...], form: int, position_bytes: int, dtype: int | None) -> None:
    val = (np.arange(1, len(idx) + 1) * np.float32(-0.25)).astype(np.float32)  # no zero among them
    sent = _sent(_layer(idx, val, shape))
    assert sent.mask_encoding == form
    positions = sent.mask_bitmap if form == pb.MASK_ENCODING_BITMAP else sent.mask_indices
    assert len(positions.data) == position_bytes
    if dtype is not None:
        assert positions.dtype == dtype
    assert len(sent.mask_values.data) == 4 * (math.prod(shape) if form == pb.MASK_ENCODING_DENSE else len(idx))
    back_idx, back_val = _back(sent)
    assert back_idx.dtype == np.int64 and back_idx.tolist() == idx
    assert np.array_equal(back_val, val)


def test_a_sent_zero_keeps_the_mask_out_of_the_dense_form() -> None:
    val = np.ones(64, np.float32)
    val[5] = 0.0  # a dense mask could not tell this entry from one not sent
    sent = _sent(_layer(list(range(64)), val, (8, 8)))
    assert sent.mask_encoding == pb.MASK_ENCODING_BITMAP
    assert _back(sent)[0].tolist() == list(range(64))


def test_narrow_values_change_the_sizes_the_choice_weighs() -> None:
    idx = list(range(1, 57))  # float32: a bitmap (8 + 224 < 256); float16: dense (128 < 8 + 112 is false)
    assert _sent(_layer(idx, np.ones(56), (8, 8))).mask_encoding == pb.MASK_ENCODING_BITMAP
    assert codec.mask_encoding(np.array(idx), np.ones(56), 64, 2) == (pb.MASK_ENCODING_BITMAP, 8 + 112)
    assert codec.mask_encoding(np.array(range(61)), np.ones(61), 64, 2) == (pb.MASK_ENCODING_DENSE, 128)
    sent = _sent(_layer(list(range(61)), np.ones(61), (8, 8)), "float16")
    assert sent.mask_encoding == pb.MASK_ENCODING_DENSE and sent.mask_values.dtype == tpb.DTYPE_FLOAT16


@pytest.mark.parametrize("density", [0.0, 0.001, 0.01, 0.05, 0.2, 0.33, 0.5, 0.9, 0.99, 1.0])
def test_no_mask_is_sent_larger_than_dense_or_than_index_lists(density: float) -> None:
    rng = np.random.default_rng(int(density * 1000))
    n = 120 * 84  # LeNet's second dense layer
    idx = np.sort(rng.choice(n, round(density * n), replace=False))
    val = rng.normal(size=idx.size).astype(np.float32) + 5.0  # no zeros
    sent = _sent(_layer(idx, val, (120, 84)))
    wire = sum(len(t.data) for t in (sent.mask_indices, sent.mask_bitmap, sent.mask_values))
    assert wire <= min(4 * n, 8 * idx.size)  # never above dense, nor above int32 positions with float32 values
    back_idx, back_val = _back(sent)
    assert np.array_equal(back_idx, idx) and np.array_equal(back_val, val)


def test_the_earlier_form_flat_positions_is_still_read() -> None:
    for dtype in (tpb.DTYPE_INT64, tpb.DTYPE_INT32):
        layer = pb.FactorizedLayer(name="l", mask_shape=[2, 3])
        width = "<i8" if dtype == tpb.DTYPE_INT64 else "<i4"
        layer.mask_indices.CopyFrom(tpb.Tensor(dtype=dtype, shape=[2], data=np.array([1, 4], width).tobytes()))
        layer.mask_values.CopyFrom(codec.tensor_to_proto(np.array([0.5, 2.0], np.float32)))
        idx, val = _back(layer)
        assert idx.dtype == np.int64 and idx.tolist() == [1, 4] and val.tolist() == [0.5, 2.0]


def test_a_mask_that_is_not_sparse_travels_as_given_for_the_receiver_to_refuse() -> None:
    sent = _sent(_layer([3, 1], [1.0, 2.0], (2, 3)))  # not increasing: the aggregator names what is wrong
    assert sent.mask_encoding == pb.MASK_ENCODING_UNSPECIFIED
    assert _back(sent)[0].tolist() == [3, 1]


def _form(form: int, shape: list[int], values: np.ndarray, *, indices: tpb.Tensor | None = None,
          bitmap: tpb.Tensor | None = None) -> pb.FactorizedLayer:
    layer = pb.FactorizedLayer(name="l", mask_shape=shape, mask_encoding=form)  # type: ignore[arg-type]
    layer.mask_values.CopyFrom(codec.tensor_to_proto(values))
    if indices is not None:
        layer.mask_indices.CopyFrom(indices)
    if bitmap is not None:
        layer.mask_bitmap.CopyFrom(bitmap)
    return layer


ONE = np.ones(1, np.float32)
TWO = np.ones(2, np.float32)


@pytest.mark.parametrize(("layer", "message"), [
    (_form(7, [2, 4], ONE), "unknown mask encoding 7"),
    (_form(pb.MASK_ENCODING_BITMAP, [2, 4], ONE, bitmap=codec.tensor_to_proto(np.zeros(2, np.uint8))),
     r"the bitmap of a mask of 8 entries is uint8 \[1\], got uint8\[2\]"),
    (_form(pb.MASK_ENCODING_BITMAP, [2, 4], ONE, bitmap=codec.tensor_to_proto(np.array([3], np.int32))),
     "is uint8"),
    (_form(pb.MASK_ENCODING_BITMAP, [2, 3], ONE, bitmap=codec.tensor_to_proto(np.array([0b00000001], np.uint8))),
     "sets padding bits past entry 6"),
    (_form(pb.MASK_ENCODING_BITMAP, [2, 4], ONE, bitmap=codec.tensor_to_proto(np.array([0b11000000], np.uint8))),
     "sets 2 bits but 1 values follow"),
    (_form(pb.MASK_ENCODING_BITMAP, [2, 4], ONE, bitmap=codec.tensor_to_proto(np.array([128], np.uint8)),
           indices=codec.tensor_to_proto(np.array([0], np.uint8))), "mask indices are not sent with MASK_ENCODING_BITMAP"),
    (_form(pb.MASK_ENCODING_GAPS, [2, 4], ONE, indices=codec.tensor_to_proto(np.array([0], np.uint8)),
           bitmap=codec.tensor_to_proto(np.array([128], np.uint8))), "bitmap is sent with MASK_ENCODING_BITMAP only"),
    (_form(pb.MASK_ENCODING_GAPS, [2, 4], TWO, indices=codec.tensor_to_proto(np.array([3, 4], np.uint8))),
     "mask gaps run past the mask's 8 entries"),  # positions 3 and 8
    (_form(pb.MASK_ENCODING_GAPS, [2, 4], TWO, indices=codec.tensor_to_proto(np.array([0, 1], np.int64))),
     "mask gaps must be uint8, uint16 or uint32, got int64"),
    (_form(pb.MASK_ENCODING_GAPS, [2, 4], TWO, indices=codec.tensor_to_proto(np.array([0], np.uint8))),
     "must be vectors of one length"),
    (_form(pb.MASK_ENCODING_DENSE, [2, 4], TWO), r"a dense mask of shape \[2, 4\] has 8 values, got 2"),
    (_form(pb.MASK_ENCODING_DENSE, [2, 1], np.ones((2, 1), np.float32)), "mask values must be a vector"),
])
def test_a_form_that_stands_for_no_mask_is_malformed(layer: pb.FactorizedLayer, message: str) -> None:
    with pytest.raises(WireError, match=message) as err:
        _back(layer)
    assert err.value.reason == "malformed"


def test_gap_sums_are_exact_beyond_int32() -> None:
    gaps = np.full(3, 2**32 - 1, np.uint32)  # positions 2^32 - 1, 2^33 - 1, 3·2^32 - 1
    size = 3 * 2**32
    layer = _form(pb.MASK_ENCODING_GAPS, [3, 2**32], np.ones(3, np.float32), indices=codec.tensor_to_proto(gaps))
    assert _back(layer)[0].tolist() == [2**32 - 1, 2**33 - 1, size - 1]
    layer.mask_shape[:] = [3, 2**32 - 1]
    with pytest.raises(WireError, match="run past"):
        _back(layer)
