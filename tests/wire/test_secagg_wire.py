"""Secure aggregation's stage messages on the wire: a whole SecAgg+ round whose every message crosses the
codec (Protobuf bytes) unmasks to the plain sum exactly; malformed stage messages and the core's refusals are
answered with the wire's reasons."""

from __future__ import annotations

import numpy as np
import pytest

from hetfed import secagg
from hetfed.secagg.errors import REASONS as SECAGG_REASONS
from hetfed.v1 import payloads_pb2 as pb
from hetfed.wire import codec
from hetfed.wire.errors import REASONS, WireError, from_secagg
from hetfed.wire.errors import SECAGG_REASONS as MAPPED
from hetfed.wire.payloads import (
    Payload,
    PayloadKind,
    SecAggKeyAdvert,
    SecAggMaskedInput,
    SecAggPeerKeys,
    SecAggPeerShares,
    SecAggSetup,
    SecAggSharedKeys,
    SecAggUnmask,
)
from tests.secagg.driver import make_config, names, random_inputs, rounding_rng


def wire(payload: Payload) -> Payload:
    """``payload`` after a trip through Protobuf bytes."""
    back = codec.payload_from_proto(pb.Payload.FromString(codec.payload_to_proto(payload).SerializeToString()))
    assert back.kind is payload.kind
    return back


@pytest.mark.parametrize(("n", "value_bits", "dropped"), [(4, 16, set()), (5, 16, {"org-02"}), (6, 40, {"org-05"})])
def test_a_round_over_the_wire_unmasks_to_the_plain_sum(n: int, value_bits: int, dropped: set[str]) -> None:
    fields = (secagg.Field("w", (3, 4), 2.0), secagg.Field("n", (), 100.0, 150.0))
    config = wire(SecAggSetup(make_config(n, fields=fields, value_bits=value_bits), unit_weights=True))
    assert isinstance(config, SecAggSetup) and config.unit_weights
    cfg = config.config
    assert cfg == make_config(n, fields=fields, value_bits=value_bits) and cfg.graph == make_config(n).graph
    assert cfg.encoding.ring_bits == (64 if value_bits > 30 else 32)
    inputs = random_inputs(cfg, n)
    server = secagg.ServerSession(cfg)
    clients = {u: secagg.ClientSession(cfg, u, secagg.SeededEntropy(u)) for u in cfg.roster}
    for u in cfg.roster:
        advert = wire(SecAggKeyAdvert(clients[u].advertise()))
        assert isinstance(advert, SecAggKeyAdvert)
        server.receive_advert(advert.message)
    peer_keys = {u: wire(SecAggPeerKeys(k)) for u, k in server.close_advertising().items()}
    for u, k in peer_keys.items():
        assert isinstance(k, SecAggPeerKeys)
        shared = wire(SecAggSharedKeys(clients[u].share_keys(k.message)))
        assert isinstance(shared, SecAggSharedKeys)
        server.receive_shared_keys(shared.message)
    encoded = {}
    for u, s in server.close_sharing().items():
        peer_shares = wire(SecAggPeerShares(s))
        assert isinstance(peer_shares, SecAggPeerShares)
        masked = clients[u].mask(peer_shares.message, inputs[u], rounding_rng(0, u))
        if u in dropped:
            continue
        got = wire(SecAggMaskedInput(masked))
        assert isinstance(got, SecAggMaskedInput)
        assert got.message.vector.dtype == cfg.encoding.dtype
        np.testing.assert_array_equal(got.message.vector, masked.vector)
        server.receive_masked(got.message)
        encoded[u] = cfg.encoding.encode(inputs[u], rounding_rng(0, u))
    for u, request in server.close_masking().items():
        down = wire(SecAggUnmask(request))
        assert isinstance(down, SecAggUnmask) and down.message == request
        up = wire(SecAggUnmask(clients[u].unmask(request)))
        assert isinstance(up, SecAggUnmask) and isinstance(up.message, secagg.UnmaskReply)
        server.receive_unmask(up.message)
    agg = server.finish()
    assert set(agg.dropped) == dropped
    plain = np.sum([cfg.encoding.signed(encoded[u]) for u in agg.survivors], axis=0, dtype=np.int64)
    np.testing.assert_array_equal(cfg.encoding.signed(agg.ring_sum), plain)


