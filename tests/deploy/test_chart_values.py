"""The chart refuses bad values with a clear message: schema errors, invalid or duplicate organizations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import CHART, Helm, HelmError, by_kind


def render_error(helm: Helm, tmp_path: Path, values: dict) -> str:
    """Helm's error for ``values`` (the test fails if the chart renders)."""
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(values))
    with pytest.raises(HelmError) as info:
        helm.template(f)
    return str(info.value)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"aggregator": {"persistance": {"enabled": False}}}, "Additional property persistance is not allowed"),
        ({"clientDefaults": {"resource": {}}}, "Additional property resource is not allowed"),
        ({"serviceMonitor": {"enabled": "yes"}}, "serviceMonitor.enabled: Invalid type. Expected: boolean"),
        ({"aggregator": {"service": {"grpcPort": "50051"}}}, "aggregator.service.grpcPort: Invalid type. Expected: integer"),
        ({"runs": [{"id": "demo", "algorithm": "fedavg", "rounds": 0}]}, "runs.0.rounds: Must be greater than or equal to 1"),
        ({"runs": [{"id": "demo", "algorithm": "fedavg", "round": 3}]}, "Additional property round is not allowed"),
        ({"clientDefaults": {"device": "gpu"}}, "clientDefaults.device: Does not match pattern"),
        ({"clientDefaults": {"dataVolume": {"type": "nfs"}}}, "clientDefaults.dataVolume.type: clientDefaults.dataVolume.type must be one of"),
        ({"organizations": [{"name": "a", "gpus": 1}]}, "organizations.0: Must validate one and only one schema"),
        ({"tls": {"enabled": True, "ca": 3}}, "tls.ca: Invalid type. Expected: string"),
        ({"unknownTopLevel": 1}, "Additional property unknownTopLevel is not allowed"),
    ],
    ids=["misspelled", "misspelled-client", "bool", "int", "range", "run-field", "pattern", "enum", "org-field",
         "tls-type", "top-level"],
)
def test_schema_rejects_misspelled_and_ill_typed_values(helm: Helm, tmp_path: Path, values: dict, expected: str) -> None:
    """values.schema.json names the offending value."""
    assert expected in render_error(helm, tmp_path, values)


def test_schema_allows_global(helm: Helm, tmp_path: Path) -> None:
    """`global` is allowed (the chart can be a subchart) even with additionalProperties false."""
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump({"global": {"imageRegistry": "registry.example.org"}}))
    assert by_kind([d for d in yaml.safe_load_all(helm.template(f)) if d], "StatefulSet")


def test_schema_is_closed_everywhere() -> None:
    """Every object in the schema with properties forbids unknown ones (except the free-form Kubernetes objects)."""
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node: dict, path: str) -> list[str]:
        open_ = []
        if node.get("type") == "object" and "properties" in node and node.get("additionalProperties") is not False:
            open_.append(path)
        for key, child in node.get("properties", {}).items():
            open_ += walk(child, f"{path}.{key}")
        for i, child in enumerate(node.get("items", {}).get("oneOf", [])):
            open_ += walk(child, f"{path}[{i}]")
        if isinstance(node.get("items"), dict):
            open_ += walk(node["items"], f"{path}[]")
        return open_

    assert walk(schema, "values") == []
    assert schema["additionalProperties"] is False and "global" in schema["properties"]


@pytest.mark.parametrize(
    ("organizations", "expected"),
    [
        (["hospital-a", "Hospital_B"], 'name "Hospital_B" must be a DNS-1123 label'),
        (["hospital-a", "lab-"], 'name "lab-" must be a DNS-1123 label'),
        (["hospital-a", "hospital-b", "hospital-a"], 'organizations[2]: name "hospital-a" is listed twice'),
        (["hospital-a", {"name": "hospital-a", "device": "cpu"}], 'name "hospital-a" is listed twice'),
        ([], "organizations: list at least one organization"),
    ],
    ids=["upper-and-underscore", "trailing-dash", "duplicate", "duplicate-object", "empty"],
)
def test_invalid_or_duplicate_organizations_fail_clearly(
    helm: Helm, tmp_path: Path, organizations: list, expected: str
) -> None:
    """_helpers.tpl fails with a message naming the organization (the schema cannot check uniqueness)."""
    err = render_error(helm, tmp_path, {"organizations": organizations})
    assert expected in err, err


def test_cross_value_checks_fail_clearly(helm: Helm, tmp_path: Path) -> None:
    """Runs naming unknown organizations, organizations in no run, mTLS without certificates, volumes without source."""
    cases = [
        ({"organizations": ["a", "b"], "runs": [{"id": "r", "algorithm": "fedavg", "organizations": ["a", "c"]}]},
         'runs[0] (r): organization "c" is not in organizations'),
        ({"organizations": ["a", "b"], "runs": [{"id": "r", "algorithm": "fedavg", "organizations": ["a"]}]},
         'organization "b" takes part in no run'),
        ({"organizations": ["a"], "runs": [{"id": "r", "algorithm": "fedavg"}, {"id": "r", "algorithm": "local"}]},
         'runs[1]: id "r" is used twice'),
        ({"tls": {"enabled": True}}, "tls.enabled: set tls.aggregator.existingSecret"),
        ({"tls": {"enabled": True, "aggregator": {"existingSecret": "s"}}}, 'organization "org-a" needs tls.existingSecret'),
        ({"tls": {"enabled": True, "aggregator": {"existingSecret": "s"}, "tests": None},
          "organizations": [{"name": "a", "tls": {"existingSecret": "x"}}]}, "the helm test calls Status as"),
        ({"tls": {"enabled": True, "aggregator": {"cert": "c", "key": "k"}, "operator": {"existingSecret": "o"}},
          "organizations": [{"name": "a", "tls": {"existingSecret": "x"}}]}, "tls.ca: the CA certificate"),
        ({"clientDefaults": {"dataVolume": {"type": "persistentVolumeClaim"}}}, "needs dataVolume.existingClaim"),
        ({"clientDefaults": {"data": {"dataset": "npz", "partition": "natural"}}}, "set dataVolume.type"),
    ]
    for values, expected in cases:
        values = {k: v for k, v in values.items() if v is not None}
        values.get("tls", {}).pop("tests", None)
        err = render_error(helm, tmp_path, values)
        assert expected in err, (values, err)


