"""An organization's identity from its client certificate: exactly one name, or a refusal.

The organization is the certificate subject's common name (CN), and there must be exactly one CN. A
certificate may also name the organization as a URI subject alternative name
``urn:hetfed:organization:<name>`` (``hetfed certs`` writes both); then there must be exactly one such URI and
it must equal the CN. Anything else is refused with ``UNAUTHENTICATED``, whatever order the names come in:
gRPC's own ``x509_common_name`` is the first CN of a subject that may hold several.
"""

from __future__ import annotations

from functools import lru_cache

from cryptography import x509
from cryptography.x509.oid import NameOID

from hetfed.wire.errors import WireError

ORGANIZATION_URI_PREFIX = "urn:hetfed:organization:"


def _clip(text: str, limit: int = 64) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def organization_of(cert: x509.Certificate) -> str:
    """The one organization a certificate names; WireError (``ambiguous_identity``, ``conflicting_identity``,
    ``no_identity``) otherwise."""
    cns = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier)
                if u.startswith(ORGANIZATION_URI_PREFIX)]
    except x509.ExtensionNotFound:
        uris = []
    if len(cns) > 1:
        raise WireError("ambiguous_identity", f"the client certificate has {len(cns)} common names "
                                              f"({', '.join(repr(_clip(c)) for c in cns[:4])}); exactly one is allowed")
    if len(uris) > 1:
        raise WireError("ambiguous_identity", f"the client certificate has {len(uris)} {ORGANIZATION_URI_PREFIX} "
                                              "names; at most one is allowed")
    if not cns or not cns[0]:
        raise WireError("no_identity", "the client certificate has no common name (the organization's id)")
    if uris and uris[0][len(ORGANIZATION_URI_PREFIX):] != cns[0]:
        raise WireError("conflicting_identity", f"the client certificate's common name {_clip(cns[0])!r} and its "
                                                f"URI name {_clip(uris[0])!r} disagree")
    return cns[0]


@lru_cache(maxsize=1024)
def organization_of_pem(pem: bytes) -> str:
    """``organization_of`` a PEM certificate (cached: a connection sends the same certificate every call)."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise WireError("no_identity", f"the client certificate cannot be read ({exc})") from None
    return organization_of(cert)
