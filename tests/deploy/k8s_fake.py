"""A local HTTP(S) server that plays the Kubernetes API server for the real ``kubernetes`` client."""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pytest_httpserver import HTTPServer

from hetfed.cli.certs import make_federation_certs


@contextmanager
def api_server(tmp_path: Path, *, tls: bool = False) -> Iterator[tuple[HTTPServer, Path | None]]:
    """A started server on 127.0.0.1 (HTTPS with a fresh CA when ``tls``); yields it and the CA file."""
    ca: Path | None = None
    context = None
    if tls:
        certs = make_federation_certs(tmp_path / "apiserver-certs", ["unused"], aggregator_names=["127.0.0.1"])
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(certs.aggregator), str(certs.aggregator_key))
        ca = certs.ca
    server = HTTPServer(host="127.0.0.1", port=0, ssl_context=context)
    server.start()
    try:
        yield server, ca
    finally:
        server.clear()
        if server.is_running():
            server.stop()


def service_account(directory: Path, ca: Path, namespace: str = "federation", token: str = "sa-token") -> Path:
    """A service-account directory as kubelet mounts it: token, ca.crt, namespace."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "token").write_text(token)
    (directory / "ca.crt").write_bytes(ca.read_bytes())
    (directory / "namespace").write_text(namespace)
    return directory


def kubeconfig(path: Path, server: str, namespace: str = "federation", token: str = "user-token") -> Path:
    """A kubeconfig with one context pointing at ``server`` with a bearer token."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server}}],
        "users": [{"name": "test", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": namespace}}],
    }))
    return path


def pod(name: str, *, component: str, organization: str = "", phase: str = "Running", node: str = "node-1",
        gpus: int = 0, restarts: int = 0, created: str = "2026-01-01T00:00:00Z", waiting: str = "",
        release: str = "fl") -> dict[str, Any]:
    """A Pod as the API server returns it, with the chart's labels."""
    labels = {"app.kubernetes.io/name": "hetfed", "app.kubernetes.io/instance": release,
              "app.kubernetes.io/part-of": "hetfed", "app.kubernetes.io/component": component}
    if organization:
        labels["hetfed.io/organization"] = organization
    resources = {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}
    state = {"waiting": {"reason": waiting}} if waiting else {"running": {"startedAt": created}}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "federation", "labels": labels, "creationTimestamp": created},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "hetfed", "resources": resources}]},
        "status": {"phase": phase, "containerStatuses": [{
            "name": "c", "image": "hetfed", "imageID": "", "ready": phase == "Running", "restartCount": restarts,
            "state": state}]},
    }


def pod_list(*pods: dict[str, Any]) -> dict[str, Any]:
    """A PodList."""
    return {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": list(pods)}
