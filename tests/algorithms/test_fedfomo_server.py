"""FedFomo's server half: the affinity step against hand-computed numbers, the ε-greedy choice of peers, the
relay (the very arrays an organization sent), the affinity matrix after a round, what it refuses and restores;
and the wire contract, which refuses any kind the spec does not declare."""

from __future__ import annotations

import numpy as np
import pytest

from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.algorithms.base import RunInfo
from hetfed.aggregator.algorithms.fedfomo import FedFomoServer, affinity_step
from hetfed.wire import codec
from hetfed.wire.contract import TensorDecl, check_download, check_update
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import (
    EvalMetrics,
    HeadWeights,
    ModelWeights,
    Payload,
    PeerWeights,
    Received,
    SeedPosteriors,
)
from hetfed.wire.phases import Phase
from hetfed.wire.specs import get_spec
from hetfed.wire.specs.fedfomo import FedFomoConfig, choose_peers

SPEC = get_spec("fedfomo")
ORGS = ("a", "b", "c", "d")
RUN = RunInfo(seed=5, organizations=ORGS)


def model(org: str) -> ModelWeights:
    """A three-element model per organization, its values telling the organizations apart."""
    i = ORGS.index(org)
    return ModelWeights({"w": np.array([i + 0.5, -i, 2.0 * i], np.float32)}, num_examples=10 + i)


def upload(org: str, report: PeerWeights | None = None) -> Received:
    return Received([model(org), *([report] if report else []), EvalMetrics()], SPEC.repeated_download)


def server(**fields: object) -> FedFomoServer:
    half = make_server_half(SPEC, SPEC.config(**fields), RUN)
    assert isinstance(half, FedFomoServer)
    return half


def round_one(half: FedFomoServer) -> None:
    for org in ORGS:
        assert half.payloads_for(Phase.TRAIN, 1, org) == []  # nothing to relay yet
    for org in reversed(ORGS):
        half.validate(Phase.TRAIN, org, upload(org))
        half.accumulate(Phase.TRAIN, org, upload(org))
    half.close_round(Phase.TRAIN, 1)


def sent_peers(payloads: list[Payload]) -> tuple[str, ...]:
    names = payloads[0]
    assert isinstance(names, PeerWeights)
    return names.organizations


def test_the_affinity_step_divides_the_signed_weights_by_the_absolute_sum() -> None:
    # 0.5 − 0.25 + 1.0 = 1.25: 0.5/1.25, −0.25/1.25, 1.0/1.25.
    assert affinity_step(np.array([0.5, -0.25, 1.0], np.float32)).tolist() == [0.4, -0.2, 0.8]
    # All negative: |−1 − 3| = 4, the signs kept.
    assert affinity_step(np.array([-1.0, -3.0])).tolist() == [-0.25, -0.75]
    # A zero sum gets 1e-9 (the reference code's guard).
    assert affinity_step(np.array([2.0, -2.0])).tolist() == [2.0 / 1e-9, -2.0 / 1e-9]


def test_exploration_decays_by_round_and_stops_at_zero() -> None:
    cfg = FedFomoConfig()
    assert [cfg.exploration(r) for r in (1, 2, 3)] == [0.3, 0.25, pytest.approx(0.2)]
    assert cfg.exploration(7) == pytest.approx(0.0, abs=1e-15) and cfg.exploration(8) == 0.0


def test_greedy_choice_takes_the_highest_affinities_with_ties_broken_at_random() -> None:
    row = np.array([0.1, 0.5, -0.2, 0.9, 0.5])
    firsts, seconds = set(), set()
    for seed in range(12):
        chosen = choose_peers(row, [1, 2, 3, 4], 3, 0.0, np.random.default_rng(seed))
        assert chosen[0] == 3 and set(chosen[1:]) == {1, 4}
        firsts.add(chosen[1])
        seconds.add(chosen[2])
    assert firsts == seconds == {1, 4}  # the tie between 1 and 4 goes both ways
    assert choose_peers(row, [1, 2], 5, 0.0, np.random.default_rng(0)) == [1, 2]  # fewer peers than places
    assert choose_peers(row, [], 3, 0.5, np.random.default_rng(0)) == []


def test_exploring_takes_the_peers_of_a_seeded_shuffle() -> None:
    row = np.array([0.0, 9.0, 8.0, 7.0, 6.0])
    rng = np.random.default_rng(11)
    rng.random(4)  # the tie-breaking draws come first
    shuffle = [[1, 2, 3, 4][int(j)] for j in rng.permutation(4)]
    assert choose_peers(row, [1, 2, 3, 4], 2, 1.0, np.random.default_rng(11)) == shuffle[:2]


