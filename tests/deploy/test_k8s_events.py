"""Kubernetes Events about the aggregator's pod, posted by the real kubernetes client to a local API server."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from werkzeug import Request, Response

from hetfed.aggregator.observe import k8s_events
from hetfed.aggregator.observe.k8s_events import EventRecorder, PodRef
from tests.conftest import RawClient, run_config, wait_until
from tests.deploy.k8s_fake import api_server, service_account

EVENTS_PATH = "/apis/events.k8s.io/v1/namespaces/federation/events"
POD_ENV = {"POD_NAME": "fl-hetfed-aggregator-0", "POD_NAMESPACE": "federation", "POD_UID": "0f6e-uid"}
# metav1.MicroTime: RFC 3339 with microseconds ("Z" or "+00:00" both parse).
MICRO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|\+00:00)$")


def created(request: Request) -> Response:
    """Answer a POST as the API server does: 201 with the object."""
    return Response(request.get_data(), status=201, content_type="application/json")


def plain_recorder(url: str, **kw: Any) -> EventRecorder:
    """A recorder talking plain HTTP to ``url`` (the in-cluster path is tested separately)."""
    from kubernetes import client

    configuration = client.Configuration()
    configuration.host = url
    return EventRecorder(client.ApiClient(configuration), PodRef("fl-hetfed-aggregator-0", "federation", "0f6e-uid"), **kw)


@pytest.fixture
def uninstall() -> Iterator[None]:
    """Leave no recorder installed after the test."""
    yield
    k8s_events.shutdown()


def test_in_cluster_recorder_posts_an_events_v1_event_about_its_pod(tmp_path: Path) -> None:
    """Token, CA and KUBERNETES_SERVICE_HOST/PORT as in a pod: HTTPS with the CA, bearer token, exact body."""
    with api_server(tmp_path, tls=True) as (server, ca):
        assert ca is not None
        sa = service_account(tmp_path / "sa", ca, token="sa-token")
        server.expect_ordered_request(
            EVENTS_PATH, method="POST",
            headers={"Authorization": "Bearer sa-token", "Content-Type": "application/json"},
        ).respond_with_handler(created)
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(server.port), **POD_ENV}
        recorder = EventRecorder.from_environment(env, serviceaccount_dir=sa)
        assert recorder is not None
        assert recorder.record("RoundClosed", "run demo closed train round 1 with 2 clients in 3.10s")
        assert recorder.flush(timeout=20)
        recorder.close()
        server.check_assertions()
        ((request, _),) = server.log
        body = json.loads(request.get_data())
    assert body["apiVersion"] == "events.k8s.io/v1" and body["kind"] == "Event"
    assert re.fullmatch(r"fl-hetfed-aggregator-0\.[0-9a-f]+", body["metadata"]["name"])
    assert body["metadata"]["namespace"] == "federation"
    assert MICRO_TIME.match(body["eventTime"]), body["eventTime"]
    assert {k: body[k] for k in ("reportingController", "reportingInstance", "action", "reason", "type", "note")} == {
        "reportingController": "hetfed.io/aggregator", "reportingInstance": "fl-hetfed-aggregator-0",
        "action": "CloseRound", "reason": "RoundClosed", "type": "Normal",
        "note": "run demo closed train round 1 with 2 clients in 3.10s",
    }
    assert body["regarding"] == {"apiVersion": "v1", "kind": "Pod", "name": "fl-hetfed-aggregator-0",
                                 "namespace": "federation", "uid": "0f6e-uid"}
    assert recorder.failed == 0


def test_outside_a_cluster_no_recorder_and_one_clear_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No KUBERNETES_SERVICE_HOST or no token: None, one log line; emit() without a recorder does nothing."""
    caplog.set_level(logging.INFO, logger="hetfed.aggregator.events")
    assert EventRecorder.from_environment({}, serviceaccount_dir=tmp_path / "none") is None
    assert EventRecorder.from_environment({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, serviceaccount_dir=tmp_path) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("not running in a Kubernetes cluster" in m for m in lines)
    assert "Kubernetes Events are off" in lines[0]
    k8s_events.emit("RoundClosed", "nothing installed: a no-op")
    caplog.clear()
    assert EventRecorder.from_environment({"HETFED_EVENTS": "off", "KUBERNETES_SERVICE_HOST": "x"}) is None
    assert caplog.records[0].getMessage() == "Kubernetes Events are off (HETFED_EVENTS=off)"


def test_record_never_blocks_and_the_queue_is_bounded(tmp_path: Path) -> None:
    """With the API server stuck, record() returns at once; past the queue's bound events are dropped, counted."""
    release = threading.Event()
    arrived = threading.Event()

    def stuck(request: Request) -> Response:
        arrived.set()
        release.wait(30)
        return created(request)

    with api_server(tmp_path) as (server, _):
        server.expect_request(EVENTS_PATH, method="POST").respond_with_handler(stuck)
        recorder = plain_recorder(server.url_for(""), max_queue=2)
        assert recorder.record("RoundClosed", "first")
        assert arrived.wait(20)  # the background thread is inside the first POST, blocked
        started = time.monotonic()
        results = [recorder.record("RoundClosed", f"event {i}") for i in range(3)]
        assert time.monotonic() - started < 0.5
        assert results == [True, True, False] and recorder.dropped == 1
        release.set()
        assert recorder.flush(timeout=20)
        recorder.close()
        assert [json.loads(r.get_data())["note"] for r, _ in server.log] == ["first", "event 0", "event 1"]


def test_bursts_are_limited_per_reason_and_the_next_event_counts_the_suppressed(tmp_path: Path) -> None:
    """A token bucket per reason: past the burst, events are suppressed until it refills; the next says how many."""
    now = [0.0]
    with api_server(tmp_path) as (server, _):
        server.expect_request(EVENTS_PATH, method="POST").respond_with_handler(created)
        recorder = plain_recorder(server.url_for(""), burst=2, refill_seconds=10.0, clock=lambda: now[0])
        assert [recorder.record("Rejected", f"r{i}", warning=True) for i in range(4)] == [True, True, False, False]
        assert recorder.record("RoundClosed", "another reason has its own bucket")
        now[0] = 10.0
        assert recorder.record("Rejected", "r4", warning=True)
        assert recorder.flush(timeout=20)
        recorder.close()
        bodies = [json.loads(r.get_data()) for r, _ in server.log]
    assert [(b["reason"], b["type"], b["note"]) for b in bodies] == [
        ("Rejected", "Warning", "r0"), ("Rejected", "Warning", "r1"),
        ("RoundClosed", "Normal", "another reason has its own bucket"),
        ("Rejected", "Warning", "r4 (2 similar events suppressed)"),
    ]
    assert bodies[0]["action"] == "Reject"


def test_a_refusing_api_server_is_counted_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """403 from the API server (no RBAC): counted and logged once; the recorder keeps working."""
    with api_server(tmp_path) as (server, _):
        server.expect_request(EVENTS_PATH, method="POST").respond_with_json(
            {"kind": "Status", "message": "events.events.k8s.io is forbidden", "code": 403}, status=403)
        recorder = plain_recorder(server.url_for(""))
        for i in range(3):
            assert recorder.record("RoundClosed", f"round {i}")
        assert recorder.flush(timeout=20)
        recorder.close()
    assert recorder.failed == 3
    warnings = [r.getMessage() for r in caplog.records if r.name == "hetfed.aggregator.events"]
    assert len(warnings) == 1 and "could not record a Kubernetes Event" in warnings[0]


def test_the_aggregator_records_round_closes_and_rejections(
    tmp_path: Path, aggregator: Callable[..., Any], raw_client: Callable[..., RawClient], uninstall: None
) -> None:
    """Wired in: a rejected Join and a closed round of a real in-process aggregator become Events."""
    import numpy as np

    from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind

    with api_server(tmp_path) as (server, _):
        server.expect_request(EVENTS_PATH, method="POST").respond_with_handler(created)
        recorder = plain_recorder(server.url_for(""))
        k8s_events.install(recorder)
        agg = aggregator(run_config(id="demo", organizations=["a"], rounds=1))
        w = np.array([1.0, 2.0], np.float32)
        intruder = raw_client(agg.port, "mallory", run="demo")
        with pytest.raises(Exception, match="unknown_organization"):
            intruder.join([(PayloadKind.MODEL_WEIGHTS, "w", w)])
        a = raw_client(agg.port, "a", run="demo")
        a.join([(PayloadKind.MODEL_WEIGHTS, "w", w)])
        a.push(1, [ModelWeights({"w": w}, 1), EvalMetrics(test_accuracy=0.5, num_test_examples=1)])
        wait_until(lambda: agg.service.runs["demo"].round == 2, timeout=10, what="round 1 to close")
        assert recorder.flush(timeout=20)
        bodies = [json.loads(r.get_data()) for r, _ in server.log]
    rejected = next(b for b in bodies if b["reason"] == "Rejected")
    assert rejected["type"] == "Warning" and rejected["note"].startswith("run demo: unknown_organization from ")
    closed = next(b for b in bodies if b["reason"] == "RoundClosed")
    assert closed["type"] == "Normal" and closed["note"].startswith("run demo closed train round 1 with 1 clients in ")
