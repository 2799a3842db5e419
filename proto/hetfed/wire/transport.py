"""One gRPC server factory and one channel factory: TLS/mTLS, keepalive, message limits, identity, health."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable

import grpc
import grpc.aio
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from hetfed.wire.errors import WireError
from hetfed.wire.identity import organization_of_pem
from hetfed.wire.tls import TlsConfig
from hetfed.wire.windows import (
    CHANNEL_WINDOW_BYTES,
    DEFAULT_WINDOW_BYTES,
    READ_CAP_BYTES,
)

log = logging.getLogger("hetfed.transport")

# Chunks are at most a few MiB, so a generous per-message limit never binds a whole payload.
MAX_GRPC_MESSAGE_BYTES = 64 << 20
ORGANIZATION_METADATA_KEY = "x-hetfed-organization"

# Each end pings the other after this long without receiving anything, and drops the connection when the
# ping's answer takes longer than KEEPALIVE_TIMEOUT_MS.
KEEPALIVE_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000


def _common_options(keepalive_ms: int) -> list[tuple[str, int | str]]:
    return [
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def ping_policy_options(keepalive_ms: int) -> list[tuple[str, int]]:
    """The server's side of the clients' keepalive: it accepts their pings every ``keepalive_ms``.

    gRPC's server counts a strike for every ping that comes sooner than its minimum interval after the previous
    one, unless it sent data, headers or a connection window update in between, and answers the third strike
    with GOAWAY "too_many_pings" (UNAVAILABLE), closing the connection and every call on it. Its default
    minimum is 5 minutes, so a connection on which the server sends nothing for four keepalive periods is
    closed: a push whose window stays full that long (waiting for admission, or not read by a busy server).
    The minimum is two thirds of the clients' interval, so that a ping a little early (timers, a loaded
    machine) is no strike. The channel argument's name is ``grpc.http2.min_ping_interval_without_data_ms``
    (C's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS); gRPC ignores names it does not know."""
    return [("grpc.http2.min_ping_interval_without_data_ms", keepalive_ms * 2 // 3)]


def matching_pair(cert: bytes, key: bytes) -> str:
    """Why ``cert`` (the chain's first certificate) and ``key`` do not belong together ("" when they do)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        leaf = x509.load_pem_x509_certificate(cert)
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as exc:
        return f"cannot be parsed ({exc})"
    der = serialization.Encoding.DER
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if leaf.public_key().public_bytes(der, spki) != private.public_key().public_bytes(der, spki):
        return "the key does not match the certificate"
    return ""


class CertificateReloader:
    """The server's certificate, key and client CA, re-read from their files when they change (cert-manager or
    ``hetfed certs`` renewing them under a running aggregator): gRPC asks ``fetch`` at every new handshake.

    The files are looked at (stat) on each handshake and read only when their signature changed; a new set
    is served only when it differs and its key matches its certificate (a half-written renewal keeps the old
    set until it is whole). Connections already open keep the certificate they were made with."""

    def __init__(self, tls: TlsConfig) -> None:
        self.tls = tls
        self._lock = threading.Lock()
        self._signature = tls.signature()
        self._served = tls.read()
        self._refused: tuple[bytes, bytes, bytes] | None = None
        self.reloads = 0

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        """The configuration of the files as served now."""
        cert, key, ca = self._served
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration when the files changed into a usable set, else None (gRPC keeps the current)."""
        try:
            with self._lock:
                signature = self.tls.signature()
                if signature is None or signature == self._signature:
                    return None
                files = self.tls.read()
                self._signature = signature
                if files == self._served or files == self._refused:
                    return None
                why = matching_pair(files[0], files[1])
                if why:
                    self._refused = files
                    log.warning("the renewed certificate in %s is not served: %s; the previous one still is",
                                self.tls.cert, why)
                    return None
                self._served, self._refused = files, None
                self.reloads += 1
            log.info("serving the renewed certificate, key and client CA from %s, %s and %s", self.tls.cert,
                     self.tls.key, self.tls.ca)
            return self.configuration()
        except Exception as exc:  # never fail a handshake over a reload: the current set stays
            log.warning("the TLS files could not be re-read (%s: %s); the previous ones are served",
                        type(exc).__name__, exc)
            return None


def server_credentials(tls: TlsConfig) -> tuple[grpc.ServerCredentials, CertificateReloader]:
    """mTLS server credentials that follow the files' renewals (``CertificateReloader``)."""
    reloader = CertificateReloader(tls)
    creds = grpc.dynamic_ssl_server_credentials(reloader.configuration(), reloader.fetch,
                                                require_client_authentication=True)
    return creds, reloader




def stream_window_options(window_bytes: int) -> list[tuple[str, int]]:
    """gRPC options that fix every stream's HTTP/2 receive window at ``window_bytes`` and cap each
    connection's socket reads at ``READ_CAP_BYTES`` (0: gRPC's adaptive windows, reads still capped).

    By default gRPC grows each connection's window with its bandwidth-delay product estimate (BDP probing), to
    at least 4 MiB and without an upper bound: a server then holds that much received, unread data for every
    client that sends faster than it reads, such as a push waiting for admission. A fixed window bounds that
    at one window (plus the rest of the message being read, at most 1 MiB) per stream. gRPC asks for more of a
    stream only once half its window has been read, so a stream moves about window / 2 per round trip.

    Each connection's socket reads are capped too. gRPC sizes a connection's read buffer to the largest read it
    has seen and keeps it between reads; ``tcp_max_read_chunk_size`` caps that in its iomgr endpoint only, not
    in the EventEngine endpoint that grpcio 1.85 uses (grpc/grpc#42194), which reads
    ``tcp_max_read_buffer_size`` instead. Without it, every connection that had carried a push of 1 MiB chunks
    kept 0.5 to 0.6 MB (docs/benchmarks.md, "The aggregator's hot path").
    """
    reads: list[tuple[str, int]] = [("grpc.experimental.tcp_max_read_chunk_size", READ_CAP_BYTES),
                                    ("grpc.experimental.tcp_max_read_buffer_size", READ_CAP_BYTES)]
    if window_bytes == 0:
        return reads
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", window_bytes), *reads]


def make_server(address: str, tls: TlsConfig | None, stream_window_bytes: int = DEFAULT_WINDOW_BYTES,
                keepalive_ms: int = KEEPALIVE_MS) -> tuple[grpc.aio.Server, int]:
    """An asyncio gRPC server bound to ``address`` (mTLS when ``tls`` is set); returns it and the bound port.

    Call it inside the event loop that will run the server. Handlers are coroutines: a waiting call holds no
    thread, so the server's thread count does not grow with its clients. ``stream_window_bytes`` fixes the
    receive window of each stream (:func:`stream_window_options`); the clients' keepalive pings every
    ``keepalive_ms`` are accepted (:func:`ping_policy_options`).
    """
    server = grpc.aio.server(options=[
        *_common_options(keepalive_ms), ("grpc.so_reuseport", 0),
        *ping_policy_options(keepalive_ms),
        *stream_window_options(stream_window_bytes),
    ])
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        creds, _ = server_credentials(tls)
        port = server.add_secure_port(address, creds)
    if port == 0:
        raise OSError(f"could not bind the gRPC server to {address}")
    return server, port


class Health:
    """The standard ``grpc.health.v1.Health`` service (Check, Watch) for an asyncio server.

    Requests are parsed from bytes in the handler, like the Aggregator service's. Use it from the server's
    event loop only.
    """

    SERVICE = "grpc.health.v1.Health"

    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._changed: asyncio.Event | None = None
        self._shutting_down = False
        # Called with (statuses, shutting down) after every change, from the thread that made it.
        self.on_change: list[Callable[[dict[str, int], bool], None]] = []

    def set(self, service: str, status: int) -> None:
        """Set a service's status (ignored once shutting down)."""
        if not self._shutting_down:
            self._status[service] = status
            self._notify()

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING from now on."""
        for service in self._status:
            self._status[service] = health_pb2.HealthCheckResponse.NOT_SERVING
        self._shutting_down = True
        self._notify()

    def status(self, service: str) -> int | None:
        """What a check of ``service`` answers now (None: never set)."""
        return self._status.get(service)

    def wake_watchers(self) -> None:
        """Let Watch streams re-read the status (after it may have changed without ``set``)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _notify(self) -> None:
        self.wake_watchers()
        if self.on_change:
            snapshot = dict(self._status)
            for callback in self.on_change:
                callback(snapshot, self._shutting_down)

    @staticmethod
    async def _request(request: bytes, context: grpc.aio.ServicerContext) -> str:  # type: ignore[type-arg]
        try:
            return health_pb2.HealthCheckRequest.FromString(request).service
        except DecodeError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed: not a HealthCheckRequest")
            raise AssertionError("unreachable") from None

    async def check(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:  # type: ignore[type-arg]
        """The service's status now (NOT_FOUND for a service never set)."""
        service = await self._request(request, context)
        status = self.status(service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service[:64]!r}")
        return health_pb2.HealthCheckResponse(status=status).SerializeToString()

    async def watch(self, request: bytes,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:  # type: ignore[type-arg]
        """The service's status now and at every change."""
        service = await self._request(request, context)
        last = None
        while True:
            status = self.status(service)
            if status is None:
                status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status).SerializeToString()
                last = status
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """The service's method handlers, with raw-bytes requests and responses."""
        return grpc.method_handlers_generic_handler(self.SERVICE, {
            "Check": grpc.unary_unary_rpc_method_handler(self.check),
            "Watch": grpc.unary_stream_rpc_method_handler(self.watch),
        })


# gRPC shares one TCP connection among every channel of a process with the same target and options (its
# global subchannel pool). Each organization is a connection of its own in a deployment, so every channel
# made here is too, including the many organizations one benchmark or test process may run.
OWN_CONNECTION: tuple[str, int] = ("grpc.use_local_subchannel_pool", 1)


def make_channel(address: str, tls: TlsConfig | None, window_bytes: int = CHANNEL_WINDOW_BYTES,
                 keepalive_ms: int = KEEPALIVE_MS) -> grpc.Channel:
    """A channel to the aggregator (mTLS when ``tls`` is set), on a TCP connection of its own, that pings it
    after ``keepalive_ms`` without receiving anything (the aggregator's ``make_server`` accepts that).

    What it receives (pulls) flows in a fixed window of ``window_bytes`` (0: gRPC's adaptive windows), as the
    aggregator's pushes do: gRPC's adaptive windows filled 65 to 80 % of a 1 Gbit/s link at 100 ms, a fixed
    32 MiB all of it (docs/benchmarks.md)."""
    options: list[tuple[str, int | str]] = [*_common_options(keepalive_ms), OWN_CONNECTION]
    if window_bytes:
        options += [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", window_bytes)]
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    cert, key, ca = tls.read()
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(address, creds, options=options)


def peer_identity(context: grpc.ServicerContext | grpc.aio.ServicerContext) -> str | None:  # type: ignore[type-arg]
    """The organization the client certificate names (``hetfed.wire.identity``), or None on insecure channels.

    Raises WireError (``UNAUTHENTICATED``) for a certificate with several names, disagreeing names or none."""
    auth = context.auth_context()
    pems = auth.get("x509_pem_cert") or []
    if pems:
        return organization_of_pem(pems[0])
    if auth.get("x509_common_name") or auth.get("transport_security_type") == [b"ssl"]:
        raise WireError("no_identity", "the TLS peer presented no readable client certificate")
    return None
