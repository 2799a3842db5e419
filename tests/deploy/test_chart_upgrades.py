"""Upgrades, images and the smaller operational values, with real Helm.

- A new chart version alone keeps every Job's name and every pod template (nothing restarts).
- An upgrade that would edit fields Kubernetes cannot change is refused with the chart's message. `lookup`
  answers only against a cluster (empty under `helm template`): these tests run `helm template
  --dry-run=server` against a local fake API server that holds the objects an earlier install made.
- Default images are the ones docker/build.sh tags; a registry value prefixes them.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from werkzeug.wrappers import Request, Response

from tests.conftest import REPO
from tests.deploy.conftest import CHART, CI_VALUES, EXAMPLE_VALUES, Helm, HelmError, by_kind, validate_all
from tests.deploy.k8s_fake import api_server, kubeconfig

# The resources the chart looks up, as the API server's discovery lists them.
RESOURCES = {
    "/apis/apps/v1": ("apps/v1", "statefulsets", "StatefulSet"),
    "/api/v1": ("v1", "persistentvolumeclaims", "PersistentVolumeClaim"),
}
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def pod_templates(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """Job name -> its pod template, plus the aggregator's pod template."""
    out = {j["metadata"]["name"]: j["spec"]["template"] for j in by_kind(objects, "Job")}
    for sts in by_kind(objects, "StatefulSet"):
        out[sts["metadata"]["name"]] = sts["spec"]["template"]
    return out


@pytest.mark.parametrize("values_file", [None, *CI_VALUES, EXAMPLE_VALUES],
                         ids=lambda p: p.stem if p else "defaults")
def test_a_new_chart_version_keeps_job_names_and_pod_templates(
    helm: Helm, chart_copy: Callable[[], Path], values_file: Path | None
) -> None:
    """The same values under chart 0.1.0 and 0.1.1: identical Job names and pod templates (labels moved on)."""
    bumped = chart_copy()
    chart_yaml = bumped / "Chart.yaml"
    text = chart_yaml.read_text()
    assert "\nversion: 0.1.0\n" in text
    chart_yaml.write_text(text.replace("\nversion: 0.1.0\n", "\nversion: 0.1.1\n"))
    files = (values_file,) if values_file else ()
    before = helm.objects(*files)
    after = helm.objects(*files, chart=bumped)
    assert pod_templates(before) == pod_templates(after)
    assert len(by_kind(before, "Job")) >= 2
    # The version did change where it may: the objects' own labels.
    (job,) = by_kind(after, "Job")[:1]
    assert job["metadata"]["labels"]["helm.sh/chart"] == "hetfed-0.1.1"
    assert "helm.sh/chart" not in job["spec"]["template"]["metadata"]["labels"]


def test_what_matters_to_one_organization_replaces_only_its_job(helm: Helm) -> None:
    """A change to one organization's values renames its Job alone; a run's rounds rename none."""
    base = {j["metadata"]["labels"]["hetfed.io/organization"]: j["metadata"]["name"]
            for j in by_kind(helm.objects(sets=("organizations={a,b}",)), "Job")}
    one = {j["metadata"]["labels"]["hetfed.io/organization"]: j["metadata"]["name"]
           for j in by_kind(helm.objects(sets=("organizations[0]=a", "organizations[1].name=b",
                                               "organizations[1].device=cpu")), "Job")}
    assert one["a"] == base["a"] and one["b"] != base["b"]


