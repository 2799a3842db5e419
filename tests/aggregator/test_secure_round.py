"""One round of secure aggregation between the aggregator's coordinator (``SecureRound``) and each organization's
``SecureClient``, every stage message through Protobuf bytes, into the real server halves of FedAvg and Fed-CMA.

In process, not over gRPC: neither module is wired into the round engine or the client runtime yet. What it
proves: the unmasked sum is the plain quantized sum exactly; the half fed it ends within the quantization's error
of the half fed each survivor's upload; dropouts after masking at the threshold are recovered, below it the
aggregate is abandoned with no share asked for and the half untouched; forged, replayed, foreign and late stage
messages are refused with the wire's reasons; a value outside its declared range is refused by its own client.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from hetfed import secagg
from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.algorithms.base import RunInfo, ServerHalf
from hetfed.aggregator.run.secure import SecureParams, SecureRound, encoding_fields
from hetfed.client.secure import SecureClient, summed_fields
from hetfed.v1 import payloads_pb2 as pb
from hetfed.wire import codec
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import (
    ClassCounts,
    ClassMeanEmbeddings,
    HeadWeights,
    ModelWeights,
    Payload,
    PayloadKind,
    Received,
    SecAggKeyAdvert,
)
from hetfed.wire.phases import Phase
from hetfed.wire.specs import AlgorithmSpec, fedavg, fedcma, fedproto
from hetfed.wire.summation import shapes

ORGS = ("org-a", "org-b", "org-c", "org-d", "org-e")  # complete graph: k = 4, t = 3
K, D = 10, 32
SEED = 21


def wire(payload: Payload) -> Payload:
    return codec.payload_from_proto(pb.Payload.FromString(codec.payload_to_proto(payload).SerializeToString()))


def rounding(org: str) -> np.random.Generator:
    return np.random.default_rng([SEED, ORGS.index(org)])


def uploads(spec: AlgorithmSpec, counts: Mapping[str, np.ndarray]) -> dict[str, list[Payload]]:
    rng = np.random.default_rng(SEED)
    out: dict[str, list[Payload]] = {}
    for org in ORGS:
        n, c = int(counts[org].sum()), counts[org]
        if spec is fedavg.SPEC:
            out[org] = [ModelWeights({"conv": rng.normal(0, 0.5, (4, 3)).astype(np.float32),
                                      "bias": rng.normal(0, 0.5, 6).astype(np.float32)}, n)]
        else:
            means = rng.uniform(0, 1, (K, D)).astype(np.float32)
            means[c == 0] = 0
            out[org] = [ClassMeanEmbeddings(np.arange(K), means, c.copy(), c > 0),
                        HeadWeights(rng.normal(0, 0.3, (K, D)).astype(np.float32),
                                    rng.normal(0, 0.3, K).astype(np.float32), n)]
    return out


def setup_half(spec: AlgorithmSpec, counts: Mapping[str, np.ndarray]) -> ServerHalf:
    half = make_server_half(spec, spec.config(), RunInfo(SEED, ORGS))
    if spec.setup_upload:
        for org in ORGS:
            half.accumulate(Phase.SETUP, org, Received([ClassCounts(counts[org])]))
        half.close_round(Phase.SETUP, 0)
    return half


def class_counts() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED + 1)
    out = {}
    for org in ORGS:
        c = rng.integers(1, 80, K).astype(np.int64)
        c[rng.integers(0, K)] = 0
        out[org] = c
    return out


class Federation:
    """The aggregator's SecureRound and every organization's SecureClient for round 1."""

    def __init__(self, spec: AlgorithmSpec, params: SecureParams | None = None) -> None:
        self.spec, self.counts = spec, class_counts()
        self.uploads = uploads(spec, self.counts)
        self.half = setup_half(spec, self.counts)
        schema = {n: s for p in self.uploads[ORGS[0]] for n, s in shapes(p).items()}
        self.round = SecureRound(spec, self.half, "run-s", 1, ORGS, SEED, schema, params or SecureParams())
        setup = wire(self.round.setup())
        self.clients = {org: SecureClient(setup, org, secagg.SeededEntropy(org)) for org in ORGS}  # type: ignore[arg-type]

    def run(self, drop_at_mask: frozenset[str] = frozenset(), silent_at_unmask: frozenset[str] = frozenset(),
            noise: dict[str, np.ndarray] | None = None) -> secagg.Aggregate | None:
        for org, c in self.clients.items():
            self.round.receive(org, wire(c.advertise()))
        for org, keys in self.round.close_stage().items():
            self.round.receive(org, wire(self.clients[org].share(wire(keys))))  # type: ignore[arg-type]
        for org, shares in self.round.close_stage().items():
            extra = (noise or {}).get(org)
            masked = self.clients[org].mask(wire(shares), self.uploads[org], self.spec.summed_upload,  # type: ignore[arg-type]
                                            rounding(org), None if extra is None else (lambda enc, e=extra: e))
            if org not in drop_at_mask:
                self.round.receive(org, wire(masked))
        requests = self.round.close_stage()
        if self.round.abandoned:
            return None
        for org, request in requests.items():
            if org not in silent_at_unmask:
                self.round.receive(org, wire(self.clients[org].unmask(wire(request))))  # type: ignore[arg-type]
        return self.round.finish()

    def encoded(self, org: str) -> np.ndarray:
        """The organization's plain encoded input, as its client encoded it (same rounding draws)."""
        values = summed_fields(self.uploads[org], self.spec.summed_upload, self.round.unit)
        return self.round.config.encoding.encode(values, rounding(org))

    def plain(self, survivors: tuple[str, ...]) -> dict[str, np.ndarray]:
        """The half fed each survivor's upload one by one, closed."""
        half = setup_half(self.spec, self.counts)
        for org in survivors:
            half.accumulate(Phase.TRAIN, org, Received(self.uploads[org]))
        half.close_round(Phase.TRAIN, 1)
        return half.state()


