"""One organization per certificate: several names, disagreeing names or none are refused over real mTLS."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hetfed.aggregator.serving.server import RunningAggregator
from hetfed.cli.certs import FederationCerts
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import aggregator_pb2_grpc as agrpc
from hetfed.wire.errors import REASONS
from hetfed.wire.identity import ORGANIZATION_URI_PREFIX
from hetfed.wire.transport import TlsConfig, make_channel

from .conftest import RUN, AggregatorFactory, join, rejected


def _crafted(certs: FederationCerts, out: Path, name: str, cns: list[str], uris: list[str]) -> TlsConfig:
    """A clientAuth certificate signed by the federation's CA with the given CNs (in order) and organization URIs."""
    ca_key = serialization.load_pem_private_key(certs.ca_key.read_bytes(), None)
    ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hetfed"),
                         *(x509.NameAttribute(NameOID.COMMON_NAME, cn) for cn in cns)])
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if uris:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in uris]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    cert_path, key_path = out / f"{name}.pem", out / f"{name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return TlsConfig(cert=str(cert_path), key=str(key_path), ca=str(certs.ca))


URI = ORGANIZATION_URI_PREFIX
CASES = {
    # name: (CNs, organization URIs, reason)
    "two-cns": (["org-a", "org-x"], [], "ambiguous_identity"),
    "two-cns-other-order": (["org-x", "org-a"], [], "ambiguous_identity"),
    "two-cns-same-uri": (["org-a", "org-x"], [URI + "org-a"], "ambiguous_identity"),
    "cn-and-other-uri": (["org-a"], [URI + "org-x"], "conflicting_identity"),
    "uri-and-other-cn": (["org-x"], [URI + "org-a"], "conflicting_identity"),
    "two-uris": (["org-a"], [URI + "org-a", URI + "org-x"], "ambiguous_identity"),
    "no-identity": ([], [], "no_identity"),
    "uri-without-cn": ([], [URI + "org-a"], "no_identity"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_certificate_naming_more_or_less_than_one_organization_is_refused(
        case: str, start: AggregatorFactory, certs: FederationCerts, tmp_path: Path) -> None:
    cns, uris, reason = CASES[case]
    assert REASONS[reason].status == "UNAUTHENTICATED"
    agg: RunningAggregator = start(certs.aggregator_tls())
    tls = _crafted(certs, tmp_path, case, cns, uris)
    for claimed in ("", "org-a"):
        with pytest.raises(grpc.RpcError) as info:
            join(agg, tls, claimed=claimed)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert info.value.details().startswith(reason)
    assert rejected(agg, reason) == 2
    # Status too: the certificate reads nothing (counted without a run).
    with make_channel(f"127.0.0.1:{agg.port}", tls) as ch, pytest.raises(grpc.RpcError) as info:
        agrpc.AggregatorStub(ch).Status(apb.StatusRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert rejected(agg, reason, run="") == 1
    # Nobody joined under the crafted certificate: the real org-a is unaffected and joins as itself.
    run = agg.service.runs[RUN]
    assert run.joined == set()
    assert join(agg, certs.client_tls("org-a")).run_id == RUN
    assert run.joined == {"org-a"}


def test_hetfed_certs_writes_one_cn_and_the_same_organization_uri(certs: FederationCerts) -> None:
    cert = x509.load_pem_x509_certificate(certs.organizations["org-a"][0].read_bytes())
    assert [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)] == ["org-a"]
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [URI + "org-a"]


def test_a_certificate_with_one_cn_and_no_uri_is_its_cn(
        start: AggregatorFactory, certs: FederationCerts, tmp_path: Path) -> None:
    """An outside PKI that writes only the CN still works."""
    agg = start(certs.aggregator_tls())
    assert join(agg, _crafted(certs, tmp_path, "cn-only", ["org-b"], [])).run_id == RUN
    assert agg.service.runs[RUN].joined == {"org-b"}
