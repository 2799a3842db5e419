"""The Aggregator service at the gRPC boundary: one server adapter and one typed client.

The server adapter turns each RPC into a typed call on an ``AggregatorHandler`` (the aggregator's service),
counts the traffic of every RPC in one place, and answers a ``WireError`` with its gRPC status plus a rich
status detail (``google.rpc.ErrorInfo``) naming the rejection reason. The client turns every RPC into a
typed call, counts the same traffic on its side, and raises ``RemoteError`` carrying that reason, so a
caller decides whether to retry by reason, never by matching text.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NoReturn, Protocol, TypeVar

import grpc
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import aggregator_pb2_grpc as agrpc
from hetfed.wire import chunks, messages
from hetfed.wire.errors import ERROR_DOMAIN, REASONS, WireError
from hetfed.wire.messages import (
    Encoded,
    Instructions,
    JoinReply,
    JoinRequest,
    PullRequest,
    PushReply,
    RunStatus,
)
from hetfed.wire.payloads import Payload
from hetfed.wire.specs import AlgorithmSpec
from hetfed.wire.traffic import TrafficBreakdown, TrafficMetrics, with_envelope
from hetfed.wire.transport import ORGANIZATION_METADATA_KEY, TlsConfig, make_channel, peer_identity

log = logging.getLogger("hetfed.wire")
T = TypeVar("T")
# Longest rejection message sent back or logged: a request's strings are never echoed in full.
MAX_DETAIL_CHARS = 512


def clip(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` cut to ``limit`` characters (with a marker), for replies and logs."""
    return text if len(text) <= limit else text[: limit - 12] + f"… (+{len(text) - limit + 12} chars)"


# ================================================================================================ server


@dataclass(frozen=True)
class Caller:
    """Who is calling, as the transport sees it; the handler decides the organization from it."""

    # The organization named by the client certificate under mTLS; None on insecure channels.
    certificate: str | None
    # The organization named in the request metadata (insecure channels only).
    header: str
    # The transport address, for logs.
    peer: str


@dataclass(frozen=True)
class Pulled:
    """Instructions to send and the round they belong to; ``encoded`` may be shared by every organization."""

    encoded: Encoded
    round: int


class AggregatorHandler(Protocol):
    """What the aggregator's service provides to the gRPC adapter; every argument and result is typed."""

    max_update_bytes: int
    chunk_bytes: int

    def identify(self, caller: Caller, claimed: str) -> str:
        """The caller's organization (its certificate's name under mTLS); raises WireError."""
        ...

    def join(self, organization: str, request: JoinRequest) -> JoinReply:
        """Admit an organization to a run."""
        ...

    def pull(self, organization: str, request: PullRequest) -> Pulled:
        """Long-poll: the organization's next instructions."""
        ...

    def admit_push(self, organization: str, run_id: str, round_: int) -> None:
        """Refuse a push before its chunks are read (unknown run or organization, wrong round)."""
        ...

    def push(self, organization: str, run_id: str, round_: int, update: messages.ParsedUpdate, digest: bytes,
             up: TrafficBreakdown) -> PushReply:
        """Check, persist and fold in an update; records its traffic (``up`` and the reply) with the round."""
        ...

    def status(self, caller: Caller, run_id: str) -> list[RunStatus]:
        """The runs the caller may see."""
        ...

    def count(self, run_id: str, organization: str, round_: int, direction: str, traffic: TrafficBreakdown) -> None:
        """Record the traffic of one RPC."""
        ...

    def rejected(self, run_id: str, peer: str, err: WireError) -> None:
        """Count and log a rejection."""
        ...


def abort(context: grpc.ServicerContext, err: WireError) -> NoReturn:
    """End the RPC with the error's status and an ErrorInfo detail naming its reason."""
    text = clip(f"{err.reason}: {err.message}")
    status = status_pb2.Status(code=getattr(code_pb2, err.status), message=text)
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=err.reason.upper(), domain=ERROR_DOMAIN))
    context.abort_with_status(rpc_status.to_status(status))
    raise AssertionError("unreachable")  # abort_with_status raises


def _caller(context: grpc.ServicerContext) -> Caller:
    header = ""
    for key, value in context.invocation_metadata():
        if key == ORGANIZATION_METADATA_KEY:
            header = value if isinstance(value, str) else value.decode(errors="replace")
    return Caller(peer_identity(context), header, context.peer())


class _ChunkCache:
    """Split instructions, by message: a broadcast round's chunks are built once for every organization."""

    def __init__(self, size: int = 64) -> None:
        self._lock = threading.Lock()
        self._items: OrderedDict[int, tuple[Encoded, list[apb.PullInstructionsResponse], int]] = OrderedDict()
        self._size = size

    def get(self, encoded: Encoded, chunk_bytes: int) -> tuple[list[apb.PullInstructionsResponse], int]:
        key = id(encoded)
        with self._lock:
            hit = self._items.get(key)
            if hit is not None and hit[0] is encoded:
                self._items.move_to_end(key)
                return hit[1], hit[2]
        responses = [apb.PullInstructionsResponse(chunk=c) for c in chunks.split(encoded.data, chunk_bytes)]
        size = sum(r.ByteSize() for r in responses)
        with self._lock:
            self._items[key] = (encoded, responses, size)  # holding ``encoded`` keeps its id unique
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return responses, size


