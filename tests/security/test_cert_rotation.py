"""Certificates that rotate: a running aggregator serves renewed files without a restart, and a client uses its
renewed files on its next connection (a new CA here, so the old and new chains cannot be mistaken)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import grpc
import pytest

from hetfed.cli.certs import FederationCerts, make_federation_certs
from hetfed.wire.rpc import AggregatorClient, RemoteError
from hetfed.wire.transport import TlsConfig
from tests.conftest import free_port, wait_until
from tests.security.conftest import RUN, RUN_ORGS, AggregatorFactory, join


def install(files: dict[str, Path], into: Path) -> TlsConfig:
    """Put the PEM files under ``into`` as a Kubernetes Secret volume does: ``..data`` links to a new directory,
    the names link through it, and the swap is one rename."""
    version = into / f"..v{len(list(into.glob('..v*')))}"
    version.mkdir(parents=True)
    for name, src in files.items():
        shutil.copyfile(src, version / name)
    tmp = into / "..data_tmp"
    tmp.symlink_to(version.name)
    os.replace(tmp, into / "..data")
    for name in files:
        link = into / name
        if not link.is_symlink():
            link.symlink_to(f"..data/{name}")
    return TlsConfig(cert=str(into / "tls.crt"), key=str(into / "tls.key"), ca=str(into / "ca.crt"))


def server_files(c: FederationCerts) -> dict[str, Path]:
    return {"tls.crt": c.aggregator, "tls.key": c.aggregator_key, "ca.crt": c.ca}


def client_files(c: FederationCerts, org: str) -> dict[str, Path]:
    cert, key = c.organizations[org]
    return {"tls.crt": cert, "tls.key": key, "ca.crt": c.ca}


@pytest.fixture(scope="module")
def renewed(tmp_path_factory: pytest.TempPathFactory) -> FederationCerts:
    """The federation's certificates issued again, by a new CA."""
    return make_federation_certs(tmp_path_factory.mktemp("renewed"), list(RUN_ORGS))


def test_a_running_aggregator_serves_renewed_files(start: AggregatorFactory, certs: FederationCerts,
                                                   renewed: FederationCerts, tmp_path: Path) -> None:
    mounted = tmp_path / "aggregator-tls"
    agg = start(install(server_files(certs), mounted))
    assert join(agg, certs.client_tls("org-a")).run_id == RUN
    install(server_files(renewed), mounted)  # renewed under the running process
    # A client holding the new chain connects; one holding only the old chain no longer can.
    assert join(agg, renewed.client_tls("org-b")).run_id == RUN
    with pytest.raises(grpc.RpcError) as err:
        join(agg, certs.client_tls("org-b"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_half_written_renewal_keeps_the_previous_certificate(start: AggregatorFactory, certs: FederationCerts,
                                                                renewed: FederationCerts, tmp_path: Path) -> None:
    mounted = tmp_path / "aggregator-tls"
    agg = start(install(server_files(certs), mounted))
    # The new certificate with the old key: not a usable pair, so the old set stays served.
    install({"tls.crt": renewed.aggregator, "tls.key": certs.aggregator_key, "ca.crt": renewed.ca}, mounted)
    assert join(agg, certs.client_tls("org-a")).run_id == RUN
    install(server_files(renewed), mounted)
    assert join(agg, renewed.client_tls("org-a")).run_id == RUN


def test_a_client_uses_its_renewed_files_on_its_next_connection(start: AggregatorFactory, certs: FederationCerts,
                                                               renewed: FederationCerts, tmp_path: Path) -> None:
    port = free_port()
    agg = start(install(server_files(certs), tmp_path / "aggregator-tls"), listen=f"127.0.0.1:{port}")
    tls = install(client_files(certs, "org-a"), tmp_path / "org-a-tls")
    stale = install(client_files(certs, "org-a"), tmp_path / "stale-tls")
    client = AggregatorClient(f"127.0.0.1:{port}", tls, "org-a", RUN, call_timeout=5)
    never_renewed = AggregatorClient(f"127.0.0.1:{port}", stale, "org-a", RUN, call_timeout=5)
    try:
        assert client.join().run_id == RUN and never_renewed.join().run_id == RUN
        # Both sides renewed by the new CA; the aggregator restarts on the same port (its open connections drop).
        agg.stop(grace=0)
        install(server_files(renewed), tmp_path / "aggregator-tls")
        install(client_files(renewed, "org-a"), tmp_path / "org-a-tls")
        start(TlsConfig(cert=str(tmp_path / "aggregator-tls" / "tls.crt"),
                        key=str(tmp_path / "aggregator-tls" / "tls.key"),
                        ca=str(tmp_path / "aggregator-tls" / "ca.crt")), listen=f"127.0.0.1:{port}")
        assert wait_until(lambda: _joins(client), timeout=30, what="the renewed client to connect")
        with pytest.raises(RemoteError) as err:
            never_renewed.join()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        client.close()
        never_renewed.close()


def _joins(client: AggregatorClient) -> bool:
    try:
        return client.join().run_id == RUN
    except RemoteError:
        return False
