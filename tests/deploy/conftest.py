"""Fixtures of the deployment tests: the real Helm binary, rendering the chart, validating manifests."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

CHART = REPO / "helm" / "hetfed"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
EXAMPLE_VALUES = REPO / "docs" / "examples" / "values-three-hospitals.yaml"
# The Kubernetes versions every rendered manifest must be valid for.
KUBERNETES_VERSIONS = ("1.28.0", "1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0")
# Prometheus operator kinds: no schema ships with kubernetes-validate, the tests check them by hand.
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def helm_binary() -> str | None:
    """The Helm binary: $HETFED_HELM, the one scripts/install_tools.sh puts in .tools/, or helm on PATH."""
    for candidate in (os.environ.get("HETFED_HELM"), str(REPO / ".tools" / "helm" / "helm"), shutil.which("helm")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


class HelmError(RuntimeError):
    """Helm exited with an error; the message is its stderr."""


class Helm:
    """Runs the real Helm binary with a private HOME."""

    def __init__(self, binary: str, home: Path) -> None:
        self.binary = binary
        self.env = {**os.environ, "HOME": str(home), "HELM_CACHE_HOME": str(home / "cache"),
                    "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}

    def run(self, *args: str) -> str:
        """Run ``helm ARGS``; its stdout, or HelmError with stderr."""
        proc = subprocess.run([self.binary, *args], capture_output=True, text=True, env=self.env, timeout=120)
        if proc.returncode != 0:
            raise HelmError(proc.stderr.strip() or proc.stdout.strip())
        return proc.stdout

    def template(self, *values_files: Path, chart: Path = CHART, sets: tuple[str, ...] = (),
                 api_versions: tuple[str, ...] = (), release: str = "fl", namespace: str = "federation",
                 show_only: str | None = None) -> str:
        """``helm template`` of the chart; the rendered YAML."""
        args = ["template", release, str(chart), "--namespace", namespace]
        for f in values_files:
            args += ["-f", str(f)]
        for s in sets:
            args += ["--set", s]
        for a in api_versions:
            args += ["--api-versions", a]
        if show_only:
            args += ["--show-only", show_only]
        return self.run(*args)

    def objects(self, *values_files: Path, **kw: Any) -> list[dict[str, Any]]:
        """The rendered objects (hooks such as the helm test pod included)."""
        return [d for d in yaml.safe_load_all(self.template(*values_files, **kw)) if d]


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """The real Helm binary (installed by scripts/install_tools.sh, which .ci/run calls)."""
    binary = helm_binary()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("helm not found: .ci/run installs it with scripts/install_tools.sh")
        pytest.skip("helm not found: run scripts/install_tools.sh (puts it in .tools/helm/helm)")
    return Helm(binary, tmp_path_factory.mktemp("helm-home"))


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The objects of one kind."""
    return [o for o in objects if o["kind"] == kind]


def validate_all(objects: list[dict[str, Any]], versions: tuple[str, ...] = KUBERNETES_VERSIONS) -> int:
    """Validate every non-CRD object strictly against each Kubernetes version's schema; how many were checked."""
    import kubernetes_validate

    checked = 0
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} is invalid for Kubernetes {version}: "
                            f"{exc.message} at {'.'.join(str(p) for p in exc.path)}")
            checked += 1
    return checked


@pytest.fixture
def chart_copy(tmp_path: Path) -> Callable[[], Path]:
    """Factory: a copy of the chart in a temporary directory, to add fixture files to."""

    def make() -> Path:
        dest = tmp_path / "hetfed"
        shutil.copytree(CHART, dest)
        return dest

    return make