def step_bound(fed: Federation) -> float:
    """The largest quantization step of any field."""
    enc = fed.round.config.encoding
    return max(f.bound for f in enc.fields) / enc.level


@pytest.mark.parametrize("spec", [fedavg.SPEC, fedcma.SPEC], ids=lambda s: s.name)
@pytest.mark.parametrize("dropped", [frozenset(), frozenset({"org-c"})])  # k - t = 1: at the threshold
def test_the_secure_round_sums_exactly_and_the_half_follows_the_plain_one(spec: AlgorithmSpec,
                                                                           dropped: frozenset[str]) -> None:
    fed = Federation(spec)
    agg = fed.run(drop_at_mask=dropped)
    assert agg is not None and not fed.round.abandoned
    assert set(agg.dropped) == dropped and set(agg.survivors) == set(ORGS) - dropped
    enc = fed.round.config.encoding
    plain_sum = np.sum([enc.signed(fed.encoded(u)) for u in agg.survivors], axis=0, dtype=np.int64)
    np.testing.assert_array_equal(enc.signed(agg.ring_sum), plain_sum)  # exactly the plain quantized sum
    fed.half.close_round(Phase.TRAIN, 1)
    secure, plain = fed.half.state(), fed.plain(agg.survivors)
    assert secure.keys() == plain.keys()
    # Each survivor's rounding moves a summed value by under one step, the summed weight too: the mean Σwx / Σw
    # moves by under n·step·(1 + |mean|) / Σw (plus float32's rounding of FedAvg's model).
    n, step = len(agg.survivors), step_bound(fed)
    least_weight = min(float(fed.counts[u][fed.counts[u] > 0].min()) for u in agg.survivors)
    for name in plain:
        if plain[name].dtype.kind != "f":
            np.testing.assert_array_equal(secure[name], plain[name])
            continue
        a, b = np.asarray(plain[name], np.float64), np.asarray(secure[name], np.float64)
        tol = n * step * (1 + np.abs(a).max()) / least_weight + 1e-6 * np.abs(a).max()
        assert np.abs(b - a).max() <= tol, (name, np.abs(b - a).max(), tol)
    assert step < 1e-3  # the default encoding: value bound 100, weights up to 10^6, 40 bits


def test_survivors_silent_at_unmasking_down_to_the_threshold_are_tolerated() -> None:
    fed = Federation(fedavg.SPEC)
    agg = fed.run(silent_at_unmask=frozenset({"org-e"}))
    assert agg is not None and agg.survivors == ORGS and agg.dropped == ()


