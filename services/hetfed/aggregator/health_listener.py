"""A plaintext listener that serves only the gRPC health service, for the kubelet's probes.

Under mTLS the aggregator's gRPC port requires a client certificate, and the kubelet's built-in gRPC
probe presents none. This second listener shares the aggregator's ``HealthServicer`` (so it reports
NOT_SERVING as soon as a graceful stop begins) and carries nothing else: no run, no status, no payload.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from hetfed.wire.transport import make_server


def start_health_listener(address: str, servicer: health.HealthServicer) -> grpc.Server:
    """Serve ``servicer`` in plaintext on ``address`` (``host:port``); returns the started server."""
    server, _port = make_server(address, None, max_workers=2)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.start()
    return server
