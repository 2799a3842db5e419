"""``hetfed status`` with the real kubernetes client against a local API server and a real in-process aggregator."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import numpy as np
import pytest
from pytest_httpserver import HTTPServer

from hetfed.cli import main as hetfed_main
from hetfed.cli.k8s_status import aggregator_address, kubernetes_client
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from tests.conftest import RawClient, run_config
from tests.deploy.k8s_fake import api_server, kubeconfig, pod, pod_list, service_account

PODS_PATH = "/api/v1/namespaces/federation/pods"
SELECTOR = "app.kubernetes.io/part-of=hetfed,app.kubernetes.io/instance=fl"
W = np.array([1.0, 2.0, 3.0], np.float32)


def release_pods() -> dict[str, Any]:
    """The aggregator, org-a on a GPU node (restarted once), org-b retried by its Job (a failed pod, a newer one)."""
    return pod_list(
        pod("fl-hetfed-aggregator-0", component="aggregator", node="cpu-1"),
        pod("fl-hetfed-org-a-1a2b3c4d-x7k2p", component="client", organization="org-a", node="gpu-1", gpus=1,
            restarts=1),
        pod("fl-hetfed-org-b-5e6f7a8b-aaaaa", component="client", organization="org-b", node="gpu-2", gpus=1,
            phase="Failed", created="2026-01-01T00:00:00Z"),
        pod("fl-hetfed-org-b-5e6f7a8b-bbbbb", component="client", organization="org-b", node="gpu-2", gpus=1,
            phase="Pending", waiting="ContainerCreating", created="2026-01-01T00:05:00Z"),
    )


def started_run(aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]) -> int:
    """An aggregator whose run "demo" has org-a's round-1 update accepted and org-b not joined; its port."""
    agg = aggregator(run_config(id="demo", organizations=["org-a", "org-b"], rounds=3))
    a = raw_client(agg.port, "org-a", run="demo")
    a.join([(PayloadKind.MODEL_WEIGHTS, "w", W)])
    a.push(1, [ModelWeights({"w": W}, 5), EvalMetrics(test_accuracy=0.5, num_test_examples=4)])
    return int(agg.port)


def expected_bytes(port: int) -> tuple[int, int]:
    """org-a's bytes up and down as the aggregator's own ledger counts them (the table must print these)."""
    from hetfed.v1 import aggregator_pb2 as apb
    from hetfed.v1 import aggregator_pb2_grpc as agrpc
    from hetfed.wire.transport import make_channel

    with make_channel(f"127.0.0.1:{port}", None) as ch:
        (run,) = agrpc.AggregatorStub(ch).Status(apb.StatusRequest(), timeout=10).runs
    org_a = run.organization_status[0]
    return org_a.bytes_up, org_a.bytes_down