class AggregatorServicer(agrpc.AggregatorServicer):
    """The generated servicer, converting at the boundary and delegating to a typed handler."""

    def __init__(self, handler: AggregatorHandler) -> None:
        self.handler = handler
        self._chunks = _ChunkCache()

    def _fail(self, context: grpc.ServicerContext, run_id: str, err: WireError) -> NoReturn:
        self.handler.rejected(run_id, context.peer(), err)
        abort(context, err)

    def Join(self, request: apb.JoinRequest, context: grpc.ServicerContext) -> apb.JoinResponse:  # noqa: N802
        try:
            org = self.handler.identify(_caller(context), request.organization_id)
            reply = self.handler.join(org, messages.join_request_from_proto(request))
        except WireError as err:
            self._fail(context, request.run_id, err)
        resp = messages.join_reply_to_proto(reply)
        self.handler.count(request.run_id, org, reply.current_round, "up", with_envelope(TrafficBreakdown(), request.ByteSize()))
        self.handler.count(request.run_id, org, reply.current_round, "down", with_envelope(TrafficBreakdown(), resp.ByteSize()))
        return resp

    def PullInstructions(  # noqa: N802
        self, request: apb.PullInstructionsRequest, context: grpc.ServicerContext
    ) -> Iterator[apb.PullInstructionsResponse]:
        try:
            org = self.handler.identify(_caller(context), request.organization_id)
            pulled = self.handler.pull(org, messages.pull_request_from_proto(request))
        except WireError as err:
            self._fail(context, request.run_id, err)
        responses, size = self._chunks.get(pulled.encoded, self.handler.chunk_bytes)
        # The request is traffic too: an envelope-only message up.
        self.handler.count(request.run_id, org, pulled.round, "up", with_envelope(TrafficBreakdown(), request.ByteSize()))
        self.handler.count(request.run_id, org, pulled.round, "down",
                           with_envelope(pulled.encoded.payloads, size, len(responses)))
        yield from responses

    def PushUpdate(  # noqa: N802
        self, request_iterator: Iterator[apb.PushUpdateRequest], context: grpc.ServicerContext
    ) -> apb.PushUpdateResponse:
        run_id = ""
        try:
            first = next(request_iterator, None)
            if first is None:
                raise WireError("malformed", "an empty PushUpdate stream")
            run_id = first.run_id
            org = self.handler.identify(_caller(context), first.organization_id)
            self.handler.admit_push(org, run_id, first.round)  # refuse a stale or foreign push before reading it
            assembler = chunks.Reassembler(self.handler.max_update_bytes)
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
            update = messages.ParsedUpdate(assembler.data())
            up = with_envelope(update.payload_traffic, wire_bytes, messages=n)
            reply = self.handler.push(org, run_id, first.round, update, assembler.sha256, up)
        except WireError as err:
            self._fail(context, run_id, err)
        return messages.push_reply_to_proto(reply)

    def Status(self, request: apb.StatusRequest, context: grpc.ServicerContext) -> apb.StatusResponse:  # noqa: N802
        try:
            runs = self.handler.status(_caller(context), request.run_id)
        except WireError as err:
            self._fail(context, request.run_id, err)
        return apb.StatusResponse(runs=[messages.run_status_to_proto(r) for r in runs])


def add_aggregator_handler(server: grpc.Server, handler: AggregatorHandler) -> AggregatorServicer:
    """Serve ``handler`` as the hetfed.v1.Aggregator service on ``server``."""
    servicer = AggregatorServicer(handler)
    agrpc.add_AggregatorServicer_to_server(servicer, server)
    return servicer


# ================================================================================================ client

# Transport failures worth retrying when the aggregator gives no reason: restarting, unreachable, overloaded.
_TRANSPORT_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


