"""The aggregator process: an asyncio gRPC server with health service, metrics endpoint, deadline ticker and a
graceful stop that ends in bounded time.

The gRPC server runs on one event loop in a thread of its own; blocking work runs in the service's bounded
worker pool (see ``hetfed.aggregator.serving.service``). Threads: the caller's, the event loop's, gRPC's fixed
completion-queue pollers, ``server.worker_threads`` workers, the metrics HTTP server's and, from the first
push it makes durable, the spool's (its fsyncs); none per client.
With ``server.health_listen`` set, the plaintext health listener is a small child process fed by a heartbeat
of the serving loop (see ``hetfed.aggregator.serving.health_listener``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc.aio
from grpc_health.v1 import health_pb2
from prometheus_client import start_http_server

from hetfed.aggregator.config import AggregatorConfig
from hetfed.aggregator.journal.store import Disk
from hetfed.aggregator.observe import k8s_events
from hetfed.aggregator.observe.metrics import AggregatorMetrics
from hetfed.aggregator.observe.run_metrics import RunMetricsCollector
from hetfed.aggregator.serving.health_listener import HealthListener
from hetfed.aggregator.serving.service import AggregatorService
from hetfed.wire.rpc import SERVICE_NAME, add_aggregator_handler
from hetfed.wire.transport import Health, make_server

log = logging.getLogger("hetfed.aggregator")
# How often overdue rounds are closed (and failed closes retried).
TICK_SECONDS = 0.2


@dataclass
class RunningAggregator:
    """A started aggregator: its bound ports and a way to stop it (from any thread)."""

    port: int
    metrics_port: int
    service: AggregatorService
    _loop: asyncio.AbstractEventLoop
    _thread: threading.Thread
    _server: grpc.aio.Server
    _health: Health
    _ticker: asyncio.Task[None]
    _http: Any | None
    _health_listener: HealthListener | None = None
    _heartbeat: asyncio.Task[None] | None = None
    _stopped: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def stop(self, grace: float = 2.0) -> None:
        """Flip health to NOT_SERVING, answer long-polls with WAIT, drain other calls for ``grace`` seconds, stop.

        Bounded: calls still running after ``grace`` are cancelled; work already in the worker pool finishes.
        """
        with self._lock:
            if self._stopped.is_set():
                return
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(grace), self._loop).result(timeout=grace + 30)
            except Exception:
                log.exception("the gRPC server did not stop cleanly")
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=30)
                if not self._thread.is_alive():
                    self._loop.close()
                self.service.close()
                if self._health_listener is not None:
                    self._health_listener.stop()
                if self._http is not None:
                    self._http.shutdown()
                self._stopped.set()

    async def _shutdown(self, grace: float) -> None:
        self._health.enter_graceful_shutdown()
        self.service.stopping()
        self._ticker.cancel()
        await self._server.stop(grace)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    def wait(self) -> None:
        """Block until the aggregator has stopped."""
        self._stopped.wait()


async def _tick(service: AggregatorService) -> None:
    while True:
        await asyncio.sleep(TICK_SECONDS)
        try:
            await service.blocking(service.tick)
        except Exception:  # keep closing rounds even if one tick fails
            log.exception("deadline tick failed")


def start_aggregator(config: AggregatorConfig, disk: Disk | None = None) -> RunningAggregator:
    """Start serving ``config``, restoring each run's state from the state directory first.

    Raises ``StateError`` (naming the file and the problem) when a run's state cannot be resumed. ``disk``
    replaces the store's file layer (tests inject failures with it).
    """
    metrics = AggregatorMetrics()
    service = AggregatorService(config, metrics, disk)
    metrics.registry.register(RunMetricsCollector(lambda: list(service.runs.values())))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="hetfed-grpc", daemon=True)
    thread.start()

    listener = (HealthListener(config.server.health_listen, config.server.health_stall_seconds)
                if config.server.health_listen else None)

    async def boot() -> tuple[grpc.aio.Server, int, Health, asyncio.Task[None], asyncio.Task[None] | None]:
        server, port = make_server(config.server.listen, config.server.tls, config.server.stream_window_bytes)
        add_aggregator_handler(server, service)
        health = Health()
        if listener is not None:
            health.on_change.append(listener.mirror)
        server.add_generic_rpc_handlers((health.generic_handler(),))
        await server.start()
        for name in ("", SERVICE_NAME):
            health.set(name, health_pb2.HealthCheckResponse.SERVING)
        beat = asyncio.create_task(listener.heartbeat.beat()) if listener is not None else None
        return server, port, health, asyncio.create_task(_tick(service)), beat

    try:
        if listener is not None:
            listener.start()
        server, port, health, ticker, beat = asyncio.run_coroutine_threadsafe(boot(), loop).result(timeout=60)
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        service.close()
        if listener is not None:
            listener.stop()
        raise
    http = None
    metrics_port = -1
    if config.server.metrics_port >= 0:
        http, _thread = start_http_server(
            config.server.metrics_port, addr=config.server.metrics_host, registry=metrics.registry
        )
        metrics_port = http.server_port
    log.info("aggregator serving on port %d (metrics on %d) with runs %s", port, metrics_port,
             ", ".join(service.runs))
    return RunningAggregator(port, metrics_port, service, loop, thread, server, health, ticker, http, listener, beat)


def serve(config: AggregatorConfig, ready_file: str | None = None) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully."""
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        done.set()

    # Before anything starts: a SIGTERM during start-up (a pod deleted while restoring) still stops gracefully.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    k8s_events.start_from_environment()
    agg = start_aggregator(config)
    if ready_file:
        tmp = Path(ready_file + ".tmp")
        tmp.write_text(json.dumps({"port": agg.port, "metrics_port": agg.metrics_port}))
        tmp.replace(ready_file)
    done.wait()
    agg.stop()
    k8s_events.shutdown()