@contextmanager
def cluster(tmp_path: Path, live: list[dict[str, Any]]) -> Iterator[Path]:
    """A fake API server that holds ``live`` (what lookup finds) and answers 404 for anything else; its kubeconfig."""
    seen: list[str] = []
    by_path = {}
    for obj in live:
        base, (_, plural, _) = next((b, r) for b, r in RESOURCES.items() if r[2] == obj["kind"])
        by_path[f"{base}/namespaces/{obj['metadata']['namespace']}/{plural}/{obj['metadata']['name']}"] = obj

    def handle(request: Request) -> Response:
        seen.append(request.path)
        if request.path in RESOURCES:
            group_version, plural, kind = RESOURCES[request.path]
            body: dict[str, Any] = {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version,
                                    "resources": [{"name": plural, "singularName": kind.lower(), "namespaced": True,
                                                   "kind": kind, "verbs": ["get", "list"]}]}
        elif request.path in by_path:
            body = by_path[request.path]
        else:
            return Response(json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                        "reason": "NotFound", "code": 404}), status=404, content_type="application/json")
        return Response(json.dumps(body), content_type="application/json")

    tmp_path.mkdir(parents=True, exist_ok=True)
    with api_server(tmp_path) as (server, _):
        server.expect_request(re.compile(".*")).respond_with_handler(handle)
        yield kubeconfig(tmp_path / "kubeconfig", server.url_for("/").rstrip("/"))
    # The chart asked the API server for the objects it checks.
    assert any(p.startswith(("/apis/apps/v1/namespaces/", "/api/v1/namespaces/")) for p in seen), seen