class RemoteError(Exception):
    """An RPC failed: the gRPC status, the aggregator's rejection reason (empty for transport failures)."""

    def __init__(self, code: grpc.StatusCode, reason: str, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.reason = reason
        self.details = details

    @property
    def retryable(self) -> bool:
        """Whether the same call may succeed later: by the reason's entry, else by the transport status."""
        if self.reason in REASONS:
            return REASONS[self.reason].retryable
        return self.code in _TRANSPORT_RETRYABLE

    @classmethod
    def of(cls, err: grpc.RpcError) -> RemoteError:
        """The RemoteError of a failed call, with the reason from its ErrorInfo detail when present."""
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = (err.details() if hasattr(err, "details") else "") or ""
        reason = ""
        try:
            status = rpc_status.from_call(err)  # type: ignore[arg-type]
        except (ValueError, AttributeError):
            status = None
        if status is not None:
            for detail in status.details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    if info.domain == ERROR_DOMAIN:
                        reason = info.reason.lower()
        return cls(code, reason, details)


Retry = Callable[[str, Callable[[], T]], T]


def call_once(what: str, call: Callable[[], T]) -> T:
    """The retry policy that does not retry."""
    return call()


class AggregatorClient:
    """One organization's typed client of the Aggregator service; counts the traffic of every RPC it makes.

    ``retry(what, call)`` wraps every call (the client runtime passes its backoff policy); calls raise
    ``RemoteError``. The same encoded update is resent on a retried push.
    """

    def __init__(self, address: str, tls: TlsConfig | None, organization: str, run_id: str, *,
                 traffic: TrafficMetrics | None = None, retry: Retry | None = None,
                 call_timeout: float = 30.0) -> None:
        self.organization = organization
        self.run_id = run_id
        self.algorithm = "unknown"  # the traffic label, known after Join
        self._traffic = traffic
        self._retry: Retry = retry or call_once  # type: ignore[assignment]
        self._timeout = call_timeout
        self._channel = make_channel(address, tls)
        self._stub = agrpc.AggregatorStub(self._channel)
        self._metadata = () if tls else ((ORGANIZATION_METADATA_KEY, organization),)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> AggregatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count(self, direction: str, b: TrafficBreakdown) -> None:
        if self._traffic is not None:
            self._traffic.record(self.run_id, self.algorithm, self.organization, direction, b)

    def _call(self, what: str, call: Callable[[], T]) -> T:
        def once() -> T:
            try:
                return call()
            except grpc.RpcError as err:
                raise RemoteError.of(err) from None

        return self._retry(what, once)

    def join(self, declared: Sequence[messages.contract.DeclaredTensor] = (),
             seed_set: messages.Fingerprint | None = None, num_train_examples: int = 0) -> JoinReply:
        """Join the run (declaring ``declared`` tensors); learns the algorithm, config and seed."""
        req = messages.join_request_to_proto(JoinRequest(self.run_id, self.organization, tuple(declared), seed_set,
                                                         num_train_examples))
        resp = self._call("Join", lambda: self._stub.Join(req, metadata=self._metadata, timeout=self._timeout))
        reply = messages.join_reply_from_proto(resp)
        self.algorithm = reply.algorithm
        self._count("up", with_envelope(TrafficBreakdown(), req.ByteSize()))
        self._count("down", with_envelope(TrafficBreakdown(), resp.ByteSize()))
        return reply

    def pull(self, completed_round: int, wait_seconds: float, spec: AlgorithmSpec | None) -> Instructions:
        """Long-poll for the next instructions; their payloads are checked against ``spec``'s download contract."""
        req = messages.pull_request_to_proto(PullRequest(self.run_id, self.organization, completed_round, wait_seconds))

        def call() -> tuple[bytes, int, int]:
            asm = chunks.Reassembler(max_bytes=1 << 40)
            wire, n = 0, 0
            for resp in self._stub.PullInstructions(req, metadata=self._metadata, timeout=wait_seconds + 60):
                wire += resp.ByteSize()
                n += 1
                asm.add(resp.chunk)
            return asm.data(), wire, n

        data, wire, n = self._call("PullInstructions", call)
        ins, payloads = messages.decode_instructions(data, spec)
        self._count("up", with_envelope(TrafficBreakdown(), req.ByteSize()))
        self._count("down", with_envelope(payloads, wire, n))
        return ins

    def push(self, round_: int, payloads: Sequence[Payload], wire_dtype: str | None = None) -> PushReply:
        """Upload this organization's update for ``round_`` as a chunked stream (idempotent on retry)."""
        encoded = messages.encode_update(messages.Update(self.run_id, round_, self.organization, payloads), wire_dtype)
        requests = [apb.PushUpdateRequest(run_id=self.run_id, round=round_, organization_id=self.organization, chunk=c)
                    for c in chunks.split(encoded.data)]
        resp = self._call("PushUpdate", lambda: self._stub.PushUpdate(
            iter(requests), metadata=self._metadata, timeout=600))
        reply = messages.push_reply_from_proto(resp)
        if not reply.duplicate:
            self._count("up", with_envelope(encoded.payloads, sum(r.ByteSize() for r in requests), len(requests)))
            self._count("down", with_envelope(TrafficBreakdown(), resp.ByteSize()))
        return reply

    def status(self, run_id: str = "") -> list[RunStatus]:
        """The Status of one run (or every run the caller may see)."""
        resp = self._call("Status", lambda: self._stub.Status(apb.StatusRequest(run_id=run_id),
                                                              metadata=self._metadata, timeout=self._timeout))
        return [messages.run_status_from_proto(r) for r in resp.runs]


def status_of(address: str, tls: TlsConfig | None, run_ids: Iterable[str] = (), timeout: float = 10.0,
              organization: str = "") -> list[RunStatus]:
    """One Status call (an operator's or orchestrator's read-only view)."""
    with AggregatorClient(address, tls, organization, "", call_timeout=timeout) as client:
        wanted = list(run_ids)
        if not wanted:
            return client.status()
        return [s for r in wanted for s in client.status(r)]
