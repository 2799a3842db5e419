"""An organization's own model, data and image through the chart (real Helm): values, rendered TOML, pods.

One organization brings its encoder builder, its torch data factory on a PVC and its own client image; the
other points the built-in imagefolder at a directory on the node. The rendered client configs load with
hetfed's own loader; the schema and the chart refuse what cannot work, naming the value.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from hetfed.client.config import load_client_config
from tests.conftest import REPO
from tests.deploy.conftest import CHART, Helm, HelmError, by_kind, validate_all
from tests.deploy.test_chart_upgrades import against, cluster, installed

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
EXAMPLE = REPO / "docs" / "examples" / "values-own-code.yaml"

VALUES: dict[str, Any] = {
    "organizations": [
        {
            "name": "hospital-a",
            "image": {"registry": "registry.hospital-a.example", "repository": "hetfed-client-hospital-a",
                      "tag": "2024.1"},
            "model": {"builder": "hetfed_example.models:resnet", "latent_dim": 64},
            "data": {"dataset": "torch", "factory": "hetfed_example.data:fashion_folder",
                     "options": {"split_seed": "7", "classes": "0,1,2"}, "num_workers": 2, "pin_memory": False},
            "dataVolume": {"type": "persistentVolumeClaim", "existingClaim": "hospital-a-images",
                           "mountPath": "/data/fashion"},
            "outputVolume": {"enabled": True},
        },
        {
            "name": "lab-b",
            "model": {"name": "cnn"},
            "data": {"dataset": "imagefolder", "image_size": 28, "channels": 1, "mean": [0.5], "std": [0.25],
                     "verify_images": False, "num_workers": 1},
            "dataVolume": {"type": "hostPath", "hostPath": "/srv/lab-b/images"},
            "outputVolume": {"enabled": True, "existingClaim": "lab-b-models", "mountPath": "/models"},
        },
    ],
    "runs": [{"id": "own", "algorithm": "fedavg_head", "rounds": 5,
              "algorithm_config": {"local_epochs": 1, "lr": 0.01, "momentum": 0.9}}],
    # A default architecture the organizations override: a builder replaces the default name, not joins it.
    "clientDefaults": {"model": {"name": "lenet", "latent_dim": 32}, "device": "cpu"},
}


def write(tmp_path: Path, values: dict[str, Any], name: str = "values.yaml") -> Path:
    """``values`` as a YAML file."""
    f = tmp_path / name
    f.write_text(yaml.safe_dump(values))
    return f


def render(helm: Helm, tmp_path: Path, values: dict[str, Any] = VALUES) -> list[dict[str, Any]]:
    """The rendered objects for ``values``."""
    return helm.objects(write(tmp_path, values))


def job(objects: list[dict[str, Any]], org: str) -> dict[str, Any]:
    """One organization's client Job."""
    (j,) = [j for j in by_kind(objects, "Job") if j["metadata"]["labels"]["hetfed.io/organization"] == org]
    return j


