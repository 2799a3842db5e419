"""The aggregator's service: identity, rate limits, push limits and run lookup in front of the round engine.

It implements ``hetfed.wire.rpc.AggregatorHandler``: the wire package's asyncio gRPC adapter converts every
RPC into a typed call here and maps the ``WireError`` raised into a gRPC status with its reason.

Concurrency model: every RPC is a coroutine on one event loop. What may block (disk writes and fsyncs,
decoding updates, aggregating, building instructions or Status) runs in a bounded pool of
``server.worker_threads`` threads; a long-poll waits on its run's ``ChangeNotifier`` in the event loop and holds no
thread, and a cancelled long-poll (the client gave up) ends at once. So the aggregator's thread count does
not depend on its clients, and pushes and health checks never queue behind long-polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from hetfed.aggregator.config import AggregatorConfig, RunConfig
from hetfed.aggregator.journal.store import Disk, RunConflictError
from hetfed.aggregator.observe import k8s_events
from hetfed.aggregator.observe.metrics import AggregatorMetrics
from hetfed.aggregator.observe.observers import RunObserver
from hetfed.aggregator.run.admission import Limits
from hetfed.aggregator.run.conductor import Run
from hetfed.aggregator.serving.memory import Trimmer
from hetfed.aggregator.serving.spool import SPOOL_DIR, Spool
from hetfed.wire.chunks import Bytes
from hetfed.wire.errors import WireError, clip
from hetfed.wire.messages import (
    JoinReply,
    JoinRequest,
    ParsedUpdate,
    Pulled,
    PullRequest,
    PushReply,
    RunStatus,
)
from hetfed.wire.payloads import Payload
from hetfed.wire.rpc import Caller, Receiving, SecureStageReply
from hetfed.wire.traffic import Direction, TrafficBreakdown, with_envelope

log = logging.getLogger("hetfed.aggregator")
T = TypeVar("T")
# Token buckets kept for organizations seen in the last few seconds; an idle bucket is full again, the same as
# none, so the table is pruned past this size (identities are claimed before they are checked).
_MAX_BUCKETS = 10_000


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
            now = time.monotonic()
            if len(self._buckets) > _MAX_BUCKETS:
                refill = 2.0  # seconds for an empty bucket (2 x rate tokens) to be full again
                self._buckets = {k: v for k, v in self._buckets.items() if now - v[1] < refill}
            tokens, last = self._buckets.get(key, (self.rate * 2, now))
            tokens = min(self.rate * 2, tokens + (now - last) * self.rate)
            if tokens < 1:
                self._buckets[key] = (tokens, now)
                return False
            self._buckets[key] = (tokens - 1, now)
            return True


class PushReservation:
    """What one admitted push stream of an organization holds of its ``PushBudget`` (a stream, the bytes its
    first chunk announced, later a reassembly slot, its spool file) until ``release``: the wire's ``AdmittedPush``."""

    def __init__(self, budget: PushBudget, organization: str, reserved: int) -> None:
        self._budget = budget
        self.organization = organization
        self.reserved = reserved
        self._released = False
        self._slot = False
        # Where its chunks go: set by the service (the spool, the run and round), then by ``receive``.
        self.destination: tuple[Spool, str, int, float] | None = None
        self._receiving: Receiving | None = None

    async def receive(self, update_digest: bytes, index: int, count: int, total_bytes: int) -> Receiving:
        """The push's spool file: a new one, or the partial push this stream resumes."""
        assert self.destination is not None
        spool, run_id, round_, wait = self.destination
        self._receiving = await spool.receive(self.organization, run_id, round_, update_digest,
                                              (index, count, total_bytes), wait)
        return self._receiving

    async def reassembly_slot(self) -> None:
        """Wait (up to ``wait_seconds``) for one of the bounded reassembly slots; WireError ``busy`` if none."""
        budget = self._budget
        try:
            await asyncio.wait_for(budget.slots.acquire(), budget.wait_seconds)
        except TimeoutError:
            raise WireError("busy", f"{budget.max_reassemblies} updates are being received "
                                    f"(server.max_concurrent_reassemblies) and none finished in "
                                    f"{budget.wait_seconds:g} s (server.reassembly_wait_seconds); retry later") from None
        self._slot = True

    def release(self, refused: bool = False) -> None:
        """Give the stream, its reserved bytes and its reassembly slot back (idempotent; on the event loop).

        ``refused``: the push ended without being accepted (refused, stalled, cancelled); what it had received
        is then handed back to the system too, not kept for reuse."""
        if not self._released:
            self._released = True
            if self._receiving is not None and self.destination is not None:
                self.destination[0].finish(self._receiving, accepted=not refused)
                self._receiving = None
            if self._slot:
                self._budget.slots.release()
            if refused:  # a push that waited for a slot held stream windows of gRPC's buffers too
                self._budget.trimmer.request()
            self._budget._release(self)


