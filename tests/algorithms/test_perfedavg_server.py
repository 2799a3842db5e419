"""Per-FedAvg's server half on three-element arrays: Algorithm 1's uniform average of the returned models by
default, FedAvg's example-weighted one on request, the model sent down, and what it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.algorithms.base import RunInfo
from hetfed.aggregator.algorithms.fedavg import FedAvgServer
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import EvalMetrics, ModelWeights, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import get_spec

RUN = RunInfo(seed=0, organizations=("a", "b"))
A = np.array([1.0, 2.0, 4.0], np.float32)
B = np.array([0.5, -3.0, 10.0], np.float32)


def update(w: np.ndarray, n: int) -> Received:
    return Received([ModelWeights({"head.weight": w}, n), EvalMetrics()], frozenset())


def one_round(name: str, **fields: object) -> np.ndarray:
    spec = get_spec(name)
    half = make_server_half(spec, spec.config(**fields), RUN)
    assert isinstance(half, FedAvgServer)
    assert half.payloads_for(Phase.TRAIN, 1, "a") == []  # round 1 starts from the run seed's model
    for org, w, n in (("a", A, 1), ("b", B, 3)):
        half.validate(Phase.TRAIN, org, update(w, n))
        half.accumulate(Phase.TRAIN, org, update(w, n))
    half.close_round(Phase.TRAIN, 1)
    (sent,) = half.payloads_for(Phase.TRAIN, 2, "b")
    assert isinstance(sent, ModelWeights) and list(sent.tensors) == ["head.weight"]
    return np.asarray(sent.tensors["head.weight"])


@pytest.mark.parametrize("name", ["perfedavg", "perfedavg_hf"])
def test_the_returned_models_are_averaged_uniformly(name: str) -> None:
    # (A + B) / 2, whatever the example counts 1 and 3.
    np.testing.assert_array_equal(one_round(name), np.array([0.75, -0.5, 7.0], np.float32))


def test_examples_weighting_is_fedavgs_weighted_mean() -> None:
    # (1·A + 3·B) / 4 = [0.625, -1.75, 8.5].
    np.testing.assert_array_equal(one_round("perfedavg", weighting="examples"),
                                  np.array([0.625, -1.75, 8.5], np.float32))


def test_an_update_without_examples_or_with_an_implausible_value_is_refused() -> None:
    spec = get_spec("perfedavg")
    half = make_server_half(spec, spec.config(), RUN)
    with pytest.raises(WireError, match="num_examples must be > 0"):
        half.validate(Phase.TRAIN, "a", update(A, 0))
    with pytest.raises(WireError, match="max_abs_weight") as refused:
        half.validate(Phase.TRAIN, "a", update(np.array([1.0, 2e6, 0.0], np.float32), 5))
    assert refused.value.reason == "implausible_update"