def client_toml(objects: list[dict[str, Any]], org: str, run: str = "own") -> str:
    """One organization's rendered client config for one run (TOML text)."""
    (cm,) = [c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"] == f"fl-hetfed-{org}"]
    return str(cm["data"][f"{run}.toml"])


def render_error(helm: Helm, tmp_path: Path, values: dict[str, Any]) -> str:
    """Helm's error for ``values`` (the test fails if the chart renders)."""
    with pytest.raises(HelmError) as info:
        helm.template(write(tmp_path, values, "bad.yaml"))
    return str(info.value)


def test_own_builder_factory_and_image_render_into_toml_and_pod(helm: Helm, tmp_path: Path) -> None:
    """hospital-a: builder, torch factory with options on its PVC at its mount path, its image, its output claim."""
    objects = render(helm, tmp_path)
    validate_all(objects)
    cfg = tomllib.loads(client_toml(objects, "hospital-a"))
    assert cfg["model"] == {"builder": "hetfed_example.models:resnet", "latent_dim": 64}
    data = cfg["data"]
    assert data["dataset"] == "torch" and data["factory"] == "hetfed_example.data:fashion_folder"
    assert data["options"] == {"split_seed": "7", "classes": "0,1,2"}
    assert data["path"] == "/data/fashion"  # the data volume's mount path
    assert data["partition"] == "natural"  # the organization's own data, as it is
    assert (data["num_workers"], data["pin_memory"]) == (2, False)
    assert (data["num_clients"], data["client_index"]) == (2, 0)
    assert cfg["output_dir"] == "/var/lib/hetfed-output/own"
    spec = job(objects, "hospital-a")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["image"] == "registry.hospital-a.example/hetfed-client-hospital-a:2024.1"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["data"] == {"name": "data", "mountPath": "/data/fashion", "readOnly": True}
    assert mounts["output"] == {"name": "output", "mountPath": "/var/lib/hetfed-output"}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "hospital-a-images", "readOnly": True}
    assert volumes["output"]["persistentVolumeClaim"] == {"claimName": "fl-hetfed-hospital-a-output"}
    # The chart makes hospital-a's output claim (kept on uninstall); lab-b brings its own.
    (claim,) = by_kind(objects, "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "fl-hetfed-hospital-a-output"
    assert claim["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}


def test_imagefolder_renders_its_fields_and_the_mount_as_path(helm: Helm, tmp_path: Path) -> None:
    """lab-b: imagefolder on a hostPath at the default mount, the built-in cnn, the default image, its own claim."""
    objects = render(helm, tmp_path)
    cfg = tomllib.loads(client_toml(objects, "lab-b"))
    assert cfg["model"] == {"name": "cnn", "latent_dim": 32}
    data = cfg["data"]
    assert {k: data[k] for k in ("dataset", "path", "partition", "image_size", "channels", "mean", "std",
                                 "verify_images", "num_workers")} == {
        "dataset": "imagefolder", "path": "/data", "partition": "natural", "image_size": 28, "channels": 1,
        "mean": [0.5], "std": [0.25], "verify_images": False, "num_workers": 1}
    assert "factory" not in data and "options" not in data
    assert cfg["output_dir"] == "/models/own"
    spec = job(objects, "lab-b")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["image"] == f"localhost/hetfed-client:{VERSION}"
    assert {"name": "data", "mountPath": "/data", "readOnly": True} in container["volumeMounts"]
    assert {"name": "output", "mountPath": "/models"} in container["volumeMounts"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["data"]["hostPath"] == {"path": "/srv/lab-b/images", "type": "Directory"}
    assert volumes["output"]["persistentVolumeClaim"] == {"claimName": "lab-b-models"}


@pytest.mark.parametrize("org", ["hospital-a", "lab-b"])
def test_rendered_client_configs_load_with_hetfeds_loader(helm: Helm, tmp_path: Path, org: str) -> None:
    """The ConfigMap's TOML, written to a file, is a valid ClientConfig with the values' fields."""
    f = tmp_path / f"{org}.toml"
    f.write_text(client_toml(render(helm, tmp_path), org))
    cfg = load_client_config(f)
    assert cfg.organization == org and cfg.run == "own"
    if org == "hospital-a":
        assert cfg.model.builder == "hetfed_example.models:resnet" and cfg.model.name == ""
        assert cfg.data.dataset == "torch" and cfg.data.factory == "hetfed_example.data:fashion_folder"
        assert dict(cfg.data.options) == {"split_seed": "7", "classes": "0,1,2"}
        assert cfg.data.path == "/data/fashion" and cfg.data.num_workers == 2 and cfg.data.pin_memory is False
        assert cfg.output_dir == "/var/lib/hetfed-output/own"
    else:
        assert cfg.model.name == "cnn" and cfg.model.builder == ""
        assert cfg.data.dataset == "imagefolder" and cfg.data.path == "/data"
        assert (cfg.data.image_size, cfg.data.channels, tuple(cfg.data.mean), tuple(cfg.data.std)) == (
            28, 1, (0.5,), (0.25,))
        assert cfg.data.verify_images is False and cfg.output_dir == "/models/own"


def test_torch_without_a_data_volume_sets_no_path(helm: Helm, tmp_path: Path) -> None:
    """A factory that finds its data itself (an object store, a database): no volume, no path in the TOML."""
    values = {"organizations": [{"name": "a", "data": {"dataset": "torch", "factory": "pkg.data:make"}}]}
    cfg = tomllib.loads(client_toml(render(helm, tmp_path, values), "a", "demo"))
    assert cfg["data"]["dataset"] == "torch" and "path" not in cfg["data"]
    assert cfg["model"] == {"name": "lenet", "latent_dim": 0}  # neither name nor builder: lenet, as before
    assert "output_dir" not in cfg


def test_defaults_for_own_code_and_an_organization_on_another_data_set(helm: Helm, tmp_path: Path) -> None:
    """Builder and factory in clientDefaults; an organization on imagefolder drops the factory, one with a name the builder."""
    values = {
        "clientDefaults": {"model": {"builder": "pkg.models:net"},
                           "data": {"dataset": "torch", "factory": "pkg.data:make", "options": {"k": "v"}},
                           "dataVolume": {"type": "persistentVolumeClaim", "existingClaim": "shared"}},
        "organizations": ["a", {"name": "b", "model": {"name": "mlp"}, "data": {"dataset": "imagefolder"}}],
    }
    objects = render(helm, tmp_path, values)
    a = tomllib.loads(client_toml(objects, "a", "demo"))
    assert a["model"] == {"builder": "pkg.models:net", "latent_dim": 0}
    assert a["data"]["factory"] == "pkg.data:make" and a["data"]["path"] == "/data"
    b = tomllib.loads(client_toml(objects, "b", "demo"))
    assert b["model"] == {"name": "mlp", "latent_dim": 0}
    assert b["data"]["dataset"] == "imagefolder" and "factory" not in b["data"] and "options" not in b["data"]
    assert b["data"]["partition"] == "natural" and b["data"]["path"] == "/data"


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"clientDefaults": {"data": {"factroy": "pkg.data:make"}}}, "Additional property factroy is not allowed"),
        ({"clientDefaults": {"outputVolume": {"enable": True}}}, "Additional property enable is not allowed"),
        ({"organizations": [{"name": "a", "model": {"buildr": "pkg.models:net"}}]},
         "organizations.0: Must validate one and only one schema"),
        ({"clientDefaults": {"model": {"builder": "pkg.models.net"}}}, "clientDefaults.model.builder: Does not match pattern"),
        ({"clientDefaults": {"data": {"factory": "pkg/data.py:make"}}}, "clientDefaults.data.factory: Does not match pattern"),
        ({"clientDefaults": {"model": {"name": "cnn", "builder": "pkg.models:net"}}},
         "clientDefaults.model: Must not validate the schema (not)"),
        ({"organizations": [{"name": "a", "model": {"name": "cnn", "builder": "pkg.models:net"}}]},
         "organizations.0: Must validate one and only one schema"),
        ({"clientDefaults": {"data": {"options": {"limit": 100}}}}, "clientDefaults.data.options.limit: Invalid type"),
        ({"clientDefaults": {"data": {"channels": 2}}}, "clientDefaults.data.channels: clientDefaults.data.channels must be one of"),
        ({"clientDefaults": {"data": {"num_workers": -1}}}, "clientDefaults.data.num_workers: Must be greater than or equal to 0"),
    ],
    ids=["misspelled-data-key", "misspelled-output-key", "misspelled-org-model-key", "builder-without-colon",
         "factory-a-path", "name-and-builder", "org-name-and-builder", "option-not-a-string", "channels", "workers"],
)
def test_schema_rejects_bad_own_code_values(helm: Helm, tmp_path: Path, values: dict[str, Any], expected: str) -> None:
    """values.schema.json names the offending value."""
    err = render_error(helm, tmp_path, values)
    assert expected in err, err


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"clientDefaults": {"data": {"dataset": "torch"}}}, 'organization "org-a": data.dataset torch needs data.factory'),
        ({"clientDefaults": {"data": {"dataset": "imagefolder"}}},
         'organization "org-a": data.dataset imagefolder reads the organization\'s own files: set dataVolume.type'),
        ({"clientDefaults": {"data": {"factory": "pkg.data:make"}}},
         "data.factory and data.options are only used with data.dataset torch, got dataset mnist5k"),
    ],
    ids=["torch-without-factory", "imagefolder-without-volume", "factory-without-torch"],
)
def test_chart_refuses_own_data_it_cannot_run(helm: Helm, tmp_path: Path, values: dict[str, Any], expected: str) -> None:
    """Checks across merged values (the schema sees clientDefaults and each organization apart) fail clearly."""
    err = render_error(helm, tmp_path, values)
    assert expected in err, err