class PushBudget:
    """Per-organization limits on pushes in flight: concurrent streams, and the bytes their first chunks announce
    (reserved until the push is answered, so the buffered chunks of one organization stay bounded)."""

    def __init__(self, max_streams: int, max_bytes: int, max_reassemblies: int = 8, wait_seconds: float = 30.0) -> None:
        self.max_streams = max_streams
        self.max_bytes = max_bytes
        # Admission control across organizations: at most this many updates are reassembled (and held in
        # memory) at once; the other streams wait for a slot under HTTP/2 flow control, up to wait_seconds.
        self.max_reassemblies = max_reassemblies
        self.wait_seconds = wait_seconds
        self.slots = asyncio.Semaphore(max_reassemblies)
        self.trimmer = Trimmer()
        self._lock = threading.Lock()
        self._streams: dict[str, int] = {}
        self._bytes: dict[str, int] = {}

    def admit(self, organization: str, announced: int, max_update_bytes: int) -> PushReservation:
        """A reservation for a new push announcing ``announced`` bytes, or WireError when over a limit."""
        reserved = min(max(announced, 0), max_update_bytes)
        if reserved > self.max_bytes:
            raise WireError("oversized", f"an update of {reserved} bytes exceeds the {self.max_bytes} bytes one "
                                         "organization may have in flight (server.max_buffered_bytes_per_organization)")
        with self._lock:
            streams = self._streams.get(organization, 0)
            held = self._bytes.get(organization, 0)
            if streams >= self.max_streams:
                raise WireError("too_many_streams", f"organization {organization!r} already has {streams} pushes in "
                                                    f"flight (server.max_pushes_per_organization); retry later")
            if held + reserved > self.max_bytes:
                raise WireError("buffer_full", f"organization {organization!r} has {held} bytes of pushes in flight; "
                                               f"{reserved} more would exceed {self.max_bytes} "
                                               "(server.max_buffered_bytes_per_organization); retry later")
            self._streams[organization] = streams + 1
            self._bytes[organization] = held + reserved
        return PushReservation(self, organization, reserved)

    def in_flight(self, organization: str) -> tuple[int, int]:
        """(streams, reserved bytes) of an organization's pushes in flight."""
        with self._lock:
            return self._streams.get(organization, 0), self._bytes.get(organization, 0)

    def _release(self, reservation: PushReservation) -> None:
        with self._lock:
            org = reservation.organization
            self._streams[org] -= 1
            self._bytes[org] -= reservation.reserved
            if not self._streams[org]:
                del self._streams[org], self._bytes[org]