def against(helm: Helm, kubeconfig_path: Path, sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """``helm template --dry-run=server`` against the fake cluster: lookup answers; the rendered objects."""
    out = helm.run("template", "fl", str(CHART), "--namespace", "federation", "--dry-run=server",
                   "--kubeconfig", str(kubeconfig_path), *(a for s in sets for a in ("--set", s)))
    return [d for d in yaml.safe_load_all(out) if d]


def installed(helm: Helm, kind: str, sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The objects of one kind as an install with ``sets`` made them (what lookup finds afterwards)."""
    return by_kind(helm.objects(sets=sets), kind)


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ((), ("aggregator.persistence.size=20Gi",),
         "aggregator.persistence.size: the StatefulSet fl-hetfed-aggregator keeps its state volume at 8Gi"),
        ((), ("aggregator.persistence.storageClass=fast",),
         'aggregator.persistence.storageClass: the StatefulSet fl-hetfed-aggregator keeps its state volume in class ""'),
        ((), ("aggregator.persistence.enabled=false",),
         "aggregator.persistence.enabled: the StatefulSet fl-hetfed-aggregator was installed with persistence.enabled=true"),
        (("aggregator.persistence.enabled=false",), (),
         "was installed with persistence.enabled=false"),
        ((), ("aggregator.persistence.accessModes={ReadWriteOncePod}",), "aggregator.persistence.accessModes"),
    ],
    ids=["size", "class", "disabled", "enabled", "access-modes"],
)
def test_an_upgrade_that_edits_the_state_volume_template_fails_clearly(
    helm: Helm, tmp_path: Path, before: tuple[str, ...], after: tuple[str, ...], expected: str
) -> None:
    """The StatefulSet's volumeClaimTemplates cannot change: the chart says which value and how to resize."""
    with cluster(tmp_path, installed(helm, "StatefulSet", before)) as kc, pytest.raises(HelmError) as info:
        against(helm, kc, after)
    assert expected in str(info.value)
    if "size" in expected or "class" in expected:
        assert "docs/deploy.md" in str(info.value)


def test_an_upgrade_that_keeps_the_volume_renders(helm: Helm, tmp_path: Path) -> None:
    """The same volume (sizes written alike or not) and other changes pass; the check reads the live object."""
    with cluster(tmp_path, installed(helm, "StatefulSet", ("aggregator.persistence.size=1Gi",))) as kc:
        for sets in [("aggregator.persistence.size=1024Mi",),
                     ("aggregator.persistence.size=1Gi", "runs[0].id=demo", "runs[0].algorithm=fedavg", "runs[0].rounds=9")]:
            assert by_kind(against(helm, kc, sets), "StatefulSet")
        with pytest.raises(HelmError, match="keeps its state volume at 1Gi"):
            against(helm, kc)  # the default 8Gi is not what is installed
    # No aggregator installed yet (a first install): nothing to compare, any size renders.
    with cluster(tmp_path / "empty", []) as kc:
        assert by_kind(against(helm, kc, ("aggregator.persistence.size=3Gi",)), "StatefulSet")


def test_an_organization_state_claim_may_grow_never_shrink_nor_change_class(helm: Helm, tmp_path: Path) -> None:
    """A state claim of 2Gi in class fast: 4Gi renders; 1Gi and class slow are refused with the claim's name."""
    on = ("clientDefaults.stateVolume.enabled=true", "clientDefaults.stateVolume.size=2Gi",
          "clientDefaults.stateVolume.storageClass=fast")
    claims = installed(helm, "PersistentVolumeClaim", on)
    assert sorted(c["metadata"]["name"] for c in claims) == ["fl-hetfed-org-a-state", "fl-hetfed-org-b-state"]
    with cluster(tmp_path, claims) as kc:
        grown = by_kind(against(helm, kc, (*on, "clientDefaults.stateVolume.size=4Gi")), "PersistentVolumeClaim")
        assert {c["spec"]["resources"]["requests"]["storage"] for c in grown} == {"4Gi"}
        with pytest.raises(HelmError, match=re.escape(
                'organization "org-a": stateVolume.size: the claim fl-hetfed-org-a-state holds 2Gi')):
            against(helm, kc, (*on, "clientDefaults.stateVolume.size=1Gi"))
        with pytest.raises(HelmError, match=re.escape(
                'stateVolume.storageClass: the claim fl-hetfed-org-a-state is in class "fast"')):
            against(helm, kc, (*on, "clientDefaults.stateVolume.storageClass=slow"))


def test_state_volume_claim_mount_and_config(helm: Helm) -> None:
    """A chart-made claim per organization (kept on uninstall), or an existing one; mounted; the state_dir."""
    objects = helm.objects(sets=("clientDefaults.stateVolume.enabled=true", "organizations[0]=a",
                                 "organizations[1].name=b", "organizations[1].stateVolume.existingClaim=b-state",
                                 "organizations[1].stateVolume.mountPath=/state"))
    validate_all(objects)
    (claim,) = by_kind(objects, "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "fl-hetfed-a-state"
    assert claim["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
    cms = {c["metadata"]["name"]: c["data"] for c in by_kind(objects, "ConfigMap")}
    for org, claim_name, mount in (("a", "fl-hetfed-a-state", "/var/lib/hetfed-client"), ("b", "b-state", "/state")):
        (job,) = [j for j in by_kind(objects, "Job") if j["metadata"]["labels"]["hetfed.io/organization"] == org]
        spec = job["spec"]["template"]["spec"]
        assert {"name": "state", "persistentVolumeClaim": {"claimName": claim_name}} in spec["volumes"]
        assert {"name": "state", "mountPath": mount} in spec["containers"][0]["volumeMounts"]
        assert tomllib.loads(cms[f"fl-hetfed-{org}"]["demo.toml"])["state_dir"] == mount
    off = helm.objects()
    assert by_kind(off, "PersistentVolumeClaim") == []
    assert all("state_dir" not in tomllib.loads(t) for c in by_kind(off, "ConfigMap") for t in c["data"].values()
               if c["metadata"]["name"].endswith(("org-a", "org-b")))
    kept = helm.objects(sets=("clientDefaults.stateVolume.enabled=true", "clientDefaults.stateVolume.keepOnUninstall=false"))
    assert all("annotations" not in c["metadata"] for c in by_kind(kept, "PersistentVolumeClaim"))


def test_default_images_are_what_docker_build_sh_tags(helm: Helm) -> None:
    """localhost/hetfed-{aggregator,client}:<version> by default; a registry value replaces localhost."""
    build = (REPO / "docker" / "build.sh").read_text()
    assert '-t "localhost/hetfed-aggregator:$version"' in build and '-t "localhost/hetfed-client:$version"' in build
    assert 'version=$(python3 -c \'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])\')' in build
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION

    def images(*sets: str) -> set[str]:
        objs = helm.objects(sets=sets)
        return {c["image"] for o in objs if o["kind"] in ("StatefulSet", "Job", "Pod")
                for c in (o["spec"] if o["kind"] == "Pod" else o["spec"]["template"]["spec"])["containers"]}

    assert images() == {f"localhost/hetfed-aggregator:{VERSION}", f"localhost/hetfed-client:{VERSION}"}
    assert images("global.imageRegistry=registry.example.org/fl") == {
        f"registry.example.org/fl/hetfed-aggregator:{VERSION}", f"registry.example.org/fl/hetfed-client:{VERSION}"}
    assert images("aggregator.image.registry=", "clientDefaults.image.registry=ghcr.io/acme",
                  "clientDefaults.image.tag=1.2") == {f"hetfed-aggregator:{VERSION}", "ghcr.io/acme/hetfed-client:1.2"}


def test_pdb_retention_policy_and_fs_group_change_policy(helm: Helm) -> None:
    """The aggregator's PodDisruptionBudget and claim retention come from values; pods chown only on mismatch."""
    objects = helm.objects()
    (pdb,) = by_kind(objects, "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 0, "selector": {"matchLabels": {
        "app.kubernetes.io/name": "hetfed", "app.kubernetes.io/instance": "fl", "app.kubernetes.io/component": "aggregator"}}}
    (sts,) = by_kind(objects, "StatefulSet")
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    for obj in [sts, *by_kind(objects, "Job")]:
        assert obj["spec"]["template"]["spec"]["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    changed = helm.objects(sets=("aggregator.persistence.retentionPolicy.whenDeleted=Delete",
                                 "aggregator.podDisruptionBudget.enabled=false"))
    assert by_kind(changed, "PodDisruptionBudget") == []
    assert by_kind(changed, "StatefulSet")[0]["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Delete"


def test_extra_volumes_mounts_and_init_containers_per_organization(helm: Helm, tmp_path: Path) -> None:
    """An organization stages its data with an init container into an extra volume its clients mount."""
    values = {
        "organizations": ["a", {"name": "b", "data": {"dataset": "npz", "partition": "natural", "path": "/staged"},
                                "extraVolumes": [{"name": "staged", "emptyDir": {}}],
                                "extraVolumeMounts": [{"name": "staged", "mountPath": "/staged", "readOnly": True}],
                                "initContainers": [{"name": "fetch", "image": "registry.example.org/fetch:1",
                                                    "args": ["s3://bucket/b", "/staged"],
                                                    "volumeMounts": [{"name": "staged", "mountPath": "/staged"}]}]}],
    }
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(values))
    objects = helm.objects(f)
    validate_all(objects)
    jobs = {j["metadata"]["labels"]["hetfed.io/organization"]: j["spec"]["template"]["spec"] for j in by_kind(objects, "Job")}
    assert "initContainers" not in jobs["a"]
    assert [c["name"] for c in jobs["b"]["initContainers"]] == ["fetch"]
    assert {"name": "staged", "emptyDir": {}} in jobs["b"]["volumes"]
    assert {"name": "staged", "mountPath": "/staged", "readOnly": True} in jobs["b"]["containers"][0]["volumeMounts"]


def test_network_policies_dns_cidrs_extra_egress_and_external_grpc(helm: Helm, tmp_path: Path) -> None:
    """DNS by namespace, ports and node-local CIDRs; one organization's extra egress; external gRPC by CIDR."""
    egress = [{"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"port": 443, "protocol": "TCP"}]}]
    values = {
        "organizations": [{"name": "a", "tls": {"existingSecret": "a-tls"}},
                          {"name": "b", "tls": {"existingSecret": "b-tls"}, "extraEgress": egress}],
        "networkPolicy": {"dns": {"cidrs": ["169.254.20.10/32"], "ports": [{"port": 5353, "protocol": "UDP"}]}},
        "aggregator": {"external": {"enabled": True, "type": "NodePort", "nodePort": 30051,
                                    "sourceRanges": ["198.51.100.0/24"]}},
        "tls": {"enabled": True, "aggregator": {"existingSecret": "agg"}, "operator": {"existingSecret": "op"}},
    }
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(values))
    objects = helm.objects(f)
    validate_all(objects)
    policies = {p["metadata"]["name"]: p["spec"] for p in by_kind(objects, "NetworkPolicy")}
    assert sorted(policies) == ["fl-hetfed-aggregator", "fl-hetfed-b-egress", "fl-hetfed-clients"]
    dns = policies["fl-hetfed-clients"]["egress"][1]
    assert dns == {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                           "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}},
                          {"ipBlock": {"cidr": "169.254.20.10/32"}}],
                   "ports": [{"port": 5353, "protocol": "UDP"}]}
    b = policies["fl-hetfed-b-egress"]
    assert b["podSelector"]["matchLabels"]["hetfed.io/organization"] == "b" and b["policyTypes"] == ["Egress"]
    assert b["egress"] == egress
    _, external_in, metrics_in = policies["fl-hetfed-aggregator"]["ingress"]
    assert external_in == {"from": [{"ipBlock": {"cidr": "198.51.100.0/24"}}], "ports": [{"port": "grpc", "protocol": "TCP"}]}
    assert metrics_in["from"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    (external,) = [s for s in by_kind(objects, "Service") if s["metadata"]["name"].endswith("-external")]
    assert external["spec"]["type"] == "NodePort" and external["spec"]["ports"][0]["nodePort"] == 30051
    assert "loadBalancerSourceRanges" not in external["spec"]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"aggregator": {"enabled": False}}, "aggregator.enabled is false: set aggregator.address"),
        ({"aggregator": {"enabled": False, "address": "agg.example.org"}}, "expected host:port"),
        ({"aggregator": {"enabled": False, "address": "agg.example.org:443"}}, "needs mTLS end to end"),
        ({"aggregator": {"external": {"enabled": True}}}, "needs mTLS end to end"),
        ({"aggregator": {"enabled": False, "address": "a:1"}, "clientDefaults": {"enabled": False}},
         "the release would deploy nothing"),
    ],
    ids=["no-address", "no-port", "plaintext-remote", "plaintext-external", "nothing"],
)
def test_cross_silo_values_fail_clearly(helm: Helm, tmp_path: Path, values: dict, expected: str) -> None:
    """An organization-only release needs the aggregator's host:port, and anything crossing clusters needs mTLS."""
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(values))
    with pytest.raises(HelmError) as info:
        helm.template(f)
    assert expected in str(info.value)


