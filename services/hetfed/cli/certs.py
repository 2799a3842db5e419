"""``hetfed certs``: a CA, the aggregator's server certificate and one client certificate per organization.

An organization's identity under mTLS is its certificate's common name, so the names given here are the
organization ids of the runs. Keys are EC P-256; private keys are written with mode 0600.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hetfed.aggregator.config import NAME_RE
from hetfed.wire.identity import ORGANIZATION_URI_PREFIX
from hetfed.wire.transport import TlsConfig

DEFAULT_AGGREGATOR_NAMES = ("localhost", "127.0.0.1")
CA_COMMON_NAME = "hetfed federation CA"
# Certificates are valid from a little before now, so a client whose clock lags slightly still accepts them.
_CLOCK_SKEW = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class FederationCerts:
    """Paths of the PEM files ``make_federation_certs`` wrote."""

    ca: Path
    ca_key: Path
    aggregator: Path
    aggregator_key: Path
    # organization -> (certificate, private key)
    organizations: dict[str, tuple[Path, Path]]

    def aggregator_tls(self) -> TlsConfig:
        """The aggregator's ``server.tls`` section."""
        return TlsConfig(cert=str(self.aggregator), key=str(self.aggregator_key), ca=str(self.ca))

    def client_tls(self, organization: str, server_name: str = "") -> TlsConfig:
        """An organization's ``tls`` section (``server_name`` when the dialled host is not in the SANs)."""
        cert, key = self.organizations[organization]
        return TlsConfig(cert=str(cert), key=str(key), ca=str(self.ca), server_name=server_name)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hetfed"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for n in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            entries.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(entries)


def _org_san(organization: str) -> x509.SubjectAlternativeName:
    """The organization as a URI name too, equal to the CN (``hetfed.wire.identity`` refuses any other)."""
    return x509.SubjectAlternativeName([x509.UniformResourceIdentifier(f"{ORGANIZATION_URI_PREFIX}{organization}")])


def _leaf(
    subject_key: ec.EllipticCurvePrivateKey,
    common_name: str,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    eku: x509.ObjectIdentifier,
    days: int,
    now: dt.datetime,
    san: x509.SubjectAlternativeName | None = None,
) -> x509.Certificate:
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(subject_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=False, crl_sign=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(subject_key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
    )
    if san is not None:
        builder = builder.add_extension(san, critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def _ca(key: ec.EllipticCurvePrivateKey, days: int, now: dt.datetime) -> x509.Certificate:
    name = _name(CA_COMMON_NAME)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with ``mode`` from the first byte on (a temporary file, then a rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have narrowed it
        with os.fdopen(fd, "wb") as f:
            fd = -1
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise


def make_federation_certs(
    out_dir: str | Path,
    organizations: Sequence[str],
    aggregator_names: Sequence[str] | None = None,
    days: int = 365,
    force: bool = False,
) -> FederationCerts:
    """Write a new federation's CA, aggregator certificate and per-organization client certificates.

    ``aggregator_names`` become the server certificate's subject alternative names (an IP address
    becomes an IP SAN, anything else a DNS name); the default is localhost and 127.0.0.1. Existing
    files are never replaced unless ``force`` is set.
    """
    out = Path(out_dir)
    orgs = list(organizations)
    names = list(aggregator_names) if aggregator_names else list(DEFAULT_AGGREGATOR_NAMES)
    if not orgs:
        raise ValueError("at least one organization is needed")
    for org in orgs:
        if not NAME_RE.match(org):
            raise ValueError(f"organization {org!r} must match {NAME_RE.pattern}")
    if len(set(orgs)) != len(orgs):
        raise ValueError(f"organizations must be unique, got {orgs}")
    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    for n in names:
        if not n or any(c.isspace() for c in n):
            raise ValueError(f"aggregator name {n!r} must be a non-empty host name or IP address")

    files = {"ca": ("ca.pem", "ca-key.pem"), "aggregator": ("aggregator.pem", "aggregator-key.pem")}
    stems = [*files, *orgs]
    all_names = [f"{s}.pem" for s in stems] + [f"{s}-key.pem" for s in stems]
    clashes = sorted({n for n in all_names if all_names.count(n) > 1})
    if clashes:
        raise ValueError(f"organization names clash with other files of the federation: {', '.join(clashes)}")
    existing = [n for n in all_names if (out / n).exists()]
    if existing and not force:
        raise FileExistsError(f"{out} already holds {', '.join(existing)}; pass --force to replace them")

    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = dt.datetime.now(dt.UTC)
    ca_key = _new_key()
    ca_cert = _ca(ca_key, days, now)
    _write(out / "ca-key.pem", _key_pem(ca_key), 0o600)
    _write(out / "ca.pem", _cert_pem(ca_cert), 0o644)

    agg_key = _new_key()
    agg_cert = _leaf(agg_key, names[0], ca_cert, ca_key, ExtendedKeyUsageOID.SERVER_AUTH, days, now, _san(names))
    _write(out / "aggregator-key.pem", _key_pem(agg_key), 0o600)
    _write(out / "aggregator.pem", _cert_pem(agg_cert), 0o644)

    issued: dict[str, tuple[Path, Path]] = {}
    for org in orgs:
        key = _new_key()
        cert = _leaf(key, org, ca_cert, ca_key, ExtendedKeyUsageOID.CLIENT_AUTH, days, now, _org_san(org))
        _write(out / f"{org}-key.pem", _key_pem(key), 0o600)
        _write(out / f"{org}.pem", _cert_pem(cert), 0o644)
        issued[org] = (out / f"{org}.pem", out / f"{org}-key.pem")
    return FederationCerts(
        ca=out / "ca.pem", ca_key=out / "ca-key.pem", aggregator=out / "aggregator.pem",
        aggregator_key=out / "aggregator-key.pem", organizations=issued,
    )