class AggregatorService:
    """Hosts every configured run behind one gRPC service (an ``AggregatorHandler``).

    Constructing it restores every run from the state directory (blocking; raises ``StateError`` with the
    file and the problem when a run's state cannot be resumed).
    """

    def __init__(self, config: AggregatorConfig, metrics: AggregatorMetrics, disk: Disk | None = None) -> None:
        self.config = config
        self.metrics = metrics
        s = config.server
        self.max_update_bytes = s.max_update_bytes
        self.chunk_bytes = s.chunk_bytes
        limits = Limits(s.chunk_bytes, s.max_update_bytes, s.max_tensor_elements, s.max_examples_per_organization,
                        s.max_metrics_per_report, s.max_name_chars, s.max_declared_tensors)
        self.runs: dict[str, Run] = {}
        # Runs not hosted because their stored state conflicts with their config: run id -> (config, why).
        self.refused_runs: dict[str, tuple[RunConfig, str]] = {}
        try:
            for r in config.runs:
                try:
                    observer = RunObserver(r.id, r.algorithm, metrics, r.spec.figures)
                    self.runs[r.id] = Run(r, s.state_dir, observer, limits, disk)
                except RunConflictError as exc:
                    self._refuse_run(r, str(exc))
        except BaseException:
            for run in self.runs.values():
                run.close()
            raise
        self._limiter = _RateLimiter(s.max_requests_per_second)
        self.push_idle_seconds = s.push_idle_seconds
        self.pushes = PushBudget(s.max_pushes_per_organization, s.max_buffered_bytes_per_organization,
                                 s.max_concurrent_reassemblies, s.reassembly_wait_seconds)
        self.spool = Spool(Path(s.state_dir) / SPOOL_DIR, self.runs, s.partial_push_seconds,
                           s.max_partial_push_bytes, s.max_update_bytes, metrics.partial_pushes_dropped,
                           self._round_open)
        self._executor = ThreadPoolExecutor(max_workers=s.worker_threads, thread_name_prefix="hetfed-work")
        self._stopping = False

    def _round_open(self, run_id: str, organization: str, round_: int) -> bool:
        """Whether ``organization`` may still push ``round_`` of ``run_id`` (else its partial push is dropped)."""
        run = self.runs.get(run_id)
        if run is None:
            return False
        try:
            run.admit_push(organization, round_)
        except WireError:
            return False
        return True

    def _refuse_run(self, run: RunConfig, why: str) -> None:
        """Serve the other runs; this one is answered ``run_refused`` and shown in Status, the log and an Event."""
        self.refused_runs[run.id] = (run, why)
        self.metrics.refused_runs.labels(run.id).set(1)
        log.error("run %s is not served: %s", run.id, why)
        k8s_events.emit("RunRefused", f"run {run.id} is not served: {why}", warning=True)

    async def blocking(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in the bounded worker pool (it may block on disk or compute) and await its result."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    # ------------------------------------------------------------------ helpers
    def _run(self, run_id: str) -> Run:
        run = self.runs.get(run_id)
        if run is None and run_id in self.refused_runs:
            raise WireError("run_refused", f"run {clip(run_id, 64)!r} is not served: {self.refused_runs[run_id][1]}")
        if run is None:
            raise WireError("unknown_run", f"no run {clip(run_id, 64)!r} on this aggregator (runs: {sorted(self.runs)})")
        return run

    def _limit(self, organization: str) -> None:
        if not self._limiter.allow(organization):
            raise WireError("rate_limited", f"organization {clip(organization, 64)!r} exceeds "
                                            f"{self._limiter.rate} requests per second")

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
    async def join(self, organization: str, request: JoinRequest) -> JoinReply:
        """Admit an organization to a run."""
        run = self._run(request.run_id)
        try:
            return await self.blocking(lambda: run.join(organization, request))
        except WireError as err:
            await self.blocking(functools.partial(run.refuse, organization, err))
            raise

    async def pull(self, organization: str, request: PullRequest) -> Pulled:
        """Long-poll for the organization's next instructions, waiting without a thread; WAIT when none came."""
        run = self._run(request.run_id)
        run.check_member(organization)
        deadline = time.monotonic() + min(request.wait_seconds, self.config.server.max_pull_wait_seconds)
        while not self._stopping:
            seen = run.notifier.version
            pulled = await self.blocking(lambda: run.poll(organization, request))
            if pulled is not None:
                return pulled
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            await run.notifier.wait(seen, remaining)
        return run.wait_reply()

    async def secure_stage(self, organization: str, run_id: str, round_: int, payload: Payload | None,
                           wait_seconds: float) -> SecureStageReply:
        """Take a stage message of secure aggregation (in the worker pool), then long-poll without a thread until
        the stage's close gives the organization its next message, or the wait ends (a reply without one)."""
        run = self._run(run_id)
        run.check_member(organization)
        deadline = time.monotonic() + min(wait_seconds, self.config.server.max_pull_wait_seconds)
        sent: list[Payload | None] = [payload]
        while True:
            seen = run.notifier.version
            reply = await self.blocking(lambda: run.secure_stage(organization, round_, sent[0]))
            sent[0] = None
            remaining = deadline - time.monotonic()
            if reply.payload is not None or reply.abandoned or self._stopping or remaining <= 0:
                return reply
            await run.notifier.wait(seen, remaining)

    def admit_push(self, organization: str, run_id: str, round_: int, announced_bytes: int) -> PushReservation:
        """Refuse a push before its chunks are read (a stale or foreign push, or one over the push limits)."""
        # A refusal here is not recorded as permanent: recording may close a round (disk writes), and this runs
        # on the event loop; a client refused here was refused at Join first, or gets it on its next Join.
        self._run(run_id).admit_push(organization, round_)
        reservation = self.pushes.admit(organization, announced_bytes, self.max_update_bytes)
        reservation.destination = (self.spool, run_id, round_, self.push_idle_seconds)
        return reservation

    async def push_progress(self, organization: str, run_id: str, round_: int, update_digest: bytes,
                            total_bytes: int) -> tuple[int, int]:
        """(chunks, bytes) held of the organization's cut push of ``update_digest``; (0, 0) when none."""
        self._run(run_id).check_member(organization)
        return await self.spool.progress(organization, run_id, round_, update_digest, total_bytes,
                                         self.push_idle_seconds)

    async def push(self, organization: str, run_id: str, round_: int, data: Bytes, digest: bytes, wire_bytes: int,
                   chunks: int) -> PushReply:
        """Parse, check, log and fold in an update (in the worker pool).

        The bytes are handed to the worker, not kept in this frame, so they are freed once logged."""
        run = self._run(run_id)
        handed = [data]
        del data

        def work() -> PushReply:
            update = ParsedUpdate(handed.pop())
            up = with_envelope(update.payload_traffic, wire_bytes, messages=chunks)
            return run.push(organization, round_, update, digest, up, defer_commit=True)

        try:
            reply = await self.blocking(work)
        except WireError as err:
            # Its client exits on a permanent refusal, so rounds stop waiting for it (a replay does not count:
            # the organization's accepted update stands).
            await self.blocking(functools.partial(run.refuse, organization, err, at_push=err.reason != "replayed"))
            raise
        # A push that closed the round is acknowledged at once; the round's checkpoint is written in the pool
        # meanwhile (the next round's pushes wait for it, its instructions do not).
        self._commit_soon(run)
        return reply

    def _commit_soon(self, run: Run) -> None:
        if run.has_pending_commit():
            with contextlib.suppress(RuntimeError):  # the pool is shut down: Run.close commits it
                self._executor.submit(run.commit_pending)

    def count(self, run_id: str, organization: str, round_: int, direction: Direction, traffic: TrafficBreakdown,
              in_round: bool = True) -> None:
        """Record the traffic of one RPC (``in_round`` false: in the metrics only, not the round's record)."""
        run = self.runs.get(run_id)
        if run is not None:
            run.record_traffic(organization, round_, direction, traffic, in_round)

    def rejected(self, run_id: str, peer: str, err: WireError) -> None:
        """Count and log a rejection (every string from the request clipped)."""
        self.metrics.rejected.labels(run_id if run_id in self.runs else "", err.reason).inc()
        log.warning("rejected (%s) from %s: %s", err.reason, clip(peer, 64), clip(err.message))
        k8s_events.emit("Rejected", f"run {run_id or '-'}: {err.reason} from {clip(peer, 64)}: {clip(err.message)}",
                        warning=True)

    async def status(self, caller: Caller, run_id: str) -> list[RunStatus]:
        """Run state and history. Under mTLS an operator (server.operators) sees every run; an organization sees
        only the runs it belongs to, with only its own reported metrics."""
        refused = [self._refused_status(rid) for rid in ([run_id] if run_id else self.refused_runs)
                   if rid in self.refused_runs]
        runs = [] if refused and run_id else [self._run(run_id)] if run_id else list(self.runs.values())
        who = caller.certificate
        if who is not None:
            self._limit(who)
        if who is None or who in self.config.server.operators:
            return [*await self.blocking(lambda: [r.status() for r in runs]), *refused]
        refused = [s for s in refused if who in s.organizations]
        mine = [run for run in runs if who in run.cfg.organizations]
        if run_id and not mine and not refused:
            raise WireError("unknown_organization", f"organization {who!r} is not part of run {clip(run_id, 64)!r}")

        def own() -> list[RunStatus]:
            visible = []
            for run in mine:
                s = run.status()
                history = tuple(dataclasses.replace(h, reports={o: m for o, m in h.reports.items() if o == who})
                                for h in s.history)
                own_status = tuple(o for o in s.organization_status if o.organization == who)
                own_refusals = tuple(r for r in s.refused if r.organization == who)
                visible.append(dataclasses.replace(s, history=history, organization_status=own_status,
                                                   refused=own_refusals))
            return visible

        return [*await self.blocking(own), *refused]

    def _refused_status(self, run_id: str) -> RunStatus:
        """The Status of a run the aggregator does not host: its config and why."""
        cfg, why = self.refused_runs[run_id]
        return RunStatus(run_id=cfg.id, algorithm=cfg.algorithm, phase=cfg.spec.first_phase,
                         round=0, total_rounds=cfg.rounds, organizations=tuple(cfg.organizations), refused_reason=why)

    def tick(self) -> None:
        """Close overdue rounds, retrying closes that failed (blocking: call it from the worker pool)."""
        for run in self.runs.values():
            run.tick()
        self.spool.sweep()

    def stopping(self) -> None:
        """Answer every waiting and later long-poll with WAIT at once (the server is shutting down)."""
        self._stopping = True
        for run in self.runs.values():
            run.notifier.notify()

    def close(self) -> None:
        """Finish the work in the pool and close every run's files."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.spool.close()
        for run in self.runs.values():
            run.close()
