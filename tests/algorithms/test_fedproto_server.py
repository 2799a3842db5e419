"""FedProto's server half: each class's global prototype over the organizations that hold it, against float64
hand computations with missing classes, for every weighting; what it sends, refuses and restores."""

from __future__ import annotations

import numpy as np
import pytest

from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.algorithms.base import RunInfo
from hetfed.aggregator.algorithms.fedproto import FedProtoServer
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import ClassMeanEmbeddings, EvalMetrics, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import get_spec

SPEC = get_spec("fedproto")
K, D = 4, 3
ORGS = ("a", "b", "c")
RUN = RunInfo(seed=1, organizations=ORGS)

# Organization a holds classes 0, 1; b holds 1, 2; c holds 0, 1, 2; nobody holds class 3. Rows of classes an
# organization lacks hold junk (NaN, a huge value), which must never be read.
MEANS = {
    "a": np.array([[1.0, 2.0, 3.0], [0.5, -1.0, 4.0], [np.nan, np.nan, np.nan], [9e9, 9e9, 9e9]], np.float32),
    "b": np.array([[7e7, 0.0, 0.0], [2.5, 1.0, 0.0], [3.0, 3.0, -3.0], [0.0, 0.0, 0.0]], np.float32),
    "c": np.array([[4.0, -2.0, 0.25], [1.5, 0.5, 2.0], [-1.0, 6.0, 1.0], [5.0, 5.0, 5.0]], np.float32),
}
COUNTS = {"a": np.array([10, 30, 0, 0]), "b": np.array([0, 10, 20, 0]), "c": np.array([30, 60, 5, 0])}


def upload(org: str) -> Received:
    counts = COUNTS[org].astype(np.int64)
    return Received([ClassMeanEmbeddings(np.arange(K, dtype=np.int64), MEANS[org], counts, counts > 0),
                     EvalMetrics()], frozenset())


def hand(weighting: str) -> np.ndarray:
    """C̄ written out class by class in float64 from the values above."""
    m = {o: MEANS[o].astype(np.float64) for o in ORGS}
    c0 = {"uniform": (m["a"][0] + m["c"][0]) / 2,
          "count": (10 * m["a"][0] + 30 * m["c"][0]) / 40,
          "paper": (10 / 40 * m["a"][0] + 30 / 40 * m["c"][0]) / 2}[weighting]
    c1 = {"uniform": (m["a"][1] + m["b"][1] + m["c"][1]) / 3,
          "count": (30 * m["a"][1] + 10 * m["b"][1] + 60 * m["c"][1]) / 100,
          "paper": (30 / 100 * m["a"][1] + 10 / 100 * m["b"][1] + 60 / 100 * m["c"][1]) / 3}[weighting]
    c2 = {"uniform": (m["b"][2] + m["c"][2]) / 2,
          "count": (20 * m["b"][2] + 5 * m["c"][2]) / 25,
          "paper": (20 / 25 * m["b"][2] + 5 / 25 * m["c"][2]) / 2}[weighting]
    return np.stack([c0, c1, c2, np.zeros(D)])


def server(weighting: str = "uniform") -> FedProtoServer:
    half = make_server_half(SPEC, SPEC.config(latent_dim=D, num_classes=K, prototype_weighting=weighting), RUN)
    assert isinstance(half, FedProtoServer)
    return half


def one_round(half: FedProtoServer, orgs: tuple[str, ...] = ORGS, round_: int = 1) -> None:
    for org in orgs:
        half.validate(Phase.TRAIN, org, upload(org))
        half.accumulate(Phase.TRAIN, org, upload(org))
    half.close_round(Phase.TRAIN, round_)


