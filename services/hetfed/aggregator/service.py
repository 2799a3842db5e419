"""The aggregator's service: identity, rate limits and run lookup in front of the round engine.

It implements ``hetfed.wire.rpc.AggregatorHandler``: the wire package's gRPC adapter converts every RPC into
a typed call here and maps the ``WireError`` raised into a gRPC status with its reason.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from hetfed.aggregator import k8s_events
from hetfed.aggregator.config import AggregatorConfig
from hetfed.aggregator.engine import Limits, Run
from hetfed.aggregator.metrics import AggregatorMetrics
from hetfed.wire.errors import WireError
from hetfed.wire.messages import JoinReply, JoinRequest, ParsedUpdate, PullRequest, PushReply, RunStatus
from hetfed.wire.rpc import Caller, Pulled, clip
from hetfed.wire.traffic import TrafficBreakdown

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


class AggregatorService:
    """Hosts every configured run behind one gRPC service (an ``AggregatorHandler``)."""

    def __init__(self, config: AggregatorConfig, metrics: AggregatorMetrics) -> None:
        self.config = config
        self.metrics = metrics
        s = config.server
        self.max_update_bytes = s.max_update_bytes
        self.chunk_bytes = s.chunk_bytes
        limits = Limits(s.chunk_bytes, s.max_update_bytes, s.max_tensor_elements)
        self.runs = {r.id: Run(r, s.state_dir, metrics, limits) for r in config.runs}
        self._limiter = _RateLimiter(s.max_requests_per_second)

    # ------------------------------------------------------------------ helpers
    def _run(self, run_id: str) -> Run:
        run = self.runs.get(run_id)
        if run is None:
            raise WireError("unknown_run", f"no run {clip(run_id, 64)!r} on this aggregator (runs: {sorted(self.runs)})")
        return run

    def _limit(self, organization: str) -> None:
        if not self._limiter.allow(organization):
            raise WireError("rate_limited",
                            f"organization {organization!r} exceeds {self._limiter.rate} requests per second")

    def identify(self, caller: Caller, claimed: str) -> str:
        """The caller's organization: its certificate's name under mTLS, else the metadata header; rate-limited."""
        if caller.certificate is not None:
            if claimed and claimed != caller.certificate:
                raise WireError("identity_mismatch", f"the client certificate is for {caller.certificate!r}, "
                                                     f"the request claims {clip(claimed, 64)!r}")
            org = caller.certificate
        else:
            if caller.header and claimed and caller.header != claimed:
                raise WireError("identity_mismatch", f"metadata names {clip(caller.header, 64)!r}, "
                                                     f"the request claims {clip(claimed, 64)!r}")
            org = claimed or caller.header
            if not org:
                raise WireError("unauthenticated", "no organization identity (no client certificate, no organization)")
        self._limit(org)
        return org

    # ------------------------------------------------------------------ AggregatorHandler
    def join(self, organization: str, request: JoinRequest) -> JoinReply:
        """Admit an organization to a run."""
        return self._run(request.run_id).join(organization, request)

    def pull(self, organization: str, request: PullRequest) -> Pulled:
        """Long-poll for the organization's next instructions."""
        return self._run(request.run_id).pull(organization, request, self.config.server.max_pull_wait_seconds)

    def admit_push(self, organization: str, run_id: str, round_: int) -> None:
        """Refuse a push before its chunks are read."""
        self._run(run_id).admit_push(organization, round_)

    def push(self, organization: str, run_id: str, round_: int, update: ParsedUpdate, digest: bytes,
             up: TrafficBreakdown) -> PushReply:
        """Check, persist and fold in an update."""
        return self._run(run_id).push(organization, round_, update, digest, up)

    def count(self, run_id: str, organization: str, round_: int, direction: str, traffic: TrafficBreakdown) -> None:
        """Record the traffic of one RPC."""
        run = self.runs.get(run_id)
        if run is not None:
            run.record_traffic(organization, round_, direction, traffic)

    def rejected(self, run_id: str, peer: str, err: WireError) -> None:
        """Count and log a rejection."""
        self.metrics.rejected.labels(run_id if run_id in self.runs else "", err.reason).inc()
        log.warning("rejected (%s) from %s: %s", err.reason, clip(peer, 64), clip(err.message))
        k8s_events.emit("Rejected", f"run {run_id or '-'}: {err.reason} from {clip(peer, 64)}: {clip(err.message)}",
                        warning=True)

    def status(self, caller: Caller, run_id: str) -> list[RunStatus]:
        """Run state and history. Under mTLS an operator (server.operators) sees every run; an organization sees
        only the runs it belongs to, with only its own reported metrics."""
        runs = [self._run(run_id)] if run_id else list(self.runs.values())
        who = caller.certificate
        if who is not None:
            self._limit(who)
        if who is None or who in self.config.server.operators:
            return [r.status() for r in runs]
        visible = []
        for run in runs:
            if who not in run.cfg.organizations:
                continue
            s = run.status()
            own = tuple(dataclasses.replace(h, reports={o: m for o, m in h.reports.items() if o == who})
                        for h in s.history)
            mine = tuple(o for o in s.organization_status if o.organization == who)
            visible.append(dataclasses.replace(s, history=own, organization_status=mine))
        if run_id and not visible:
            raise WireError("unknown_organization", f"organization {who!r} is not part of run {clip(run_id, 64)!r}")
        return visible

    def tick(self) -> None:
        """Close overdue rounds (called periodically by the server)."""
        for run in self.runs.values():
            run.tick()
