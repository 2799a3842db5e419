"""Server halves driven directly with three-element arrays and exact expected numbers."""

from __future__ import annotations

import math
import typing

import numpy as np
import pytest

from hetfed.aggregator.algorithms import make_server_half, server_half_type
from hetfed.aggregator.algorithms.aggregators import ExactSum, WeightedMean
from hetfed.aggregator.algorithms.base import RunInfo, ServerHalf
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import HeadWeights, ModelWeights, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import SPECS, get_spec
from hetfed.wire.specs.fedavg import FedAvgConfig
from hetfed.wire.specs.fedavg_head import HeadFedAvgConfig
from hetfed.wire.specs.fedprox import FedProxConfig
from hetfed.wire.specs.local import LocalConfig

RUN = RunInfo(seed=0, organizations=("a", "b"))
TRAIN, EVALUATE, SETUP = Phase.TRAIN, Phase.EVALUATE, Phase.SETUP


def half_of(name: str, config: object) -> ServerHalf:  # type: ignore[type-arg]
    """The registered server half of ``name``."""
    return make_server_half(get_spec(name), config, RUN)  # type: ignore[arg-type]


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


def test_weighted_mean_of_tensors_larger_than_its_block_matches_the_exact_sum_bit_for_bit() -> None:
    rng = np.random.default_rng(3)
    n = ExactSum.BLOCK * 2 + 12_345  # three blocks, the last partial
    parts = [(rng.standard_normal((n // 5, 5)).astype(np.float32), w) for w in (3.0, 0.25, 17.0)]
    small = [(rng.standard_normal(7).astype(np.float16), w) for _, w in parts]
    acc = WeightedMean()
    for (a, w), (b, _) in zip(parts, small, strict=True):
        acc.add({"big": a, "small": b}, w)

    def exact(arrays: list[tuple[np.ndarray, float]]) -> np.ndarray:
        flat = [a.astype(np.float64).reshape(-1) * w for a, w in arrays]
        return np.array([math.fsum(column) for column in zip(*flat, strict=True)]).reshape(arrays[0][0].shape)

    got = acc.mean()
    assert got["big"].shape == (n // 5, 5) and got["big"].dtype == np.float64
    np.testing.assert_array_equal(got["big"], exact(parts) / 20.25)
    np.testing.assert_array_equal(got["small"], exact(small) / 20.25)


def test_fedavg_server_round() -> None:
    half = half_of("fedavg", FedAvgConfig())
    assert half.payloads_for(TRAIN, 1, "a") == []  # round 1: every client starts from the run seed
    half.accumulate(TRAIN, "a", Received([ModelWeights({"w": np.array([1.0, 2.0, 3.0], np.float32)}, 1)]))
    half.accumulate(TRAIN, "b", Received([ModelWeights({"w": np.array([3.0, 6.0, 9.0], np.float32)}, 3)]))
    half.close_round(TRAIN, 1)
    (sent,) = half.payloads_for(TRAIN, 2, "a")
    assert isinstance(sent, ModelWeights)
    np.testing.assert_array_equal(sent.tensors["w"], np.array([2.5, 5.0, 7.5], np.float32))
    assert sent.tensors["w"].dtype == np.float32
    # A round in which nobody sent weights (the evaluate phase) keeps the model.
    half.close_round(EVALUATE, 3)
    np.testing.assert_array_equal(half.payloads_for(EVALUATE, 3, "a")[0].tensors["w"], [2.5, 5.0, 7.5])  # type: ignore[attr-defined]
    # Checkpoint round trip.
    other = half_of("fedavg", FedAvgConfig())
    other.load_state(half.state())
    np.testing.assert_array_equal(other.payloads_for(TRAIN, 3, "b")[0].tensors["w"], [2.5, 5.0, 7.5])  # type: ignore[attr-defined]


@pytest.mark.parametrize(("name", "weighting", "want"), [
    ("fedavg", "examples", [2.5, 5.0, 7.5]),  # (1·w_a + 3·w_b) / 4
    ("fedavg", "uniform", [2.0, 4.0, 6.0]),  # (w_a + w_b) / 2
    ("fedsr", "uniform", [2.0, 4.0, 6.0]),
])
def test_fedavg_weighting_by_examples_or_uniform(name: str, weighting: str, want: list[float]) -> None:
    config = get_spec(name).config(weighting=weighting)
    half = half_of(name, config)
    half.accumulate(TRAIN, "a", Received([ModelWeights({"w": np.array([1.0, 2.0, 3.0], np.float32)}, 1)]))
    half.accumulate(TRAIN, "b", Received([ModelWeights({"w": np.array([3.0, 6.0, 9.0], np.float32)}, 3)]))
    half.close_round(TRAIN, 1)
    np.testing.assert_array_equal(half.payloads_for(TRAIN, 2, "a")[0].tensors["w"], want)  # type: ignore[attr-defined]


def test_fedsr_and_its_variants_average_uniformly_by_default() -> None:
    assert [get_spec(n).config().weighting for n in ("fedavg", "fedsr", "fedl2r", "fedcmi")] == [
        "examples", "uniform", "uniform", "uniform"]
    half = half_of("fedsr", get_spec("fedsr").config())
    with pytest.raises(WireError) as err:  # a bad example count is refused even when it does not weigh
        half.validate(TRAIN, "a", Received([ModelWeights({"w": np.ones(3, np.float32)}, 0)]))
    assert err.value.reason == "invalid_value"


def test_fedavg_rejects_zero_weight() -> None:
    half = half_of("fedprox", FedProxConfig())
    with pytest.raises(WireError) as err:
        half.validate(TRAIN, "a", Received([ModelWeights({"w": np.ones(3, np.float32)}, 0)]))
    assert err.value.reason == "invalid_value"


def test_head_fedavg_averages_only_the_head() -> None:
    half = half_of("fedavg_head", HeadFedAvgConfig())
    half.accumulate(TRAIN, "a", Received([HeadWeights(np.array([[1.0, 0.0, 2.0]], np.float32), np.array([1.0], np.float32), 2)]))
    half.accumulate(TRAIN, "b", Received([HeadWeights(np.array([[4.0, 3.0, -1.0]], np.float32), np.array([-2.0], np.float32), 1)]))
    half.close_round(TRAIN, 1)
    (head,) = half.payloads_for(TRAIN, 2, "a")
    assert isinstance(head, HeadWeights)
    np.testing.assert_array_equal(head.weight, [[2.0, 1.0, 1.0]])
    np.testing.assert_array_equal(head.bias, [0.0])


def test_local_sends_nothing() -> None:
    half = half_of("local", LocalConfig())
    half.close_round(TRAIN, 1)
    assert half.payloads_for(TRAIN, 2, "a") == [] and half.state() == {}


def config_type_of(half: type) -> type:
    """The config type a half is generic in (from its first parameterised base in the MRO)."""
    for cls in half.__mro__:
        for base in getattr(cls, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type):
                return args[0]
    raise AssertionError(f"{half.__name__} names no config type")


def test_every_spec_has_a_server_half_generic_in_its_config() -> None:
    for name, spec in SPECS.items():
        # The spec names its half: the half's config type is the spec's (or a base of it).
        assert issubclass(spec.config_type, config_type_of(server_half_type(spec))), name
