"""A leave notice for a reason of the organization's own (its local training diverged): refused organization_left,
listed, counted, and the run goes on without the organization from the open round on, without its deadline."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import codec, messages
from hetfed.wire.errors import MAX_LEAVE_REASON_CHARS, ORGANIZATION_LEFT_REASON, REASONS
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from hetfed.wire.rpc import AggregatorClient, RemoteError
from tests.conftest import RawClient, run_config

W = np.array([1.0, 2.0, 3.0], np.float32)
DECL = [(PayloadKind.MODEL_WEIGHTS, "w", W)]
NEVER = 900.0  # a deadline no test reaches: a round closes only because nobody else is waited for


def good(scale: float = 1.0, n: int = 10) -> list[Any]:
    return [ModelWeights({"w": W * scale}, n), EvalMetrics(train_loss=0.5, test_accuracy=0.9, num_test_examples=5)]


def started(aggregator: Callable[..., Any], raw_client: Callable[..., RawClient], orgs: str,
            **cfg: Any) -> tuple[Any, list[RawClient]]:
    agg = aggregator(run_config(organizations=list(orgs), round_deadline_seconds=NEVER, **cfg))
    clients = [raw_client(agg.port, o) for o in orgs]
    for c in clients:
        c.join(DECL)
    return agg, clients


def push(client: RawClient, round_: int, scale: float = 1.0, n: int = 10) -> apb.PushUpdateResponse:
    return client.push_bytes(round_, client.update_bytes(round_, good(scale, n)))


def leave(client: RawClient, round_: int, reason: str) -> grpc.RpcError:
    """A leave notice as the client runtime sends it (no payload, a reason); its refusal."""
    data = messages.encode_update(messages.Update("r", round_, client.organization, [], leave_reason=reason)).data
    with pytest.raises(grpc.RpcError) as err:
        client.push_bytes(round_, data)
    return err.value


def sample(agg: Any, name: str, **labels: str) -> float | None:
    return agg.service.metrics.registry.get_sample_value(name, {"run": "r", **labels})


def refusals(client: RawClient) -> list[tuple[str, str, str]]:
    (run,) = client.stub.Status(apb.StatusRequest(run_id="r"), timeout=10).runs
    return [(r.organization_id, r.reason, r.message) for r in run.refused]


def global_weights(ins: apb.Instructions) -> np.ndarray:
    mw = codec.payload_from_proto(ins.payloads[0])
    assert isinstance(mw, ModelWeights)
    return mw.tensors["w"]


def test_organization_left_is_a_final_failed_precondition() -> None:
    assert ORGANIZATION_LEFT_REASON == "organization_left"
    assert REASONS[ORGANIZATION_LEFT_REASON] == ("FAILED_PRECONDITION", False)


def test_a_leave_notice_is_refused_listed_and_the_round_closes_when_the_others_pushed(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    agg, (a, b, c) = started(aggregator, raw_client, "abc", rounds=3)
    run = agg.service.runs["r"]
    assert push(a, 1, 1.0, 10).accepted
    err = leave(b, 1, "its local training diverged in round 1 (the mean training loss is nan over 2 steps at lr 5)")
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    why = ("organization 'b' leaves run 'r': its local training diverged in round 1 (the mean training loss is nan "
           "over 2 steps at lr 5); the run goes on without it")
    assert err.details() == f"organization_left: {why}"
    assert sample(agg, "hetfed_rejected_messages_total", reason="organization_left") == 1
    assert refusals(a) == [("b", "organization_left", why)]
    assert sample(agg, "hetfed_refused_organizations", organization="b", reason="organization_left") == 1
    assert run.refused["b"].at_push and run.refused["b"].round == 1
    assert sorted(run.pushed) == ["a"] and run.round == 1  # the notice is no update: c is still waited for
    # c's push closes round 1 at once (the deadline is 15 minutes away): b is no longer waited for.
    assert push(c, 1, 3.0, 30).accepted
    assert run.round == 2
    ins = a.pull(completed=1)
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 2
    np.testing.assert_array_equal(global_weights(ins), W * 2.5)  # (10·W + 30·3W) / 40: nothing of b
    # Later rounds do not wait for b either; its refusal stays listed.
    push(a, 2)
    push(c, 2)
    assert run.round == 3 and [r[:2] for r in refusals(c)] == [("b", "organization_left")]


def test_the_last_organization_to_leave_closes_the_round_itself(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    agg, (a, b) = started(aggregator, raw_client, "ab", rounds=2)
    run = agg.service.runs["r"]
    push(a, 1)
    leave(b, 1, "its local training diverged in round 1")
    assert run.round == 2 and a.pull(completed=1).envelope.round == 2


def test_a_leave_notice_with_payloads_is_malformed_and_holds_its_round(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    """Only a notice without payloads leaves: one with an update in it is refused malformed (its client exits,
    as for any refusal at a push), so the open round still waits for a corrected update."""
    agg, (a, b) = started(aggregator, raw_client, "ab", rounds=2)
    run = agg.service.runs["r"]
    push(a, 1)
    msg = apb.Update.FromString(b.update_bytes(1, good()))
    msg.leave_reason = "diverged"
    with pytest.raises(grpc.RpcError) as err:
        b.push_bytes(1, msg.SerializeToString())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "malformed: a leave notice carries no payload; this one carries 2"
    assert run.round == 1 and not run.state.given_up("b", run.rules)


def test_the_reason_is_kept_on_one_line_and_cut_to_its_limit(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    """A reason sent by hand with line breaks, tabs or more than the limit: one line, at most the limit kept. A
    reason of blanks only is no leave notice: the update then misses its payloads."""
    _agg, (a, b, c) = started(aggregator, raw_client, "abc", rounds=2)
    long = "x" * (MAX_LEAVE_REASON_CHARS + 100)
    for client, reason in ((a, "diverged\n\tin  round 1"), (b, long)):
        msg = apb.Update(envelope=apb.Envelope(run_id="r", round=1, organization_id=client.organization),
                         leave_reason=reason)
        with pytest.raises(grpc.RpcError) as err:
            client.push_bytes(1, msg.SerializeToString())
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    got = {org: why for org, _, why in refusals(c)}
    assert got["a"] == "organization 'a' leaves run 'r': diverged in round 1; the run goes on without it"
    assert f": {'x' * MAX_LEAVE_REASON_CHARS}; the run goes on" in got["b"]
    blank = apb.Update(envelope=apb.Envelope(run_id="r", round=1, organization_id="c"), leave_reason=" \n ")
    with pytest.raises(grpc.RpcError) as err:
        c.push_bytes(1, blank.SerializeToString())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "missing_payload" in err.value.details()


def test_the_typed_client_sends_a_leave_notice_and_gets_organization_left(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    """What the client runtime does when its local training diverges: push no payload, a reason."""
    agg, (_a, b) = started(aggregator, raw_client, "ab")
    with AggregatorClient(f"127.0.0.1:{agg.port}", None, "a", "r") as client, pytest.raises(RemoteError) as err:
        client.push(1, [], leave_reason="its local training diverged in round 1")
    e = err.value
    assert (e.code, e.reason, e.retryable) == (grpc.StatusCode.FAILED_PRECONDITION, "organization_left", False)
    run = agg.service.runs["r"]
    assert run.state.given_up("a", run.rules)
    push(b, 1)
    assert run.round == 2


def test_encoding_a_leave_notice_checks_it_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="a leave notice carries no payloads"):
        messages.encode_update(messages.Update("r", 1, "a", good(), leave_reason="diverged"))
    for bad in (" ", "x" * (MAX_LEAVE_REASON_CHARS + 1)):
        with pytest.raises(ValueError, match=f"a leave reason must be 1 to {MAX_LEAVE_REASON_CHARS} characters"):
            messages.encode_update(messages.Update("r", 1, "a", [], leave_reason=bad))
    parsed = messages.ParsedUpdate(messages.encode_update(messages.Update("r", 1, "a", [], leave_reason="why")).data)
    assert parsed.leaving and parsed.leave_reason == "why"
    plain = messages.ParsedUpdate(messages.encode_update(messages.Update("r", 1, "a", good())).data)
    assert not plain.leaving and plain.leave_reason == ""


def test_a_notice_that_misses_its_round_is_sent_again_for_the_current_one(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    """Round 1 closes before c's notice for it arrives (c trained past it): refused late, the typed client reads the
    current round from Status and sends the notice for round 2, which the aggregator takes. Round 2 then closes when
    a and b have pushed, without waiting for c."""
    agg, (a, b, c) = started(aggregator, raw_client, "abc", rounds=4)
    run = agg.service.runs["r"]
    for client in (a, b, c):
        push(client, 1)
    assert run.round == 2
    with AggregatorClient(f"127.0.0.1:{agg.port}", None, "c", "r") as client:
        err = client.leave(1, leave_reason="its local training diverged in round 1")
    assert err is not None and (err.reason, err.code) == ("organization_left", grpc.StatusCode.FAILED_PRECONDITION)
    assert run.state.given_up("c", run.rules)
    assert sample(agg, "hetfed_rejected_messages_total", reason="late") == 1
    push(a, 2)
    push(b, 2)
    assert run.round == 3


def test_a_notice_for_a_round_not_yet_open_is_resent_only_when_attempts_allow(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    """A notice for a round that has not opened is refused late. With one attempt it is not resent: the refusal
    comes back and nothing is recorded. With the default attempts it is resent for round 1, the current one."""
    agg, _ = started(aggregator, raw_client, "ab", rounds=4)
    run = agg.service.runs["r"]
    with AggregatorClient(f"127.0.0.1:{agg.port}", None, "a", "r") as client:
        err = client.leave(5, leave_reason="diverged", attempts=1)
        assert err is not None and err.reason == "late" and "round 5 has not started" in err.details
        assert not run.state.given_up("a", run.rules)
        taken = client.leave(5, leave_reason="diverged")  # resent for round 1, the current one
    assert taken is not None and taken.reason == "organization_left"
    assert run.state.given_up("a", run.rules)


def test_leave_needs_at_least_one_attempt() -> None:
    with AggregatorClient("127.0.0.1:1", None, "a", "r") as client, pytest.raises(ValueError, match="attempts"):
        client.leave(1, leave_reason="diverged", attempts=0)
