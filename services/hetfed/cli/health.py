"""``hetfed health ADDRESS``: the aggregator image's own health check (helm test, probes by hand, scripts).

Calls the standard gRPC health service for ``hetfed.v1.Aggregator`` and, with ``--status``, the
aggregator's ``Status``; exits 0 only when the service is SERVING (and Status answered). Under mTLS it
needs a client certificate from the federation's CA (the operator's, so Status shows every run).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hetfed.wire.messages import RunStatus
    from hetfed.wire.transport import TlsConfig

SERVICE_NAME = "hetfed.v1.Aggregator"


def progress(run: RunStatus) -> str:
    """Where a run stands, for a person: ``train, round 2 of 3``; ``round 3 of 3, finished`` once it ended."""
    # The final evaluation counts as round R + 1 on the wire; a person reads the R-th of R as the last one.
    shown = min(run.round, run.total_rounds)
    if run.finished:
        return f"round {shown} of {run.total_rounds}, finished"
    return f"{run.phase.value}, round {shown} of {run.total_rounds}"


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``hetfed health``."""
    p = subparsers.add_parser(
        "health",
        help="check that an aggregator serves (gRPC health service, optionally its Status)",
        description="Exits 0 when the aggregator at ADDRESS reports SERVING; with --status also prints every "
        "run's state. Under mTLS pass a client certificate of the federation (the operator's).",
    )
    p.add_argument("address", help="host:port of the aggregator's gRPC (or plaintext health) port")
    p.add_argument("--service", default=SERVICE_NAME, help=f"health service name to check (default {SERVICE_NAME})")
    p.add_argument("--status", action="store_true", help="also call Status and print each run's state")
    add_tls_arguments(p)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each answer (default 10)")
    p.set_defaults(func=main)


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    """The client-certificate options shared by ``hetfed health`` and ``hetfed status``."""
    p.add_argument("--tls-cert", help="PEM client certificate (mTLS)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", help="PEM certificate of the federation's CA")
    p.add_argument("--server-name", default="", help="name in the aggregator's certificate, when it differs from the host")


def tls_from_args(args: argparse.Namespace) -> TlsConfig | None:
    """The TlsConfig the --tls-* options name, None when none is given; all three or none."""
    given = [args.tls_cert, args.tls_key, args.tls_ca]
    if not any(given):
        return None
    if not all(given):
        raise SystemExit("hetfed: --tls-cert, --tls-key and --tls-ca go together")
    from hetfed.wire.transport import TlsConfig

    return TlsConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca, server_name=args.server_name)


def main(args: argparse.Namespace) -> int:
    """Run ``hetfed health``."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from hetfed.wire.rpc import RemoteError, status_of
    from hetfed.wire.transport import make_channel

    with make_channel(args.address, tls_from_args(args)) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as err:
            print(f"{args.address}: health check failed: {err.code().name}: {err.details()}",  # type: ignore[attr-defined]
                  file=sys.stderr)
            return 1
        state = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        print(f"{args.address} {args.service}: {state}")
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            return 1
        if args.status:
            try:
                runs = status_of(args.address, tls_from_args(args), timeout=args.timeout)
            except RemoteError as err:
                print(f"{args.address}: Status failed: {err}", file=sys.stderr)
                return 1
            for run in runs:
                print(f"run {run.run_id} ({run.algorithm}): {progress(run)}, {len(run.organizations)} organizations")
    return 0
