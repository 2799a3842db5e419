"""Privacy declarations at the aggregator: required where the run says so, never going back, in the metrics and
Status, kept across a restart; a leave notice (budget spent) releases its organization at once."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from hetfed.aggregator.config import aggregator_config_from_mapping
from hetfed.aggregator.run.org_ledger import OrganizationLedger
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import codec, messages
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from hetfed.wire.privacy import PrivacyDeclaration
from hetfed.wire.rpc import AggregatorClient, RemoteError
from tests.conftest import RawClient, run_config, wait_until

W = np.array([1.0, 2.0, 3.0], np.float32)
DECL = [(PayloadKind.MODEL_WEIGHTS, "w", W)]


def dp(epsilon: float, delta: float = 1e-5) -> PrivacyDeclaration:
    return PrivacyDeclaration("dp-sgd", noise_multiplier=1.1, clip_norm=1.0, epsilon=epsilon, delta=delta,
                              accountant="rdp")


def good(scale: float = 1.0, n: int = 10) -> list[Any]:
    return [ModelWeights({"w": W * scale}, n), EvalMetrics(train_loss=0.5, test_accuracy=0.9, num_test_examples=5)]


def push(client: RawClient, round_: int, privacy: PrivacyDeclaration | None, scale: float = 1.0,
         n: int = 10) -> apb.PushUpdateResponse:
    """Push a good update declaring ``privacy`` (set by hand: a bad declaration is sent as it is)."""
    msg = apb.Update.FromString(client.update_bytes(round_, good(scale, n)))
    if privacy is not None:
        messages.privacy_to_proto(privacy, msg.privacy)
    return client.push_bytes(round_, msg.SerializeToString())


def sample(agg: Any, name: str, **labels: str) -> float | None:
    return agg.service.metrics.registry.get_sample_value(name, {"run": "r", **labels})


def rejected(agg: Any, reason: str) -> float:
    return sample(agg, "hetfed_rejected_messages_total", reason=reason) or 0.0


def global_weights(ins: apb.Instructions) -> np.ndarray:
    mw = codec.payload_from_proto(ins.payloads[0])
    assert isinstance(mw, ModelWeights)
    return mw.tensors["w"]


def started(aggregator: Callable[..., Any], raw_client: Callable[..., RawClient], orgs: str = "ab",
            **cfg: Any) -> tuple[Any, list[RawClient]]:
    agg = aggregator(run_config(organizations=list(orgs), **cfg))
    clients = [raw_client(agg.port, o) for o in orgs]
    for c in clients:
        c.join(DECL)
    return agg, clients


def org_privacy(client: RawClient) -> dict[str, tuple[bool, float]]:
    (run,) = client.stub.Status(apb.StatusRequest(run_id="r"), timeout=10).runs
    return {o.organization_id: (o.privacy_declared, o.privacy_epsilon) for o in run.organization_status}


def test_require_privacy_is_off_by_default_and_read_from_the_run_config() -> None:
    cfg = aggregator_config_from_mapping({"runs": [run_config(), run_config(id="s", require_privacy=True)]})
    assert [r.require_privacy for r in cfg.runs] == [False, True]


def test_an_undeclared_update_is_refused_where_the_run_requires_privacy_and_the_round_goes_on(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    agg, (a, b, c) = started(aggregator, raw_client, "abc", require_privacy=True, rounds=3, min_clients=2,
                             round_deadline_seconds=0.5)
    assert push(a, 1, dp(0.4), 1.0, 10).accepted
    with pytest.raises(grpc.RpcError) as err:
        push(b, 1, None)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == (
        "privacy_required: the update of organization 'b' declares no privacy; run 'r' requires differential "
        "privacy of every organization (require_privacy, docs/privacy.md)")
    assert rejected(agg, "privacy_required") == 1
    run = agg.service.runs["r"]
    assert sorted(run.pushed) == ["a"]
    # The round goes on: c's update is accepted, and the round closes with a and c at its deadline.
    assert push(c, 1, dp(0.6), 3.0, 30).accepted
    wait_until(lambda: run.round == 2, timeout=10, what="round 1 to close on its deadline")
    ins = a.pull(completed=1)
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 2
    np.testing.assert_array_equal(global_weights(ins), W * 2.5)  # (10·W + 30·3W) / 40: b's update is not in it
    (status,) = a.stub.Status(apb.StatusRequest(run_id="r"), timeout=10).runs
    assert [(r.organization_id, r.reason) for r in status.refused] == [("b", "privacy_required")]
    assert status.history[0].clients == 2
    assert sample(agg, "hetfed_refused_organizations", organization="b", reason="privacy_required") == 1
    # b's client exits on the refusal: later rounds close without waiting for it.
    push(a, 2, dp(0.5))
    push(c, 2, dp(0.7))
    assert run.round == 3
    # Declaring, b is accepted again (which lifts its refusal).
    assert push(b, 3, dp(0.5)).accepted
    assert "b" not in run.refused
    assert sample(agg, "hetfed_privacy_unprotected_organizations") == 0


def test_ephemeral_ledgers_and_max_epsilon_are_read_from_the_run_config() -> None:
    from hetfed.wire.config import ConfigError

    cfg = aggregator_config_from_mapping({"runs": [
        run_config(), run_config(id="s", refuse_ephemeral_ledgers=True, max_epsilon=2.5)]})
    assert [(r.refuse_ephemeral_ledgers, r.max_epsilon) for r in cfg.runs] == [(False, None), (True, 2.5)]
    with pytest.raises(ConfigError, match=r"max_epsilon must be a number > 0 \(leave it out for no limit\), got 0\.0"):
        aggregator_config_from_mapping({"runs": [run_config(max_epsilon=0.0)]})


def test_an_ephemeral_ledger_is_refused_counted_and_stops_its_organization_where_the_run_refuses_them(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    agg, (a, b) = started(aggregator, raw_client, refuse_ephemeral_ledgers=True)
    with pytest.raises(grpc.RpcError) as err:
        push(a, 1, dataclasses.replace(dp(0.4), ephemeral_ledger=True))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == (
        "privacy_ephemeral_ledger: organization 'a' keeps its privacy ledger only in its client process "
        "(privacy.ephemeral_ledger); run 'r' refuses such ledgers (refuse_ephemeral_ledgers): give the client a "
        "state_dir")
    assert rejected(agg, "privacy_ephemeral_ledger") == 1
    assert sample(agg, "hetfed_refused_organizations", organization="a", reason="privacy_ephemeral_ledger") == 1
    assert push(b, 1, dp(0.4)).accepted  # a ledger on disk is accepted
    run = agg.service.runs["r"]
    assert sorted(run.pushed) == ["b"] and "a" in run.refused
    # Not retryable: the client's runtime stops the organization for good (ClientError, exit 2).
    from hetfed.wire.errors import REASONS

    assert REASONS["privacy_ephemeral_ledger"] == ("FAILED_PRECONDITION", False)


def test_an_ephemeral_ledger_is_accepted_where_the_run_allows_them(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    agg, (a, b) = started(aggregator, raw_client)
    assert push(a, 1, dataclasses.replace(dp(0.4), ephemeral_ledger=True)).accepted
    assert push(b, 1, dp(0.4)).accepted
    assert rejected(agg, "privacy_ephemeral_ledger") == 0


def test_a_declaration_above_max_epsilon_is_refused_counted_and_stops_its_organization(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    agg, (a, b) = started(aggregator, raw_client, max_epsilon=1.0, rounds=3)
    assert push(a, 1, dp(1.0)).accepted  # at the limit
    with pytest.raises(grpc.RpcError) as err:
        push(b, 1, dp(1.25))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == (
        "privacy_epsilon_exceeded: organization 'b' declared ε=1.25; run 'r' accepts at most ε=1 (max_epsilon)")
    assert rejected(agg, "privacy_epsilon_exceeded") == 1
    assert sample(agg, "hetfed_refused_organizations", organization="b", reason="privacy_epsilon_exceeded") == 1
    run = agg.service.runs["r"]
    assert sorted(run.pushed) == ["a"]  # b's payload was not accepted
    assert org_privacy(a)["b"] == (False, 0.0)
    from hetfed.wire.errors import REASONS

    assert REASONS["privacy_epsilon_exceeded"] == ("FAILED_PRECONDITION", False)


def test_a_refused_organization_may_still_send_a_declared_update_in_that_round(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    agg, (a, b) = started(aggregator, raw_client, require_privacy=True)
    with pytest.raises(grpc.RpcError):
        push(a, 1, None)
    assert push(b, 1, dp(0.3)).accepted
    assert push(a, 1, dp(0.3)).accepted
    assert agg.service.runs["r"].round == 2


def test_an_undeclared_update_is_accepted_where_the_run_does_not_require_privacy(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    agg, (a, b) = started(aggregator, raw_client)
    assert push(a, 1, dp(0.4)).accepted
    assert push(b, 1, None).accepted
    assert a.pull(completed=1).envelope.round == 2
    assert rejected(agg, "privacy_required") == 0


def test_an_invalid_declaration_is_refused_counted_and_harmless(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    agg, (a, b) = started(aggregator, raw_client)
    with pytest.raises(grpc.RpcError) as err:
        push(a, 1, dataclasses.replace(dp(0.4), noise_multiplier=0.0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "invalid_privacy: privacy.noise_multiplier is 0; σ must be > 0"
    assert rejected(agg, "invalid_privacy") == 1
    assert agg.service.runs["r"].pushed == {}
    assert sample(agg, "hetfed_privacy_epsilon", organization="a") is None
    # The round goes on: b's update, then a's corrected one, make round 1's FedAvg as without the refusal.
    assert push(b, 1, dp(0.4), 3.0, 30).accepted
    assert push(a, 1, dp(0.4), 1.0, 10).accepted
    ins = b.pull(completed=1)
    assert ins.envelope.round == 2
    np.testing.assert_array_equal(global_weights(ins), W * 2.5)


def test_an_epsilon_below_the_last_accepted_one_is_privacy_regressed(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    agg, (a, b) = started(aggregator, raw_client, rounds=3)
    assert push(a, 1, dp(1.2)).accepted
    assert push(b, 1, dp(0.3)).accepted
    a.pull(completed=1)
    with pytest.raises(grpc.RpcError) as err:
        push(a, 2, dp(0.5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == ("privacy_regressed: organization 'a' declared ε=0.50 after ε=1.20: its privacy "
                                   "ledger was lost; keep the client's state_dir")
    assert rejected(agg, "privacy_regressed") == 1
    assert sample(agg, "hetfed_privacy_epsilon", organization="a") == 1.2  # the refused ε is not recorded
    assert agg.service.runs["r"].pushed == {}
    # The round goes on: b's update is accepted, and a's with its ε of before.
    assert push(b, 2, dp(0.6)).accepted
    assert push(a, 2, dp(1.2)).accepted  # an equal ε is no regression
    assert b.pull(completed=2).envelope.round == 3
    # Another organization's ε never counts against a's.
    assert push(a, 3, dp(1.3)).accepted
    assert push(b, 3, dp(0.6)).accepted
    assert sample(agg, "hetfed_privacy_epsilon", organization="a") == 1.3


def test_a_regression_is_caught_across_an_undeclared_update(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    """The comparison is with the last accepted declaration, even when a later accepted update declared none."""
    _agg, (a, b) = started(aggregator, raw_client, rounds=3)
    push(a, 1, dp(2.0))
    push(b, 1, None)
    a.pull(completed=1)
    push(a, 2, None)
    push(b, 2, None)
    a.pull(completed=2)
    assert org_privacy(a)["a"] == (False, 2.0)
    with pytest.raises(grpc.RpcError) as err:
        push(a, 3, dp(1.9))
    assert "declared ε=1.90 after ε=2.00" in err.value.details()


def test_a_regression_too_small_for_two_decimals_is_printed_with_more() -> None:
    from hetfed.aggregator.run.admission import _epsilons

    assert _epsilons(0.5, 1.2) == ("0.50", "1.20")
    assert _epsilons(1.2001, 1.2004) == ("1.200100", "1.200400")
    assert _epsilons(1.0, 1.0 + 1e-12) == ("1.0", "1.000000000001")


def test_the_gauges_and_status_after_accepted_updates(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    agg, (a, b, c) = started(aggregator, raw_client, "abc", rounds=3)
    assert sample(agg, "hetfed_privacy_unprotected_organizations") == 0  # nobody pushed yet
    assert sample(agg, "hetfed_privacy_epsilon", organization="a") is None
    push(a, 1, dp(0.8, 1e-5))
    push(b, 1, dp(1.5, 1e-6))
    push(c, 1, None)
    assert sample(agg, "hetfed_privacy_epsilon", organization="a") == 0.8
    assert sample(agg, "hetfed_privacy_delta", organization="a") == 1e-5
    assert sample(agg, "hetfed_privacy_epsilon", organization="b") == 1.5
    assert sample(agg, "hetfed_privacy_delta", organization="b") == 1e-6
    assert sample(agg, "hetfed_privacy_epsilon", organization="c") is None
    assert sample(agg, "hetfed_privacy_delta", organization="c") is None
    assert sample(agg, "hetfed_privacy_unprotected_organizations") == 1
    assert org_privacy(a) == {"a": (True, 0.8), "b": (True, 1.5), "c": (False, 0.0)}
    # Round 2: a's ε grows; b stops declaring (its last ε stays, it counts as unprotected); c starts.
    a.pull(completed=1)
    push(a, 2, dp(1.1, 1e-5))
    push(b, 2, None)
    push(c, 2, dp(0.2, 1e-5))
    assert sample(agg, "hetfed_privacy_epsilon", organization="a") == 1.1
    assert sample(agg, "hetfed_privacy_epsilon", organization="b") == 1.5
    assert sample(agg, "hetfed_privacy_epsilon", organization="c") == 0.2
    assert sample(agg, "hetfed_privacy_unprotected_organizations") == 1
    assert org_privacy(a) == {"a": (True, 1.1), "b": (False, 1.5), "c": (True, 0.2)}


def test_restore_keeps_the_last_epsilon_of_closed_rounds_and_of_the_open_ones_log(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    cfg = run_config(organizations=["a", "b", "c"], rounds=3)
    agg, (a, b, c) = started(aggregator, raw_client, "abc", rounds=3)
    push(a, 1, dp(1.0))
    push(b, 1, dp(2.0, 1e-6))
    push(c, 1, None)
    wait_until(lambda: agg.service.runs["r"].round == 2, timeout=10, what="round 1 to close")
    push(a, 2, dp(1.5))  # in the open round's log only: the restart replays it
    agg.stop(grace=0.1)

    agg2 = aggregator(cfg)
    run = agg2.service.runs["r"]
    assert run.round == 2 and sorted(run.pushed) == ["a"]
    assert sample(agg2, "hetfed_privacy_epsilon", organization="a") == 1.5
    assert sample(agg2, "hetfed_privacy_epsilon", organization="b") == 2.0
    assert sample(agg2, "hetfed_privacy_delta", organization="b") == 1e-6
    assert sample(agg2, "hetfed_privacy_unprotected_organizations") == 1  # c
    b2, c2 = raw_client(agg2.port, "b"), raw_client(agg2.port, "c")
    assert org_privacy(b2) == {"a": (True, 1.5), "b": (True, 2.0), "c": (False, 0.0)}
    # The restored ε still bounds the next declaration.
    with pytest.raises(grpc.RpcError) as err:
        push(b2, 2, dp(0.5))
    assert err.value.details().startswith("privacy_regressed: organization 'b' declared ε=0.50 after ε=2.00")
    assert push(c2, 2, dp(0.1)).accepted
    assert push(b2, 2, dp(2.5)).accepted
    assert c2.pull(completed=2).envelope.round == 3
    assert sample(agg2, "hetfed_privacy_unprotected_organizations") == 0
    assert org_privacy(b2) == {"a": (True, 1.5), "b": (True, 2.5), "c": (True, 0.1)}


def test_the_ledger_checkpoints_privacy_and_reads_its_older_form() -> None:
    ledger = OrganizationLedger()
    ledger.pushed("a", 1, dp(1.0))
    ledger.pushed("b", 1)
    ledger.pushed("c", 1, dp(0.5))
    ledger.pushed("c", 2)  # declared once, not at its last update
    ledger.pushed("a", 0, dp(0.1))  # a replayed older round changes nothing
    data = ledger.to_json()
    assert data["b"] == [1, 0, 0]  # no declaration ever: the older form, which older aggregators read
    assert data["a"][3] == {"protected": True, "last": dataclasses.asdict(dp(1.0))}
    restored = OrganizationLedger.from_json(data)
    assert restored.to_json() == data
    a, b, c = (restored.get(o) for o in "abc")
    assert (a.privacy, a.protected, a.unprotected) == (dp(1.0), True, False)
    assert (b.privacy, b.protected, b.unprotected) == (None, False, True)
    assert (c.privacy, c.protected, c.unprotected) == (dp(0.5), False, True)
    assert not OrganizationLedger().get("x").unprotected  # never pushed: not counted
    older = OrganizationLedger.from_json({"a": [3, 10, 20]})
    assert (older.get("a").last_round_pushed, older.get("a").privacy) == (3, None)


# ------------------------------------------------------------------------------------------------ leave notice
# A round deadline no test waits for: a round that closes does so because nobody else is expected.
NEVER = 900.0


def leave(client: RawClient, round_: int, epsilon: float, delta: float = 1e-5) -> grpc.RpcError:
    """Send the leave notice a client whose budget is spent sends (no payload, budget_spent); its refusal."""
    notice = dataclasses.replace(dp(epsilon, delta), budget_spent=True)
    data = messages.encode_update(messages.Update("r", round_, client.organization, [], notice)).data
    with pytest.raises(grpc.RpcError) as err:
        client.push_bytes(round_, data)
    return err.value


def refusals(client: RawClient) -> list[tuple[str, str]]:
    (run,) = client.stub.Status(apb.StatusRequest(run_id="r"), timeout=10).runs
    return [(r.organization_id, r.reason) for r in run.refused]


def test_a_leave_notice_is_refused_listed_and_the_round_closes_when_the_others_pushed(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    agg, (a, b, c) = started(aggregator, raw_client, "abc", require_privacy=True, rounds=3,
                             round_deadline_seconds=NEVER)
    run = agg.service.runs["r"]
    assert push(a, 1, dp(0.4), 1.0, 10).accepted
    err = leave(b, 1, 0.91234, 1e-5)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == ("privacy_budget_spent: organization 'b' leaves run 'r': its privacy budget is spent "
                             "(ε=0.9123 at δ=1e-05); the run goes on without it")
    assert rejected(agg, "privacy_budget_spent") == 1
    assert refusals(a) == [("b", "privacy_budget_spent")]
    assert sample(agg, "hetfed_refused_organizations", organization="b", reason="privacy_budget_spent") == 1
    assert run.refused["b"].at_push and run.refused["b"].round == 1
    assert sorted(run.pushed) == ["a"] and run.round == 1  # the notice is no update: c is still waited for
    # c's push closes round 1 at once (the deadline is 15 minutes away): b is no longer waited for.
    assert push(c, 1, dp(0.6), 3.0, 30).accepted
    assert run.round == 2
    ins = a.pull(completed=1)
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 2
    np.testing.assert_array_equal(global_weights(ins), W * 2.5)  # (10·W + 30·3W) / 40
    (status,) = a.stub.Status(apb.StatusRequest(run_id="r"), timeout=10).runs
    assert status.history[0].clients == 2
    # Later rounds do not wait for b either; its refusal stays listed.
    push(a, 2, dp(0.5))
    push(c, 2, dp(0.7))
    assert run.round == 3
    assert refusals(c) == [("b", "privacy_budget_spent")]
    # Its last accepted ε is untouched by the notice (b never had an update accepted).
    assert org_privacy(a)["b"] == (False, 0.0)


def test_a_leave_notice_after_everyone_else_pushed_closes_the_round_itself(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    agg, (a, b, c) = started(aggregator, raw_client, "abc", require_privacy=True, rounds=3,
                             round_deadline_seconds=NEVER)
    run = agg.service.runs["r"]
    push(a, 1, dp(0.4))
    push(b, 1, dp(0.4))
    push(c, 1, dp(0.4))
    assert a.pull(completed=1).envelope.round == 2
    push(a, 2, dp(0.8))
    push(c, 2, dp(0.8))
    assert run.round == 2
    assert leave(b, 2, 0.4).code() == grpc.StatusCode.FAILED_PRECONDITION
    assert run.round == 3, "round 2 closed on b's leave notice: a and c had pushed"
    assert a.pull(completed=2).envelope.round == 3


def test_another_refusal_at_a_push_still_holds_its_round(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    """Only a leave notice releases the open round: after any other refusal at a push, a corrected update may
    still come, so the round waits for it as before."""
    agg, (a, b) = started(aggregator, raw_client, require_privacy=True, rounds=2, round_deadline_seconds=NEVER)
    run = agg.service.runs["r"]
    push(a, 1, dp(0.4))
    with pytest.raises(grpc.RpcError):
        push(b, 1, None)  # privacy_required
    assert run.refused["b"].at_push and run.round == 1
    assert not run.state.given_up("b", run.rules)


def test_the_typed_client_gets_privacy_budget_spent_for_its_leave_notice(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    """What a client whose budget is spent does: push no payload, its last declaration marked budget_spent."""
    agg, (_a, b) = started(aggregator, raw_client, require_privacy=True, round_deadline_seconds=NEVER)
    last = dp(1.5, 1e-6)
    with AggregatorClient(f"127.0.0.1:{agg.port}", None, "a", "r") as client, pytest.raises(RemoteError) as err:
        client.push(1, [], "float16", privacy=dataclasses.replace(last, budget_spent=True))
    e = err.value
    assert (e.code, e.reason, e.retryable) == (grpc.StatusCode.FAILED_PRECONDITION, "privacy_budget_spent", False)
    assert "its privacy budget is spent (ε=1.5 at δ=1e-06)" in e.details
    run = agg.service.runs["r"]
    assert run.state.given_up("a", run.rules)
    push(b, 1, dp(0.3))
    assert run.round == 2


def test_a_leave_notice_survives_a_restart(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    cfg = run_config(organizations=["a", "b", "c"], rounds=3, require_privacy=True, round_deadline_seconds=NEVER)
    agg, (a, b, _c) = started(aggregator, raw_client, "abc", rounds=3, require_privacy=True,
                             round_deadline_seconds=NEVER)
    leave(b, 1, 0.7)
    push(a, 1, dp(0.4))  # in the open round's log only
    agg.stop(grace=0.1)  # before any round closed: only the refusal's own checkpoint carries it

    agg2 = aggregator(cfg)
    run = agg2.service.runs["r"]
    a2, c2 = raw_client(agg2.port, "a"), raw_client(agg2.port, "c")
    assert run.round == 1 and sorted(run.pushed) == ["a"]
    assert refusals(a2) == [("b", "privacy_budget_spent")]
    assert sample(agg2, "hetfed_refused_organizations", organization="b", reason="privacy_budget_spent") == 1
    assert run.state.given_up("b", run.rules)
    assert push(c2, 1, dp(0.6)).accepted
    assert run.round == 2, "round 1 closed once c pushed: b stays given up across the restart"
    push(a2, 2, dp(0.5))
    push(c2, 2, dp(0.7))
    assert run.round == 3
    agg2.stop(grace=0.1)

    # Restored from a close's checkpoint this time: still given up, still listed.
    agg3 = aggregator(cfg)
    run = agg3.service.runs["r"]
    a3, c3 = raw_client(agg3.port, "a"), raw_client(agg3.port, "c")
    assert run.round == 3 and refusals(a3) == [("b", "privacy_budget_spent")]
    push(a3, 3, dp(0.6))
    push(c3, 3, dp(0.8))
    assert run.round == 4