def test_a_round_relays_the_peers_models_unchanged_and_reports_move_the_affinity_matrix() -> None:
    half = server(peers_per_round=2, epsilon=0.0)
    round_one(half)
    sent = {org: half.payloads_for(Phase.TRAIN, 2, org) for org in ORGS}
    for org, payloads in sent.items():
        peers = sent_peers(payloads)
        assert len(peers) == 2 and org not in peers and len(set(peers)) == 2
        names = payloads[0]
        assert isinstance(names, PeerWeights) and names.weights.tolist() == [0.0, 0.0]
        for peer, mw in zip(peers, payloads[1:], strict=True):
            assert isinstance(mw, ModelWeights)
            assert mw.tensors["w"].tolist() == model(peer).tensors["w"].tolist()
            assert mw.num_examples == model(peer).num_examples
        check_download(SPEC, [codec.payload_to_proto(p) for p in payloads])  # the download contract holds
    p1, p2 = sent_peers(sent["a"])
    reports = {org: PeerWeights((org, *sent_peers(sent[org])), np.array([0.5, -0.25, 1.0], np.float32))
               for org in ORGS}
    reports["b"] = PeerWeights(reports["b"].organizations, np.array([-1.0, -1.0, -2.0], np.float32))
    for org in ORGS:
        half.validate(Phase.TRAIN, org, upload(org, reports[org]))
        half.accumulate(Phase.TRAIN, org, upload(org, reports[org]))
    half.close_round(Phase.TRAIN, 2)
    want = 0.1 * np.eye(4)
    for org, report in reports.items():
        step = {"b": [-0.25, -0.25, -0.5]}.get(org, [0.4, -0.2, 0.8])
        for name, s in zip(report.organizations, step, strict=True):
            want[ORGS.index(org), ORGS.index(name)] += s
    np.testing.assert_allclose(half.affinity, want, rtol=0, atol=1e-15)
    # Greedy round 3: a's best peer (p2, 0.8) first, then one at affinity 0, never p1 at −0.2.
    chosen = sent_peers(half.payloads_for(Phase.TRAIN, 3, "a"))
    assert chosen[0] == p2 and p1 not in chosen


def test_it_refuses_reports_that_do_not_name_what_was_sent() -> None:
    half = server(peers_per_round=2, epsilon=0.0)
    round_one(half)
    peers = sent_peers(half.payloads_for(Phase.TRAIN, 2, "a"))
    other = next(o for o in ORGS if o not in (*peers, "a"))
    w = np.ones(3, np.float32)
    cases = [
        (None, "missing_payload", "must report its peer_weights"),
        (PeerWeights((*peers, "a"), w), "invalid_value", "itself, then its peers in the order sent"),
        (PeerWeights(("a", peers[0], other), w), "invalid_value", "name"),
        (PeerWeights(("a", *peers), np.ones(2, np.float32)), "shape_mismatch", r"float vector \[3\]"),
        (PeerWeights(("a", *peers), np.ones(3, np.int64)), "shape_mismatch", "float vector"),
    ]
    for report, reason, message in cases:
        with pytest.raises(WireError, match=message) as refused:
            half.validate(Phase.TRAIN, "a", upload("a", report))
        assert refused.value.reason == reason
    half.validate(Phase.TRAIN, "a", upload("a", PeerWeights(("a", *peers), w)))  # the right one passes


def test_the_contract_refuses_every_kind_the_spec_does_not_declare() -> None:
    schema = {ModelWeights.kind: {"w": TensorDecl("float32", (3,))}}
    good = [codec.payload_to_proto(p) for p in (model("a"), PeerWeights(("a",), np.ones(1, np.float32)),
                                                EvalMetrics())]
    assert check_update(SPEC, Phase.TRAIN, good, schema, 10**6).get(PeerWeights).organizations == ("a",)
    for stray in (HeadWeights(np.ones((2, 2), np.float32), np.ones(2, np.float32)),
                  SeedPosteriors("s", np.arange(2), np.full((2, 2), 0.5, np.float32), 1.0)):
        with pytest.raises(WireError, match=f"fedfomo does not accept {stray.kind.value}") as refused:
            check_update(SPEC, Phase.TRAIN, [*good, codec.payload_to_proto(stray)], schema, 10**6)
        assert refused.value.reason == "payload_kind_not_allowed"
    with pytest.raises(WireError, match="fedfomo never receives seed_posteriors"):
        check_download(SPEC, [codec.payload_to_proto(SeedPosteriors("s", np.arange(2),
                                                                     np.full((2, 2), 0.5, np.float32), 1.0))])
    with pytest.raises(WireError, match="two peer_weights payloads"):  # one PeerWeights per message, down too
        check_download(SPEC, [codec.payload_to_proto(PeerWeights(("b",), np.ones(1, np.float32)))] * 2)


def test_the_state_restores_the_matrix_the_models_and_the_open_rounds_choice() -> None:
    half = server(peers_per_round=3)
    round_one(half)
    before = {org: half.payloads_for(Phase.TRAIN, 2, org) for org in ORGS}
    restored = server(peers_per_round=3)
    restored.load_state(half.state())
    for org in ORGS:
        again = restored.payloads_for(Phase.TRAIN, 2, org)
        assert sent_peers(again) == sent_peers(before[org])
        for a, b in zip(again[1:], before[org][1:], strict=True):
            assert isinstance(a, ModelWeights) and isinstance(b, ModelWeights)
            assert a.tensors["w"].tobytes() == b.tensors["w"].tobytes() and a.num_examples == b.num_examples
    np.testing.assert_array_equal(restored.affinity, half.affinity)


@pytest.mark.parametrize(("fields", "message"), [
    ({"peers_per_round": -1}, "peers_per_round must be >= 0"),
    ({"epsilon": 1.5}, r"epsilon must be in \[0, 1\]"),
    ({"epsilon_decay": -0.1}, "epsilon_decay must be >= 0"),
    ({"val_fraction": 0.0}, r"val_fraction must be in \(0, 1\)"),
    ({"val_fraction": 1.0}, r"val_fraction must be in \(0, 1\)"),
])
def test_the_config_refuses_out_of_range_fields(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SPEC.config(**fields)