def test_a_64_bit_vector_travels_as_two_words_per_element() -> None:
    v = np.array([0, 1, 2**32, 2**64 - 1], np.uint64)
    msg = codec.payload_to_proto(SecAggMaskedInput(secagg.MaskedInput("r", 1, "a", v)))
    assert list(msg.secagg_masked_input.vector.shape) == [4, 2]
    assert codec.tensor_elements(msg) == 8
    back = codec.payload_from_proto(msg)
    assert isinstance(back, SecAggMaskedInput)
    assert back.message.vector.dtype == np.uint64
    np.testing.assert_array_equal(back.message.vector, v)


@pytest.mark.parametrize("vector", [np.zeros(3, np.float32), np.zeros(3, np.int64), np.zeros((2, 2), np.uint32)])
def test_a_masked_input_that_is_not_a_ring_vector_is_malformed(vector: np.ndarray) -> None:
    with pytest.raises(WireError) as err:
        codec.payload_to_proto(SecAggMaskedInput(secagg.MaskedInput("r", 1, "a", vector)))
    assert err.value.reason == "malformed"
    msg = pb.Payload()
    msg.secagg_masked_input.sender = "a"
    msg.secagg_masked_input.vector.CopyFrom(codec.tensor_to_proto(vector if vector.ndim == 1 else
                                                                  np.zeros((2, 3), np.uint32)))
    with pytest.raises(WireError) as err:
        codec.payload_from_proto(msg)
    assert err.value.reason == "malformed"


def test_a_setup_the_core_refuses_is_invalid() -> None:
    msg = codec.payload_to_proto(SecAggSetup(make_config(5)))
    msg.secagg_setup.threshold = 2  # not above k/2 = 2
    with pytest.raises(WireError) as err:
        codec.payload_from_proto(msg)
    assert err.value.reason == "invalid_value" and "threshold" in str(err.value)
    msg = codec.payload_to_proto(SecAggSetup(make_config(5)))
    msg.secagg_setup.ring_bits = 18  # a sum of 5 values of 16 bits needs 19
    with pytest.raises(WireError) as err:
        codec.payload_from_proto(msg)
    assert err.value.reason == "invalid_value" and "wrap" in str(err.value)


def test_an_unmask_payload_that_is_neither_request_nor_reply_is_malformed() -> None:
    msg = pb.Payload()
    msg.secagg_unmask.SetInParent()
    with pytest.raises(WireError) as err:
        codec.payload_from_proto(msg)
    assert err.value.reason == "malformed"


def test_every_secagg_reason_maps_onto_a_wire_reason() -> None:
    assert set(MAPPED) == set(SECAGG_REASONS)
    assert set(MAPPED.values()) <= set(REASONS)
    refused = from_secagg(secagg.AbandonedError("unmask", "2 of 'org-01's seed shares arrived, 3 needed"))
    assert refused.reason == "secagg_abandoned" and refused.status == "FAILED_PRECONDITION"
    assert "abandoned at unmask" in str(refused)
    assert from_secagg(secagg.SecAggError("foreign_message", "x")).reason == "foreign_message"
    assert from_secagg(secagg.SecAggError("duplicate", "x")).reason == "replayed"
    assert from_secagg(secagg.SecAggError("sum_out_of_range", "x")).reason == "implausible_update"


def test_a_foreign_stage_message_is_refused_by_the_session_after_the_wire() -> None:
    """A key advert of another round, after a trip through the wire, is still refused (foreign_message)."""
    cfg = make_config(4)
    server = secagg.ServerSession(cfg)
    other = secagg.ClientSession(make_config(4, round_no=2), names(4)[0], secagg.SeededEntropy("x"))
    advert = wire(SecAggKeyAdvert(other.advertise()))
    assert isinstance(advert, SecAggKeyAdvert)
    with pytest.raises(secagg.SecAggError) as err:
        server.receive_advert(advert.message)
    assert from_secagg(err.value).reason == "foreign_message"


def test_stage_kinds_use_the_reserved_numbers() -> None:
    kinds = [k for k in PayloadKind if k.value.startswith("secagg_")]
    assert sorted(k.proto_enum for k in kinds) == list(range(20, 27))
    fields = {f.name: f.number for f in pb.Payload.DESCRIPTOR.oneofs_by_name["kind"].fields}
    assert sorted(fields[k.value] for k in kinds) == list(range(20, 27))