def test_status_joins_pods_with_the_aggregators_status(
    tmp_path: Path, httpserver: HTTPServer, aggregator: Callable[..., Any], raw_client: Callable[..., RawClient],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One pods request by label selector; one table: pod state beside last round and bytes per organization."""
    port = started_run(aggregator, raw_client)
    httpserver.expect_ordered_request(PODS_PATH, method="GET", query_string={"labelSelector": SELECTOR},
                                      headers={"Authorization": "Bearer user-token"}).respond_with_json(release_pods())
    config = kubeconfig(tmp_path / "kubeconfig", httpserver.url_for("").rstrip("/"))
    rc = hetfed_main(["status", "--kubeconfig", str(config), "--release", "fl",
                      "--aggregator", f"127.0.0.1:{port}"])
    httpserver.check_assertions()
    assert rc == 0
    assert len(httpserver.log) == 1  # --aggregator given: no Service lookup
    up, down = expected_bytes(port)
    assert up > 0 and down > 0

    def fmt(n: int) -> str:
        return f"{n} B" if n < 1000 else f"{n / 1000:.2f} kB"

    rows = [
        ["ORGANIZATION", "RUN", "POD", "PHASE", "NODE", "GPU", "RESTARTS", "JOINED", "LAST ROUND", "BYTES UP", "BYTES DOWN",
         "ε"],
        ["(aggregator)", "-", "fl-hetfed-aggregator-0", "Running", "cpu-1", "0", "0", "-", "-", "-", "-", "-"],
        ["org-a", "demo", "fl-hetfed-org-a-1a2b3c4d-x7k2p", "Running", "gpu-1", "1", "1", "yes", "1", fmt(up), fmt(down),
         "-"],
        ["org-b", "demo", "fl-hetfed-org-b-5e6f7a8b-bbbbb", "Pending (ContainerCreating)", "gpu-2", "1", "1", "no",
         "-", "0 B", "0 B", "-"],
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    assert capsys.readouterr().out.splitlines() == [*table, "", "run demo (fedavg): train, round 1 of 3"]


def test_status_finds_the_aggregator_service_by_label(tmp_path: Path, httpserver: HTTPServer) -> None:
    """Without --aggregator, the address is the release's aggregator Service (not the headless one)."""
    services = {"apiVersion": "v1", "kind": "ServiceList", "metadata": {}, "items": [
        {"metadata": {"name": "fl-hetfed-aggregator-headless"},
         "spec": {"clusterIP": "None", "ports": [{"name": "grpc", "port": 50051}]}},
        {"metadata": {"name": "fl-hetfed-aggregator"},
         "spec": {"clusterIP": "10.0.0.7", "ports": [{"name": "metrics", "port": 9090}, {"name": "grpc", "port": 50051}]}},
    ]}
    httpserver.expect_ordered_request(
        "/api/v1/namespaces/federation/services", method="GET",
        query_string={"labelSelector": f"{SELECTOR},app.kubernetes.io/component=aggregator"},
    ).respond_with_json(services)
    api, namespace = kubernetes_client(str(kubeconfig(tmp_path / "kc", httpserver.url_for("").rstrip("/"))))
    assert namespace == "federation"  # from the kubeconfig context
    assert aggregator_address(api, namespace, "fl") == "fl-hetfed-aggregator.federation.svc:50051"
    httpserver.check_assertions()


def test_status_in_cluster_uses_the_service_account(tmp_path: Path) -> None:
    """Inside a pod: HTTPS to KUBERNETES_SERVICE_HOST:PORT with the mounted CA and token, the pod's namespace."""
    with api_server(tmp_path, tls=True) as (server, ca):
        assert ca is not None
        sa = service_account(tmp_path / "sa", ca, namespace="federation", token="in-cluster-token")
        server.expect_ordered_request(PODS_PATH, method="GET", query_string={"labelSelector": SELECTOR},
                                      headers={"Authorization": "Bearer in-cluster-token"}).respond_with_json(
            release_pods())
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(server.port)}
        api, namespace = kubernetes_client(environ=env, serviceaccount_dir=sa)
        assert namespace == "federation"
        from hetfed.cli.k8s_status import list_pods

        pods = list_pods(api, namespace, "fl")
        server.check_assertions()
    assert [(p.organization, p.phase, p.gpus) for p in pods] == [
        ("", "Running", 0), ("org-a", "Running", 1), ("org-b", "Failed", 1),
        ("org-b", "Pending (ContainerCreating)", 1)]


def test_status_outside_a_cluster_degrades_with_a_clear_message(
    tmp_path: Path, aggregator: Callable[..., Any], raw_client: Callable[..., RawClient],
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """No kubeconfig and not in a pod: exit 2 with the reason; with --aggregator, the Status part alone."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    assert hetfed_main(["status"]) == 2
    err = capsys.readouterr().err
    assert "not inside a cluster and no kubeconfig at" in err and "pass --kubeconfig" in err
    port = started_run(aggregator, raw_client)
    assert hetfed_main(["status", "--aggregator", f"127.0.0.1:{port}"]) == 0
    captured = capsys.readouterr()
    assert "showing the aggregator's Status only" in captured.err
    lines = captured.out.splitlines()
    assert lines[1].split() == ["(aggregator)", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-"]
    assert lines[2].split()[:2] == ["org-a", "demo"] and lines[2].split()[7:9] == ["yes", "1"]


def test_status_of_an_unreachable_aggregator_still_prints_the_pods(
    tmp_path: Path, httpserver: HTTPServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """The API answers, the aggregator does not: pods are printed, the failure is named, exit 1."""
    httpserver.expect_request(PODS_PATH, method="GET").respond_with_json(release_pods())
    from tests.conftest import free_port

    config = kubeconfig(tmp_path / "kc", httpserver.url_for("").rstrip("/"))
    rc = hetfed_main(["status", "--kubeconfig", str(config), "--release", "fl",
                      "--aggregator", f"127.0.0.1:{free_port()}", "--timeout", "2"])
    captured = capsys.readouterr()
    assert rc == 1 and "did not answer Status: UNAVAILABLE" in captured.err
    assert [line.split()[0] for line in captured.out.splitlines()[1:]] == ["(aggregator)", "org-a", "org-b"]
    (request, _), = httpserver.log
    assert parse_qs(request.query_string.decode())["labelSelector"] == [SELECTOR]


def one_line_exit_2(capsys: pytest.CaptureFixture[str], rc: int) -> str:
    """The command's single stderr line, after checking it exited 2 with no traceback."""
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    assert line.startswith("hetfed status: ")
    return line


def test_status_answers_a_403_in_one_line(tmp_path: Path, httpserver: HTTPServer,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    forbidden = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
                 "message": 'pods is forbidden: User "dev" cannot list resource "pods" in the namespace "federation"'}
    httpserver.expect_request(PODS_PATH, method="GET").respond_with_json(forbidden, status=403)
    config = kubeconfig(tmp_path / "kc", httpserver.url_for("").rstrip("/"))
    line = one_line_exit_2(capsys, hetfed_main(["status", "--kubeconfig", str(config), "--release", "fl"]))
    assert "answered 403 Forbidden: pods is forbidden: User \"dev\" cannot list resource \"pods\"" in line


def test_status_answers_an_unreachable_api_server_in_one_line(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from tests.conftest import free_port

    url = f"http://127.0.0.1:{free_port()}"
    config = kubeconfig(tmp_path / "kc", url)
    line = one_line_exit_2(capsys, hetfed_main(["status", "--kubeconfig", str(config), "--release", "fl",
                                                "--aggregator", "127.0.0.1:1"]))
    assert line.startswith(f"hetfed status: cannot reach the Kubernetes API server at {url}: ")


def test_status_answers_a_bad_kubeconfig_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "kc"
    bad.write_text("apiVersion: v1\nkind: Config\ncurrent-context: nowhere\ncontexts: []\n")
    # Even with --aggregator: a kubeconfig that exists but is wrong is an error, not "outside a cluster".
    line = one_line_exit_2(capsys, hetfed_main(["status", "--kubeconfig", str(bad), "--aggregator", "127.0.0.1:1"]))
    assert line.startswith(f"hetfed status: cannot load kubeconfig {bad}: ") and "nowhere" in line


def test_status_merges_every_kubeconfig_path(tmp_path: Path, httpserver: HTTPServer,
                                             monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """As kubectl: the context in one file, its cluster and user in another; the first file's values win."""
    import json

    contexts = tmp_path / "contexts"
    contexts.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fed",
        "contexts": [{"name": "fed", "context": {"cluster": "lab", "user": "me", "namespace": "federation"}}]}))
    credentials = kubeconfig(tmp_path / "credentials", httpserver.url_for("").rstrip("/"), token="merged-token")
    text = json.loads(credentials.read_text())
    text["clusters"][0]["name"], text["users"][0]["name"] = "lab", "me"
    text["contexts"], text["current-context"] = [], "ignored-second"
    credentials.write_text(json.dumps(text))
    httpserver.expect_ordered_request(PODS_PATH, method="GET", query_string={"labelSelector": SELECTOR},
                                      headers={"Authorization": "Bearer merged-token"}).respond_with_json(release_pods())
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join([str(tmp_path / "missing"), str(contexts), str(credentials)]))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    rc = hetfed_main(["status", "--release", "fl", "--aggregator", "127.0.0.1:1", "--timeout", "1"])
    httpserver.check_assertions()
    assert rc == 1  # the pods were listed; only the (absent) aggregator did not answer
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["(aggregator)", "-"]


