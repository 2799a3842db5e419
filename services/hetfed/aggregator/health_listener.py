"""A plaintext listener that serves only the gRPC health service, for the kubelet's probes.

Under mTLS the aggregator's gRPC port requires a client certificate, and the kubelet's built-in gRPC
probe presents none. This second listener shares the aggregator's ``Health`` service (so it reports
NOT_SERVING as soon as a graceful stop begins) and carries nothing else: no run, no status, no payload.
"""

from __future__ import annotations

import grpc.aio

from hetfed.wire.transport import Health, make_server


async def start_health_listener(address: str, health: Health) -> grpc.aio.Server:
    """Serve ``health`` in plaintext on ``address`` (``host:port``) from the running event loop; returns the
    started server."""
    server, _port = make_server(address, None)
    server.add_generic_rpc_handlers((health.generic_handler(),))
    await server.start()
    return server
