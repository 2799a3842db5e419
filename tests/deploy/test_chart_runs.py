"""The rendered chart runs: its ConfigMaps' configs pass --check-config and federate to the end over loopback.

The chart's default federation (only organization names given), every values file that ships (helm/hetfed/ci,
docs/examples) and the cross-silo releases are rendered by real Helm; the aggregator's and every client's
TOML are taken from the ConfigMaps, and run as real processes with only addresses, paths and devices mapped
to the test's. Chart and binaries cannot drift apart.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import aggregator_pb2_grpc as agrpc
from hetfed.wire.transport import TlsConfig, make_channel
from tests.conftest import REPO, free_port, wait_until
from tests.deploy.conftest import CHART, CI_VALUES, EXAMPLE_VALUES, Helm, by_kind, validate_all

pytestmark = pytest.mark.e2e
ORGANIZATIONS = ("north", "south")


# The example organization package the own-code image installs (docker/examples/own-code.Dockerfile).
EXAMPLE_PACKAGE = REPO / "examples" / "hetfed_example"


def hetfed(*args: str, log: Path | None = None) -> subprocess.Popen[bytes]:
    """Start ``python -m hetfed.cli ARGS`` as the chart's containers do (one thread per process here); the
    example organization package is importable, as in its own client image."""
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(EXAMPLE_PACKAGE)) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
    return subprocess.Popen([sys.executable, "-m", "hetfed.cli", *args], stdout=out, stderr=subprocess.STDOUT, env=env)


def start_aggregator(agg_cfg: dict[str, Any], workdir: Path, procs: list[subprocess.Popen[bytes]]) -> int:
    """Start ``hetfed aggregator`` on the mapped config (appended to ``procs``) and return its port once ready."""
    mapped = workdir / "aggregator.json"
    mapped.write_text(json.dumps(agg_cfg))
    ready = workdir / "aggregator.ready"
    aggregator = hetfed("aggregator", "--config", str(mapped), "--ready-file", str(ready),
                        log=workdir / "aggregator.log")
    procs.append(aggregator)
    wait_until(lambda: ready.exists() or aggregator.poll() is not None, timeout=60, what="the aggregator")
    assert aggregator.poll() is None, (workdir / "aggregator.log").read_text()
    return int(json.loads(ready.read_text())["port"])


def assert_finished(run: Any, organizations: list[str], final_round: int) -> None:
    """Every organization joined and pushed the final round, and each reported an accuracy in (0, 1]."""
    assert [(o.organization_id, o.joined, o.last_round_pushed) for o in run.organization_status] == [
        (org, True, final_round) for org in organizations]
    reports = run.history[-1].reports
    assert {r.organization_id for r in reports} == set(organizations)
    assert all(0.0 < r.metrics.test_accuracy <= 1.0 for r in reports)


def kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill and reap every process still running."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def rendered_configs(helm: Helm, workdir: Path) -> tuple[Path, dict[str, Path]]:
    """Write the ConfigMaps' TOML files as rendered: the aggregator's and one per organization."""
    objects = helm.objects(sets=(f"organizations={{{','.join(ORGANIZATIONS)}}}",))
    cms = {c["metadata"]["name"]: c["data"] for c in by_kind(objects, "ConfigMap")}
    agg = workdir / "aggregator.toml"
    agg.write_text(cms["fl-hetfed-aggregator"]["aggregator.toml"])
    clients = {}
    for org in ORGANIZATIONS:
        (name, text), = cms[f"fl-hetfed-{org}"].items()  # one run: one client config
        clients[org] = workdir / f"{org}-{name}"
        clients[org].write_text(text)
    return agg, clients


def check_configs(files: list[tuple[str, Path]]) -> list[str]:
    """``hetfed KIND --config PATH --check-config`` for each file, concurrently; their outputs (each must exit 0)."""
    procs = [subprocess.Popen([sys.executable, "-m", "hetfed.cli", kind, "--config", str(path), "--check-config"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for kind, path in files]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.append(out)
    return outputs


def test_rendered_default_federation_checks_and_runs_to_the_end(helm: Helm, tmp_path: Path) -> None:
    """--check-config accepts every rendered file; the run they describe finishes with every organization."""
    agg_file, client_files = rendered_configs(helm, tmp_path)
    outputs = check_configs([("aggregator", agg_file), *(("client", f) for f in client_files.values())])
    assert "aggregator config OK" in outputs[0]
    for org, out in zip(client_files, outputs[1:], strict=True):
        assert f"client config OK: organization {org}" in out

    # Map addresses and paths to the test's; every other field stays as rendered.
    agg_cfg: dict[str, Any] = tomllib.loads(agg_file.read_text())
    health_port = free_port()
    agg_cfg["server"].update(listen="127.0.0.1:0", metrics_port=0, metrics_host="127.0.0.1",
                             health_listen=f"127.0.0.1:{health_port}", state_dir=str(tmp_path / "state"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        port = start_aggregator(agg_cfg, tmp_path, procs)
        (aggregator,) = procs
        # The plaintext health listener the kubelet probes answers, through the image's own check.
        health = subprocess.run([sys.executable, "-m", "hetfed.cli", "health", f"127.0.0.1:{health_port}"],
                                capture_output=True, text=True, timeout=60)
        assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr

        clients = {}
        for org, f in client_files.items():
            cfg: dict[str, Any] = tomllib.loads(f.read_text())
            assert cfg["aggregator"] == "fl-hetfed-aggregator.federation.svc:50051"
            cfg.update(aggregator=f"127.0.0.1:{port}", metrics_port=0, metrics_host="127.0.0.1")
            path = tmp_path / f"{org}.json"
            path.write_text(json.dumps(cfg))
            clients[org] = hetfed("client", "--config", str(path), log=tmp_path / f"{org}.log")
            procs.append(clients[org])
        deadline = time.monotonic() + 240
        for org, proc in clients.items():
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert rc == 0, (tmp_path / f"{org}.log").read_text()[-3000:]

        with make_channel(f"127.0.0.1:{port}", None) as channel:
            status = agrpc.AggregatorStub(channel).Status(apb.StatusRequest(), timeout=10)
        (run,) = status.runs
        rendered_run = agg_cfg["runs"][0]
        assert run.run_id == rendered_run["id"] and run.state == apb.RUN_STATE_FINISHED
        assert list(run.organizations) == list(ORGANIZATIONS)
        final_round = rendered_run["rounds"] + 1  # the evaluation round follows the training rounds
        assert_finished(run, list(ORGANIZATIONS), final_round)
        assert all(o.bytes_up > 0 and o.bytes_down > 0 for o in run.organization_status)

        aggregator.send_signal(signal.SIGTERM)  # what the kubelet sends: drain, then exit 0
        assert aggregator.wait(timeout=30) == 0
    finally:
        kill_all(procs)


# ---------------------------------------------------------------------------------------------------------
# Every values file that ships runs: each is one federation (the cross-silo files one federation of three
# releases), rendered by real Helm and run from its Jobs' containers as Kubernetes would start them.
# Mapped to this machine: addresses, paths (data, state, certificates), devices (cuda -> cpu); kept
# affordable: at most ROUNDS training rounds of one local epoch. Everything else runs as rendered.

ROUNDS = 1
CI_DIR = CHART / "ci"
EXAMPLES = REPO / "docs" / "examples"
CROSS_SILO = EXAMPLES / "cross-silo"
# id -> the releases of one federation: (release, namespace, values files in order).
Release = tuple[str, str, tuple[Path, ...]]
FEDERATIONS: dict[str, list[Release]] = {
    **{p.stem: [("fl", "federation", (p,))] for p in CI_VALUES},
    EXAMPLE_VALUES.stem: [("fl", "federation", (EXAMPLE_VALUES,))],
    "values-own-code": [("fl", "federation", (EXAMPLES / "values-own-code.yaml",))],
    "cross-silo": [
        ("fl", "federation", (CROSS_SILO / "federation.yaml", CROSS_SILO / "aggregator.yaml")),
        ("fl-a", "hospital-a", (CROSS_SILO / "federation.yaml", CROSS_SILO / "hospital-a.yaml")),
        ("fl-b", "hospital-b", (CROSS_SILO / "federation.yaml", CROSS_SILO / "hospital-b.yaml")),
    ],
}


@dataclass
class ClientSpec:
    """One client container of a rendered Job: who, which run, its rendered TOML and what its pod mounts."""

    release: str
    organization: str
    run: str
    toml: str
    tls_secret: str | None
    state_mount: str | None
    output_mount: str | None = None


@dataclass
class Rendered:
    """What the releases of one federation render: the aggregator's TOML, the client containers, the objects."""

    aggregator: str
    clients: list[ClientSpec]
    objects: dict[str, list[dict[str, Any]]]