@pytest.mark.parametrize(("drop", "silent"), [(frozenset({"org-a", "org-b"}), frozenset()),
                                              (frozenset({"org-a"}), frozenset({"org-b"}))])
def test_below_the_threshold_the_aggregate_is_abandoned_and_the_half_untouched(drop: frozenset[str],
                                                                                 silent: frozenset[str]) -> None:
    fed = Federation(fedavg.SPEC)
    before = fed.half.state()
    assert fed.run(drop_at_mask=drop, silent_at_unmask=silent) is None
    assert "below_threshold" in fed.round.abandoned and fed.round.stage == "abandoned"
    fed.half.close_round(Phase.TRAIN, 1)
    assert fed.half.state().keys() == before.keys() == set()  # no global model was made from anything
    if not silent:  # abandoned before masking closed: nobody was asked for a share
        assert fed.round.session.revealed == {}


def test_an_implausible_sum_is_refused_and_the_half_untouched() -> None:
    """A client that skips its own range check (here: a huge offset added to its encoded input) makes the sum
    exceed survivors × bound: the aggregator refuses the round's aggregate."""
    fed = Federation(fedavg.SPEC)
    enc = fed.round.config.encoding
    offset = np.zeros(enc.length, enc.dtype)
    offset[0] = enc.dtype(6 * enc.level)
    assert fed.run(noise={"org-a": offset}) is None
    assert "implausible_update" in fed.round.abandoned and "beyond" in fed.round.abandoned
    fed.half.close_round(Phase.TRAIN, 1)
    assert fed.half.state() == {}


def test_noise_added_to_the_masked_vector_is_noise_in_the_sum() -> None:
    """The distributed-DP seam: integers added at masking arrive in the unmasked sum, exactly."""
    fed = Federation(fedavg.SPEC)
    enc = fed.round.config.encoding
    e = np.zeros(enc.length, enc.dtype)
    e[:3] = np.array([5, 0, 2**64 - 7], np.uint64).astype(enc.dtype)  # +5, 0, -7 in the ring
    agg = fed.run(noise={"org-b": e})
    assert agg is not None
    plain_sum = np.sum([enc.signed(fed.encoded(u)) for u in ORGS], axis=0, dtype=np.int64)
    np.testing.assert_array_equal(enc.signed(agg.ring_sum)[:3] - plain_sum[:3], [5, 0, -7])
    np.testing.assert_array_equal(enc.signed(agg.ring_sum)[3:], plain_sum[3:])


def test_stage_messages_are_bound_to_their_sender_run_round_and_stage() -> None:
    fed = Federation(fedavg.SPEC)
    advert = fed.clients["org-a"].advertise()
    with pytest.raises(WireError) as err:
        fed.round.receive("org-b", advert)  # org-b forwarding org-a's keys
    assert err.value.reason == "identity_mismatch"
    fed.round.receive("org-a", advert)
    with pytest.raises(WireError) as err:
        fed.round.receive("org-a", advert)
    assert err.value.reason == "replayed"
    other = secagg.ClientSession(secagg.RoundConfig("run-s", 2, ORGS, 4, 3, bytes(32), fed.round.config.encoding),
                                 "org-c", secagg.SeededEntropy("x"))
    with pytest.raises(WireError) as err:
        fed.round.receive("org-c", SecAggKeyAdvert(other.advertise()))  # round 2's keys in round 1
    assert err.value.reason == "foreign_message"
    for org in ORGS[1:]:
        fed.round.receive(org, fed.clients[org].advertise())
    fed.round.close_stage()
    with pytest.raises(WireError) as err:
        fed.round.receive("org-b", advert)  # stage 1 is closed
    assert err.value.reason in ("unexpected_stage", "identity_mismatch")
    with pytest.raises(WireError) as err:
        fed.round.receive("org-a", advert)
    assert err.value.reason == "unexpected_stage"


