"""mTLS end to end: the organization is the client certificate's name, whatever a request says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from hetfed.aggregator.config import aggregator_config_from_mapping
from hetfed.aggregator.serving.server import RunningAggregator
from hetfed.cli.certs import FederationCerts
from hetfed.cli.localrun import OPERATOR_ORGANIZATION, LocalRunOptions, aggregator_config, client_config
from hetfed.client.config import ClientConfig
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import aggregator_pb2_grpc as agrpc
from hetfed.wire.config import from_mapping
from hetfed.wire.transport import ORGANIZATION_METADATA_KEY, TlsConfig, make_channel

from .conftest import OPERATOR, OUTSIDER, RUN, AggregatorFactory, join, rejected


@pytest.fixture
def agg(start: AggregatorFactory, certs: FederationCerts) -> RunningAggregator:
    return start(certs.aggregator_tls())


def _unavailable(agg: RunningAggregator, channel: grpc.Channel) -> grpc.RpcError:
    with channel, pytest.raises(grpc.RpcError) as info:
        agrpc.AggregatorStub(channel).Status(apb.StatusRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    return info.value


def test_an_organization_joins_as_its_certificate(agg: RunningAggregator, certs: FederationCerts) -> None:
    resp = join(agg, certs.client_tls("org-a"), claimed="org-a")
    assert resp.run_id == RUN
    # No claim at all: the certificate alone names the organization.
    assert join(agg, certs.client_tls("org-b")).run_id == RUN
    # The server name is only needed when the dialled host is not in the aggregator's SANs.
    assert join(agg, certs.client_tls("org-a", server_name="localhost"), claimed="org-a").run_id == RUN


def test_a_certificate_cannot_claim_another_organization(agg: RunningAggregator, certs: FederationCerts) -> None:
    before = rejected(agg, "identity_mismatch")
    with pytest.raises(grpc.RpcError) as info:
        join(agg, certs.client_tls("org-a"), claimed="org-b")
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "identity_mismatch" in info.value.details()
    assert rejected(agg, "identity_mismatch") == before + 1


def test_the_metadata_header_is_ignored_under_mtls(agg: RunningAggregator, certs: FederationCerts) -> None:
    # org-x's certificate with a header naming org-a: still org-x, which is in no run.
    with pytest.raises(grpc.RpcError) as info:
        join(agg, certs.client_tls(OUTSIDER), metadata=((ORGANIZATION_METADATA_KEY, "org-a"),))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "unknown_organization" in info.value.details()
    assert "org-x" in info.value.details()


def test_an_organization_outside_the_run_is_denied(agg: RunningAggregator, certs: FederationCerts) -> None:
    before = rejected(agg, "unknown_organization")
    with pytest.raises(grpc.RpcError) as info:
        join(agg, certs.client_tls(OUTSIDER), claimed=OUTSIDER)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "unknown_organization" in info.value.details()
    assert rejected(agg, "unknown_organization") == before + 1


def test_without_a_client_certificate_the_handshake_fails(agg: RunningAggregator, certs: FederationCerts) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())
    _unavailable(agg, grpc.secure_channel(f"127.0.0.1:{agg.port}", creds))


def test_a_plaintext_client_cannot_talk_to_an_mtls_aggregator(agg: RunningAggregator) -> None:
    _unavailable(agg, grpc.insecure_channel(f"127.0.0.1:{agg.port}"))


def test_a_certificate_from_another_ca_fails(
    agg: RunningAggregator, certs: FederationCerts, foreign_certs: FederationCerts
) -> None:
    cert, key = foreign_certs.organizations["org-a"]
    # It trusts the right CA, so only the aggregator's check of the client certificate can fail.
    tls = TlsConfig(cert=str(cert), key=str(key), ca=str(certs.ca))
    _unavailable(agg, make_channel(f"127.0.0.1:{agg.port}", tls))


def test_a_client_refuses_an_aggregator_from_another_ca(
    agg: RunningAggregator, foreign_certs: FederationCerts
) -> None:
    _unavailable(agg, make_channel(f"127.0.0.1:{agg.port}", foreign_certs.client_tls("org-a")))


def test_the_server_certificate_is_not_a_client_certificate(agg: RunningAggregator, certs: FederationCerts) -> None:
    tls = TlsConfig(cert=str(certs.aggregator), key=str(certs.aggregator_key), ca=str(certs.ca))
    _unavailable(agg, make_channel(f"127.0.0.1:{agg.port}", tls))


def test_the_operator_reads_status_but_is_no_participant(agg: RunningAggregator, certs: FederationCerts) -> None:
    assert OPERATOR == OPERATOR_ORGANIZATION
    with make_channel(f"127.0.0.1:{agg.port}", certs.client_tls(OPERATOR)) as ch:
        status = agrpc.AggregatorStub(ch).Status(apb.StatusRequest(), timeout=10)
        assert [r.run_id for r in status.runs] == [RUN]
        with pytest.raises(grpc.RpcError) as info:
            join(ch)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "unknown_organization" in info.value.details()


def test_local_run_configs_carry_tls(tmp_path: Path, certs: FederationCerts) -> None:
    opts = LocalRunOptions(algorithms=("local",), clients=2, tls=True)
    agg_cfg = aggregator_config_from_mapping(aggregator_config(opts, str(tmp_path), certs.aggregator_tls()))
    assert agg_cfg.server.tls == certs.aggregator_tls()
    client = from_mapping(ClientConfig, client_config(opts, "local", 1, 1234, certs.client_tls("org-b")))
    assert client.tls == certs.client_tls("org-b")
    # Without --tls nothing changes.
    assert aggregator_config_from_mapping(aggregator_config(opts, str(tmp_path))).server.tls is None
    assert "tls" not in client_config(opts, "local", 1, 1234)


@pytest.mark.e2e
def test_hetfed_run_over_mtls(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "hetfed.cli", "run", "--tls", "--algorithm", "local", "--clients", "2",
           "--rounds", "1", "--dataset", "digits", "--model", "mlp", "--output", str(out), "--timeout", "240"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    server = json.loads((out / "aggregator.json").read_text())["server"]
    assert server["tls"]["cert"] == str(out / "certs" / "aggregator.pem")
    client = json.loads((out / "client-local-org-1.json").read_text())
    assert client["tls"]["cert"] == str(out / "certs" / "org-1.pem")
    assert (out / "certs" / f"{OPERATOR_ORGANIZATION}.pem").exists()
    results = json.loads((out / "results.json").read_text())
    assert results["runs"][0]["final_test_accuracy"] is not None


def test_status_is_scoped_to_the_callers_runs(certs: FederationCerts, tmp_path: Path) -> None:
    """Under mTLS an organization sees only its runs and its own reports; an operator sees everything."""
    from hetfed.aggregator.config import aggregator_config_from_mapping
    from hetfed.aggregator.serving.server import start_aggregator
    from hetfed.v1 import aggregator_pb2 as apb
    from hetfed.v1 import aggregator_pb2_grpc as agrpc
    from hetfed.wire.config import to_mapping
    from hetfed.wire.transport import make_channel

    cfg = aggregator_config_from_mapping({
        "server": {"listen": "127.0.0.1:0", "metrics_port": -1, "state_dir": str(tmp_path / "s"),
                   "tls": to_mapping(certs.aggregator_tls()), "operators": ["hetfed-operator"]},
        "runs": [{"id": "ab", "algorithm": "local", "organizations": ["org-a", "org-b"]},
                 {"id": "b-only", "algorithm": "local", "organizations": ["org-b"]}],
    })
    agg = start_aggregator(cfg)
    try:
        def status(org: str, run_id: str = "") -> apb.StatusResponse:
            with make_channel(f"127.0.0.1:{agg.port}", certs.client_tls(org)) as ch:
                return agrpc.AggregatorStub(ch).Status(apb.StatusRequest(run_id=run_id), timeout=10)

        assert [r.run_id for r in status("org-a").runs] == ["ab"]
        assert [r.run_id for r in status("org-b").runs] == ["ab", "b-only"]
        assert [r.run_id for r in status("hetfed-operator").runs] == ["ab", "b-only"]
        assert status("org-x").runs == []
        # A refused outsider is listed to the operator only, never to the run's organizations.
        with make_channel(f"127.0.0.1:{agg.port}", certs.client_tls("org-x")) as ch, pytest.raises(grpc.RpcError):
            agrpc.AggregatorStub(ch).Join(apb.JoinRequest(run_id="ab"), timeout=10)
        assert [r.organization_id for r in status("hetfed-operator", "ab").runs[0].refused] == ["org-x"]
        assert list(status("org-a", "ab").runs[0].refused) == []
        with pytest.raises(grpc.RpcError) as err:
            status("org-a", "b-only")
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        agg.stop(0)