def test_long_names_stay_within_63_characters_and_distinct(helm: Helm) -> None:
    """Long release and organization names are cut with a hash: every name fits, two long ones stay distinct."""
    long_a = "a" * 60 + "-one"
    long_b = "a" * 60 + "-two"
    objects = [d for d in yaml.safe_load_all(helm.template(
        sets=(f"organizations={{{long_a[:63]},{long_b[:63]}}}",), release="r" * 53)) if d]
    names = [o["metadata"]["name"] for o in objects]
    assert all(len(n) <= 63 for n in names), names
    keys = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys))  # two long organizations' objects stay distinct
    assert len(by_kind(objects, "Job")) == 2 and len({j["metadata"]["name"] for j in by_kind(objects, "Job")}) == 2
    (sts,) = by_kind(objects, "StatefulSet")
    assert len(sts["metadata"]["name"]) <= 52  # + "-<10-char revision hash>" fits a label value


PRIVACY_NEEDS_STATE = ('organization "org-b": config.privacy needs stateVolume.enabled: the privacy ledger lives in the '
                       "client's state_dir, and on the pod's own disk a restarted pod would count ε from zero "
                       "(docs/privacy.md)")


@pytest.mark.parametrize("privacy", [{"epsilon_budget": 3.0}, {"target_epsilon": 2.0},
                                     {"noise_multiplier": 1.1, "ephemeral_ledger": True}],
                         ids=["budget", "target", "sigma-ephemeral"])
def test_an_organization_with_privacy_and_no_state_volume_is_refused(helm: Helm, tmp_path: Path,
                                                                     privacy: dict) -> None:
    """The ledger must outlive the pod (backoffLimit restarts it): the chart fails, naming the organization."""
    err = render_error(helm, tmp_path, {"organizations": ["org-a", {"name": "org-b", "config": {"privacy": privacy}}]})
    assert PRIVACY_NEEDS_STATE in err


def test_privacy_with_a_state_volume_renders_the_ledger_dir_and_the_run_limits(helm: Helm, tmp_path: Path) -> None:
    """With the state volume the client config carries state_dir and [privacy]; a run's privacy limits reach the
    aggregator's config. Privacy settings alone (clip_norm) switch nothing on, so need no volume."""
    import tomllib

    values = {
        "organizations": ["org-a", {"name": "org-b", "config": {"privacy": {"epsilon_budget": 3.0}},
                                    "stateVolume": {"enabled": True}}],
        "clientDefaults": {"config": {"privacy": {"clip_norm": 0.5}}},
        "runs": [{"id": "demo", "algorithm": "fedavg", "require_privacy": True, "refuse_ephemeral_ledgers": True,
                  "max_epsilon": 4.0}],
    }
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(values))
    objects = [d for d in yaml.safe_load_all(helm.template(f)) if d]
    cms = {c["metadata"]["name"]: c.get("data", {}) for c in by_kind(objects, "ConfigMap")}
    (org_b,) = [v for k, v in cms.items() if k.endswith("-org-b")]
    b = tomllib.loads(org_b["demo.toml"])
    assert b["state_dir"] == "/var/lib/hetfed-client" and b["privacy"] == {"epsilon_budget": 3.0, "clip_norm": 0.5}
    (org_a,) = [v for k, v in cms.items() if k.endswith("-org-a")]
    assert "state_dir" not in tomllib.loads(org_a["demo.toml"])
    (agg,) = [v for k, v in cms.items() if k.endswith("-aggregator")]
    (run,) = tomllib.loads(agg["aggregator.toml"])["runs"]
    assert (run["require_privacy"], run["refuse_ephemeral_ledgers"], run["max_epsilon"]) == (True, True, 4.0)


def test_a_runs_secure_aggregation_graph_reaches_the_aggregators_config(helm: Helm, tmp_path: Path) -> None:
    """runs[].secure_degree and secure_threshold pass the schema and reach the aggregator's run as given."""
    import tomllib

    values = {"organizations": ["org-a", "org-b", "org-c", "org-d", "org-e"],
              "runs": [{"id": "demo", "algorithm": "fedavg", "secure_aggregation": True, "secure_degree": 2,
                        "secure_threshold": 2}]}
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(values))
    objects = [d for d in yaml.safe_load_all(helm.template(f)) if d]
    cms = {c["metadata"]["name"]: c.get("data", {}) for c in by_kind(objects, "ConfigMap")}
    (agg,) = [v for k, v in cms.items() if k.endswith("-aggregator")]
    (run,) = tomllib.loads(agg["aggregator.toml"])["runs"]
    assert (run["secure_aggregation"], run["secure_degree"], run["secure_threshold"]) == (True, 2, 2)