def render_federation(helm: Helm, releases: list[Release]) -> Rendered:
    """Render each release; take the aggregator's config from its ConfigMap and each client from its Job."""
    aggregator: list[str] = []
    clients: list[ClientSpec] = []
    objects = {}
    for release, namespace, files in releases:
        objs = helm.objects(*files, release=release, namespace=namespace)
        objects[release] = objs
        cms = {c["metadata"]["name"]: c.get("data", {}) for c in by_kind(objs, "ConfigMap")}
        aggregator += [d["aggregator.toml"] for d in cms.values() if "aggregator.toml" in d]
        for job in by_kind(objs, "Job"):
            spec = job["spec"]["template"]["spec"]
            volumes = {v["name"]: v for v in spec["volumes"]}
            config_map = cms[volumes["config"]["configMap"]["name"]]
            for c in spec["containers"]:
                (config_path,) = [a for a in c["args"] if a.startswith("/etc/hetfed/config/")]
                mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
                assert mounts["config"] == "/etc/hetfed/config"
                clients.append(ClientSpec(
                    release=release, organization=job["metadata"]["labels"]["hetfed.io/organization"], run=c["name"],
                    toml=config_map[Path(config_path).name],
                    tls_secret=volumes["tls"]["secret"]["secretName"] if "tls" in volumes else None,
                    state_mount=mounts.get("state"), output_mount=mounts.get("output")))
    assert len(aggregator) == 1, f"{len(aggregator)} aggregator configs among {[r[0] for r in releases]}"
    return Rendered(aggregator[0], clients, objects)


