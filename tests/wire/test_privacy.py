"""The privacy declaration an update carries: its domain, its round trip through the wire, its place in Status."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import numpy as np
import pytest

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import messages
from hetfed.wire.contract import Schema, TensorDecl
from hetfed.wire.errors import PRIVACY_BUDGET_SPENT_REASON, REASONS, WireError
from hetfed.wire.messages import OrganizationStatus, ParsedUpdate, RunStatus, Update
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind, Received
from hetfed.wire.phases import Phase
from hetfed.wire.privacy import ACCOUNTANTS, MECHANISMS, PrivacyDeclaration
from hetfed.wire.rpc import AggregatorClient
from hetfed.wire.specs import get_spec

GOOD = PrivacyDeclaration("dp-sgd", noise_multiplier=1.1, clip_norm=1.0, epsilon=1.2, delta=1e-5, accountant="rdp")
W = np.array([1.0, 2.0, 3.0], np.float32)
SCHEMA: Schema = {PayloadKind.MODEL_WEIGHTS: {"w": TensorDecl("float32", (3,))}}


def update(privacy: PrivacyDeclaration | None) -> Update:
    return Update("r", 1, "a", [ModelWeights({"w": W}, 10), EvalMetrics(test_accuracy=0.5, num_test_examples=2)],
                  privacy)


def check(parsed: ParsedUpdate) -> Received:
    return parsed.check(get_spec("fedavg"), Phase.TRAIN, SCHEMA, 1 << 20, "r", 1, "a")


def test_the_constants_are_the_documented_ones() -> None:
    assert MECHANISMS == ("dp-sgd", "dp-sgd+gaussian-sums", "dp-sgd+distributed-skellam")
    assert ACCOUNTANTS == ("rdp", "pld")
    assert [f.name for f in dataclasses.fields(PrivacyDeclaration)] == [
        "mechanism", "noise_multiplier", "clip_norm", "epsilon", "delta", "accountant", "budget_spent",
        "ephemeral_ledger"]
    assert GOOD.budget_spent is False  # a declaration is no leave notice unless it says so
    assert GOOD.ephemeral_ledger is False  # nor an ephemeral ledger
    with pytest.raises(dataclasses.FrozenInstanceError):
        GOOD.epsilon = 0.0  # type: ignore[misc]


@pytest.mark.parametrize("declared", [
    GOOD,
    PrivacyDeclaration("dp-sgd+gaussian-sums", 0.7, 2.5, 0.0, 0.5, "pld"),  # ε of 0: nothing spent yet
    PrivacyDeclaration("dp-sgd", 1e-3, 1e-6, 1e6, 1e-12, "rdp"),
])
def test_a_declaration_round_trips_through_encode_and_parse(declared: PrivacyDeclaration) -> None:
    data = messages.encode_update(update(declared)).data
    assert apb.Update.FromString(data).privacy.epsilon == declared.epsilon
    parsed = ParsedUpdate(data)
    assert parsed.privacy == declared
    received = check(parsed)
    assert parsed.privacy == declared  # kept once the payloads are decoded
    mw = received.maybe(ModelWeights)
    assert mw is not None and np.array_equal(mw.tensors["w"], W)
    assert messages.privacy_from_proto(messages.privacy_to_proto(declared)) == declared


def test_an_update_without_a_declaration_has_none_and_the_same_bytes_as_before() -> None:
    data = messages.encode_update(update(None)).data
    assert not apb.Update.FromString(data).HasField("privacy")
    parsed = ParsedUpdate(data)
    assert parsed.privacy is None
    check(parsed)
    # The field is additive: the bytes of an undeclared update are what an older client sends.
    legacy = apb.Update.FromString(data)
    assert legacy.SerializeToString() == data
    # The declaration adds its own bytes only.
    declared = messages.encode_update(update(GOOD)).data
    assert len(declared) == len(data) + apb.Update(privacy=messages.privacy_to_proto(GOOD)).ByteSize()


INVALID: dict[str, tuple[dict[str, Any], str]] = {
    "NaN σ": ({"noise_multiplier": float("nan")}, "privacy.noise_multiplier is nan; it must be a finite number"),
    "infinite C": ({"clip_norm": float("inf")}, "privacy.clip_norm is inf; it must be a finite number"),
    "infinite ε": ({"epsilon": float("inf")}, "privacy.epsilon is inf; it must be a finite number"),
    "NaN δ": ({"delta": float("nan")}, "privacy.delta is nan; it must be a finite number"),
    "σ of 0": ({"noise_multiplier": 0.0}, "privacy.noise_multiplier is 0; σ must be > 0"),
    "negative σ": ({"noise_multiplier": -1.0}, "privacy.noise_multiplier is -1; σ must be > 0"),
    "C of 0": ({"clip_norm": 0.0}, "privacy.clip_norm is 0; C must be > 0"),
    "negative C": ({"clip_norm": -0.5}, "privacy.clip_norm is -0.5; C must be > 0"),
    "negative ε": ({"epsilon": -0.1}, "privacy.epsilon is -0.1; ε must be >= 0"),
    "δ of 0": ({"delta": 0.0}, "privacy.delta is 0; δ must be in (0, 1)"),
    "δ of 1": ({"delta": 1.0}, "privacy.delta is 1; δ must be in (0, 1)"),
    "negative δ": ({"delta": -1e-5}, "privacy.delta is -1e-05; δ must be in (0, 1)"),
    "unknown accountant": ({"accountant": "moments"},
                           "privacy.accountant is 'moments'; it must be one of ['rdp', 'pld']"),
    "empty accountant": ({"accountant": ""}, "privacy.accountant is ''; it must be one of ['rdp', 'pld']"),
    "unknown mechanism": ({"mechanism": "laplace"},
                          "privacy.mechanism is 'laplace'; it must be one of ['dp-sgd', 'dp-sgd+gaussian-sums', "
                          "'dp-sgd+distributed-skellam']"),
    "empty mechanism": ({"mechanism": ""}, "privacy.mechanism is ''; it must be one of"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_each_value_out_of_its_domain_is_invalid_privacy(case: str) -> None:
    change, message = INVALID[case]
    bad = dataclasses.replace(GOOD, **change)
    with pytest.raises(WireError) as err:
        bad.check()
    assert (err.value.reason, err.value.status, err.value.retryable) == ("invalid_privacy", "INVALID_ARGUMENT", False)
    assert err.value.message.startswith(message), err.value.message
    # A client cannot encode it...
    with pytest.raises(WireError, match="invalid_privacy"):
        messages.encode_update(update(bad))
    # ...and the aggregator's parse refuses it when it arrives anyway (built by hand).
    msg = apb.Update.FromString(messages.encode_update(update(None)).data)
    messages.privacy_to_proto(bad, msg.privacy)
    parsed = ParsedUpdate(msg.SerializeToString())
    assert parsed.privacy == bad or case.startswith("NaN")  # NaN != NaN
    with pytest.raises(WireError) as err:
        check(parsed)
    assert err.value.reason == "invalid_privacy" and err.value.message.startswith(message)


def test_check_returns_the_declaration() -> None:
    assert GOOD.check() is GOOD


def test_an_envelope_mismatch_is_reported_before_the_declaration() -> None:
    bad = dataclasses.replace(GOOD, delta=2.0)
    msg = apb.Update.FromString(messages.encode_update(Update("r", 1, "b", update(None).payloads)).data)
    messages.privacy_to_proto(bad, msg.privacy)
    with pytest.raises(WireError, match="envelope_mismatch"):
        check(ParsedUpdate(msg.SerializeToString()))


def test_push_takes_privacy_as_an_optional_keyword() -> None:
    sig = inspect.signature(AggregatorClient.push)
    assert list(sig.parameters) == ["self", "round_", "payloads", "wire_dtype", "privacy", "leave_reason"]
    assert sig.parameters["privacy"].default is None and sig.parameters["wire_dtype"].default is None
    assert sig.parameters["leave_reason"].default == ""


def test_status_carries_each_organizations_declared_epsilon() -> None:
    status = RunStatus("r", "fedavg", Phase.TRAIN, 2, 3, ("a", "b"), organization_status=(
        OrganizationStatus("a", True, 1, 10, 20, privacy_declared=True, privacy_epsilon=1.25),
        OrganizationStatus("b", True, 1, 10, 20)))
    msg = messages.run_status_to_proto(status)
    assert [(o.privacy_declared, o.privacy_epsilon) for o in msg.organization_status] == [(True, 1.25), (False, 0.0)]
    assert messages.run_status_from_proto(apb.RunStatus.FromString(msg.SerializeToString())) == status


# ------------------------------------------------------------------------------------------------ leave notice
LEAVE = dataclasses.replace(GOOD, budget_spent=True)


def test_budget_spent_round_trips_and_is_not_sent_when_false() -> None:
    msg = messages.privacy_to_proto(LEAVE)
    assert msg.budget_spent is True
    assert messages.privacy_from_proto(apb.PrivacyDeclaration.FromString(msg.SerializeToString())) == LEAVE
    assert messages.privacy_from_proto(messages.privacy_to_proto(GOOD)) == GOOD
    # proto3 leaves a false bool out: a declaration without it is the same bytes as an older client's.
    assert messages.privacy_to_proto(GOOD).ByteSize() == msg.ByteSize() - 2
    assert not apb.PrivacyDeclaration.FromString(messages.privacy_to_proto(GOOD).SerializeToString()).budget_spent


def test_a_leave_notice_encodes_with_no_payload_and_parses_as_leaving() -> None:
    data = messages.encode_update(Update("r", 3, "a", [], LEAVE)).data
    sent = apb.Update.FromString(data)
    assert len(sent.payloads) == 0 and list(sent.envelope.payload_kinds) == []
    assert sent.privacy.budget_spent and sent.privacy.epsilon == GOOD.epsilon
    parsed = ParsedUpdate(data)
    assert parsed.leaving and parsed.privacy == LEAVE
    parsed.check_envelope("r", 3, "a")  # its envelope and declaration are checked like any update's
    with pytest.raises(WireError, match="envelope_mismatch"):
        parsed.check_envelope("r", 3, "b")
    assert not ParsedUpdate(messages.encode_update(update(GOOD)).data).leaving
    assert not ParsedUpdate(messages.encode_update(update(None)).data).leaving


def test_a_leave_notice_with_a_declaration_out_of_its_domain_is_invalid_privacy() -> None:
    bad = dataclasses.replace(LEAVE, delta=1.0)
    with pytest.raises(WireError, match="invalid_privacy"):
        messages.encode_update(Update("r", 1, "a", [], bad))
    msg = apb.Update.FromString(messages.encode_update(Update("r", 1, "a", [], None)).data)
    messages.privacy_to_proto(bad, msg.privacy)
    with pytest.raises(WireError, match="invalid_privacy"):
        ParsedUpdate(msg.SerializeToString()).check_envelope("r", 1, "a")


def test_privacy_budget_spent_is_a_final_failed_precondition() -> None:
    assert PRIVACY_BUDGET_SPENT_REASON == "privacy_budget_spent"
    err = WireError(PRIVACY_BUDGET_SPENT_REASON, "x")
    assert (err.status, err.retryable) == ("FAILED_PRECONDITION", False)
    assert REASONS["privacy_budget_spent"] == ("FAILED_PRECONDITION", False)
