"""The aggregator process: gRPC server with health service, metrics endpoint, deadline ticker, graceful stop."""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass

from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from hetfed.aggregator import k8s_events
from hetfed.aggregator.config import AggregatorConfig
from hetfed.aggregator.health_listener import start_health_listener
from hetfed.aggregator.metrics import AggregatorMetrics
from hetfed.aggregator.run_metrics import RunMetricsCollector
from hetfed.aggregator.service import AggregatorService
from hetfed.wire.rpc import add_aggregator_handler
from hetfed.wire.transport import make_server

log = logging.getLogger("hetfed.aggregator")
SERVICE_NAME = "hetfed.v1.Aggregator"


@dataclass
class RunningAggregator:
    """A started aggregator: its bound ports and a way to stop it."""

    port: int
    metrics_port: int
    service: AggregatorService
    _server: object
    _health: health.HealthServicer
    _stop: threading.Event
    _http: object | None
    _health_server: object | None = None

    def stop(self, grace: float = 2.0) -> None:
        """Flip health to NOT_SERVING, drain in-flight calls for ``grace`` seconds, stop."""
        self._health.enter_graceful_shutdown()
        self._stop.set()
        self._server.stop(grace).wait()  # type: ignore[attr-defined]
        if self._health_server is not None:
            self._health_server.stop(0)  # type: ignore[attr-defined]
        if self._http is not None:
            self._http.shutdown()  # type: ignore[attr-defined]

    def wait(self) -> None:
        """Block until the server stops."""
        self._server.wait_for_termination()  # type: ignore[attr-defined]


def start_aggregator(config: AggregatorConfig) -> RunningAggregator:
    """Start serving ``config`` (restoring each run's state from the state directory)."""
    metrics = AggregatorMetrics()
    service = AggregatorService(config, metrics)
    metrics.registry.register(RunMetricsCollector(lambda: list(service.runs.values())))
    server, port = make_server(config.server.listen, config.server.tls)
    add_aggregator_handler(server, service)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    http = None
    metrics_port = -1
    if config.server.metrics_port >= 0:
        http, _thread = start_http_server(
            config.server.metrics_port, addr=config.server.metrics_host, registry=metrics.registry
        )
        metrics_port = http.server_port
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_server = start_health_listener(config.server.health_listen, health_servicer) if config.server.health_listen else None
    stop = threading.Event()

    def ticker() -> None:
        while not stop.wait(0.2):
            try:
                service.tick()
            except Exception:  # keep closing rounds even if one tick fails
                log.exception("deadline tick failed")

    threading.Thread(target=ticker, name="hetfed-deadlines", daemon=True).start()
    log.info("aggregator serving on port %d (metrics on %d) with runs %s", port, metrics_port,
             ", ".join(service.runs))
    return RunningAggregator(port, metrics_port, service, server, health_servicer, stop, http, health_server)


def serve(config: AggregatorConfig, ready_file: str | None = None) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully."""
    k8s_events.start_from_environment()
    agg = start_aggregator(config)
    if ready_file:
        import json
        from pathlib import Path

        tmp = Path(ready_file + ".tmp")
        tmp.write_text(json.dumps({"port": agg.port, "metrics_port": agg.metrics_port}))
        tmp.replace(ready_file)
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    done.wait()
    agg.stop()
    k8s_events.shutdown()
