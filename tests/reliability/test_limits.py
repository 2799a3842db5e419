"""Limits wherever input arrives, each answered with a clear status and counted."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2_grpc

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import codec
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from tests.conftest import RawClient, run_config, wait_until

Start = Callable[..., Any]
Clients = Callable[..., RawClient]
W = np.array([1.0, 2.0, 3.0], np.float32)
DECL = [(PayloadKind.MODEL_WEIGHTS, "w", W)]


def rejected(agg: Any, reason: str, run: str = "r") -> float:
    return agg.service.metrics.registry.get_sample_value(
        "hetfed_rejected_messages_total", {"run": run, "reason": reason}) or 0.0


def upd(scale: float, n: int = 10, **extra: float) -> list[Any]:
    return [ModelWeights({"w": W * scale}, n), EvalMetrics(test_accuracy=0.5, num_test_examples=1, extra=extra)]


# ------------------------------------------------------------------------------------------ 9


class HeldPush:
    """A push whose first chunk announces ``total`` bytes, held open until ``release``."""

    def __init__(self, client: RawClient, total: int) -> None:
        self._release = threading.Event()
        self.error: grpc.RpcError | None = None

        def requests() -> Any:
            chunk = apb.Chunk(index=0, count=2, total_bytes=total, data=b"\0" * 16)
            yield apb.PushUpdateRequest(run_id="r", round=1, organization_id=client.organization, chunk=chunk)
            self._release.wait(30)

        def call() -> None:
            try:
                client.stub.PushUpdate(requests(), metadata=client.metadata, timeout=60)
            except grpc.RpcError as err:
                self.error = err

        self._thread = threading.Thread(target=call, daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._release.set()
        self._thread.join(30)


def test_9_pushes_in_flight_are_bounded_per_organization(aggregator: Start, raw_client: Clients) -> None:
    agg = aggregator(run_config(), max_pushes_per_organization=2, max_buffered_bytes_per_organization=100_000)
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a.join(DECL)
    b.join(DECL)
    budget = agg.service.pushes
    first = HeldPush(a, 60_000)
    wait_until(lambda: budget.in_flight("a") == (1, 60_000), timeout=10, what="the first held push")
    with pytest.raises(grpc.RpcError) as err:  # 60,000 + 50,000 bytes announced > 100,000
        a.push_bytes(1, b"\0" * 50_000)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details().startswith("buffer_full: organization 'a' has 60000 bytes of pushes in flight")
    second = HeldPush(a, 1_000)
    wait_until(lambda: budget.in_flight("a") == (2, 61_000), timeout=10, what="the second held push")
    with pytest.raises(grpc.RpcError) as err:
        a.push(1, upd(1.0))
    assert err.value.details().startswith("too_many_streams: organization 'a' already has 2 pushes in flight")
    with pytest.raises(grpc.RpcError) as err:  # one update over the per-organization limit never fits
        a.push_bytes(1, b"\0" * 200_000)
    assert err.value.details().startswith("oversized: an update of 200000 bytes exceeds the 100000 bytes")
    assert b.push(1, upd(3.0)).accepted  # another organization is not affected
    for held in (first, second):
        held.release()
        assert held.error is not None and held.error.code() == grpc.StatusCode.ABORTED  # cut short: incomplete
    assert budget.in_flight("a") == (0, 0)
    assert a.push(1, upd(1.0)).accepted
    assert (rejected(agg, "buffer_full"), rejected(agg, "too_many_streams")) == (1, 1)


def test_concurrent_reassemblies_are_bounded_across_organizations(aggregator: Start, raw_client: Clients) -> None:
    """Admission control: with one slot, a second organization's push waits for it (here past
    reassembly_wait_seconds: ``busy``, retryable) and succeeds once the slot is free."""
    agg = aggregator(run_config(), max_concurrent_reassemblies=1, reassembly_wait_seconds=0.5)
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a.join(DECL)
    b.join(DECL)
    held = HeldPush(a, 1_000)
    wait_until(lambda: agg.service.pushes.in_flight("a") == (1, 1_000), timeout=10, what="the held push")
    wait_until(lambda: agg.service.pushes.slots.locked(), timeout=10, what="its slot")
    with pytest.raises(grpc.RpcError) as err:
        b.push(1, upd(3.0))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details().startswith("busy: 1 updates are being received (server.max_concurrent_reassemblies)")
    held.release()
    assert b.push(1, upd(3.0)).accepted  # the slot came back with the held push's end
    assert a.push(1, upd(1.0)).accepted
    assert rejected(agg, "busy") == 1 and not agg.service.pushes.slots.locked()


def test_a_push_that_waits_for_a_slot_goes_through_when_it_frees(aggregator: Start, raw_client: Clients) -> None:
    """Within reassembly_wait_seconds the waiting push is not refused: it is received once the slot frees."""
    agg = aggregator(run_config(), max_concurrent_reassemblies=1, reassembly_wait_seconds=30)
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a.join(DECL)
    b.join(DECL)
    held = HeldPush(a, 1_000)
    wait_until(lambda: agg.service.pushes.slots.locked(), timeout=10, what="the held push's slot")
    result: list[Any] = []
    waiting = threading.Thread(target=lambda: result.append(b.push(1, upd(3.0))))
    waiting.start()
    wait_until(lambda: agg.service.pushes.in_flight("b")[0] == 1, timeout=10, what="b's push to be admitted")
    assert not result  # it waits for the slot
    held.release()
    waiting.join(30)
    assert result and result[0].accepted


def test_a_stalled_push_stream_is_refused_and_frees_its_slot(aggregator: Start, raw_client: Clients) -> None:
    """A stream that sends no chunk for push_idle_seconds is refused (``stalled``, DEADLINE_EXCEEDED)."""
    agg = aggregator(run_config(), max_concurrent_reassemblies=1, push_idle_seconds=0.5)
    a = raw_client(agg.port, "a")
    a.join(DECL)
    held = HeldPush(a, 1_000)
    wait_until(lambda: held.error is not None, timeout=10, what="the stalled push's refusal")
    assert held.error is not None and held.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert held.error.details().startswith("stalled: no chunk for 0.5 s (server.push_idle_seconds)")
    assert agg.service.pushes.in_flight("a") == (0, 0) and not agg.service.pushes.slots.locked()
    held.release()
    assert a.push(1, upd(1.0)).accepted
    assert rejected(agg, "stalled") == 1


# ------------------------------------------------------------------------------------------ 10

GARBAGE = b"\xff\xff\xff\xff not a protobuf"


@pytest.mark.parametrize("method", ["Join", "PullInstructions", "PushUpdate", "Status"])
def test_10_an_undecodable_request_is_an_ordinary_counted_rejection(aggregator: Start, method: str) -> None:
    agg = aggregator(run_config())
    with grpc.insecure_channel(f"127.0.0.1:{agg.port}") as ch:
        path = f"/hetfed.v1.Aggregator/{method}"
        call: Callable[[], Any] = {
            "Join": lambda: ch.unary_unary(path)(GARBAGE, timeout=5),
            "PullInstructions": lambda: list(ch.unary_stream(path)(GARBAGE, timeout=5)),
            "PushUpdate": lambda: ch.stream_unary(path)(iter([GARBAGE]), timeout=5),
            "Status": lambda: ch.unary_unary(path)(GARBAGE, timeout=5),
        }[method]
        with pytest.raises(grpc.RpcError) as err:
            call()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("malformed: the request is not a valid hetfed.v1.")
    assert rejected(agg, "malformed", run="") == 1


def test_10_an_undecodable_health_check_is_refused(aggregator: Start) -> None:
    agg = aggregator(run_config())
    with grpc.insecure_channel(f"127.0.0.1:{agg.port}") as ch:
        with pytest.raises(grpc.RpcError) as err:
            ch.unary_unary("/grpc.health.v1.Health/Check")(GARBAGE, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert health_pb2_grpc.HealthStub(ch) is not None


# ------------------------------------------------------------------------------------------ 11


@pytest.mark.parametrize("field", ["run_id", "organization_id"])
def test_11_a_huge_request_string_is_neither_logged_nor_echoed_in_full(aggregator: Start, field: str,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    agg = aggregator(run_config())
    huge = "x" * (8 << 20)
    with grpc.insecure_channel(f"127.0.0.1:{agg.port}") as ch, caplog.at_level(logging.INFO):
        req = apb.JoinRequest(**{"run_id": "r", "organization_id": "a", field: huge})
        with pytest.raises(grpc.RpcError) as err:
            ch.unary_unary("/hetfed.v1.Aggregator/Join")(req.SerializeToString(), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("malformed: an id of 8388608 characters (at most 128)")
    assert len(err.value.details()) <= 512
    assert len(caplog.text) < 2_000  # was 8 MB of log per request


def test_11_a_report_with_100000_figure_names_is_refused_before_any_metric(aggregator: Start,
                                                                           raw_client: Clients) -> None:
    agg = aggregator(run_config())
    a = raw_client(agg.port, "a")
    a.join(DECL)
    many = {f"m{i}": 1.0 for i in range(100_000)}
    with pytest.raises(grpc.RpcError) as err:
        a.push(1, upd(1.0, **many))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == ("oversized: eval_metrics carries 100000 named figures; at most 64 "
                                   "(server.max_metrics_per_report)")
    families = {m.name for m in agg.service.metrics.registry.collect() for s in m.samples
                if s.labels.get("name", "").startswith("m")}
    assert families == set()
    with pytest.raises(grpc.RpcError) as err:
        a.push(1, upd(1.0, **{"n" * 200: 1.0}))
    assert err.value.details().startswith("invalid_value: eval_metrics figure name 'nnnn")
    assert "has 200 characters; at most 128" in err.value.details()
    assert a.push(1, upd(1.0, accuracy_of_something=0.5)).accepted


# ------------------------------------------------------------------------------------------ 12


def test_12_example_counts_are_bounded_by_the_declaration_at_join(aggregator: Start, raw_client: Clients) -> None:
    agg = aggregator(run_config(organizations=["a", "b", "c"]), max_examples_per_organization=1000)
    a, b, c = raw_client(agg.port, "a"), raw_client(agg.port, "b"), raw_client(agg.port, "c")
    with pytest.raises(grpc.RpcError) as err:
        a.join(DECL, examples=1001)
    assert err.value.details() == ("invalid_value: num_train_examples must be in [0, 1000] "
                                   "(the run's max_examples, server.max_examples_per_organization), got 1001")
    a.join(DECL, examples=600)
    b.join(DECL)  # declares nothing: bounded by the server's maximum
    c.join(DECL, examples=10)
    for n, expected in ((2**63 - 1, "claims 9223372036854775807 training examples; 'a' declared 600 training "
                                    "examples at Join"),
                        (601, "claims 601 training examples"), (-5, "claims -5 training examples")):
        with pytest.raises(grpc.RpcError) as err:
            a.push(1, upd(1e30, n))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert expected in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        b.push(1, upd(1.0, 1001))
    assert "it declared none, and the limit is 1000 (the run's max_examples" in err.value.details()
    assert rejected(agg, "invalid_value") == 5
    a.push(1, upd(1.0, 600))
    b.push(1, upd(2.0, 1000))
    c.push(1, upd(3.0, 10))
    mw = codec.payload_from_proto(a.pull(completed=1).payloads[0])
    assert isinstance(mw, ModelWeights)
    np.testing.assert_allclose(mw.tensors["w"], W * (600 + 2000 + 30) / 1610, rtol=1e-6)


def test_12_the_trimmed_mean_keeps_a_poisoned_update_out_of_the_global_model(aggregator: Start,
                                                                             raw_client: Clients) -> None:
    orgs = ["a", "b", "c", "m"]
    agg = aggregator(run_config(organizations=orgs, algorithm_config={"aggregation": "trimmed_mean", "trim": 1,
                                                                                "max_abs_weight": 0}))
    clients = {o: raw_client(agg.port, o) for o in orgs}
    for c in clients.values():
        c.join(DECL, examples=100)
    for org, scale in (("a", 1.0), ("b", 2.0), ("c", 4.0)):
        clients[org].push(1, upd(scale, 100))
    clients["m"].push(1, [ModelWeights({"w": np.array([1e30, -1e30, 1e30], np.float32)}, 100),
                          EvalMetrics(test_accuracy=1.0, num_test_examples=1)])
    mw = codec.payload_from_proto(clients["a"].pull(completed=1).payloads[0])
    assert isinstance(mw, ModelWeights)
    # w: a=1, b=2, c=4 times [1, 2, 3] and m=[1e30, -1e30, 1e30]; per coordinate the largest and the smallest
    # go: [1, 2, 4, 1e30] -> (2 + 4) / 2 = 3; [2, 4, 8, -1e30] -> (2 + 4) / 2 = 3; [3, 6, 12, 1e30] -> 9.
    np.testing.assert_array_equal(mw.tensors["w"], [3.0, 3.0, 9.0])


def test_11_figure_names_no_longer_reported_leave_the_metrics(aggregator: Start, raw_client: Clients) -> None:
    """64 fresh names a round must not grow /metrics round after round."""
    agg = aggregator(run_config(rounds=3))
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    for c in (a, b):
        c.join(DECL)
    reg = agg.service.metrics.registry

    def names(family: str) -> set[str]:
        return {s.labels["name"] for m in reg.collect() if m.name == family for s in m.samples}

    for r in (1, 2):
        fresh = {f"r{r}_{i}": 1.0 for i in range(64)}
        a.push(r, upd(1.0, **fresh))
        b.push(r, upd(1.0, **fresh))
        a.pull(completed=r)
        assert names("hetfed_reported_metric") == set(fresh)
        assert names("hetfed_reported_metric_mean") == set(fresh)
