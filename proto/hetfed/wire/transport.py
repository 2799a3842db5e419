"""One gRPC server factory and one channel factory: TLS/mTLS, keepalive, message limits, identity."""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from hetfed.wire.config import check

# Chunks are at most a few MiB, so a generous per-message limit never binds a whole payload.
MAX_GRPC_MESSAGE_BYTES = 64 << 20
ORGANIZATION_METADATA_KEY = "x-hetfed-organization"

_COMMON_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]


@dataclass(frozen=True)
class TlsConfig:
    """PEM files for mutual TLS: this side's certificate and key, and the federation's CA."""

    cert: str
    key: str
    ca: str
    # Clients only: the name the aggregator's certificate was issued for, when it differs from the host.
    server_name: str = ""

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            check(bool(getattr(self, name)), f"tls.{name} must name a PEM file")

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, private key, CA certificates) as bytes."""
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), Path(self.ca).read_bytes()


def make_server(address: str, tls: TlsConfig | None, max_workers: int = 32) -> tuple[grpc.Server, int]:
    """A gRPC server bound to ``address`` (mTLS when ``tls`` is set); returns it and the bound port."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="hetfed-rpc"),
        options=[*_COMMON_OPTIONS, ("grpc.so_reuseport", 0)],
    )
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        cert, key, ca = tls.read()
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
        port = server.add_secure_port(address, creds)
    if port == 0:
        raise OSError(f"could not bind the gRPC server to {address}")
    return server, port


def make_channel(address: str, tls: TlsConfig | None) -> grpc.Channel:
    """A channel to the aggregator (mTLS when ``tls`` is set)."""
    if tls is None:
        return grpc.insecure_channel(address, options=_COMMON_OPTIONS)
    cert, key, ca = tls.read()
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    options = list(_COMMON_OPTIONS)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(address, creds, options=options)


def peer_identity(context: grpc.ServicerContext) -> str | None:
    """The organization named by the client certificate's common name, or None on insecure channels."""
    auth = context.auth_context()
    names = auth.get("x509_common_name") or []
    return names[0].decode() if names else None