def test_an_output_claim_may_grow_never_shrink(helm: Helm, tmp_path: Path) -> None:
    """Like the state claim: an installed 2Gi output claim may grow to 4Gi; 1Gi is refused naming the claim."""
    on = ("clientDefaults.outputVolume.enabled=true", "clientDefaults.outputVolume.size=2Gi")
    claims = installed(helm, "PersistentVolumeClaim", on)
    assert sorted(c["metadata"]["name"] for c in claims) == ["fl-hetfed-org-a-output", "fl-hetfed-org-b-output"]
    with cluster(tmp_path, claims) as kc:
        grown = by_kind(against(helm, kc, (*on, "clientDefaults.outputVolume.size=4Gi")), "PersistentVolumeClaim")
        assert {c["spec"]["resources"]["requests"]["storage"] for c in grown} == {"4Gi"}
        with pytest.raises(HelmError, match=re.escape(
                'organization "org-a": outputVolume.size: the claim fl-hetfed-org-a-output holds 2Gi')):
            against(helm, kc, (*on, "clientDefaults.outputVolume.size=1Gi"))


def test_docs_example_values_render_validate_and_load(helm: Helm, tmp_path: Path) -> None:
    """docs/examples/values-own-code.yaml renders, validates for Kubernetes 1.28-1.33 and its configs load."""
    objects = helm.objects(EXAMPLE)
    validate_all(objects)
    assert helm.run("lint", "--strict", str(CHART), "-f", str(EXAMPLE)).count("0 chart(s) failed") == 1
    for cm in by_kind(objects, "ConfigMap"):
        if cm["metadata"]["labels"].get("app.kubernetes.io/component") != "client":
            continue
        for name, text in cm["data"].items():
            f = tmp_path / f"{cm['metadata']['name']}-{name}"
            f.write_text(text)
            load_client_config(f)
    images = {c["image"] for j in by_kind(objects, "Job") for c in j["spec"]["template"]["spec"]["containers"]}
    assert any("hetfed-client-example" in i for i in images), images
