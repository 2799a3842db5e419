"""FedADG's server half: the authors' unweighted mean of F, C and G (models/Fed.py), on three-element arrays with
exact numbers, whatever the example counts and the arrival order; FedAvg's half bound to FedADG's spec."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.algorithms.base import RunInfo
from hetfed.aggregator.algorithms.fedavg import FedAvgServer
from hetfed.wire.payloads import EvalMetrics, ModelWeights, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import get_spec

ORGS = ("a", "b", "c")
# Per organization: the classifier's bias and G's last bias, and very different example counts.
UPLOADS = {
    "a": ({"head.bias": [1.0, 2.0, 3.0], "generator.net.fc2.bias": [0.5, 0.0, -0.5]}, 10),
    "b": ({"head.bias": [4.0, 5.0, 6.0], "generator.net.fc2.bias": [1.5, 3.0, 0.5]}, 100),
    "c": ({"head.bias": [10.0, 20.0, 30.0], "generator.net.fc2.bias": [-2.0, 0.0, 3.0]}, 1000),
}


def _server() -> FedAvgServer:
    spec = get_spec("fedadg")
    half = make_server_half(spec, spec.config(), RunInfo(seed=1, organizations=ORGS))
    assert type(half) is FedAvgServer
    return half  # type: ignore[return-value]


@pytest.mark.parametrize("order", list(itertools.permutations(ORGS)))
def test_the_global_f_c_and_g_are_the_unweighted_mean(order: tuple[str, ...]) -> None:
    half = _server()
    assert half.payloads_for(Phase.TRAIN, 1, "a") == []  # round 1 starts from the run seed
    for org in order:
        tensors, n = UPLOADS[org]
        update = Received([ModelWeights({k: np.array(v, np.float32) for k, v in tensors.items()}, n), EvalMetrics()])
        half.validate(Phase.TRAIN, org, update)
        half.accumulate(Phase.TRAIN, org, update)
    half.close_round(Phase.TRAIN, 1)
    (sent,) = half.payloads_for(Phase.TRAIN, 2, "b")
    assert isinstance(sent, ModelWeights)
    # (1 + 4 + 10)/3, (2 + 5 + 20)/3, (3 + 6 + 30)/3 and (0.5 + 1.5 − 2)/3, (0 + 3 + 0)/3, (−0.5 + 0.5 + 3)/3:
    # the example counts 10, 100 and 1000 do not weigh (their weighted mean would be near c's).
    assert sent.tensors["head.bias"].tolist() == [5.0, 9.0, 13.0]
    assert sent.tensors["generator.net.fc2.bias"].tolist() == [0.0, 1.0, 1.0]
    assert all(a.dtype == np.float32 for a in sent.tensors.values())