def test_a_renewed_chart_made_certificate_replaces_only_its_pods(helm: Helm, tmp_path: Path) -> None:
    """A new inline certificate for hospital-b changes its checksum/tls and Job name; hospital-a and the aggregator stay."""
    mtls = CHART / "ci" / "mtls-values.yaml"
    values = yaml.safe_load(mtls.read_text())
    values["organizations"][1]["tls"]["cert"] = values["organizations"][1]["tls"]["cert"].replace("hospital-b", "renewed")
    renewed = tmp_path / "renewed.yaml"
    renewed.write_text(yaml.safe_dump(values))

    def pods(objects: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
        out = {j["metadata"]["labels"]["hetfed.io/organization"]: (
            j["metadata"]["name"], j["spec"]["template"]["metadata"]["annotations"].get("checksum/tls", ""))
            for j in by_kind(objects, "Job")}
        (sts,) = by_kind(objects, "StatefulSet")
        out["aggregator"] = (sts["metadata"]["name"], json.dumps(sts["spec"]["template"], sort_keys=True))
        return out

    before, after = pods(helm.objects(mtls)), pods(helm.objects(renewed))
    assert before["hospital-a"] == after["hospital-a"] and before["aggregator"] == after["aggregator"]
    assert before["hospital-b"][0] != after["hospital-b"][0] and before["hospital-b"][1] != after["hospital-b"][1]
    assert before["hospital-a"][1] == ""  # an existing Secret: the kubelet updates its files in place