def write_npz(directory: Path, part: int) -> Path:
    """An organization's own data as docs/data.md describes it: 300 MNIST images (uint8, N x 1 x 28 x 28)."""
    from hetfed.client.data.images import load_mnist5k

    x, y = load_mnist5k()
    rows = np.random.default_rng(part).permutation(len(y))[:300]  # the file is sorted by label
    directory.mkdir(parents=True)
    images = np.rint(np.asarray(x[rows]) * 255).astype(np.uint8)
    assert set(np.asarray(y[rows]).tolist()) == set(range(10))  # the label space every model shares
    np.savez(directory / "train.npz", x=images, y=np.asarray(y[rows]))
    return directory


def write_image_tree(directory: Path) -> Path:
    """An organization's images as a directory per class: 20 Fashion-MNIST PNGs a class, train/ and test/."""
    sys.path.insert(0, str(EXAMPLE_PACKAGE))
    try:
        from hetfed_example.data import write_fashion_folder
    finally:
        sys.path.remove(str(EXAMPLE_PACKAGE))
    write_fashion_folder(directory, per_class=20)
    return directory


def run_federation(rendered: Rendered, workdir: Path, timeout: float = 420.0) -> None:
    """Run the rendered federation on loopback to the end of every run; check it through Status."""
    agg_cfg: dict[str, Any] = tomllib.loads(rendered.aggregator)
    server = agg_cfg["server"]
    tls_on = "tls" in server
    assert all(("tls" in tomllib.loads(c.toml)) == tls_on for c in rendered.clients)
    organizations = sorted({o for r in agg_cfg["runs"] for o in r["organizations"]})
    certs = workdir / "certs"
    dialled = sorted({tomllib.loads(c.toml)["aggregator"].rsplit(":", 1)[0] for c in rendered.clients})
    if tls_on:
        operator = server["operators"][0]
        names = [a for h in ["127.0.0.1", *dialled] for a in ("--aggregator-name", h)]
        made = subprocess.run([sys.executable, "-m", "hetfed.cli", "certs", "--out", str(certs), "--organizations",
                               ",".join([*organizations, operator]), *names], capture_output=True, text=True, timeout=120)
        assert made.returncode == 0, made.stderr

    def pem(party: str) -> dict[str, str]:
        return {"cert": str(certs / f"{party}.pem"), "key": str(certs / f"{party}-key.pem"), "ca": str(certs / "ca.pem")}

    health_port = free_port()
    server.update(listen="127.0.0.1:0", metrics_port=0, metrics_host="127.0.0.1",
                  health_listen=f"127.0.0.1:{health_port}", state_dir=str(workdir / "aggregator-state"))
    if tls_on:
        server["tls"] = pem("aggregator")
    for run in agg_cfg["runs"]:
        run["rounds"] = min(run["rounds"], ROUNDS)
        if "local_epochs" in run.get("algorithm_config", {}):
            run["algorithm_config"]["local_epochs"] = 1
    procs: list[subprocess.Popen[bytes]] = []
    try:
        port = start_aggregator(agg_cfg, workdir, procs)
        (aggregator,) = procs

        clients = {}
        state_files: list[Path] = []
        exports: list[Path] = []
        npz_parts: dict[str, Path] = {}
        for c in rendered.clients:
            cfg: dict[str, Any] = tomllib.loads(c.toml)
            assert cfg["organization"] == c.organization and cfg["run"] == c.run
            host = cfg["aggregator"].rsplit(":", 1)[0]
            cfg.update(aggregator=f"127.0.0.1:{port}", metrics_port=0, metrics_host="127.0.0.1", threads=1)
            if cfg["device"] != "cpu":
                cfg["device"] = "cpu"  # GPUs mapped to CPU
            if tls_on:
                cfg["tls"] = {**pem(c.organization), "server_name": cfg["tls"].get("server_name") or host}
            if cfg["data"]["dataset"] == "npz":
                if c.organization not in npz_parts:
                    npz_parts[c.organization] = write_npz(workdir / "data" / c.organization, len(npz_parts))
                cfg["data"]["path"] = str(npz_parts[c.organization])
            if cfg["data"]["dataset"] in ("imagefolder", "torch") and "path" in cfg["data"]:
                tree = workdir / "data" / "images"
                if not tree.exists():
                    write_image_tree(tree)
                cfg["data"]["path"] = str(tree)
            if c.output_mount is not None:  # the output volume: each run's client writes <mount>/<run>/model/
                assert cfg["output_dir"] == f"{c.output_mount}/{c.run}"
                cfg["output_dir"] = str(workdir / "client-output" / c.organization / c.run)
                exports.append(Path(cfg["output_dir"]) / "model" / "card.json")
            if c.state_mount is not None:
                assert cfg["state_dir"] == c.state_mount  # the volume; each run's client writes <run>/ in it
                cfg["state_dir"] = str(workdir / "client-state" / c.organization)
                state_files.append(Path(cfg["state_dir"]) / c.run / "client-state.pt")
            else:
                assert "state_dir" not in cfg
            name = f"{c.organization}-{c.run}"
            path = workdir / f"{name}.json"
            path.write_text(json.dumps(cfg))
            clients[name] = hetfed("client", "--config", str(path), log=workdir / f"{name}.log")
            procs.append(clients[name])
        deadline = time.monotonic() + timeout
        for name, proc in clients.items():
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert rc == 0, (workdir / f"{name}.log").read_text()[-3000:]
        if importlib.util.find_spec("hetfed.client.state") is not None:  # the runtime that keeps private state
            assert [f for f in state_files if not f.is_file()] == []
        for card in exports:  # each organization's trained model, on its output volume
            assert json.loads(card.read_text())["architecture"], card

        channel_tls = TlsConfig(**pem(server["operators"][0]), server_name="127.0.0.1") if tls_on else None
        with make_channel(f"127.0.0.1:{port}", channel_tls) as channel:
            status = agrpc.AggregatorStub(channel).Status(apb.StatusRequest(), timeout=10)
        runs = {r.run_id: r for r in status.runs}
        assert sorted(runs) == sorted(r["id"] for r in agg_cfg["runs"])
        for run_cfg in agg_cfg["runs"]:
            run = runs[run_cfg["id"]]
            assert run.state == apb.RUN_STATE_FINISHED, run_cfg["id"]
            assert list(run.organizations) == run_cfg["organizations"]
            final_round = run_cfg["rounds"] + 1  # the evaluation round follows the training rounds
            assert_finished(run, run_cfg["organizations"], final_round)
        aggregator.send_signal(signal.SIGTERM)  # what the kubelet sends: drain, then exit 0
        assert aggregator.wait(timeout=30) == 0
    finally:
        kill_all(procs)


