"""``hetfed status``: a release's pods (from the Kubernetes API) joined with the aggregator's ``Status``.

Pods are found by labels the chart sets whatever ``nameOverride`` or ``fullnameOverride`` say
(``app.kubernetes.io/part-of=hetfed``, ``app.kubernetes.io/instance=<release>``); the aggregator's address is its Service's DNS name (inside the cluster) or ``--aggregator``
(outside, after ``kubectl port-forward``). One row per organization and run: the newest pod's phase,
node, GPUs and restarts beside the organization's last accepted round and its bytes up and down. Inside
a pod the in-cluster configuration is used, elsewhere a kubeconfig; without either, the table is built
from the aggregator alone (with ``--aggregator``) after a clear message. Every ``KUBECONFIG`` path is merged
as kubectl does. A kubeconfig that cannot be loaded, an API server that refuses (403) or cannot be reached
ends the command with one line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetfed.cli.health import add_tls_arguments, progress, tls_from_args

if TYPE_CHECKING:  # the gRPC layer loads when the command runs, not when `hetfed` builds its parser
    from hetfed.wire.messages import RunStatus
    from hetfed.wire.transport import TlsConfig

SERVICEACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
NAME_LABEL = "app.kubernetes.io/name"
# Set by the chart on every object and pod, whatever nameOverride/fullnameOverride (app.kubernetes.io/name follows
# nameOverride, so it cannot select a release installed with one).
PART_OF_LABEL = "app.kubernetes.io/part-of"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
ORGANIZATION_LABEL = "hetfed.io/organization"
GPU_RESOURCE = "nvidia.com/gpu"
# Seconds (connect, read) for each API request.
REQUEST_TIMEOUT = (10.0, 30.0)


class KubernetesUnavailableError(RuntimeError):
    """No in-cluster configuration and no kubeconfig, or no kubernetes package."""


class KubernetesFailedError(RuntimeError):
    """A kubeconfig that cannot be loaded, or an API server that refused or could not be reached."""


@dataclass(frozen=True)
class PodInfo:
    """What the table shows of one organization's (or the aggregator's) pods."""

    name: str
    component: str
    organization: str
    phase: str
    node: str
    gpus: int
    restarts: int
    created: str = ""


@dataclass
class Row:
    """One line of the table."""

    organization: str
    run: str = "-"
    pod: str = "-"
    phase: str = "-"
    node: str = "-"
    gpus: str = "-"
    restarts: str = "-"
    joined: str = "-"
    last_round: str = "-"
    bytes_up: str = "-"
    bytes_down: str = "-"
    # The ε its last accepted update declared (differential privacy, docs/privacy.md); "-" without.
    epsilon: str = "-"


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``hetfed status``."""
    p = subparsers.add_parser(
        "status",
        help="a Kubernetes release's pods joined with the aggregator's Status, one row per organization",
        description="Finds the release's aggregator and client pods by label (in-cluster config inside a pod, "
        "a kubeconfig outside), calls the aggregator's Status, and prints one table: phase, node, GPUs and "
        "restarts of each organization's pod beside its last accepted round and bytes up and down.",
    )
    p.add_argument("--release", help="Helm release name (default: the only hetfed release in the namespace)")
    p.add_argument("--namespace", "-n", help="namespace (default: the pod's, or the kubeconfig context's)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    p.add_argument("--context", help="kubeconfig context (default: the current one)")
    p.add_argument("--aggregator", help="host:port of the aggregator's gRPC port (default: its Service's DNS name; "
                   "outside the cluster use kubectl port-forward and localhost:PORT)")
    add_tls_arguments(p)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each answer (default 10)")
    p.set_defaults(func=main)


# ---------------------------------------------------------------------------------------------- Kubernetes
def in_cluster(environ: Mapping[str, str] | None = None, serviceaccount_dir: Path = SERVICEACCOUNT_DIR) -> bool:
    """True inside a pod: the API server's address in the environment and a service-account token mounted."""
    env = os.environ if environ is None else environ
    return bool(env.get("KUBERNETES_SERVICE_HOST")) and (serviceaccount_dir / "token").is_file()


def kubernetes_client(
    kubeconfig: str | None = None,
    context: str | None = None,
    namespace: str | None = None,
    environ: Mapping[str, str] | None = None,
    serviceaccount_dir: Path = SERVICEACCOUNT_DIR,
) -> tuple[Any, str]:
    """(ApiClient, namespace): in-cluster inside a pod (unless a kubeconfig is named), else from a kubeconfig."""
    env = os.environ if environ is None else environ
    try:
        from kubernetes import client
        from kubernetes.config import kube_config
        from kubernetes.config.incluster_config import InClusterConfigLoader
    except ImportError as exc:
        raise KubernetesUnavailableError(
            f"the kubernetes package is not installed ({exc}): pip install 'hetfed[kubernetes]'"
        ) from None
    configuration = client.Configuration()
    configuration.retries = 0  # an unreachable server is reported at once, not after urllib3's retries
    if kubeconfig is None and in_cluster(env, serviceaccount_dir):
        InClusterConfigLoader(
            str(serviceaccount_dir / "token"), str(serviceaccount_dir / "ca.crt"), environ=env
        ).load_and_set(configuration)
        ns_file = serviceaccount_dir / "namespace"
        return client.ApiClient(configuration), namespace or (ns_file.read_text().strip() if ns_file.is_file()
                                                              else "default")
    paths = kubeconfig_paths(kubeconfig, env)
    found = [p for p in paths if Path(p).is_file()]
    if not found:
        raise KubernetesUnavailableError(
            f"not inside a cluster and no kubeconfig at {os.pathsep.join(paths)}: pass --kubeconfig, set KUBECONFIG, "
            "or run inside the cluster"
        )
    path = os.pathsep.join(found)
    try:
        merged = merge_kubeconfigs(found)
        kube_config.load_kube_config_from_dict(merged, context=context, client_configuration=configuration,
                                               persist_config=False)
    except Exception as exc:
        raise KubernetesFailedError(f"cannot load kubeconfig {path}: {' '.join(str(exc).split())}") from None
    contexts = merged.get("contexts") or []
    active = next((c for c in contexts if c.get("name") == merged.get("current-context")), None)
    chosen = next((c for c in contexts if c.get("name") == context), active) if context else active
    ns = namespace or (chosen or {}).get("context", {}).get("namespace") or "default"
    return client.ApiClient(configuration), ns


def kubeconfig_paths(kubeconfig: str | None, environ: Mapping[str, str]) -> list[str]:
    """The kubeconfig files to merge: ``--kubeconfig``, else every ``KUBECONFIG`` path, else ~/.kube/config."""
    if kubeconfig:
        return [kubeconfig]
    paths = [p for p in environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    return paths or [str(Path.home() / ".kube" / "config")]


# Kubeconfig fields that name files, resolved against the directory of the file that holds them.
_FILE_FIELDS = {"clusters": ("certificate-authority",), "users": ("client-certificate", "client-key", "tokenFile")}


def merge_kubeconfigs(paths: Sequence[str]) -> dict[str, Any]:
    """The kubeconfig files merged as kubectl merges KUBECONFIG: the first file to set a value, or to name a
    cluster, context or user, wins; relative file names are resolved against their own file's directory."""
    import yaml

    merged: dict[str, Any] = {"clusters": [], "contexts": [], "users": []}
    for path in paths:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is None:
            continue
        if not isinstance(loaded, dict):
            raise ValueError(f"{path} is not a kubeconfig mapping")
        base = Path(path).resolve().parent
        for key, value in loaded.items():
            if key in merged and isinstance(merged[key], list):
                names = {item.get("name") for item in merged[key]}
                for item in value or []:
                    if item.get("name") in names:
                        continue
                    entry = dict(item)
                    section = key if key in _FILE_FIELDS else ""
                    inner = dict(entry.get(key[:-1], {}) or {})
                    for field in _FILE_FIELDS.get(section, ()):
                        if inner.get(field) and not Path(inner[field]).is_absolute():
                            inner[field] = str(base / inner[field])
                    if inner:
                        entry[key[:-1]] = inner
                    merged[key].append(entry)
            elif key not in merged and value not in (None, ""):
                merged[key] = value
    return merged


def api_failure(exc: BaseException, api: Any) -> str:
    """One line for a failed API request: the status and message the server gave, or why it was not reached."""
    host = getattr(getattr(api, "configuration", None), "host", "the API server")
    status = getattr(exc, "status", None)
    if status:  # kubernetes.client.ApiException: the server answered
        reason = getattr(exc, "reason", "") or ""
        message = ""
        body = getattr(exc, "body", None)
        if body:
            try:
                import json

                answer = json.loads(body)  # a metav1.Status: its reason and message
                message = str(answer.get("message", ""))
                reason = str(answer.get("reason") or reason)
            except (ValueError, AttributeError):
                message = str(body)[:200]
        return f"the Kubernetes API server at {host} answered {status} {reason}" + (f": {message}" if message else "")
    return f"cannot reach the Kubernetes API server at {host}: {' '.join(str(exc).split())[:300]}"


def selector(release: str | None, component: str | None = None) -> str:
    """The chart's label selector for a release (every release of hetfed when None)."""
    parts = [f"{PART_OF_LABEL}=hetfed"]
    if release:
        parts.append(f"{INSTANCE_LABEL}={release}")
    if component:
        parts.append(f"{COMPONENT_LABEL}={component}")
    return ",".join(parts)


def _pod_info(pod: Any) -> PodInfo:
    labels = pod.metadata.labels or {}
    phase = pod.status.phase or "Unknown"
    waiting = [
        s.state.waiting.reason for s in (pod.status.container_statuses or [])
        if s.state and s.state.waiting and s.state.waiting.reason
    ]
    if waiting:
        phase = f"{phase} ({waiting[0]})"
    gpus = 0
    for c in pod.spec.containers:
        limits = (c.resources.limits if c.resources else None) or {}
        gpus += int(str(limits.get(GPU_RESOURCE, "0")))
    restarts = sum(s.restart_count or 0 for s in (pod.status.container_statuses or []))
    created = pod.metadata.creation_timestamp
    return PodInfo(
        name=pod.metadata.name, component=labels.get(COMPONENT_LABEL, ""),
        organization=labels.get(ORGANIZATION_LABEL, ""), phase=phase, node=pod.spec.node_name or "-",
        gpus=gpus, restarts=restarts, created=created.isoformat() if created else "",
    )


def list_pods(api: Any, namespace: str, release: str | None) -> list[PodInfo]:
    """The release's pods (one request, by label selector)."""
    from kubernetes import client

    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector(release),
                                                     _request_timeout=REQUEST_TIMEOUT)
    infos = [_pod_info(p) for p in pods.items]
    releases = {((p.metadata.labels if p.metadata else None) or {}).get(INSTANCE_LABEL, "") for p in pods.items}
    if release is None and len(releases) > 1:
        raise SystemExit(f"hetfed status: several hetfed releases in namespace {namespace} "
                         f"({', '.join(sorted(releases))}): pass --release")
    return infos


def aggregator_address(api: Any, namespace: str, release: str | None) -> str:
    """``<service>.<namespace>.svc:<grpc port>`` of the release's aggregator Service."""
    from kubernetes import client

    services = client.CoreV1Api(api).list_namespaced_service(
        namespace, label_selector=selector(release, "aggregator"), _request_timeout=REQUEST_TIMEOUT
    )
    for svc in services.items:
        if svc.spec is None or svc.metadata is None or svc.spec.cluster_ip == "None":  # headless: the StatefulSet's
            continue
        for port in svc.spec.ports or []:
            if port.name == "grpc":
                return f"{svc.metadata.name}.{namespace}.svc:{port.port}"
    raise SystemExit(f"hetfed status: no aggregator Service with a grpc port matches {selector(release, 'aggregator')} "
                     f"in namespace {namespace}")


# ---------------------------------------------------------------------------------------------- the table
def fetch_status(address: str, tls: TlsConfig | None, timeout: float) -> list[RunStatus]:
    """The aggregator's Status of every run."""
    from hetfed.wire.rpc import status_of

    return status_of(address, tls, timeout=timeout)


def format_bytes(n: int) -> str:
    """Bytes in decimal units: 950 B, 1.23 MB."""
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{n} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1000
    return f"{n} B"


def _newest(pods: Sequence[PodInfo]) -> tuple[PodInfo, int]:
    """The newest pod and the retries it stands for (older pods of a Job plus container restarts)."""
    newest = max(pods, key=lambda p: (p.created, p.name))
    return newest, sum(p.restarts for p in pods) + len(pods) - 1


def build_rows(pods: Sequence[PodInfo], status: list[RunStatus] | None) -> list[Row]:
    """The aggregator's row, then one row per (organization, run) in the runs' order, then pods no run knows."""
    rows: list[Row] = []

    def with_pod(row: Row, group: Sequence[PodInfo]) -> Row:
        if group:
            pod, restarts = _newest(group)
            row.pod, row.phase, row.node = pod.name, pod.phase, pod.node
            row.gpus, row.restarts = str(pod.gpus), str(restarts)
        return row

    rows.append(with_pod(Row("(aggregator)"), [p for p in pods if p.component == "aggregator"]))
    by_org: dict[str, list[PodInfo]] = {}
    for p in pods:
        if p.component == "client":
            by_org.setdefault(p.organization, []).append(p)
    seen: set[str] = set()
    for run in status or []:
        for org in run.organization_status:
            row = with_pod(Row(org.organization, run.run_id), by_org.get(org.organization, []))
            row.joined = "yes" if org.joined else "no"
            row.last_round = str(org.last_round_pushed) if org.last_round_pushed >= 0 else "-"
            row.bytes_up, row.bytes_down = format_bytes(org.bytes_up), format_bytes(org.bytes_down)
            if org.privacy_declared:
                row.epsilon = f"{org.privacy_epsilon:.3g}"
            rows.append(row)
            seen.add(org.organization)
    for name, group in sorted(by_org.items()):
        if name not in seen:
            rows.append(with_pod(Row(name), group))
    return rows


HEADER = ("ORGANIZATION", "RUN", "POD", "PHASE", "NODE", "GPU", "RESTARTS", "JOINED", "LAST ROUND",
          "BYTES UP", "BYTES DOWN", "ε")


def format_table(rows: Sequence[Row], status: list[RunStatus] | None) -> str:
    """The table, then one line per run (state and round)."""
    cells = [HEADER] + [
        (r.organization, r.run, r.pod, r.phase, r.node, r.gpus, r.restarts, r.joined, r.last_round,
         r.bytes_up, r.bytes_down, r.epsilon)
        for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    if status is not None:
        lines.append("")
        for run in status:
            if run.refused_reason:
                lines.append(f"run {run.run_id} ({run.algorithm}): REFUSED: {run.refused_reason}")
                continue
            lines.append(f"run {run.run_id} ({run.algorithm}): {progress(run)}")
            for r in run.refused:
                lines.append(f"  organization {r.organization} refused for good ({r.reason}): {r.message}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run ``hetfed status``."""
    from hetfed.wire.rpc import RemoteError

    tls = tls_from_args(args)
    pods: list[PodInfo] = []
    address = args.aggregator
    try:
        api, namespace = kubernetes_client(args.kubeconfig, args.context, args.namespace)
    except KubernetesFailedError as exc:
        print(f"hetfed status: {exc}", file=sys.stderr)
        return 2
    except KubernetesUnavailableError as exc:
        if not address:
            print(f"hetfed status: {exc}", file=sys.stderr)
            return 2
        print(f"hetfed status: {exc}; showing the aggregator's Status only", file=sys.stderr)
    else:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            pods = list_pods(api, namespace, args.release)
            if not pods:
                print(f"hetfed status: no pods match {selector(args.release)} in namespace {namespace}",
                      file=sys.stderr)
            if not address:
                address = aggregator_address(api, namespace, args.release)
        except (ApiException, HTTPError, OSError) as exc:
            print(f"hetfed status: {api_failure(exc, api)}", file=sys.stderr)
            return 2
    status = None
    try:
        status = fetch_status(address, tls, args.timeout)
    except RemoteError as err:
        print(f"hetfed status: the aggregator at {address} did not answer Status: {err}", file=sys.stderr)
    print(format_table(build_rows(pods, status), status))
    return 0 if status is not None else 1
