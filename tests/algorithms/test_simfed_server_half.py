"""SimFed's server half through its hooks: per-organization downloads with exact numbers, state, checks."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from hetfed.aggregator.algorithms import server_half_type
from hetfed.aggregator.algorithms.base import RunInfo
from hetfed.aggregator.algorithms.simfed import SimFedServer
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import (
    CriteriaEmbeddings,
    EvalMetrics,
    FactorizedLayer,
    FactorizedWeights,
    Payload,
    Received,
)
from hetfed.wire.phases import Phase
from hetfed.wire.specs import get_spec
from hetfed.wire.specs.simfed import SimFedConfig

ORGS = ("a", "b", "c")
# Embeddings with cosines 0.96 (a, b), 0 (a, c), 0.28 (b, c); α with exp(α·0.04) = 3 weighs (1, 0.96) as (3/4, 1/4).
Z = {"a": [[1.0, 0.0]], "b": [[0.96, 0.28]], "c": [[0.0, 1.0]]}
ALPHA_3_TO_1 = math.log(3.0) / 0.04
CRITERIA = "normal(0,1) seed=0 count=1 shape=2"


def factors(u: list[float], v: list[float], idx: list[int], val: list[float], name: str = "encoder.0") -> FactorizedWeights:
    layer = FactorizedLayer(name, np.array(u, np.float32), np.array(v, np.float32), np.array(idx, np.int64),
                            np.array(val, np.float32), (len(u), len(v)))
    return FactorizedWeights((layer,), num_examples=10)


UPLOADS = {
    "a": factors([1.0, 2.0, 3.0], [1.0], [0, 2], [1.0, 2.0]),
    "b": factors([5.0, 6.0, 7.0], [5.0], [1, 2], [4.0, 6.0]),
    "c": factors([0.1, 0.2, 0.3], [0.5], [1], [0.7]),
}


def update(org: str, fw: FactorizedWeights | None = None, z: list[list[float]] | None = None,
           criteria: str = CRITERIA) -> Received:
    payloads: list[Payload] = [fw or UPLOADS[org], CriteriaEmbeddings(criteria, np.array(z or Z[org], np.float32)),
                               EvalMetrics()]
    return Received(payloads)


def server(**config: object) -> SimFedServer:
    cfg = SimFedConfig(**{"tau": 0.9, "alpha": ALPHA_3_TO_1, **config})  # type: ignore[arg-type]
    return SimFedServer(cfg, RunInfo(seed=7, organizations=ORGS))


def train_round(half: SimFedServer, round_: int, uploads: dict[str, FactorizedWeights] | None = None) -> None:
    for org in ORGS:
        u = update(org, (uploads or UPLOADS)[org])
        half.validate(Phase.TRAIN, org, u)
        half.accumulate(Phase.TRAIN, org, u)
    half.close_round(Phase.TRAIN, round_)


def layer_of(payloads: list[Payload]) -> FactorizedLayer:
    (fw,) = payloads
    assert isinstance(fw, FactorizedWeights)
    (layer,) = fw.layers
    return layer


def test_registered_and_personalised() -> None:
    assert server_half_type(get_spec("simfed")) is SimFedServer and SimFedServer.broadcast is False


def test_round_one_sends_nothing_then_each_organization_gets_its_own_reflection() -> None:
    half = server()
    assert half.payloads_for(Phase.TRAIN, 1, "a") == []
    train_round(half, 1)
    np.testing.assert_allclose(half.sigma, [[1, 0.96, 0], [0.96, 1, 0.28], [0, 0.28, 1]], atol=1e-6)
    assert half.sets["a"][0] == ("a", "b") and half.sets["c"][0] == ("c",)
    a, b, c = (layer_of(half.payloads_for(Phase.TRAIN, 2, o)) for o in ORGS)
    # θ_a + 3/4·0 + 1/4·(θ_b − θ_a); θ_b + 1/4·(θ_a − θ_b); masks on their dense scatters [1, 0, 2], [0, 4, 6].
    np.testing.assert_allclose(a.u, [2.0, 3.0, 4.0], atol=1e-5)
    np.testing.assert_allclose(a.v, [2.0], atol=1e-6)
    assert a.mask_indices.tolist() == [0, 1, 2] and np.allclose(a.mask_values, [0.75, 1.0, 3.0], atol=1e-6)
    np.testing.assert_allclose(b.u, [4.0, 5.0, 6.0], atol=1e-5)
    assert b.mask_indices.tolist() == [0, 1, 2] and np.allclose(b.mask_values, [0.25, 3.0, 5.0], atol=1e-6)
    own = UPLOADS["c"].layers[0]  # J_c = {c}: its own factors, bit for bit
    assert np.array_equal(c.u, own.u) and np.array_equal(c.mask_values, own.mask_values)
    assert half.payloads_for(Phase.EVALUATE, 3, "a") == []


def test_uploads_of_the_open_round_do_not_change_its_downloads() -> None:
    half = server()
    train_round(half, 1)
    before = layer_of(half.payloads_for(Phase.TRAIN, 2, "a"))
    # b trains round 2 and pushes before a has pulled its round-2 factors.
    moved = factors([50.0, 60.0, 70.0], [9.0], [0], [1.0])
    half.validate(Phase.TRAIN, "b", update("b", moved))
    half.accumulate(Phase.TRAIN, "b", update("b", moved))
    after = layer_of(half.payloads_for(Phase.TRAIN, 2, "a"))
    assert np.array_equal(before.u, after.u) and np.array_equal(before.mask_values, after.mask_values)
    # At the close b's new factors replace its old ones by reference (no copy); a and c keep theirs.
    half.close_round(Phase.TRAIN, 2)
    assert half.latest["b"] is moved and half.latest["a"] is UPLOADS["a"]
    assert not half.pending


def test_state_round_trips_and_its_size_is_the_held_arrays() -> None:
    half = server()
    train_round(half, 1)
    arrays = half.state()
    again = server()
    again.load_state({k: np.array(v) for k, v in arrays.items()})
    assert again.closed_round == 1 and again.order == ORGS
    np.testing.assert_array_equal(again.sigma, half.sigma)
    for org in ORGS:
        x, y = layer_of(half.payloads_for(Phase.TRAIN, 2, org)), layer_of(again.payloads_for(Phase.TRAIN, 2, org))
        assert np.array_equal(x.u, y.u) and np.array_equal(x.mask_indices, y.mask_indices)
        assert np.array_equal(x.mask_values, y.mask_values)
    # u (3 floats), v (1), mask entries (int64 + float32 each), embeddings (2 floats) per organization, σ 3x3.
    per_org = {o: 4 * 3 + 4 + 12 * UPLOADS[o].layers[0].mask_indices.size + 4 * 2 for o in ORGS}
    assert half.state_nbytes() == sum(per_org.values()) + 8 * 9
    server().load_state({})  # a new run's empty state


def test_random_matching_weighs_its_members_as_eq8_or_equally() -> None:
    half = server(matching="random", random_partners=1)
    train_round(half, 1)
    sigma = dict(zip(ORGS, half.sigma, strict=True))
    for org in ORGS:
        members, weights = half.sets[org]
        assert org in members and len(members) == 2
        other = next(m for m in members if m != org)
        # softmax(α·σ) over {org, other}: exp(α·1) against exp(α·σ_other), in members' order
        w_other = 1.0 / (1.0 + math.exp(ALPHA_3_TO_1 * (1.0 - sigma[org][ORGS.index(other)])))
        expected = [w_other if m == other else 1.0 - w_other for m in members]
        np.testing.assert_allclose(weights, expected, rtol=1e-12)
    equal = server(matching="random", random_partners=1, match_weights="equal")
    train_round(equal, 1)
    for org in ORGS:
        np.testing.assert_array_equal(equal.sets[org][1], [0.5, 0.5])
    assert {o: equal.sets[o][0] for o in ORGS} == {o: half.sets[o][0] for o in ORGS}  # seeded by run and round


def test_top_and_bottom_matching_take_the_most_and_least_similar_partner() -> None:
    # σ(a, b) = 0.96, σ(a, c) = 0, σ(b, c) = 0.28
    top, bottom = server(matching="top", random_partners=1), server(matching="bottom", random_partners=1)
    for half in (top, bottom):
        train_round(half, 1)
    assert {o: top.sets[o][0] for o in ORGS} == {"a": ("a", "b"), "b": ("a", "b"), "c": ("b", "c")}
    assert {o: bottom.sets[o][0] for o in ORGS} == {"a": ("a", "c"), "b": ("b", "c"), "c": ("a", "c")}
    # a's top set weighs (1, 0.96) as (3/4, 1/4) under this α, as the similarity matching does
    np.testing.assert_allclose(top.sets["a"][1], [0.75, 0.25], rtol=1e-6)  # float32 embeddings


def test_uploads_that_break_the_run_layout_or_criteria_are_refused() -> None:
    half = server()
    train_round(half, 1)

    def refused(u: Received, reason: str, text: str) -> None:
        with pytest.raises(WireError, match=text) as err:
            half.validate(Phase.TRAIN, "a", u)
        assert err.value.reason == reason

    refused(update("a", factors([1.0, 2.0], [1.0], [], [])), "schema_mismatch", "differ from those it sent before")
    refused(update("a", factors([1.0, 2.0, 3.0], [1.0], [], [], name="encoder.9")), "schema_mismatch", "encoder.9")
    refused(update("a", factors([1.0, 2.0, 3.0], [1.0], [2, 1], [1.0, 1.0])), "invalid_value", "strictly increasing")
    refused(update("a", factors([1.0, 2.0, 3.0], [1.0], [3], [1.0])), "invalid_value", "strictly increasing")
    refused(update("a", factors([1.0, np.nan, 3.0], [1.0], [], [])), "non_finite", "encoder.0.u")
    bad_shape = dataclasses.replace(UPLOADS["a"].layers[0], mask_shape=(1, 3))
    refused(update("a", FactorizedWeights((bad_shape,))), "shape_mismatch", "vectors of the mask's shape")
    refused(update("a", criteria="normal(0,1) seed=1 count=1 shape=2"), "invalid_value", "criteria set")
    refused(update("a", z=[[1.0, 0.0, 0.0]]), "shape_mismatch", "criteria embeddings")
    refused(update("a", z=[[np.inf, 0.0]]), "non_finite", "criteria embeddings")
    with pytest.raises(WireError, match="missing") as err:
        half.validate(Phase.TRAIN, "a", Received([UPLOADS["a"], EvalMetrics()]))
    assert err.value.reason == "missing_payload"
    half.validate(Phase.TRAIN, "a", update("a"))  # the round is unharmed: a valid upload still passes


def test_organizations_of_another_architecture_are_left_out_of_the_reflection() -> None:
    """b's factors have another layout (another architecture): a, similar to b, reflects with itself alone, and
    b receives its own factors; the layouts survive a restart."""
    other = factors([5.0, 6.0], [5.0, 4.0], [1], [4.0], name="encoder.3")
    half = server(tau=-1.0)  # everyone similar: only the layouts separate them
    train_round(half, 1, {**UPLOADS, "b": other})
    assert half.sets["a"][0] == ("a", "c") and half.sets["b"][0] == ("b",) and half.sets["c"][0] == ("a", "c")
    own = layer_of(half.payloads_for(Phase.TRAIN, 2, "b"))
    assert (own.name, own.u.tolist(), own.v.tolist()) == ("encoder.3", [5.0, 6.0], [5.0, 4.0])
    restored = server(tau=-1.0)
    restored.load_state(half.state())
    assert restored.layouts == half.layouts and restored.sets["b"][0] == ("b",)
    with pytest.raises(WireError, match="differ from those it sent before"):
        half.validate(Phase.TRAIN, "b", update("b", UPLOADS["b"]))