def test_every_shipped_values_file_is_run() -> None:
    """Each values file in helm/hetfed/ci/ and docs/examples/ (and below) belongs to a federation run here."""
    shipped = {*CI_DIR.glob("*.yaml"), *EXAMPLES.rglob("*.yaml")}
    covered = {f for releases in FEDERATIONS.values() for _, _, files in releases for f in files}
    assert covered == shipped


@pytest.mark.parametrize("federation", [k for k in FEDERATIONS if k != "cross-silo"])
def test_shipped_values_run_to_the_end(helm: Helm, tmp_path: Path, federation: str) -> None:
    """The values file's federation, from its rendered Jobs and ConfigMaps, finishes every run with every organization."""
    rendered = render_federation(helm, FEDERATIONS[federation])
    jobs = by_kind(rendered.objects["fl"], "Job")
    assert sorted({c.organization for c in rendered.clients}) == sorted(
        j["metadata"]["labels"]["hetfed.io/organization"] for j in jobs)
    run_federation(rendered, tmp_path)


def test_cross_silo_releases_run_a_federation_over_mtls(helm: Helm, tmp_path: Path) -> None:
    """An aggregator-only release and two organization-only releases federate over mTLS, each with only its own key."""
    rendered = render_federation(helm, FEDERATIONS["cross-silo"])
    agg, org_a, org_b = (rendered.objects[r] for r in ("fl", "fl-a", "fl-b"))
    # The aggregator's release: no client, no organization's Secret; gRPC exposed outside on its own Service.
    assert by_kind(agg, "Job") == [] and by_kind(agg, "PersistentVolumeClaim") == []
    assert all(s["metadata"]["labels"]["app.kubernetes.io/component"] != "client" for s in by_kind(agg, "Secret"))
    external = next(s for s in by_kind(agg, "Service") if s["metadata"]["name"] == "fl-hetfed-aggregator-external")
    assert external["spec"]["type"] == "LoadBalancer" and [p["name"] for p in external["spec"]["ports"]] == ["grpc"]
    assert external["spec"]["loadBalancerSourceRanges"] == ["198.51.100.0/24", "203.0.113.0/24"]
    assert external["spec"]["externalTrafficPolicy"] == "Local"
    (policy,) = by_kind(agg, "NetworkPolicy")
    blocks = [p["ipBlock"]["cidr"] for rule in policy["spec"]["ingress"] for p in rule["from"] if "ipBlock" in p]
    assert blocks == ["198.51.100.0/24", "203.0.113.0/24"]
    # Each organization's release: its one Job, mounting only its own certificate; no aggregator, no Secret.
    for objs, own, other in ((org_a, "hospital-a", "hospital-b"), (org_b, "hospital-b", "hospital-a")):
        assert {o["kind"] for o in objs} <= {"Job", "ConfigMap", "NetworkPolicy", "PersistentVolumeClaim"}
        (job,) = by_kind(objs, "Job")
        assert job["metadata"]["labels"]["hetfed.io/organization"] == own
        assert other not in json.dumps(objs)
        (client_policy,) = by_kind(objs, "NetworkPolicy")
        to_aggregator = client_policy["spec"]["egress"][0]
        assert to_aggregator == {"ports": [{"port": 50051, "protocol": "TCP"}], "to": [{"ipBlock": {"cidr": "192.0.2.10/32"}}]}
        validate_all(objs)
    validate_all(agg)
    assert {(c.release, c.organization, c.tls_secret) for c in rendered.clients} == {
        ("fl-a", "hospital-a", "hetfed-hospital-a-tls"), ("fl-b", "hospital-b", "hetfed-hospital-b-tls")}
    assert {tomllib.loads(c.toml)["aggregator"] for c in rendered.clients} == {"fl.aggregator.example.org:50051"}
    run_federation(rendered, tmp_path)
