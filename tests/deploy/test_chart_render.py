"""The chart with real Helm: lint, render every ci values file, validate for Kubernetes 1.28-1.33, inspect objects."""

from __future__ import annotations

import base64
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.conftest import (
    CHART,
    CI_VALUES,
    CRD_KINDS,
    EXAMPLE_VALUES,
    KUBERNETES_VERSIONS,
    Helm,
    by_kind,
    validate_all,
)

MONITORING = ("monitoring.coreos.com/v1",)


def values(name: str) -> Path:
    """A ci values file by stem."""
    return CHART / "ci" / f"{name}-values.yaml"


def jobs_by_org(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The client Jobs, keyed by their organization label."""
    return {j["metadata"]["labels"]["hetfed.io/organization"]: j for j in by_kind(objects, "Job")}


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of a StatefulSet, Job or Pod."""
    return obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]


def config_maps(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """ConfigMap name -> data."""
    return {c["metadata"]["name"]: c.get("data", {}) for c in by_kind(objects, "ConfigMap")}


def test_lint_strict_with_every_values_file(helm: Helm) -> None:
    """helm lint --strict passes with the defaults, each ci values file, the README's example and each cross-silo release."""
    helm.run("lint", "--strict", str(CHART))
    silo = EXAMPLE_VALUES.parent / "cross-silo"
    for files in [*([f] for f in CI_VALUES), [EXAMPLE_VALUES],
                  *([silo / "federation.yaml", silo / f"{part}.yaml"] for part in ("aggregator", "hospital-a", "hospital-b"))]:
        out = helm.run("lint", "--strict", str(CHART), *(a for f in files for a in ("-f", str(f))))
        assert "0 chart(s) failed" in out, out


@pytest.mark.parametrize("values_file", [*CI_VALUES, EXAMPLE_VALUES], ids=lambda p: p.stem)
def test_every_manifest_validates_for_kubernetes_1_28_to_1_33(helm: Helm, values_file: Path) -> None:
    """Every rendered object passes kubernetes-validate --strict for 1.28 through 1.33."""
    objects = helm.objects(values_file, api_versions=MONITORING)
    checked = validate_all(objects)
    assert checked == len(KUBERNETES_VERSIONS) * len([o for o in objects if o["kind"] not in CRD_KINDS])
    kinds = {o["kind"] for o in objects}
    assert {"StatefulSet", "Service", "ConfigMap", "Job", "NetworkPolicy", "Pod"} <= kinds


def test_one_job_per_organization_with_its_own_selector_label(helm: Helm) -> None:
    """Five organizations: five Jobs, each pod labelled with its organization, names within 63 characters."""
    objects = helm.objects(values("five-orgs-gpu"))
    jobs = jobs_by_org(objects)
    assert sorted(jobs) == ["hospital-a", "hospital-b", "hospital-c", "lab-d", "lab-e"]
    for org, job in jobs.items():
        labels = job["spec"]["template"]["metadata"]["labels"]
        assert labels["hetfed.io/organization"] == org
        assert labels["app.kubernetes.io/component"] == "client"
        assert labels["app.kubernetes.io/instance"] == "fl"
        assert len(job["metadata"]["name"]) <= 63
        assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
        # 2: a refusal no retry fixes; 3: the organization's privacy budget is spent (docs/privacy.md).
        assert job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [2, 3]
    # Two runs: organizations in both get one container per run, the others one.
    containers = {org: [c["name"] for c in pod_spec(j)["containers"]] for org, j in jobs.items()}
    assert containers == {"hospital-a": ["heads", "fedprox"], "hospital-b": ["heads"],
                          "hospital-c": ["heads"], "lab-d": ["heads"], "lab-e": ["heads", "fedprox"]}
    # Selectors never carry values that change between releases.
    sts = by_kind(objects, "StatefulSet")[0]
    assert sts["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "hetfed", "app.kubernetes.io/instance": "fl",
        "app.kubernetes.io/component": "aggregator",
    }


def test_gpu_limits_node_selectors_tolerations_and_data_volumes(helm: Helm) -> None:
    """GPU limits, node selectors and tolerations where asked, merged per organization; data volumes mounted."""
    jobs = jobs_by_org(helm.objects(values("five-orgs-gpu")))
    for org, job in jobs.items():
        spec = pod_spec(job)
        for c in spec["containers"]:
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert spec["runtimeClassName"] == "nvidia"
        expected_pool = {"node.kubernetes.io/pool": "lab-d-gpus"} if org == "lab-d" else {}
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true", **expected_pool}
    volumes = {org: {v["name"]: v for v in pod_spec(j)["volumes"]} for org, j in jobs.items()}
    assert volumes["hospital-c"]["data"]["persistentVolumeClaim"] == {"claimName": "hospital-c-data", "readOnly": True}
    assert volumes["lab-d"]["data"]["hostPath"] == {"path": "/srv/lab-d/hetfed", "type": "Directory"}
    assert "data" not in volumes["hospital-a"]
    mounts = {m["name"]: m for m in pod_spec(jobs["hospital-c"])["containers"][0]["volumeMounts"]}
    assert mounts["data"] == {"name": "data", "mountPath": "/data", "readOnly": True}
    # Nothing asks for a GPU on CPU-only values.
    cpu_jobs = jobs_by_org(helm.objects(values("two-orgs-cpu")))
    for job in cpu_jobs.values():
        for c in pod_spec(job)["containers"]:
            assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


def test_client_configs_are_rendered_per_organization_and_run(helm: Helm) -> None:
    """Each organization's TOML names it, its run, the aggregator's Service, its own partition and its model."""
    objects = helm.objects(values("five-orgs-gpu"))
    cms = config_maps(objects)
    a = tomllib.loads(cms["fl-hetfed-hospital-a"]["fedprox.toml"])
    assert a["organization"] == "hospital-a" and a["run"] == "fedprox"
    assert a["aggregator"] == "fl-hetfed-aggregator.federation.svc:50051"
    assert a["device"] == "cuda"
    assert a["data"]["num_clients"] == 2 and a["data"]["client_index"] == 0
    assert a["model"] == {"name": "lenet", "latent_dim": 64}
    b = tomllib.loads(cms["fl-hetfed-hospital-b"]["heads.toml"])
    assert b["model"] == {"name": "cnn", "latent_dim": 64}
    assert b["data"]["num_clients"] == 5 and b["data"]["client_index"] == 1
    c = tomllib.loads(cms["fl-hetfed-hospital-c"]["heads.toml"])
    assert c["data"]["dataset"] == "npz" and c["data"]["path"] == "/data"
    e = tomllib.loads(cms["fl-hetfed-lab-e"]["heads.toml"])
    assert e["metrics_port"] == -1
    agg = tomllib.loads(cms["fl-hetfed-aggregator"]["aggregator.toml"])
    runs = {r["id"]: r for r in agg["runs"]}
    assert runs["heads"]["organizations"] == ["hospital-a", "hospital-b", "hospital-c", "lab-d", "lab-e"]
    assert runs["heads"]["algorithm"] == "fedavg_head"
    assert runs["heads"]["min_clients"] == 3 and isinstance(runs["heads"]["rounds"], int)
    assert runs["heads"]["round_deadline_seconds"] == 900
    assert runs["fedprox"]["algorithm_config"] == {"mu": 0.01}
    assert agg["server"]["max_requests_per_second"] == 20
    assert agg["server"]["state_dir"] == "/var/lib/hetfed"


def test_aggregator_statefulset_pvc_probes_and_termination(helm: Helm) -> None:
    """StatefulSet with a PVC template for its state, gRPC probes on the plaintext health port, a long grace period."""
    objects = helm.objects(values("five-orgs-gpu"))
    (sts,) = by_kind(objects, "StatefulSet")
    assert sts["spec"]["replicas"] == 1
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "state"
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    spec = pod_spec(sts)
    (c,) = spec["containers"]
    assert {"name": "state", "mountPath": "/var/lib/hetfed"} in c["volumeMounts"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9090, "health": 8081}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == 8081
    assert c["readinessProbe"]["grpc"]["service"] == "hetfed.v1.Aggregator"
    assert spec["terminationGracePeriodSeconds"] > 2  # the aggregator drains for 2 s
    cfg = tomllib.loads(config_maps(objects)["fl-hetfed-aggregator"]["aggregator.toml"])
    assert cfg["server"]["health_listen"] == "0.0.0.0:8081"
    services = {s["metadata"]["name"]: s for s in by_kind(objects, "Service")}
    assert {p["name"] for p in services["fl-hetfed-aggregator"]["spec"]["ports"]} == {"grpc", "metrics"}
    assert services["fl-hetfed-aggregator-headless"]["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == "fl-hetfed-aggregator-headless"
    # Persistence off: an emptyDir and no claim template.
    (sts,) = by_kind(helm.objects(sets=("aggregator.persistence.enabled=false",)), "StatefulSet")
    assert "volumeClaimTemplates" not in sts["spec"]
    assert {"name": "state", "emptyDir": {}} in pod_spec(sts)["volumes"]


def test_checksum_annotations_follow_the_config(helm: Helm) -> None:
    """A changed run or client value changes the pods' checksum/config (and the Job's name): the pods roll."""
    base = helm.objects()
    more_rounds = helm.objects(sets=("runs[0].id=demo", "runs[0].algorithm=fedavg", "runs[0].rounds=4"))
    other_model = helm.objects(sets=("clientDefaults.model.name=mlp",))

    def sums(objs: list[dict[str, Any]]) -> tuple[str, dict[str, str], list[str]]:
        (sts,) = by_kind(objs, "StatefulSet")
        agg = sts["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        jobs = jobs_by_org(objs)
        clients = {o: j["spec"]["template"]["metadata"]["annotations"]["checksum/config"] for o, j in jobs.items()}
        return agg, clients, sorted(j["metadata"]["name"] for j in jobs.values())

    agg0, clients0, names0 = sums(base)
    agg1, clients1, names1 = sums(more_rounds)
    agg2, clients2, names2 = sums(other_model)
    assert len(agg0) == 64 and agg1 != agg0 and clients1 == clients0 and names1 == names0
    assert agg2 == agg0 and all(clients2[o] != clients0[o] for o in clients0) and set(names2).isdisjoint(names0)
    assert sums(helm.objects()) == (agg0, clients0, names0)  # deterministic


def test_security_contexts_numeric_non_root_read_only(helm: Helm) -> None:
    """Every pod runs as a numeric non-root user, every container read-only, unprivileged, without capabilities."""
    objects = helm.objects(values("mtls"))
    pods = [o for o in objects if o["kind"] in ("StatefulSet", "Job", "Pod")]
    assert len(pods) == 4  # aggregator, two clients, the helm test
    for obj in pods:
        spec = pod_spec(obj)
        sc = spec["securityContext"]
        assert sc["runAsNonRoot"] is True and isinstance(sc["runAsUser"], int) and sc["runAsUser"] > 0
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in spec["containers"]:
            csc = c["securityContext"]
            assert csc["readOnlyRootFilesystem"] is True
            assert csc["allowPrivilegeEscalation"] is False and csc["privileged"] is False
            assert csc["capabilities"] == {"drop": ["ALL"]}
            assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
        assert {"name": "tmp", "emptyDir": {}} in spec["volumes"]


def test_network_policies(helm: Helm) -> None:
    """Clients reach only the aggregator's gRPC port and DNS; the aggregator takes gRPC from clients, metrics from monitoring."""
    objects = helm.objects(values("servicemonitor"))
    policies = {p["metadata"]["name"]: p["spec"] for p in by_kind(objects, "NetworkPolicy")}
    clients = policies["fl-hetfed-clients"]
    assert clients["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "client"
    assert clients["policyTypes"] == ["Ingress", "Egress"]
    to_aggregator, to_dns = clients["egress"]
    assert to_aggregator["to"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "hetfed", "app.kubernetes.io/instance": "fl",
        "app.kubernetes.io/component": "aggregator"}}}]
    assert to_aggregator["ports"] == [{"port": 50051, "protocol": "TCP"}]
    assert to_dns["ports"] == [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                  "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    assert clients["ingress"] == [{"from": [monitoring], "ports": [{"port": 9091, "protocol": "TCP"}]}]
    agg = policies["fl-hetfed-aggregator"]
    assert agg["policyTypes"] == ["Ingress"]
    grpc_rule, metrics_rule = agg["ingress"]
    assert grpc_rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    (peer,) = grpc_rule["from"]
    assert peer["podSelector"]["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["client", "test"]}]
    assert metrics_rule == {"from": [monitoring], "ports": [{"port": "metrics", "protocol": "TCP"}]}
    assert by_kind(helm.objects(sets=("networkPolicy.enabled=false",)), "NetworkPolicy") == []


def test_mtls_secrets_mounts_and_config(helm: Helm) -> None:
    """Under mTLS: Secrets for inline certificates only, each pod mounts only its own, configs point at them."""
    objects = helm.objects(values("mtls"))
    secrets = {s["metadata"]["name"]: s for s in by_kind(objects, "Secret")}
    assert sorted(secrets) == ["fl-hetfed-hospital-b-tls", "fl-hetfed-operator-tls"]
    b = secrets["fl-hetfed-hospital-b-tls"]
    assert b["type"] == "kubernetes.io/tls"
    assert base64.b64decode(b["data"]["tls.crt"]).decode().startswith("-----BEGIN CERTIFICATE-----")
    assert set(b["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    jobs = jobs_by_org(objects)
    secret_of = {org: next(v["secret"]["secretName"] for v in pod_spec(j)["volumes"] if v["name"] == "tls")
                 for org, j in jobs.items()}
    assert secret_of == {"hospital-a": "hetfed-hospital-a-tls", "hospital-b": "fl-hetfed-hospital-b-tls"}
    (sts,) = by_kind(objects, "StatefulSet")
    assert {"name": "tls", "secret": {"secretName": "hetfed-aggregator-tls", "defaultMode": 0o440}} in pod_spec(sts)["volumes"]
    cms = config_maps(objects)
    agg = tomllib.loads(cms["fl-hetfed-aggregator"]["aggregator.toml"])
    assert agg["server"]["tls"] == {"cert": "/etc/hetfed/tls/tls.crt", "key": "/etc/hetfed/tls/tls.key",
                                    "ca": "/etc/hetfed/tls/ca.crt"}
    assert agg["server"]["operators"] == ["hetfed-operator"]
    client = tomllib.loads(cms["fl-hetfed-hospital-a"]["demo.toml"])
    assert client["tls"]["cert"] == "/etc/hetfed/tls/tls.crt"
    (test_pod,) = by_kind(objects, "Pod")
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    args = test_pod["spec"]["containers"][0]["args"]
    assert args[:3] == ["health", "fl-hetfed-aggregator.federation.svc:50051", "--status"]
    assert "--tls-cert=/etc/hetfed/tls/tls.crt" in args
    assert {"name": "tls", "secret": {"secretName": "fl-hetfed-operator-tls", "defaultMode": 0o440}} in test_pod["spec"]["volumes"]


def test_helm_test_pod_uses_the_aggregator_image(helm: Helm) -> None:
    """The helm test pod runs `hetfed health ... --status` from the aggregator image."""
    objects = helm.objects(values("five-orgs-gpu"))
    (pod,) = by_kind(objects, "Pod")
    (sts,) = by_kind(objects, "StatefulSet")
    assert pod["spec"]["containers"][0]["image"] == pod_spec(sts)["containers"][0]["image"] == \
        "registry.example.org/hetfed-aggregator:0.1.0"
    assert pod["spec"]["restartPolicy"] == "Never"


def test_events_rbac_and_service_account(helm: Helm) -> None:
    """The aggregator may create Events and nothing else; without Events no RBAC and no token."""
    objects = helm.objects()
    (role,) = by_kind(objects, "Role")
    assert role["rules"] == [{"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create"]}]
    (binding,) = by_kind(objects, "RoleBinding")
    (sa,) = by_kind(objects, "ServiceAccount")
    assert binding["subjects"][0]["name"] == sa["metadata"]["name"]
    (sts,) = by_kind(objects, "StatefulSet")
    spec = pod_spec(sts)
    assert spec["serviceAccountName"] == sa["metadata"]["name"] and spec["automountServiceAccountToken"] is True
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    for job in by_kind(objects, "Job"):
        assert pod_spec(job)["automountServiceAccountToken"] is False
    off = helm.objects(sets=("aggregator.events.enabled=false",))
    assert by_kind(off, "Role") == [] and by_kind(off, "RoleBinding") == []
    (sts,) = by_kind(off, "StatefulSet")
    assert pod_spec(sts)["automountServiceAccountToken"] is False


def test_service_monitor_needs_the_api_and_the_value(helm: Helm) -> None:
    """ServiceMonitor and PodMonitor only when monitoring.coreos.com/v1 exists and serviceMonitor.enabled."""
    with_api = helm.objects(values("servicemonitor"), api_versions=MONITORING)
    (sm,) = by_kind(with_api, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}]
    assert sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "aggregator"
    (pm,) = by_kind(with_api, "PodMonitor")
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics-0"]
    assert by_kind(helm.objects(values("servicemonitor")), "ServiceMonitor") == []
    assert by_kind(helm.objects(api_versions=MONITORING), "ServiceMonitor") == []
    # Scrape annotations on the pods either way.
    for obj in [*by_kind(with_api, "StatefulSet"), *by_kind(with_api, "Job")]:
        annotations = obj["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"


def test_default_values_render_a_demo_federation(helm: Helm) -> None:
    """With only organization names, the chart renders one run over all of them on mnist5k, each its own part."""
    objects = helm.objects(sets=("organizations={north,south,east}",))
    cms = config_maps(objects)
    agg = tomllib.loads(cms["fl-hetfed-aggregator"]["aggregator.toml"])
    (run,) = agg["runs"]
    assert run["organizations"] == ["north", "south", "east"] and run["algorithm"] == "fedavg"
    parts = []
    for i, org in enumerate(("north", "south", "east")):
        cfg = tomllib.loads(cms[f"fl-hetfed-{org}"][f"{run['id']}.toml"])
        assert cfg["data"]["dataset"] == "mnist5k" and cfg["data"]["num_clients"] == 3
        parts.append(cfg["data"]["client_index"])
        assert i == cfg["data"]["client_index"]
    assert sorted(parts) == [0, 1, 2]


def test_notes_name_the_release_objects(helm: Helm, chart_copy: Any) -> None:
    """NOTES.txt (rendered here through tpl in a chart copy: helm template skips it) names the real objects."""
    chart = chart_copy()
    (chart / "notes-src.txt").write_text((chart / "templates" / "NOTES.txt").read_text())
    (chart / "templates" / "zz-notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n  notes: |\n'
        '{{ tpl (.Files.Get "notes-src.txt") . | indent 4 }}\n')
    objects = helm.objects(values("mtls"), chart=chart, api_versions=MONITORING,
                           sets=("serviceMonitor.enabled=true",))
    notes = next(c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"] == "notes")["data"]["notes"]
    assert "aggregator  fl-hetfed-aggregator.federation.svc:50051 (mTLS)" in notes
    assert "clients     one Job per organization: hospital-a, hospital-b" in notes
    assert "logs -f statefulset/fl-hetfed-aggregator" in notes
    assert "hetfed status --namespace federation --release fl --tls-cert hetfed-operator.pem" in notes
    assert "kubectl --namespace federation wait --for=condition=complete job -l app.kubernetes.io/instance=fl," in notes
    assert "A ServiceMonitor (aggregator) and a PodMonitor (clients) are installed." in notes
