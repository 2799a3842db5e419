"""The FedAvg family's robust option: a streaming coordinate-wise trimmed mean, exact on small arrays."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetfed.aggregator.algorithms.base import RunInfo, TrimmedMean
from hetfed.aggregator.algorithms.fedavg import FedAvgServer
from hetfed.aggregator.algorithms.fedavg_head import HeadFedAvgServer
from hetfed.wire.config import ConfigError, from_mapping
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
        from_mapping(FedAvgConfig, {"aggregation": "median"}, "algorithm_config")
    with pytest.raises(ConfigError, match="trim must be >= 1"):
        from_mapping(FedAvgConfig, {"aggregation": "trimmed_mean", "trim": 0}, "algorithm_config")