def test_a_value_outside_its_declared_range_is_refused_by_its_own_client() -> None:
    fed = Federation(fedavg.SPEC, SecureParams(value_bound=1.0))
    for org, c in fed.clients.items():
        fed.round.receive(org, c.advertise())
    for org, keys in fed.round.close_stage().items():
        fed.round.receive(org, fed.clients[org].share(keys))  # type: ignore[arg-type]
    shares = fed.round.close_stage()
    big = ModelWeights({"conv": np.full((4, 3), 1.5, np.float32), "bias": np.zeros(6, np.float32)}, 10)
    with pytest.raises(WireError) as err:
        fed.clients["org-a"].mask(shares["org-a"], [big], fed.spec.summed_upload, rounding("org-a"))  # type: ignore[arg-type]
    assert err.value.reason == "implausible_update" and "declared bound 1" in str(err.value)
    heavy = ModelWeights({"conv": np.zeros((4, 3), np.float32), "bias": np.zeros(6, np.float32)}, 10**7)
    with pytest.raises(WireError) as err:  # a weight beyond weight_bound (10^6)
        fed.clients["org-b"].mask(shares["org-b"], [heavy], fed.spec.summed_upload, rounding("org-b"))  # type: ignore[arg-type]
    assert err.value.reason == "implausible_update" and "#weight" in str(err.value)


def test_algorithms_that_need_each_payload_are_refused() -> None:
    half = make_server_half(fedproto.SPEC, fedproto.SPEC.config(), RunInfo(0, ORGS))
    with pytest.raises(WireError, match="cannot run with secure_aggregation"):
        SecureRound(fedproto.SPEC, half, "r", 1, ORGS, 0, {})
    half = make_server_half(fedavg.SPEC, fedavg.SPEC.config(aggregation="median"), RunInfo(0, ORGS))
    with pytest.raises(WireError, match="median"):
        SecureRound(fedavg.SPEC, half, "r", 1, ORGS, 0, {})


def test_the_encoding_bounds_each_field() -> None:
    schema = shapes(ModelWeights({"w": np.zeros((2, 2))}, 1))
    fields = {f.name: f for f in encoding_fields(schema, SecureParams(value_bound=3.0, weight_bound=50.0), False)}
    assert fields["model_weights/w"].bound == 150.0 and fields["model_weights#weight"].bound == 50.0
    unit = {f.name: f for f in encoding_fields(schema, SecureParams(value_bound=3.0), True)}
    assert unit["model_weights/w"].bound == 3.0 and unit["model_weights#weight"].bound == 1.0
    assert PayloadKind.MODEL_WEIGHTS in fedavg.SPEC.summed_upload


def test_two_rounds_on_a_sparse_graph_follow_the_plain_rounds() -> None:
    """Eight organizations on a Harary graph of degree 4 (t = 3), two rounds with fresh graph seeds and keys,
    one dropout after masking each round: FedAvg's model after each round is the plain one's within the
    quantization's error, and keeps the model's tensor order."""
    orgs = tuple(f"org-{i}" for i in range(8))
    rng = np.random.default_rng(4)
    secure_half = make_server_half(fedavg.SPEC, fedavg.SPEC.config(), RunInfo(SEED, orgs))
    plain_half = make_server_half(fedavg.SPEC, fedavg.SPEC.config(), RunInfo(SEED, orgs))
    params = SecureParams(degree=4)
    for round_, gone in ((1, "org-3"), (2, "org-6")):
        ups = {o: ModelWeights({"w": rng.normal(0, 1, (5, 2)).astype(np.float32),
                                "b": rng.normal(0, 1, 3).astype(np.float32)}, int(rng.integers(10, 500)))
               for o in orgs}
        sr = SecureRound(fedavg.SPEC, secure_half, "run-s", round_, orgs, SEED, shapes(ups[orgs[0]]), params)
        assert sr.config.degree == 4 and sr.config.threshold == 3
        clients = {o: SecureClient(sr.setup(), o, secagg.SeededEntropy(f"{round_}{o}")) for o in orgs}
        for o, c in clients.items():
            sr.receive(o, c.advertise())
        for o, k in sr.close_stage().items():
            sr.receive(o, clients[o].share(k))  # type: ignore[arg-type]
        for o, s in sr.close_stage().items():
            masked = clients[o].mask(s, [ups[o]], fedavg.SPEC.summed_upload, np.random.default_rng(round_))  # type: ignore[arg-type]
            if o != gone:
                sr.receive(o, masked)
        for o, q in sr.close_stage().items():
            sr.receive(o, clients[o].unmask(q))  # type: ignore[arg-type]
        agg = sr.finish()
        assert agg is not None and agg.dropped == (gone,)
        secure_half.close_round(Phase.TRAIN, round_)
        for o in agg.survivors:
            plain_half.accumulate(Phase.TRAIN, o, Received([ups[o]]))
        plain_half.close_round(Phase.TRAIN, round_)
        secure, plain = secure_half.state(), plain_half.state()
        assert list(secure) == list(plain) == ["w", "b"]
        step = max(f.bound for f in sr.config.encoding.fields) / sr.config.encoding.level
        for name in plain:
            a = plain[name].astype(np.float64)
            tol = len(agg.survivors) * step * (1 + np.abs(a).max()) / 10 + 1e-6 * np.abs(a).max()
            assert np.abs(secure[name] - a).max() <= tol


