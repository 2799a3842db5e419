"""The rendered chart runs: its ConfigMaps' configs pass --check-config and federate to the end over loopback.

The chart's default federation (only organization names given) is rendered by real Helm; the aggregator's
and every client's TOML are taken from the ConfigMaps, checked by the real binaries, and run as real
processes with only addresses and paths mapped to the test's. Chart and binaries cannot drift apart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import aggregator_pb2_grpc as agrpc
from hetfed.wire.transport import make_channel
from tests.conftest import free_port, wait_until
from tests.deploy.conftest import Helm, by_kind

pytestmark = pytest.mark.e2e
ORGANIZATIONS = ("north", "south")


def hetfed(*args: str, log: Path | None = None) -> subprocess.Popen[bytes]:
    """Start ``python -m hetfed.cli ARGS`` as the chart's containers do (one thread per process here)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
    return subprocess.Popen([sys.executable, "-m", "hetfed.cli", *args], stdout=out, stderr=subprocess.STDOUT, env=env)


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
    mapped = tmp_path / "aggregator.json"
    mapped.write_text(json.dumps(agg_cfg))
    ready = tmp_path / "aggregator.ready"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        aggregator = hetfed("aggregator", "--config", str(mapped), "--ready-file", str(ready),
                            log=tmp_path / "aggregator.log")
        procs.append(aggregator)
        wait_until(lambda: ready.exists() or aggregator.poll() is not None, timeout=60, what="the aggregator")
        assert aggregator.poll() is None, (tmp_path / "aggregator.log").read_text()
        port = json.loads(ready.read_text())["port"]
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
        assert [(o.organization_id, o.joined, o.last_round_pushed) for o in run.organization_status] == [
            (org, True, final_round) for org in ORGANIZATIONS]
        assert all(o.bytes_up > 0 and o.bytes_down > 0 for o in run.organization_status)
        reports = run.history[-1].reports
        assert {r.organization_id for r in reports} == set(ORGANIZATIONS)
        assert all(0.0 < r.metrics.test_accuracy <= 1.0 for r in reports)

        aggregator.send_signal(signal.SIGTERM)  # what the kubelet sends: drain, then exit 0
        assert aggregator.wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
