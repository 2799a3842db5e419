"""The gRPC servicer: converts at the boundary, checks identity and limits, maps WireError to a status."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import grpc

from hetfed.aggregator import k8s_events
from hetfed.aggregator.config import AggregatorConfig
from hetfed.aggregator.engine import Run
from hetfed.aggregator.metrics import AggregatorMetrics
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import aggregator_pb2_grpc as agrpc
from hetfed.wire import chunks
from hetfed.wire.errors import WireError
from hetfed.wire.traffic import TrafficBreakdown, with_envelope
from hetfed.wire.transport import ORGANIZATION_METADATA_KEY, peer_identity

log = logging.getLogger("hetfed.aggregator")


class _RateLimiter:
    """A token bucket per organization."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def allow(self, key: str) -> bool:
        if self.rate <= 0:
            return True
        with self._lock:
            tokens, last = self._buckets.get(key, (self.rate * 2, time.monotonic()))
            now = time.monotonic()
            tokens = min(self.rate * 2, tokens + (now - last) * self.rate)
            if tokens < 1:
                self._buckets[key] = (tokens, now)
                return False
            self._buckets[key] = (tokens - 1, now)
            return True


class AggregatorService(agrpc.AggregatorServicer):
    """Hosts every configured run behind one gRPC service."""

    def __init__(self, config: AggregatorConfig, metrics: AggregatorMetrics) -> None:
        self.config = config
        self.metrics = metrics
        s = config.server
        self.runs = {
            r.id: Run(r, s.state_dir, metrics, s.chunk_bytes, s.max_update_bytes, s.max_tensor_elements)
            for r in config.runs
        }
        self._limiter = _RateLimiter(s.max_requests_per_second)

    # ------------------------------------------------------------------ helpers
    def _run(self, run_id: str) -> Run:
        run = self.runs.get(run_id)
        if run is None:
            raise WireError("unknown_run", f"no run {run_id!r} on this aggregator (runs: {sorted(self.runs)})")
        return run

    def _identity(self, context: grpc.ServicerContext, claimed: str) -> str:
        """The caller's organization: its certificate's name under mTLS, else the metadata header; rate-limited."""
        cert_name = peer_identity(context)
        if cert_name is not None:
            if claimed and claimed != cert_name:
                raise WireError(
                    "identity_mismatch", f"the client certificate is for {cert_name!r}, the request claims {claimed!r}"
                )
            org = cert_name
        else:
            header = dict(context.invocation_metadata()).get(ORGANIZATION_METADATA_KEY, "")
            if header and claimed and header != claimed:
                raise WireError("identity_mismatch", f"metadata names {header!r}, the request claims {claimed!r}")
            org = claimed or header
            if not org:
                raise WireError("unauthenticated", "no organization identity (no client certificate, no organization)")
        if not self._limiter.allow(org):
            raise WireError("rate_limited", f"organization {org!r} exceeds {self._limiter.rate} requests per second")
        return org

    def _reject(self, context: grpc.ServicerContext, run_id: str, err: WireError) -> None:
        self.metrics.rejected.labels(run_id if run_id in self.runs else "", err.reason).inc()
        log.warning("rejected (%s) from %s: %s", err.reason, context.peer(), err.message)
        k8s_events.emit("Rejected", f"run {run_id or '-'}: {err.reason} from {context.peer()}: {err.message}", warning=True)
        context.abort(getattr(grpc.StatusCode, err.status), f"{err.reason}: {err.message}")

    # ------------------------------------------------------------------ RPCs
    def Join(self, request: apb.JoinRequest, context: grpc.ServicerContext) -> apb.JoinResponse:
        try:
            org = self._identity(context, request.organization_id)
            run = self._run(request.run_id)
            resp = run.join(org, request)
            run.record_traffic(org, resp.current_round, "up", with_envelope(TrafficBreakdown(), request.ByteSize()))
            run.record_traffic(org, resp.current_round, "down", with_envelope(TrafficBreakdown(), resp.ByteSize()))
            return resp
        except WireError as err:
            self._reject(context, request.run_id, err)
            raise AssertionError("unreachable") from None

    def PullInstructions(
        self, request: apb.PullInstructionsRequest, context: grpc.ServicerContext
    ) -> Iterator[apb.PullInstructionsResponse]:
        try:
            org = self._identity(context, request.organization_id)
            run = self._run(request.run_id)
            wait = min(max(request.wait_seconds, 0.0), self.config.server.max_pull_wait_seconds)
            chunk_list, payload_traffic, round_ = run.instructions(org, request.completed_round, wait)
        except WireError as err:
            self._reject(context, request.run_id, err)
            return
        responses = [apb.PullInstructionsResponse(chunk=c) for c in chunk_list]
        log.debug("pull %s %s completed=%d -> round %d, %d chunks", run.cfg.id, org, request.completed_round,
                  round_, len(chunk_list))
        # The request is traffic too: an envelope-only message up.
        run.record_traffic(org, round_, "up", with_envelope(TrafficBreakdown(), request.ByteSize(), 1))
        run.record_traffic(org, round_, "down", with_envelope(
            payload_traffic, sum(r.ByteSize() for r in responses), len(responses)))
        yield from responses

    def PushUpdate(
        self, request_iterator: Iterator[apb.PushUpdateRequest], context: grpc.ServicerContext
    ) -> apb.PushUpdateResponse:
        run_id = ""
        try:
            first = next(request_iterator, None)
            if first is None:
                raise WireError("malformed", "an empty PushUpdate stream")
            run_id = first.run_id
            org = self._identity(context, first.organization_id)
            run = self._run(run_id)
            run.admit_push(org, first.round)  # refuse a stale or foreign push before reading its chunks
            assembler = chunks.Reassembler(self.config.server.max_update_bytes)
            wire_bytes, n = 0, 0
            req: apb.PushUpdateRequest | None = first
            done = False
            while req is not None:
                if (req.run_id, req.round, req.organization_id) != (first.run_id, first.round, first.organization_id):
                    raise WireError("envelope_mismatch", "chunks of one push name different runs, rounds or organizations")
                if done:
                    raise WireError("malformed", "chunks after the last announced chunk")
                wire_bytes += req.ByteSize()
                n += 1
                done = assembler.add(req.chunk)
                req = next(request_iterator, None)
            data = assembler.data()
            return run.push(org, first.round, data, assembler.sha256, wire_bytes, n)
        except WireError as err:
            self._reject(context, run_id, err)
            raise AssertionError("unreachable") from None

    def Status(self, request: apb.StatusRequest, context: grpc.ServicerContext) -> apb.StatusResponse:
        """Run state and history. Under mTLS an operator (server.operators) sees every run; an organization sees
        only the runs it belongs to, with only its own reported metrics."""
        try:
            runs = [self._run(request.run_id)] if request.run_id else list(self.runs.values())
            caller = peer_identity(context)
            if caller is not None and not self._limiter.allow(caller):
                raise WireError("rate_limited", f"organization {caller!r} exceeds {self._limiter.rate} requests per second")
        except WireError as err:
            self._reject(context, request.run_id, err)
            raise AssertionError("unreachable") from None
        if caller is None or caller in self.config.server.operators:
            return apb.StatusResponse(runs=[r.status() for r in runs])
        visible = []
        for run in runs:
            if caller not in run.cfg.organizations:
                continue
            status = run.status()
            for rec in status.history:
                own = [r for r in rec.reports if r.organization_id == caller]
                del rec.reports[:]
                rec.reports.extend(own)
            mine = [o for o in status.organization_status if o.organization_id == caller]
            del status.organization_status[:]
            status.organization_status.extend(mine)
            visible.append(status)
        if request.run_id and not visible:
            self._reject(context, request.run_id, WireError(
                "unknown_organization", f"organization {caller!r} is not part of run {request.run_id!r}"))
        return apb.StatusResponse(runs=visible)

    def tick(self) -> None:
        """Close overdue rounds (called periodically by the server)."""
        for run in self.runs.values():
            run.tick()
