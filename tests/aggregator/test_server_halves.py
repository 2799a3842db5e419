"""Server halves driven directly with three-element arrays and exact expected numbers."""

from __future__ import annotations

import numpy as np
import pytest

from hetfed.aggregator.algorithms import SERVER_HALVES, make_server_half
from hetfed.aggregator.algorithms.base import WeightedMean
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import HeadWeights, ModelWeights, PayloadKind
from hetfed.wire.specs import SPECS, FedAvgConfig, HeadFedAvgConfig, LocalConfig

MW = PayloadKind.MODEL_WEIGHTS
HW = PayloadKind.HEAD_WEIGHTS


def test_weighted_mean_is_exact_and_streaming() -> None:
    acc = WeightedMean()
    acc.add({"x": np.array([1.0, 2.0, 3.0], np.float32)}, 1.0)
    acc.add({"x": np.array([4.0, 5.0, 6.0], np.float32)}, 2.0)
    acc.add({"x": np.array([0.1, 0.2, 0.3], np.float32)}, 7.0)
    want = (np.array([1, 2, 3]) * 1 + np.array([4, 5, 6]) * 2 + np.array([0.1, 0.2, 0.3], np.float32).astype(float) * 7) / 10
    np.testing.assert_allclose(acc.mean()["x"], want, rtol=0, atol=1e-15)
    assert acc.count == 3 and acc.weight == 10.0
    with pytest.raises(ValueError, match="positive"):
        acc.add({"x": np.zeros(3)}, 0.0)
    acc.reset()
    with pytest.raises(ValueError, match="no contributions"):
        acc.mean()


def test_fedavg_server_round() -> None:
    half = make_server_half("fedavg", FedAvgConfig(), seed=0)
    assert half.payloads_for("train", 1, "a") == []  # round 1: every client starts from the run seed
    half.accumulate("train", "a", {MW: ModelWeights({"w": np.array([1.0, 2.0, 3.0], np.float32)}, 1)})
    half.accumulate("train", "b", {MW: ModelWeights({"w": np.array([3.0, 6.0, 9.0], np.float32)}, 3)})
    half.close_round("train", 1)
    (sent,) = half.payloads_for("train", 2, "a")
    assert isinstance(sent, ModelWeights)
    np.testing.assert_array_equal(sent.tensors["w"], np.array([2.5, 5.0, 7.5], np.float32))
    assert sent.tensors["w"].dtype == np.float32
    # A round in which nobody sent weights (the evaluate phase) keeps the model.
    half.close_round("evaluate", 3)
    np.testing.assert_array_equal(half.payloads_for("evaluate", 3, "a")[0].tensors["w"], [2.5, 5.0, 7.5])
    # Checkpoint round trip.
    other = make_server_half("fedavg", FedAvgConfig(), seed=0)
    other.load_state(half.state())
    np.testing.assert_array_equal(other.payloads_for("train", 3, "b")[0].tensors["w"], [2.5, 5.0, 7.5])


def test_fedavg_rejects_zero_weight() -> None:
    half = make_server_half("fedprox", FedAvgConfig(), seed=0)
    with pytest.raises(WireError) as err:
        half.validate("train", "a", {MW: ModelWeights({"w": np.ones(3, np.float32)}, 0)})
    assert err.value.reason == "invalid_value"


def test_head_fedavg_averages_only_the_head() -> None:
    half = make_server_half("fedavg_head", HeadFedAvgConfig(), seed=0)
    half.accumulate("train", "a", {HW: HeadWeights(np.array([[1.0, 0.0, 2.0]], np.float32), np.array([1.0], np.float32), 2)})
    half.accumulate("train", "b", {HW: HeadWeights(np.array([[4.0, 3.0, -1.0]], np.float32), np.array([-2.0], np.float32), 1)})
    half.close_round("train", 1)
    (head,) = half.payloads_for("train", 2, "a")
    assert isinstance(head, HeadWeights)
    np.testing.assert_array_equal(head.weight, [[2.0, 1.0, 1.0]])
    np.testing.assert_array_equal(head.bias, [0.0])


def test_local_sends_nothing() -> None:
    half = make_server_half("local", LocalConfig(), seed=0)
    half.close_round("train", 1)
    assert half.payloads_for("train", 2, "a") == [] and half.state() == {}


def test_every_spec_has_a_server_half() -> None:
    assert set(SPECS) == set(SERVER_HALVES)
