"""The SecAgg+ graph a run configures: ``secure_degree`` k and ``secure_threshold`` t, checked at load against the
run's organizations (1 <= k <= n - 1, n·k even, k/2 < t <= k), carried into every round, and capped when a round
has fewer members than the run (``graph_parameters``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.algorithms.base import RunInfo
from hetfed.aggregator.config import aggregator_config_from_mapping
from hetfed.aggregator.run.secure import SecureParams, SecureRound, graph_parameters
from hetfed.wire.config import ConfigError
from hetfed.wire.specs import fedavg
from tests.conftest import run_config

FIVE = ["a", "b", "c", "d", "e"]


def load(**run: Any) -> Any:
    return aggregator_config_from_mapping({"server": {"listen": "127.0.0.1:0", "metrics_port": -1},
                                           "runs": [run_config(organizations=FIVE, **run)]}).runs[0]


@pytest.mark.parametrize(("members", "degree", "threshold", "expected"), [
    (5, 0, 0, (4, 3)),  # the complete graph and a strict majority of 4 neighbours
    (5, 2, 0, (2, 2)),
    (5, 4, 4, (4, 4)),
    (4, 4, 4, (3, 3)),  # a round of 4 members: k capped at n - 1, t at k
    (5, 3, 0, (2, 2)),  # 5·3 is odd: no 3-regular graph on 5, one less
    (6, 3, 3, (3, 3)),
    (3, 2, 2, (2, 2)),
    (2, 0, 0, (1, 1)),
])
def test_a_rounds_graph_from_the_configured_one(members: int, degree: int, threshold: int,
                                                expected: tuple[int, int]) -> None:
    assert graph_parameters(members, SecureParams(degree=degree, threshold=threshold)) == expected


@pytest.mark.parametrize(("fields", "message"), [
    ({"secure_threshold": 3}, "need secure_aggregation = true"),
    ({"secure_aggregation": True, "secure_degree": 5}, "at most n - 1 = 4"),
    ({"secure_aggregation": True, "secure_degree": 3}, "no 3-regular graph on 5 organizations"),
    ({"secure_aggregation": True, "secure_threshold": 2}, "secure_threshold 2 must be in (k/2, k] = (2, 4]"),
    ({"secure_aggregation": True, "secure_degree": 2, "secure_threshold": 3}, "(1, 2]"),
    ({"secure_aggregation": True, "secure_degree": -2}, "must be >= 0"),
])
def test_a_graph_secagg_cannot_use_is_refused_at_load(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(**fields)
    assert message in str(err.value)


def test_the_configured_graph_reaches_the_rounds_setup(aggregator: Callable[..., Any]) -> None:
    """k = 2, t = 2 over five organizations: the run's stages hold them, and a round built with them sends them
    in its setup (what every organization receives); a round of four members caps them."""
    assert load(secure_aggregation=True, secure_degree=4, secure_threshold=4).secure_threshold == 4
    agg = aggregator(run_config(organizations=FIVE, rounds=1, secure_aggregation=True, secure_degree=2,
                                secure_threshold=2))
    run = agg.service.runs["r"]
    assert run.secure.params == SecureParams(degree=2, threshold=2)
    default = aggregator(run_config(id="s", organizations=FIVE, rounds=1, secure_aggregation=True))
    assert default.service.runs["s"].secure.params == SecureParams()
    half = make_server_half(fedavg.SPEC, fedavg.SPEC.config(), RunInfo(0, tuple(FIVE)))
    shapes = {"model_weights/w": (3,), "model_weights#weight": ()}
    setup = SecureRound(fedavg.SPEC, half, "r", 1, tuple(FIVE), 0, shapes, run.secure.params).setup()
    assert (setup.config.degree, setup.config.threshold) == (2, 2)
    assert {o: len(p) for o, p in setup.config.graph.items()} == dict.fromkeys(FIVE, 2)
    four = SecureRound(fedavg.SPEC, half, "r", 1, tuple(FIVE[:4]), 0, shapes, SecureParams(degree=4, threshold=4))
    assert (four.config.degree, four.config.threshold) == (3, 3)
