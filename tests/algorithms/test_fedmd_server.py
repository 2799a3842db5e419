"""FedMD's server half: the consensus (the mean of every organization's logits on the round's public subset)
against a float64 hand computation, whatever the arrival order; the subset it expects, what it sends, refuses
and restores."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.algorithms.base import RunInfo, SeedSetInfo, round_seed
from hetfed.aggregator.algorithms.fedmd import FedMDServer
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import EvalMetrics, Received, SeedPosteriors
from hetfed.wire.phases import Phase
from hetfed.wire.specs import get_spec
from hetfed.wire.specs.fedmd import public_subset

SPEC = get_spec("fedmd")
K, SIZE, SUBSET = 3, 40, 4
ORGS = ("a", "b", "c")
RUN = RunInfo(seed=1, organizations=ORGS, seed_set=SeedSetInfo("pub", SIZE))
S1 = public_subset(round_seed(1, 1), SIZE, SUBSET)
# Logits whose float32 sum rounds differently from the float64 one, and one column (row 3, class 0) whose float64
# sum depends on the order: (a + b) + c = 0, (a + c) + b = 1.
LOGITS = {
    "a": np.array([[1.0, -2.0, 3.5], [0.1, 0.2, 0.3], [1e7, 1.0, -1.0], [1e16, 0.0, 0.0]], np.float32),
    "b": np.array([[-4.0, 2.0, 0.5], [0.7, -0.2, 0.9], [1.0, 3e-3, 2.0], [1.0, -5.0, 1.25]], np.float32),
    "c": np.array([[2.0, 2.0, 2.0], [-0.3, 0.6, 0.0], [3.0, -1e7, 0.5], [-1e16, 2.0, 3.0]], np.float32),
}


def upload(org: str, indices: np.ndarray = S1, seed_set: str = "pub") -> Received:
    return Received([SeedPosteriors(seed_set, indices, LOGITS[org], 0.0), EvalMetrics()], frozenset())


def server(**fields: object) -> FedMDServer:
    half = make_server_half(SPEC, SPEC.config(public_subset=SUBSET, **fields), RUN)
    assert isinstance(half, FedMDServer)
    return half


def hand() -> np.ndarray:
    """(1/3)·(a + b + c), entry by entry in float64."""
    a, b, c = (LOGITS[o].astype(np.float64) for o in ORGS)
    return np.array([[(a[i, j] + b[i, j] + c[i, j]) / 3 for j in range(K)] for i in range(SUBSET)])


def close_round_1(half: FedMDServer, orgs: tuple[str, ...]) -> None:
    assert half.payloads_for(Phase.TRAIN, 1, orgs[0]) == []  # nothing before the first close
    for org in orgs:
        half.validate(Phase.TRAIN, org, upload(org))
        half.accumulate(Phase.TRAIN, org, upload(org))
    half.close_round(Phase.TRAIN, 1)


@pytest.mark.parametrize("order", list(itertools.permutations(ORGS)))
def test_the_consensus_is_the_float64_mean_of_the_logits_in_any_arrival_order(order: tuple[str, ...]) -> None:
    half = server()
    close_round_1(half, order)
    assert np.array_equal(half.consensus, hand())  # bit for bit: summed in sorted order, in float64
    (sent,) = half.payloads_for(Phase.TRAIN, 2, "a")
    assert isinstance(sent, SeedPosteriors)
    assert sent.seed_set_id == "pub" and np.array_equal(sent.indices, S1)
    assert np.array_equal(sent.probabilities, hand().astype(np.float32))


def test_the_subset_is_drawn_from_the_round_seed_and_sorted() -> None:
    assert S1.size == SUBSET and np.array_equal(S1, np.sort(S1)) and np.unique(S1).size == SUBSET
    assert np.array_equal(S1, np.sort(np.random.default_rng([round_seed(1, 1), SIZE]).choice(SIZE, SUBSET,
                                                                                              replace=False)))
    assert not np.array_equal(S1, public_subset(round_seed(1, 2), SIZE, SUBSET))  # a new subset each round
    assert np.array_equal(public_subset(7, SIZE, 0), np.arange(SIZE))  # 0: the whole public set
    assert np.array_equal(public_subset(7, SIZE, SIZE + 5), np.arange(SIZE))


def test_it_refuses_another_subset_seed_set_shape_or_non_finite_logits() -> None:
    half = server()
    half.payloads_for(Phase.TRAIN, 1, "a")
    s2 = public_subset(round_seed(1, 2), SIZE, SUBSET)
    bad_logits = LOGITS["a"].copy()
    bad_logits[1, 1] = np.nan
    cases = [
        (upload("a", s2), "invalid_value", "public subset"),  # round 2's subset in round 1
        (upload("a", seed_set="other"), "seed_set_mismatch", "other"),
        (Received([SeedPosteriors("pub", S1, LOGITS["a"][:, :1], 0.0), EvalMetrics()], frozenset()),
         "shape_mismatch", "K >= 2"),
        (Received([SeedPosteriors("pub", S1, bad_logits, 0.0), EvalMetrics()], frozenset()),
         "invalid_value", "finite"),
    ]
    for update, reason, text in cases:
        with pytest.raises(WireError) as err:
            half.validate(Phase.TRAIN, "a", update)
        assert err.value.reason == reason and text in str(err.value)
    half.validate(Phase.TRAIN, "a", upload("a"))
    half.accumulate(Phase.TRAIN, "a", upload("a"))
    with pytest.raises(WireError, match="classes"):  # another K than the round's first upload
        half.validate(Phase.TRAIN, "b", Received([SeedPosteriors("pub", S1, np.zeros((SUBSET, 4), np.float32), 0.0),
                                                  EvalMetrics()], frozenset()))


def test_after_a_close_it_expects_the_next_rounds_subset_and_restores_from_its_state() -> None:
    half = server()
    close_round_1(half, ORGS)
    s2 = public_subset(round_seed(1, 2), SIZE, SUBSET)
    with pytest.raises(WireError):
        half.validate(Phase.TRAIN, "a", upload("a", S1))
    half.validate(Phase.TRAIN, "a", upload("a", s2))
    restored = server()
    restored.load_state(half.state())
    assert restored.open_round == 2 and np.array_equal(restored.consensus, hand())
    restored.validate(Phase.TRAIN, "a", upload("a", s2))
    assert np.array_equal(restored.payloads_for(Phase.EVALUATE, 2, "b")[0].probabilities,  # type: ignore[union-attr]
                          hand().astype(np.float32))
