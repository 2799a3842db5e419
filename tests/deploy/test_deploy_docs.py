"""docs/deploy.md describes every value of the chart's schema; the README's deployment commands match the repo."""

from __future__ import annotations

import json
import re

import yaml

from tests.conftest import REPO
from tests.deploy.conftest import CHART, EXAMPLE_VALUES, Helm, by_kind, validate_all

DOC = REPO / "docs" / "deploy.md"


def schema_paths() -> list[str]:
    """Every leaf value of values.schema.json as the docs name it (organizations[].tls.cert, runs[].id, ...)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    paths: list[str] = []

    def walk(node: dict, path: str) -> None:
        props = node.get("properties")
        if node.get("type") == "object" and props:
            for key, child in props.items():
                walk(child, f"{path}.{key}" if path else key)
        else:
            paths.append(path)

    for key, child in schema["properties"].items():
        if key == "organizations":
            paths.append(key)
            org = child["items"]["oneOf"][1]
            for k in ("name", "tls"):
                walk(org["properties"][k], f"organizations[].{k}")
        elif key == "runs":
            paths.append(key)
            for k, c in child["items"]["properties"].items():
                walk(c, f"runs[].{k}")
        else:
            walk(child, key)
    return paths


def test_every_schema_value_is_described_in_docs_deploy() -> None:
    """Each value has a table row `| \\`path\\` | default | meaning |` with a non-empty meaning."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| `([^`]+)` \| (.+?) \| (.+) \|$", line)
        if m:
            rows[m.group(1)] = m.group(3).strip()
    paths = schema_paths()
    assert len(paths) > 100
    missing = [p for p in paths if not rows.get(p)]
    assert missing == [], f"undocumented values: {missing}"
    stale = [r for r in rows if r not in paths]
    assert stale == [], f"documented values the schema does not have: {stale}"


def test_organization_overrides_cover_client_defaults() -> None:
    """An organization entry accepts exactly the clientDefaults keys plus name and tls (docs say so)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    org_keys = set(schema["properties"]["organizations"]["items"]["oneOf"][1]["properties"])
    assert org_keys == set(schema["properties"]["clientDefaults"]["properties"]) | {"name", "tls"}
    assert "other than `name` and `tls` overrides the same key of `clientDefaults`" in DOC.read_text()


def test_readme_example_values_render_and_validate(helm: Helm) -> None:
    """The three-hospital example: three GPU client Jobs over mTLS with existing Secrets, valid for 1.28-1.33."""
    values = yaml.safe_load(EXAMPLE_VALUES.read_text())
    objects = helm.objects(EXAMPLE_VALUES, release="fl", namespace="federation")
    validate_all(objects)
    jobs = by_kind(objects, "Job")
    assert sorted(j["metadata"]["labels"]["hetfed.io/organization"] for j in jobs) == [
        "hospital-a", "hospital-b", "hospital-c"]
    for job in jobs:
        (container,) = job["spec"]["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert by_kind(objects, "Secret") == []  # every certificate comes from an existing Secret
    readme = (REPO / "README.md").read_text()
    assert "## Deploy on Kubernetes" in readme
    assert "helm install fl helm/hetfed --namespace federation -f docs/examples/values-three-hospitals.yaml" in readme
    # The Secret names the README's loop creates are the ones the example values name.
    made = {f"hetfed-{p}-tls" for p in ("aggregator", "operator", "hospital-a", "hospital-b", "hospital-c")}
    named = {values["tls"]["aggregator"]["existingSecret"], values["tls"]["operator"]["existingSecret"]} | {
        o["tls"]["existingSecret"] for o in values["organizations"]}
    assert named == made
    # The aggregator name the README's certificate is made for is the one clients dial.
    cfg = next(c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"] == "fl-hetfed-hospital-a")
    assert 'aggregator = "fl-hetfed-aggregator.federation.svc:50051"' in cfg["data"]["mnist-head.toml"]
    assert "--aggregator-name fl-hetfed-aggregator.federation.svc" in readme


def test_the_chart_accepts_every_server_field_it_does_not_set_itself() -> None:
    """`aggregator.server` in the schema lists exactly the `[server]` fields the chart leaves to the user."""
    import dataclasses

    from hetfed.aggregator.config import ServerConfig

    schema = json.loads((CHART / "values.schema.json").read_text())
    offered = set(schema["properties"]["aggregator"]["properties"]["server"]["properties"])
    set_by_chart = {"listen", "metrics_port", "metrics_host", "health_listen", "state_dir", "tls"}
    assert offered == {f.name for f in dataclasses.fields(ServerConfig)} - set_by_chart
