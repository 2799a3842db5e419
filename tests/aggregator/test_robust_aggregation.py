"""The FedAvg family's robust options: coordinate-wise trimmed mean and median, norm clipping; exact numbers."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from hetfed.aggregator.algorithms.aggregators import (
    NORM_BLOCK,
    CoordinateMedian,
    TrimmedMean,
    clip_to_ball,
    distance,
    global_norm,
)
from hetfed.aggregator.algorithms.base import RunInfo
from hetfed.aggregator.algorithms.fedavg import FedAvgServer
from hetfed.aggregator.algorithms.fedavg_head import HeadFedAvgServer
from hetfed.wire.config import ConfigError, from_mapping
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import HeadWeights, ModelWeights, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs.fedavg import FedAvgConfig
from hetfed.wire.specs.fedavg_head import HeadFedAvgConfig


def trimmed(values: list[list[float]], trim: int) -> np.ndarray:
    acc = TrimmedMean(trim)
    for v in values:
        acc.add({"w": np.array(v)})
    return acc.mean()["w"]


def test_drops_the_extremes_of_each_coordinate_and_averages_the_rest() -> None:
    # Coordinate 0: 1, 2, 3, 100, -50 -> drop 100 and -50 -> (1 + 2 + 3) / 3 = 2.
    # Coordinate 1: 5, 5, 6, 7, 8 -> drop 8 and 5 -> (5 + 6 + 7) / 3 = 6.
    values = [[1, 5], [2, 8], [100, 6], [3, 5], [-50, 7]]
    np.testing.assert_array_equal(trimmed(values, 1), [2.0, 6.0])
    # trim 2 of 5 leaves the median: 2 and 6.
    np.testing.assert_array_equal(trimmed(values, 2), [2.0, 6.0])


@pytest.mark.parametrize("order", list(itertools.permutations(range(5)))[::7])
def test_the_order_of_arrival_does_not_matter(order: tuple[int, ...]) -> None:
    values = [[1.0, -3.0], [4.0, 0.5], [9.0, 2.0], [16.0, -1.0], [25.0, 7.0]]
    np.testing.assert_array_equal(trimmed([values[i] for i in order], 1), [29 / 3, 1.5 / 3])


def test_an_attacker_at_1e30_changes_nothing_and_loses_no_precision() -> None:
    honest = [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]]
    clean = trimmed([*honest, [0.2, 0.3]], 1)  # the attacker replaced by one more honest value
    attacked = trimmed([*honest, [1e30, -1e30]], 1)
    # [0.1, 0.3, 0.5, 1e30] -> 0.3 + 0.5 over 2 = 0.4; [0.2, 0.4, 0.6, -1e30] -> (0.2 + 0.4) / 2 = 0.3.
    np.testing.assert_array_equal(attacked, [(0.3 + 0.5) / 2, (0.2 + 0.4) / 2])
    np.testing.assert_array_equal(clean, [(0.2 + 0.3) / 2, (0.3 + 0.4) / 2])


def test_fewer_updates_than_twice_the_trim_trim_what_the_count_allows() -> None:
    np.testing.assert_array_equal(trimmed([[7.0]], 2), [7.0])
    np.testing.assert_array_equal(trimmed([[7.0], [1.0]], 2), [4.0])  # (2 - 1) // 2 = 0 trimmed
    np.testing.assert_array_equal(trimmed([[7.0], [1.0], [100.0]], 2), [7.0])  # 1 trimmed: the median
    np.testing.assert_array_equal(trimmed([[7.0], [1.0], [100.0], [3.0]], 2), [5.0])  # 1 trimmed: (3 + 7) / 2


def test_memory_does_not_grow_with_the_clients() -> None:
    acc = TrimmedMean(2)
    rng = np.random.default_rng(0)
    for _ in range(50):
        acc.add({"w": rng.normal(size=(3, 4))})
    assert acc._high["w"].shape == acc._low["w"].shape == (2, 3, 4)
    assert acc._mid["w"].shape == (3, 4)


def test_fedavg_with_the_trimmed_mean_ignores_one_poisoned_update() -> None:
    cfg = FedAvgConfig(aggregation="trimmed_mean", trim=1)
    half = FedAvgServer(cfg, RunInfo(0, ("a", "b", "c", "m")))
    w = np.array([1.0, 2.0, 3.0], np.float32)
    for org, scale, n in (("a", 1.0, 10), ("b", 2.0, 10), ("c", 3.0, 10), ("m", 1e30, 1_000_000)):
        half.accumulate(Phase.TRAIN, org, Received([ModelWeights({"w": w * scale}, n)]))
    half.close_round(Phase.TRAIN, 1)
    assert half.global_ is not None
    np.testing.assert_array_equal(half.global_["w"], w * 2.5)  # (2 + 3) / 2: the 1e30 and the smallest dropped


def test_the_head_average_takes_the_same_option() -> None:
    half = HeadFedAvgServer(HeadFedAvgConfig(aggregation="trimmed_mean"), RunInfo(0, ("a", "b", "c")))
    for org, v in (("a", 1.0), ("b", -1e30), ("c", 4.0)):
        half.accumulate(Phase.TRAIN, org, Received([HeadWeights(np.full((2, 2), v), np.full(2, v), 1)]))
    half.close_round(Phase.TRAIN, 1)
    assert half.global_ is not None
    np.testing.assert_array_equal(half.global_["bias"], [1.0, 1.0])


def test_the_option_is_validated() -> None:
    with pytest.raises(ConfigError, match="aggregation"):
        from_mapping(FedAvgConfig, {"aggregation": "mode"}, "algorithm_config")
    with pytest.raises(ConfigError, match="trim must be >= 1"):
        from_mapping(FedAvgConfig, {"aggregation": "trimmed_mean", "trim": 0}, "algorithm_config")
    with pytest.raises(ConfigError, match="update_norm_policy"):
        from_mapping(FedAvgConfig, {"update_norm_policy": "ignore"}, "algorithm_config")
    with pytest.raises(ConfigError, match="max_update_norm_ratio"):
        from_mapping(FedAvgConfig, {"max_update_norm_ratio": -1.0}, "algorithm_config")


def median(values: list[list[float]]) -> np.ndarray:
    acc = CoordinateMedian()
    for v in values:
        acc.add({"w": np.array(v)}, weight=1e9)  # weights are ignored
    return acc.mean()["w"]


def test_the_coordinate_median_of_three_element_arrays() -> None:
    # Per coordinate: median(1, 4, -2) = 1; median(2, 1e30, 0) = 2; median(3, 5, 7) = 5.
    np.testing.assert_array_equal(median([[1, 2, 3], [4, 1e30, 5], [-2, 0, 7]]), [1.0, 2.0, 5.0])
    # An even count: the mean of the two middle values; (1 + 4) / 2, (2 + 6) / 2, (3 + 5) / 2.
    np.testing.assert_array_equal(median([[1, 2, 3], [4, 6, 5], [-2, 0, 7], [9, 9, 1]]), [2.5, 4.0, 4.0])


def test_fedavg_with_the_median_ignores_a_minority() -> None:
    half = FedAvgServer(FedAvgConfig(aggregation="median", max_abs_weight=0), RunInfo(0, ("a", "b", "c")))
    for org, v, n in (("a", [1.0, 2.0, 3.0], 1), ("b", [1e30, -1e30, 2.0], 10**6), ("c", [3.0, 4.0, 5.0], 1)):
        half.accumulate(Phase.TRAIN, org, Received([ModelWeights({"w": np.array(v, np.float32)}, n)]))
    half.close_round(Phase.TRAIN, 1)
    assert half.global_ is not None
    np.testing.assert_array_equal(half.global_["w"], [3.0, 2.0, 3.0])


def test_norm_clipping_moves_an_update_onto_the_ball() -> None:
    centre = {"w": np.array([1.0, 1.0, 1.0])}
    # [4, 5, 1] is (3, 4, 0) from the centre: distance 5; onto radius 2.5: centre + (1.5, 2, 0).
    clipped, distance = clip_to_ball({"w": np.array([4.0, 5.0, 1.0])}, centre, 2.5)
    assert distance == 5.0
    np.testing.assert_array_equal(clipped["w"], [2.5, 3.0, 1.0])
    inside, distance = clip_to_ball({"w": np.array([2.0, 1.0, 1.0])}, centre, 2.5)
    assert distance == 1.0
    np.testing.assert_array_equal(inside["w"], [2.0, 1.0, 1.0])


def test_fedavg_clips_each_update_to_its_ratio_of_the_global_norm() -> None:
    """Global g = (3, 4, 0), norm 5; ratio 0.5 allows a distance of 2.5. a = g + (0, 0, 10) is clipped to
    g + (0, 0, 2.5); b = g + (1, 0, 0) is inside. Weighted 1 and 3: g + ((0, 0, 2.5) + 3·(1, 0, 0)) / 4."""
    cfg = FedAvgConfig(max_update_norm_ratio=0.5, update_norm_policy="clip")
    half = FedAvgServer(cfg, RunInfo(0, ("a", "b")))
    half.load_state({"w": np.array([3.0, 4.0, 0.0], np.float32)})
    half.validate(Phase.TRAIN, "a", Received([ModelWeights({"w": np.array([3.0, 4.0, 10.0], np.float32)}, 1)]))
    half.accumulate(Phase.TRAIN, "a", Received([ModelWeights({"w": np.array([3.0, 4.0, 10.0], np.float32)}, 1)]))
    half.accumulate(Phase.TRAIN, "b", Received([ModelWeights({"w": np.array([4.0, 4.0, 0.0], np.float32)}, 3)]))
    half.close_round(Phase.TRAIN, 2)
    assert half.global_ is not None
    np.testing.assert_array_equal(half.global_["w"], [3.75, 4.0, 0.625])


def test_the_refuse_policy_names_the_bound() -> None:
    half = FedAvgServer(FedAvgConfig(max_update_norm_ratio=0.5), RunInfo(0, ("a",)))
    half.load_state({"w": np.array([3.0, 4.0, 0.0], np.float32)})
    ok = Received([ModelWeights({"w": np.array([3.0, 4.0, 2.5], np.float32)}, 1)])  # exactly on the bound
    half.validate(Phase.TRAIN, "a", ok)
    with pytest.raises(WireError) as err:
        half.validate(Phase.TRAIN, "a", Received([ModelWeights({"w": np.array([3.0, 4.0, 2.6], np.float32)}, 1)]))
    assert err.value.reason == "implausible_update"


def test_the_head_average_takes_the_norm_bound_too() -> None:
    half = HeadFedAvgServer(HeadFedAvgConfig(aggregation="median"), RunInfo(0, ("a", "b", "c")))
    with pytest.raises(WireError) as err:
        half.validate(Phase.TRAIN, "a", Received([HeadWeights(np.full((2, 2), 2e6), np.zeros(2), 1)]))
    assert err.value.reason == "implausible_update"


def test_the_blocked_distance_matches_float64_over_several_blocks() -> None:
    """||a − c|| over tensors longer than one block, one tensor missing from the centre, against float64 sums of
    the same values: float32 differences and squares, summed pairwise within blocks and in float64 across them."""
    rng = np.random.default_rng(7)
    n = 4 * NORM_BLOCK + 123
    c = rng.standard_normal(n).astype(np.float32)
    a = (c + 0.01 * rng.standard_normal(n)).astype(np.float32)
    extra = np.array([3.0, 4.0], np.float32)  # not in the centre: counts from 0, adds 5² = 25
    want = math.sqrt(float(np.sum((a.astype(np.float64) - c.astype(np.float64)) ** 2)) + 25.0)
    got = distance({"w": a, "extra": extra}, {"w": c})
    assert got == pytest.approx(want, rel=1e-8)  # float32 squares, summed pairwise: ~3e-9 here
    m = a[: 300 * 700].reshape(300, 700)  # a matrix over several blocks: the same sum over its elements
    assert distance({"m": m}, {"m": c[: 300 * 700].reshape(300, 700)}) == pytest.approx(math.sqrt(float(
        np.sum((m.astype(np.float64) - c[: 300 * 700].reshape(300, 700).astype(np.float64)) ** 2))), rel=1e-8)
    assert global_norm({"w": c, "extra": extra}) == pytest.approx(
        math.sqrt(float(np.sum(c.astype(np.float64) ** 2)) + 25.0), rel=1e-8)
    # Hand-computed: (4, 5, 1) − (1, 1, 1) = (3, 4, 0), norm 5, in float64 and float32 alike.
    for dtype in (np.float64, np.float32):
        assert distance({"w": np.array([4.0, 5.0, 1.0], dtype)}, {"w": np.ones(3, dtype)}) == 5.0


def test_max_abs_weight_holds_where_the_distance_cannot_settle_it() -> None:
    """The value bound is scanned for only when max|global| + distance could exceed it. Global (9, 0, 0), bound 10,
    ratio 0.5 (radius 4.5): (10.5, 0, 0) is 1.5 away, within the radius, but its 10.5 is over the bound (9 + 1.5 >
    10: scanned, refused for the value); (9.5, 0, 0) is 0.5 away, 9 + 0.5 < 10: passes without a scan."""
    half = FedAvgServer(FedAvgConfig(max_abs_weight=10.0, max_update_norm_ratio=0.5), RunInfo(0, ("a",)))
    half.load_state({"w": np.array([9.0, 0.0, 0.0], np.float32)})
    with pytest.raises(WireError) as err:
        half.validate(Phase.TRAIN, "a", Received([ModelWeights({"w": np.array([10.5, 0.0, 0.0], np.float32)}, 1)]))
    assert err.value.message == "w holds a value of magnitude 10.5; at most 10 (max_abs_weight)"
    half.validate(Phase.TRAIN, "a", Received([ModelWeights({"w": np.array([9.5, 0.0, 0.0], np.float32)}, 1)]))
    # Both bounds broken: the value is named first, as before. A tensor the global model lacks counts from 0.
    with pytest.raises(WireError) as err:
        half.validate(Phase.TRAIN, "a", Received([ModelWeights({"w": np.array([9.0, 0.0, 0.0], np.float32),
                                                                "b": np.array([-11.0], np.float32)}, 1)]))
    assert err.value.message == "b holds a value of magnitude 11; at most 10 (max_abs_weight)"
    with pytest.raises(WireError) as err:
        half.validate(Phase.TRAIN, "a", Received([ModelWeights({"w": np.array([9.0, 6.0, 0.0], np.float32)}, 1)]))
    assert err.value.message.startswith("the update is 6 from the global model, whose norm is 9; at most 0.5")


class _NoScan(np.ndarray):
    """An array whose max and min may not be read: the value bound must be settled without them."""

    def max(self, *args: object, **kwargs: object) -> np.ndarray:  # type: ignore[override]
        raise AssertionError("scanned for max_abs_weight")

    def min(self, *args: object, **kwargs: object) -> np.ndarray:  # type: ignore[override]
        raise AssertionError("scanned for max_abs_weight")


def test_a_plausible_update_is_not_scanned_for_the_value_bound_again() -> None:
    """Under both default bounds an update close to the global model passes on its distance alone; the global
    model's own largest magnitude is taken once per global model, not once per update."""
    half = FedAvgServer(FedAvgConfig(), RunInfo(0, ("a", "b")))
    half.load_state({"w": np.array([3.0, 4.0, 0.0], np.float32)})
    for _ in range(2):
        half.validate(Phase.TRAIN, "a", Received([ModelWeights(
            {"w": np.array([3.0, 4.5, 0.0], np.float32).view(_NoScan)}, 1)]))
    half.load_state({"w": np.array([3.0, 4.0, 0.0], np.float32).view(_NoScan)})  # a new global model: read again
    with pytest.raises(AssertionError, match="scanned"):
        half.validate(Phase.TRAIN, "a", Received([ModelWeights({"w": np.array([3.0, 4.5, 0.0], np.float32)}, 1)]))
    # Without the distance bound the values are scanned, as before.
    plain = FedAvgServer(FedAvgConfig(max_update_norm_ratio=0), RunInfo(0, ("a",)))
    plain.load_state({"w": np.array([3.0, 4.0, 0.0], np.float32)})
    with pytest.raises(AssertionError, match="scanned"):
        plain.validate(Phase.TRAIN, "a", Received([ModelWeights(
            {"w": np.array([3.0, 4.5, 0.0], np.float32).view(_NoScan)}, 1)]))
