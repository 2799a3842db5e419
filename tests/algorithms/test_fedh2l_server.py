"""FedH2L's server half: an exact relay (nothing computed), seeded bounded peer subsets, strict validation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import grpc
import numpy as np
import pytest

from hetfed.aggregator.algorithms.base import RunInfo, SeedSetInfo
from hetfed.aggregator.algorithms.fedh2l import FedH2LServer
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import codec
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import EvalMetrics, PayloadKind, Received, SeedPosteriors
from hetfed.wire.phases import Phase
from hetfed.wire.specs.fedh2l import FedH2LConfig
from tests.conftest import RawClient

SP = PayloadKind.SEED_POSTERIORS
SEED_SET = "rotated-test"
RANGES = {"a": (0, 10), "b": (10, 20), "c": (20, 30)}


def posteriors(lo: int, seed: int, b: int = 3, k: int = 4, dtype: type = np.float32) -> SeedPosteriors:
    rng = np.random.default_rng(seed)
    p = rng.random((b, k)) + 0.1
    p = (p / p.sum(axis=1, keepdims=True)).astype(dtype)
    return SeedPosteriors(SEED_SET, np.arange(lo, lo + b, dtype=np.int64), p, 0.75)


TRAIN, EVALUATE = Phase.TRAIN, Phase.EVALUATE


def server(**kw: object) -> FedH2LServer:
    cfg = FedH2LConfig(**kw)  # type: ignore[arg-type]
    return FedH2LServer(cfg, RunInfo(7, tuple(RANGES), SeedSetInfo(SEED_SET, 30, RANGES)))


def relay_only(seed: int, **kw: object) -> FedH2LServer:
    """A server half without a seed-set description (indices unchecked)."""
    return FedH2LServer(FedH2LConfig(**kw), RunInfo(seed, ()))  # type: ignore[arg-type]


def test_relay_is_exact_and_lags_one_round() -> None:
    half = server()
    assert half.broadcast is False
    assert half.payloads_for(TRAIN, 1, "a") == []  # round 1: nothing has been taught yet
    pushed = {org: posteriors(lo, i) for i, (org, (lo, _)) in enumerate(RANGES.items())}
    for org, sp in pushed.items():
        half.validate(TRAIN, org, Received([sp]))
        half.accumulate(TRAIN, org, Received([sp]))
    assert half.payloads_for(TRAIN, 1, "a") == []  # still round 1's (empty) relay until the round closes
    half.close_round(TRAIN, 1)
    for org in RANGES:
        got = half.payloads_for(TRAIN, 2, org)
        assert [p.source_organization for p in got] == sorted(set(RANGES) - {org})
        for p in got:
            src = pushed[p.source_organization]
            # The very arrays that arrived: the relay computes nothing from them.
            assert p.indices is src.indices and p.probabilities is src.probabilities
            assert (p.seed_set_id, p.teaching_confidence) == (src.seed_set_id, src.teaching_confidence)
            assert dataclasses.replace(p, source_organization="") == dataclasses.replace(src)
            sent, received = codec.payload_to_proto(p).seed_posteriors, codec.payload_to_proto(src).seed_posteriors
            assert sent.probabilities == received.probabilities and sent.indices == received.indices
    # The final evaluate round relays the last training round's posteriors (for the last learn step).
    assert [p.source_organization for p in half.payloads_for(EVALUATE, 3, "c")] == ["a", "b"]
    half.close_round(TRAIN, 2)  # a round nobody pushed in relays nothing afterwards
    assert half.payloads_for(TRAIN, 3, "a") == []


def test_relay_survives_a_checkpoint_round_trip() -> None:
    half = server()
    for i, (org, (lo, _)) in enumerate(RANGES.items()):
        half.accumulate(TRAIN, org, Received([posteriors(lo, i)]))
    half.close_round(TRAIN, 1)
    other = server()
    other.load_state(half.state())
    for org in RANGES:
        assert other.payloads_for(TRAIN, 2, org) == half.payloads_for(TRAIN, 2, org)


def test_peer_subsets_are_seeded_and_bounded() -> None:
    orgs = [f"o{i}" for i in range(6)]

    def filled(seed: int) -> FedH2LServer:
        half = relay_only(seed, peers_per_round=2)
        for i, o in enumerate(orgs):
            half.accumulate(TRAIN, o, Received([posteriors(0, i)]))
        half.close_round(TRAIN, 1)
        return half

    half, again, other = filled(3), filled(3), filled(4)
    seen: dict[str, set[str]] = {o: set() for o in orgs}
    differs = False
    for r in range(2, 60):
        for o in orgs:
            teachers = half.teachers(r, o)
            assert len(teachers) == 2 and o not in teachers and len(set(teachers)) == 2
            assert teachers == again.teachers(r, o)  # seeded: every aggregator replica agrees
            assert [p.source_organization for p in half.payloads_for(TRAIN, r, o)] == teachers
            differs |= teachers != other.teachers(r, o)
            seen[o].update(teachers)
    assert differs
    assert all(seen[o] == set(orgs) - {o} for o in orgs)  # every peer teaches every node now and then
    # peers_per_round at least the number of peers means every peer
    wide = relay_only(0, peers_per_round=9)
    for i, o in enumerate(orgs):
        wide.accumulate(TRAIN, o, Received([posteriors(0, i)]))
    wide.close_round(TRAIN, 1)
    assert wide.teachers(2, "o0") == orgs[1:]


def _bad(sp: SeedPosteriors, org: str = "a") -> WireError:
    with pytest.raises(WireError) as err:
        server().validate(TRAIN, org, Received([sp]))
    return err.value


def test_validation_rejects_what_is_not_a_teaching_signal() -> None:
    good = posteriors(0, 0)
    server().validate(TRAIN, "a", Received([good]))
    server().validate(TRAIN, "a", Received([EvalMetrics()]))  # nothing to check
    assert _bad(dataclasses.replace(good, seed_set_id="other")).reason == "seed_set_mismatch"
    assert _bad(good, org="b").reason == "invalid_value"  # indices outside b's own domain part
    assert "own domain part" in _bad(good, org="b").message
    out = dataclasses.replace(good, indices=np.array([0, 1, 30], np.int64))
    assert "outside the seed set" in _bad(out).message
    assert "repeat" in _bad(dataclasses.replace(good, indices=np.array([1, 1, 2], np.int64))).message
    assert _bad(dataclasses.replace(good, indices=np.array([-1, 1, 2], np.int64))).reason == "invalid_value"
    assert _bad(dataclasses.replace(good, indices=np.zeros(0, np.int64))).reason == "invalid_value"
    assert _bad(dataclasses.replace(good, probabilities=good.probabilities[:2])).reason == "shape_mismatch"
    assert _bad(dataclasses.replace(good, probabilities=good.probabilities[:, :1])).reason == "shape_mismatch"
    assert "sum to 1" in _bad(dataclasses.replace(good, probabilities=good.probabilities * 1.01)).message
    negative = good.probabilities.copy()
    negative[0, :2] = [-0.1, negative[0, 0] + negative[0, 1] + 0.1]
    assert _bad(dataclasses.replace(good, probabilities=negative)).reason == "invalid_value"
    assert _bad(dataclasses.replace(good, teaching_confidence=1.5)).reason == "invalid_value"
    assert _bad(dataclasses.replace(good, teaching_confidence=-0.1)).reason == "invalid_value"
    assert "claims" in _bad(dataclasses.replace(good, source_organization="c")).message
    # The number of classes is fixed by the first posteriors of the run.
    half = server()
    half.accumulate(TRAIN, "a", Received([good]))
    with pytest.raises(WireError, match="classes"):
        half.validate(TRAIN, "b", Received([posteriors(10, 1, k=5)]))


def test_narrow_transport_rows_get_a_matching_tolerance() -> None:
    p16 = posteriors(0, 0, dtype=np.float16)
    relay_only(0, wire_dtype="float16").validate(TRAIN, "a", Received([p16]))


def _join(stub: RawClient, seed_set: tuple[str, str]) -> None:
    req = apb.JoinRequest(run_id="h", organization_id=stub.organization)
    req.seed_set.id, req.seed_set.sha256 = seed_set
    stub.stub.Join(req, metadata=stub.metadata, timeout=10)


@pytest.mark.parametrize("wire_dtype", ["float32", "float16"])
def test_relayed_bytes_equal_pushed_bytes_through_the_service(
        aggregator: Callable[..., object], raw_client: Callable[..., RawClient], wire_dtype: str) -> None:
    seed_set = (SEED_SET, "ab" * 32)
    run = {"id": "h", "algorithm": "fedh2l", "organizations": list(RANGES), "rounds": 2,
           "seed_set": {"id": seed_set[0], "sha256": seed_set[1], "size": 30,
                        "parts": {k: list(v) for k, v in RANGES.items()}},
           "algorithm_config": {"wire_dtype": wire_dtype}}
    agg = aggregator(run)
    clients = {org: raw_client(agg.port, org, run="h") for org in RANGES}  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as err:
        _join(clients["a"], (SEED_SET, "cd" * 32))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "seed_set_mismatch" in err.value.details()
    for c in clients.values():
        _join(c, seed_set)
    pushed: dict[str, bytes] = {}
    for i, (org, c) in enumerate(clients.items()):
        ins = c.pull(completed=0)
        assert ins.envelope.round == 1 and not ins.payloads
        data = c.update_bytes(1, [posteriors(RANGES[org][0], i), EvalMetrics()], wire_dtype=None if wire_dtype == "float32" else wire_dtype)
        pushed[org] = data
        assert c.push_bytes(1, data).accepted
    for org, c in clients.items():
        ins = c.pull(completed=1)
        assert ins.envelope.round == 2 and ins.envelope.organization_id == org
        relayed = [p.seed_posteriors for p in ins.payloads]
        assert [s.source_organization for s in relayed] == sorted(set(RANGES) - {org})
        for s in relayed:
            src = apb.Update.FromString(pushed[s.source_organization]).payloads[0].seed_posteriors
            assert s.probabilities.SerializeToString() == src.probabilities.SerializeToString()
            assert s.indices.SerializeToString() == src.indices.SerializeToString()
            assert s.teaching_confidence == src.teaching_confidence and s.seed_set_id == src.seed_set_id
            # Byte for byte the pushed message, with the relay's one field added.
            src.source_organization = s.source_organization
            assert s.SerializeToString() == src.SerializeToString()