def test_the_selector_matches_the_charts_pods_under_name_overrides(helm: Any) -> None:
    """nameOverride and fullnameOverride change names and app.kubernetes.io/name; the selector still finds every
    pod of the release (and its aggregator Service)."""
    from hetfed.cli.k8s_status import selector

    objects = helm.objects(sets=("nameOverride=fed", "fullnameOverride=hospital-fl"))

    def matches(labels: dict[str, str], sel: str) -> bool:
        return all(labels.get(k) == v for k, v in (part.split("=") for part in sel.split(",")))

    templates = [o["spec"]["template"] for o in objects if o["kind"] in ("StatefulSet", "Job")]
    assert templates and all(t["metadata"]["labels"]["app.kubernetes.io/name"] == "fed" for t in templates)
    assert all(matches(t["metadata"]["labels"], selector("fl")) for t in templates)
    services = [o for o in objects if o["kind"] == "Service"
                and matches(o["metadata"].get("labels", {}), selector("fl", "aggregator"))]
    assert any(p.get("name") == "grpc" for s in services for p in s["spec"]["ports"])


def test_status_shows_the_epsilon_each_organization_declared() -> None:
    """An organization under DP shows the ε of its last accepted declaration; one without shows "-"."""
    from hetfed.cli.k8s_status import build_rows
    from hetfed.wire.messages import OrganizationStatus, RunStatus
    from hetfed.wire.phases import Phase

    run = RunStatus(run_id="demo", algorithm="fedavg", phase=Phase.TRAIN, round=2, total_rounds=3,
                    organizations=("a", "b"), organization_status=(
                        OrganizationStatus("a", True, 1, 10, 10, privacy_declared=True, privacy_epsilon=1.23456),
                        OrganizationStatus("b", True, 1, 10, 10)))
    rows = build_rows([], [run])
    assert [(r.organization, r.epsilon) for r in rows] == [("(aggregator)", "-"), ("a", "1.23"), ("b", "-")]


def test_status_shows_a_finished_run_at_its_last_round() -> None:
    """The run line under the table: a finished 3-round run (round 4 on the wire) reads round 3 of 3, finished."""
    from hetfed.cli.k8s_status import format_table
    from hetfed.wire.messages import RunStatus
    from hetfed.wire.phases import Phase

    run = RunStatus(run_id="demo", algorithm="fedavg", phase=Phase.FINISHED, round=4, total_rounds=3,
                    organizations=("a", "b"))
    assert format_table([], [run]).splitlines()[-1] == "run demo (fedavg): round 3 of 3, finished"
