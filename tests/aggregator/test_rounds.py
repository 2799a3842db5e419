"""Round lifecycle over real gRPC: quorum and deadline, late pushes, rejoining, long-poll, evaluate and finish."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import codec
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from tests.conftest import RawClient, run_config, wait_until

W = {"w": np.array([1.0, -2.0, 4.0], np.float32)}
DECL = [(PayloadKind.MODEL_WEIGHTS, "w", W["w"])]


def upd(scale: float, n: int, acc: float = 0.5) -> list[Any]:
    return [ModelWeights({"w": W["w"] * scale}, n), EvalMetrics(test_accuracy=acc, num_test_examples=10)]


def test_deadline_closes_with_quorum_and_late_push_names_current_round(
    aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]
) -> None:
    agg = aggregator(run_config(organizations=["a", "b", "c"], min_clients=2, round_deadline_seconds=0.5))
    a, b, c = (raw_client(agg.port, o) for o in "abc")
    for cl in (a, b, c):
        cl.join(DECL)
    a.push(1, upd(1.0, 1))
    b.push(1, upd(3.0, 3))
    run = agg.service.runs["r"]
    wait_until(lambda: run.round == 2, timeout=10, what="the deadline to close round 1 with a quorum of 2")
    assert run.history[0].clients == 2
    with pytest.raises(grpc.RpcError) as err:
        c.push(1, upd(100.0, 1))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "round 1 is closed; the current round is 2" in err.value.details()
    mw = codec.payload_from_proto(c.pull(completed=0).payloads[0])
    assert isinstance(mw, ModelWeights)
    np.testing.assert_array_equal(mw.tensors["w"], W["w"] * 2.5)  # (1·1 + 3·3) / 4


def test_below_quorum_waits_past_deadline(aggregator: Callable[..., Any],
                                          raw_client: Callable[..., RawClient]) -> None:
    agg = aggregator(run_config(organizations=["a", "b", "c"], min_clients=2, round_deadline_seconds=0.2))
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a.join(DECL)
    b.join(DECL)
    a.push(1, upd(1.0, 1))
    # Long past the deadline a single push is no quorum: the round stays open.
    ins = b.pull(completed=0, wait=0.6)
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 1
    assert agg.service.runs["r"].round == 1
    b.push(1, upd(1.0, 1))
    wait_until(lambda: agg.service.runs["r"].round == 2, timeout=10, what="quorum reached after the deadline")


def test_long_poll_waits_then_says_wait(aggregator: Callable[..., Any],
                                        raw_client: Callable[..., RawClient]) -> None:
    agg = aggregator(run_config())
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a.join(DECL)
    b.join(DECL)
    a.push(1, upd(1.0, 1))
    run = agg.service.runs["r"]
    before = run.open_round.record.down.total_bytes
    sample = {"run": "r", "algorithm": "fedavg", "organization": "a", "direction": "down", "payload_kind": "envelope"}
    sent = agg.service.metrics.registry.get_sample_value("hetfed_aggregator_bytes_total", sample)
    assert a.pull(completed=1, wait=0.3).action == apb.ACTION_WAIT
    # How often a long-poll expires depends on timing alone: the WAIT is in the metrics (every byte sent is), not
    # in the round's record, whose bytes a run's table reports and a seed repeats.
    assert agg.service.metrics.registry.get_sample_value("hetfed_aggregator_bytes_total", sample) > sent
    assert run.open_round.record.down.total_bytes == before


def test_client_that_reconnects_rejoins_current_round(aggregator: Callable[..., Any],
                                                      raw_client: Callable[..., RawClient]) -> None:
    agg = aggregator(run_config(rounds=3))
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a.join(DECL)
    b.join(DECL)
    a.push(1, upd(1.0, 1))
    b.push(1, upd(1.0, 1))
    b.close()
    b2 = raw_client(agg.port, "b")
    joined = b2.join(DECL)
    assert joined.current_round == 2
    ins = b2.pull(completed=-1)
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 2


def test_full_lifecycle_with_evaluation_and_status(aggregator: Callable[..., Any],
                                                    raw_client: Callable[..., RawClient]) -> None:
    agg = aggregator(run_config(rounds=2))
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    for cl in (a, b):
        cl.join(DECL)
    for r in (1, 2):
        for cl, s in ((a, 1.0), (b, 2.0)):
            ins = cl.pull(completed=r - 1)
            assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == r
            cl.push(r, upd(s, 1, acc=0.25 * s))
    for cl in (a, b):
        ins = cl.pull(completed=2)
        assert ins.action == apb.ACTION_EVALUATE and ins.envelope.round == 3
        with pytest.raises(grpc.RpcError) as err:
            cl.push(3, upd(1.0, 1))  # only metrics may be sent when evaluating
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        cl.push(3, [EvalMetrics(test_accuracy=0.75, num_test_examples=10)])
    assert a.pull(completed=3).action == apb.ACTION_FINISH
    status = a.stub.Status(apb.StatusRequest(run_id="r"), timeout=5).runs[0]
    assert status.state == apb.RUN_STATE_FINISHED
    assert [h.round for h in status.history] == [1, 2, 3]
    assert [h.clients for h in status.history] == [2, 2, 2]
    up = {t.payload_kind: t for t in status.history[1].traffic if t.direction == "up"}
    assert up["model_weights"].messages == 2 and up["model_weights"].elements == 6
    assert {r.organization_id: r.metrics.test_accuracy for r in status.history[0].reports} == {"a": 0.25, "b": 0.5}
    reg = agg.service.metrics.registry
    assert reg.get_sample_value("hetfed_aggregator_parameters_total", {
        "run": "r", "algorithm": "fedavg", "organization": "a", "direction": "up", "payload_kind": "model_weights"}) == 6
    assert reg.get_sample_value("hetfed_reported_test_accuracy", {
        "run": "r", "algorithm": "fedavg", "organization": "b"}) == 0.75
    assert reg.get_sample_value("hetfed_round_duration_seconds_count", {"run": "r", "algorithm": "fedavg"}) == 3


def test_two_runs_share_one_aggregator(aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> None:
    agg = aggregator(run_config(id="one", rounds=1), run_config(id="two", algorithm="local", rounds=1))
    a1, a2 = raw_client(agg.port, "a", run="one"), raw_client(agg.port, "a", run="two")
    a1.join(DECL)
    a2.join()
    with pytest.raises(grpc.RpcError) as err:
        a2.push(1, upd(1.0, 1))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    a2.push(1, [EvalMetrics(test_accuracy=0.5)])
    assert agg.service.runs["one"].round == 1 and agg.service.runs["two"].pushed


def test_per_organization_instructions_are_bounded_and_rebuilt_identically(
        aggregator: Callable[..., Any]) -> None:
    """A per-organization algorithm's instruction messages are kept for at most PER_ORGANIZATION_INSTRUCTIONS
    organizations at once; an evicted one is rebuilt, byte for byte, when its organization pulls again."""
    from hetfed.aggregator.run import instructions

    orgs = [f"o{i}" for i in range(instructions.PER_ORGANIZATION_INSTRUCTIONS + 4)]
    agg = aggregator(run_config(organizations=orgs))
    run = agg.service.runs["r"]
    built: list[str] = []

    class PerOrganization:  # the parts of a server half the instructions use
        broadcast = False

        def payloads_for(self, phase: Any, round_: int, organization: str) -> list[Any]:
            built.append(organization)
            return [ModelWeights({"w": np.full(3, float(len(organization) + orgs.index(organization)), np.float32)},
                                 1)]

    half: Any = PerOrganization()
    get = run.instructions.get
    first = {o: get(half, run.phase, run.round, o) for o in orgs}
    assert len(run.instructions) == instructions.PER_ORGANIZATION_INSTRUCTIONS and built == orgs
    again = get(half, run.phase, run.round, orgs[0])  # evicted: rebuilt, the same bytes
    assert again is not first[orgs[0]] and again.data == first[orgs[0]].data
    assert get(half, run.phase, run.round, orgs[-1]) is first[orgs[-1]]  # still kept: not rebuilt
    assert built == [*orgs, orgs[0]]


def test_a_broadcast_views_the_global_arrays_which_a_close_leaves_alone_while_a_pull_holds_it(
        aggregator: Callable[..., Any]) -> None:
    agg = aggregator(run_config(algorithm="fedavg", organizations=["a", "b"]))
    run = agg.service.runs["r"]

    class Shared:  # the parts of a server half the instructions use
        broadcast = True
        shares_payloads = True

        def __init__(self) -> None:
            self.w = np.arange(6, dtype=np.float32)

        def payloads_for(self, phase: Any, round_: int, organization: str) -> list[Any]:
            return [ModelWeights({"w": self.w}, 1)]

    half: Any = Shared()
    held = run.instructions.get(half, run.phase, run.round, "a")
    assert held.data.arrays[0] is half.w  # the broadcast's tensor bytes are the array's: no copy
    run.instructions.drop()  # a close: a pull still holds the broadcast, so its array becomes read-only
    assert half.w.flags.writeable is False
    half.w = np.arange(6, dtype=np.float32)
    run.instructions.get(half, run.phase, run.round, "a")  # built, then let go
    run.instructions.drop()
    assert half.w.flags.writeable is True  # nothing holds it: the close may write into it
    assert bytes(held.data).count(np.arange(6, dtype=np.float32).tobytes()) == 1
