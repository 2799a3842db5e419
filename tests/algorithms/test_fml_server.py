"""FML's server half on three-element meme models: the average weighted by example counts (or uniform, the authors'
code's merge), against hand-computed numbers, in any arrival order; what it sends and restores."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetfed.aggregator.algorithms import make_server_half, server_half_type
from hetfed.aggregator.algorithms.base import RunInfo
from hetfed.aggregator.algorithms.fedavg import FedAvgServer
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import EvalMetrics, ModelWeights, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import get_spec

SPEC = get_spec("fml")
ORGS = ("a", "b", "c")
RUN = RunInfo(seed=1, organizations=ORGS)
MEMES = {"a": ([1.0, 2.0, 4.0], 1), "b": ([3.0, -2.0, 0.5], 2), "c": ([-1.0, 0.0, 8.0], 5)}


def upload(org: str, values: list[float] | None = None, examples: int | None = None) -> Received:
    v, n = MEMES[org]
    return Received([ModelWeights({"head.bias": np.array(values or v, np.float32)}, examples or n), EvalMetrics()],
                    frozenset())


def server(**fields: object) -> FedAvgServer:
    half = make_server_half(SPEC, SPEC.config(**fields), RUN)
    assert isinstance(half, FedAvgServer)
    return half


def close(half: FedAvgServer, orgs: tuple[str, ...], round_: int = 1) -> None:
    for org in orgs:
        half.validate(Phase.TRAIN, org, upload(org))
        half.accumulate(Phase.TRAIN, org, upload(org))
    half.close_round(Phase.TRAIN, round_)


def test_the_server_half_is_fedavgs() -> None:
    assert server_half_type(SPEC) is FedAvgServer


@pytest.mark.parametrize("order", list(itertools.permutations(ORGS)))
def test_the_meme_models_are_averaged_by_example_counts(order: tuple[str, ...]) -> None:
    half = server()
    assert half.payloads_for(Phase.TRAIN, 1, "a") == []  # round 1: every meme model starts from the run seed
    close(half, order)
    # (1·(1, 2, 4) + 2·(3, −2, 0.5) + 5·(−1, 0, 8)) / 8 = (2/8, −2/8, 45/8)
    (sent,) = half.payloads_for(Phase.TRAIN, 2, "b")
    assert isinstance(sent, ModelWeights)
    assert sent.tensors["head.bias"].tolist() == [0.25, -0.25, 5.625]


def test_uniform_weighting_is_the_reference_codes_merge() -> None:
    half = server(weighting="uniform")
    close(half, ORGS)
    # ((1, 2, 4) + (3, −2, 0.5) + (−1, 0, 8)) / 3 = (1, 0, 12.5/3)
    (sent,) = half.payloads_for(Phase.TRAIN, 2, "a")
    np.testing.assert_array_equal(sent.tensors["head.bias"], np.array([1.0, 0.0, 12.5 / 3], np.float32))


def test_a_round_with_two_organizations_averages_those_two() -> None:
    half = server()
    close(half, ("a", "b"))
    (sent,) = half.payloads_for(Phase.TRAIN, 2, "c")
    # (1·(1, 2, 4) + 2·(3, −2, 0.5)) / 3 = (7/3, −2/3, 5/3)
    np.testing.assert_array_equal(sent.tensors["head.bias"], np.array([7 / 3, -2 / 3, 5 / 3], np.float32))


def test_an_implausible_meme_model_is_refused_and_the_state_restores() -> None:
    half = server()
    close(half, ORGS)
    with pytest.raises(WireError, match="max_update_norm_ratio"):
        half.validate(Phase.TRAIN, "a", upload("a", [1e4, 0.0, 0.0]))
    with pytest.raises(WireError, match="num_examples must be > 0"):
        half.validate(Phase.TRAIN, "a", Received([ModelWeights({"head.bias": np.zeros(3, np.float32)}, 0)],
                                                 frozenset()))
    again = server()
    again.load_state(half.state())
    assert again.payloads_for(Phase.TRAIN, 2, "a")[0].tensors["head.bias"].tolist() == [0.25, -0.25, 5.625]
