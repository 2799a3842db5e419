"""``hetfed certs``: files, permissions, chain, names, key usages, and no silent overwrite."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import verification
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hetfed.cli import main
from hetfed.cli.certs import FederationCerts, make_federation_certs

ORGS = ["org-a", "org-b", "org-c"]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> FederationCerts:
    return make_federation_certs(tmp_path_factory.mktemp("fed") / "certs", ORGS)


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _cn(cert: x509.Certificate) -> str:
    return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


def _eku(cert: x509.Certificate) -> list[x509.ObjectIdentifier]:
    return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_writes_every_file_with_private_keys_0600(made: FederationCerts) -> None:
    out = made.ca.parent
    expected = {"ca.pem", "ca-key.pem", "aggregator.pem", "aggregator-key.pem"}
    expected |= {f"{o}.pem" for o in ORGS} | {f"{o}-key.pem" for o in ORGS}
    assert {p.name for p in out.iterdir()} == expected
    for name in expected:
        mode = stat.S_IMODE((out / name).stat().st_mode)
        assert mode == (0o600 if name.endswith("-key.pem") else 0o644), name
    assert set(made.organizations) == set(ORGS)


def test_keys_are_ec_p256_and_match_their_certificates(made: FederationCerts) -> None:
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    pairs = [(made.ca, made.ca_key), (made.aggregator, made.aggregator_key), *made.organizations.values()]
    for cert_path, key_path in pairs:
        key = load_pem_private_key(key_path.read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        assert key.curve.name == "secp256r1"
        assert key.public_key() == _load(cert_path).public_key()


def test_ca_is_a_ca_and_signs_every_leaf(made: FederationCerts) -> None:
    ca = _load(made.ca)
    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert bc.ca
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    for path in [made.aggregator, *(c for c, _ in made.organizations.values())]:
        leaf = _load(path)
        leaf.verify_directly_issued_by(ca)  # raises on a wrong issuer or signature
        assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_aggregator_certificate_verifies_for_its_names_as_a_server(made: FederationCerts) -> None:
    ca, leaf = _load(made.ca), _load(made.aggregator)
    store = verification.Store([ca])
    assert _eku(leaf) == [ExtendedKeyUsageOID.SERVER_AUTH]
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    for name in (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))):
        verifier = verification.PolicyBuilder().store(store).build_server_verifier(name)
        verifier.verify(leaf, [])
    other = verification.PolicyBuilder().store(store).build_server_verifier(x509.DNSName("example.org"))
    with pytest.raises(verification.VerificationError):
        other.verify(leaf, [])


def test_organization_certificates_name_the_organization_and_are_client_only(made: FederationCerts) -> None:
    ca = _load(made.ca)
    verifier = verification.PolicyBuilder().store(verification.Store([ca])).build_client_verifier()
    for org, (cert_path, _) in made.organizations.items():
        leaf = _load(cert_path)
        assert _cn(leaf) == org
        assert _eku(leaf) == [ExtendedKeyUsageOID.CLIENT_AUTH]
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [f"urn:hetfed:organization:{org}"]
        verifier.verify(leaf, [])
    # An organization's certificate cannot serve as the aggregator's.
    server = verification.PolicyBuilder().store(verification.Store([ca])).build_server_verifier(
        x509.DNSName("localhost")
    )
    with pytest.raises(verification.VerificationError):
        server.verify(_load(made.organizations["org-a"][0]), [])


def test_custom_aggregator_names_and_validity(tmp_path: Path) -> None:
    made = make_federation_certs(tmp_path, ["org-a"], ["agg.hetfed.svc", "10.0.0.5", "::1"], days=30)
    leaf = _load(made.aggregator)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["agg.hetfed.svc"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.5"), ipaddress.ip_address("::1")]
    assert _cn(leaf) == "agg.hetfed.svc"
    lifetime = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert 30 * 86400 <= lifetime.total_seconds() <= 30 * 86400 + 3600


def test_refuses_to_overwrite_unless_forced(tmp_path: Path) -> None:
    first = make_federation_certs(tmp_path, ["org-a"])
    before = first.ca.read_bytes()
    with pytest.raises(FileExistsError, match=r"ca\.pem"):
        make_federation_certs(tmp_path, ["org-a"])
    assert first.ca.read_bytes() == before
    # Even one existing organization file stops the whole run, before anything is written.
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "org-a.pem").write_text("somebody's certificate")
    with pytest.raises(FileExistsError, match=r"org-a\.pem"):
        make_federation_certs(lone, ["org-b", "org-a"])
    assert [p.name for p in lone.iterdir()] == ["org-a.pem"]
    again = make_federation_certs(tmp_path, ["org-a"], force=True)
    assert again.ca.read_bytes() != before
    assert stat.S_IMODE(again.ca_key.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("orgs", "message"),
    [
        ([], "at least one"),
        (["../evil"], "must match"),
        (["org a"], "must match"),
        (["org-a", "org-a"], "unique"),
        (["ca"], "clash"),
        (["aggregator-key"], "clash"),
        (["org-a", "org-a-key"], "clash"),
    ],
)
def test_rejects_bad_organization_names(tmp_path: Path, orgs: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_federation_certs(tmp_path / "out", orgs)
    assert not (tmp_path / "out").exists()


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "certs"
    argv = ["certs", "--out", str(out), "--organizations", "org-a, org-b", "--aggregator-name", "agg.example",
            "--aggregator-name", "127.0.0.1", "--days", "10"]
    assert main(argv) == 0
    assert "org-b" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} >= {"ca.pem", "aggregator.pem", "org-a.pem", "org-b-key.pem"}
    san = _load(out / "aggregator.pem").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["agg.example"]
    assert main(argv) == 2
    assert "--force" in capsys.readouterr().err
    assert main([*argv, "--force"]) == 0