CUTS = ("advertise:2", "advertise:closed", "share_keys:3", "share_keys:closed", "mask:1", "mask:closed", "unmask:2")


@pytest.mark.parametrize("cut", CUTS)
def test_a_round_rebuilt_from_its_events_at_any_point_ends_as_the_uninterrupted_one(cut: str) -> None:
    """The coordinator is replaced at ``cut`` (stage:messages received, or stage:closed) by a fresh one fed the
    old one's events through Protobuf bytes, as a restarted aggregator would be: it is at the same stage, gives
    the same outbox, and the round ends with the same sum and the same model; org-e drops after masking."""
    whole = Federation(fedavg.SPEC)
    expected = whole.run(drop_at_mask=frozenset({"org-e"}))
    assert expected is not None
    fed = Federation(fedavg.SPEC)
    stage, _, at = cut.partition(":")
    restarted: list[str] = []
    events: list[tuple[str, Payload | None]] = []  # every accepted stage message and every close, in order

    def maybe_restart(now: str, received: int | None) -> None:
        if now != stage or (at == "closed") != (received is None) or (received is not None and received != int(at)):
            return
        old = fed.round
        fresh = SecureRound(fedavg.SPEC, setup_half(fedavg.SPEC, fed.counts), "run-s", 1, ORGS, SEED,
                            {n: s for p in fed.uploads[ORGS[0]] for n, s in shapes(p).items()}, SecureParams())
        for org, payload in events:  # what the stage log and the update log hold, through Protobuf bytes
            if payload is None:
                fresh.close_stage()
            else:
                fresh.receive(org, wire(payload))
        assert fresh.stage == old.stage and fresh.outbox.keys() == old.outbox.keys()
        for org, msg in old.outbox.items():
            assert codec.payload_to_proto(fresh.outbox[org]) == codec.payload_to_proto(msg)
        fed.half, fed.round = fresh.half, fresh
        restarted.append(cut)

    def stage_loop(name: str, send: dict[str, Payload]) -> None:
        for i, (org, payload) in enumerate(send.items()):
            maybe_restart(name, i)
            fed.round.receive(org, wire(payload))
            events.append((org, payload))
        maybe_restart(name, len(send))
        assert fed.round.stage == name

    stage_loop("advertise", {o: c.advertise() for o, c in fed.clients.items()})
    keys = fed.round.close_stage()
    events.append(("", None))
    maybe_restart("advertise", None)
    stage_loop("share_keys", {o: fed.clients[o].share(k) for o, k in keys.items()})  # type: ignore[arg-type]
    shares = fed.round.close_stage()
    events.append(("", None))
    maybe_restart("share_keys", None)
    masked = {o: fed.clients[o].mask(s, fed.uploads[o], fed.spec.summed_upload, rounding(o))  # type: ignore[arg-type]
              for o, s in shares.items()}
    stage_loop("mask", {o: m for o, m in masked.items() if o != "org-e"})
    requests = fed.round.close_stage()
    events.append(("", None))
    maybe_restart("mask", None)
    stage_loop("unmask", {o: fed.clients[o].unmask(q) for o, q in requests.items()})  # type: ignore[arg-type]
    got = fed.round.finish()
    assert restarted == [cut]
    assert got is not None and got.survivors == expected.survivors and got.dropped == ("org-e",)
    np.testing.assert_array_equal(got.ring_sum, expected.ring_sum)
    fed.half.close_round(Phase.TRAIN, 1)
    whole.half.close_round(Phase.TRAIN, 1)
    for name, a in whole.half.state().items():
        np.testing.assert_array_equal(fed.half.state()[name], a)