@pytest.mark.parametrize("weighting", ["uniform", "count", "paper"])
def test_each_class_is_averaged_over_the_organizations_that_hold_it(weighting: str) -> None:
    half = server(weighting)
    assert half.payloads_for(Phase.TRAIN, 1, "a") == []  # round 1 trains on cross-entropy alone
    one_round(half)
    want = hand(weighting)
    np.testing.assert_allclose(half.prototypes, want, rtol=1e-15, atol=0)
    assert half.present.tolist() == [True, True, True, False]
    assert half.support.tolist() == [40, 100, 25, 0]
    (sent,) = half.payloads_for(Phase.TRAIN, 2, "b")
    assert isinstance(sent, ClassMeanEmbeddings)
    assert sent.means.dtype == np.float32 and np.array_equal(sent.means, want.astype(np.float32))
    assert sent.presence.tolist() == [True, True, True, False] and sent.counts.tolist() == [40, 100, 25, 0]
    assert half.payloads_for(Phase.EVALUATE, 2, "c")[0].means.tobytes() == sent.means.tobytes()


def test_the_weightings_differ_on_these_numbers() -> None:
    """The three hand computations are three different answers, so each test above checks its own formula."""
    u, c, p = hand("uniform"), hand("count"), hand("paper")
    assert not np.allclose(u[:3], c[:3]) and not np.allclose(c[:3], p[:3]) and not np.allclose(u[:3], p[:3])


def test_a_class_nobody_reports_keeps_its_last_prototype() -> None:
    half = server()
    one_round(half)
    before = half.prototypes.copy()
    one_round(half, ("b",), round_=2)  # b alone: classes 1 and 2 become b's, class 0 keeps round 1's
    assert np.array_equal(half.prototypes[0], before[0])
    assert np.array_equal(half.prototypes[1:3], MEANS["b"][1:3].astype(np.float64))
    assert half.support.tolist() == [40, 10, 20, 0]
    assert half.present.tolist() == [True, True, True, False]


def test_the_state_restores_the_prototypes_bit_for_bit() -> None:
    half = server("count")
    one_round(half)
    again = server("count")
    again.load_state(half.state())
    assert again.payloads_for(Phase.TRAIN, 2, "a")[0].means.tobytes() == \
        half.payloads_for(Phase.TRAIN, 2, "a")[0].means.tobytes()
    one_round(half, round_=2)
    one_round(again, tuple(reversed(ORGS)), round_=2)
    assert half.prototypes.tobytes() == again.prototypes.tobytes()


def bad(**changes: object) -> Received:
    counts = np.array([3, 0, 1, 0], np.int64)
    fields = {"labels": np.arange(K, dtype=np.int64), "means": np.zeros((K, D), np.float32), "counts": counts,
              "presence": counts > 0, **changes}
    return Received([ClassMeanEmbeddings(**fields), EvalMetrics()], frozenset())  # type: ignore[arg-type]


@pytest.mark.parametrize(("update", "reason", "match"), [
    (bad(means=np.zeros((K, D + 1), np.float32)), "shape_mismatch", r"means must be a floating tensor of shape"),
    (bad(labels=np.array([0, 1, 3, 2])), "invalid_value", r"labels must be the integers 0..3"),
    (bad(counts=np.array([3, 0, -1, 0])), "invalid_value", r"counts must be >= 0"),
    (bad(presence=np.array([True, True, True, False])), "invalid_value", r"presence exactly counts > 0"),
    (bad(presence=np.array([1, 0, 1, 0])), "shape_mismatch", r"presence must be bool"),
    (bad(means=np.array([[np.inf, 0, 0]] + [[0, 0, 0]] * 3, np.float32)), "invalid_value", r"must be finite"),
])
def test_malformed_prototypes_are_refused_with_a_reason(update: Received, reason: str, match: str) -> None:
    with pytest.raises(WireError, match=match) as err:
        server().validate(Phase.TRAIN, "a", update)
    assert err.value.reason == reason


def test_an_absent_class_may_carry_anything() -> None:
    """A NaN row of a class the organization lacks is not an error: it is never read."""
    server().validate(Phase.TRAIN, "a", bad(means=np.array([[0, 0, 0], [np.nan] * 3, [0, 0, 0], [0, 0, 0]],
                                                           np.float32)))
