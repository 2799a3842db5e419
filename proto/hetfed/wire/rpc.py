"""The Aggregator service at the gRPC boundary: one server adapter and one typed client.

The server adapter (on a ``grpc.aio`` server) parses each request from its bytes, turns each RPC into a typed
call on an ``AggregatorHandler`` (the aggregator's service), counts the traffic of every RPC in one place,
and answers a ``WireError`` with its gRPC status plus a rich status detail (``google.rpc.ErrorInfo``) naming
the rejection reason. The client turns every RPC into a
typed call, counts the same traffic on its side, and raises ``RemoteError`` carrying that reason, so a
caller decides whether to retry by reason, never by matching text.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import aggregator_pb2_grpc as agrpc
from hetfed.v1 import payloads_pb2 as pb
from hetfed.wire import chunks, codec, messages
from hetfed.wire.chunks import Bytes
from hetfed.wire.errors import ERROR_DOMAIN, REASONS, WireError, clip
from hetfed.wire.messages import (
    Encoded,
    Instructions,
    JoinReply,
    JoinRequest,
    Pulled,
    PullRequest,
    PushReply,
    RunStatus,
)
from hetfed.wire.payloads import Payload
from hetfed.wire.privacy import PrivacyDeclaration
from hetfed.wire.specs import AlgorithmSpec
from hetfed.wire.traffic import Direction, TrafficBreakdown, TrafficMetrics, breakdown, with_envelope
from hetfed.wire.transport import ORGANIZATION_METADATA_KEY, TlsConfig, make_channel, peer_identity

log = logging.getLogger("hetfed.wire")
T = TypeVar("T")
# ================================================================================================ server

# The gRPC service the adapter serves, and the longest run or organization id it reads from a request (ids
# are at most 63 characters; a longer one is refused before it is looked up, logged or echoed).
SERVICE_NAME = "hetfed.v1.Aggregator"
# The response header the aggregator sends on a PushUpdate call once the push holds a reassembly slot; it says
# so at Join (``JoinResponse.push_admission_headers``), and the typed client then sends its other chunks after it.
PUSH_ADMITTED_METADATA_KEY = "x-hetfed-push-admitted"
MAX_ID_CHARS = 128


@dataclass(frozen=True)
class Caller:
    """Who is calling, as the transport sees it; the handler decides the organization from it."""

    # The organization named by the client certificate under mTLS; None on insecure channels.
    certificate: str | None
    # The organization named in the request metadata (insecure channels only).
    header: str
    # The transport address, for logs.
    peer: str


@dataclass(eq=False)
class Receiving:
    """One push's reassembly, which the handler keeps across the streams of a resumed push."""

    assembler: chunks.Reassembler
    # The messages added to the assembler and their bytes, over every stream of the push.
    wire_bytes: int = 0
    messages: int = 0
    # True while a stream waits for its next chunk: a stream cut then leaves a partial push worth resuming.
    waiting: bool = False
    # What the handler keeps the reception in (the wire package does not look at it).
    owner: object = field(default=None, repr=False)
    # Called after each chunk is added and counted (the aggregator's spool makes the push durable from it).
    after_chunk: Callable[[], None] | None = field(default=None, repr=False)


class AdmittedPush(Protocol):
    """An admitted push: released once the push has been answered (its stream and buffered bytes freed)."""

    async def reassembly_slot(self) -> None:
        """Wait for one of the aggregator's bounded reassembly slots before the chunks are read (the stream
        waits under HTTP/2 flow control meanwhile); raises WireError when none frees up in time."""
        ...

    async def receive(self, update_digest: bytes, index: int, count: int, total_bytes: int) -> Receiving:
        """Where the push's chunks go, given its first chunk's header: a new reception when ``index`` is 0, else
        the partial push of ``update_digest`` that it resumes (WireError ``not_resumable`` when none is held)."""
        ...

    def release(self, refused: bool = False) -> None:
        """Free the push's share of its organization's limits (and its reassembly slot); ``refused``: the push
        was not accepted (refused, stalled or cancelled), so what it received need not be kept for reuse."""
        ...


@dataclass(frozen=True)
class SecureStageReply:
    """A SecureStage call's answer: what the closed stage gives the organization (None: nothing yet), the
    round's open stage, and why the round's secure aggregate was abandoned ("" while it was not)."""

    payload: Payload | None
    stage: str
    abandoned: str = ""


class AggregatorHandler(Protocol):
    """What the aggregator's service provides to the gRPC adapter; every argument and result is typed.

    The adapter runs on an asyncio event loop. Plain methods are called on the loop and must never block;
    coroutines do their blocking work elsewhere (``blocking`` runs a function in the handler's worker pool).
    """

    max_update_bytes: int
    chunk_bytes: int
    # Seconds a push stream may go without a chunk before it is refused (``stalled``).
    push_idle_seconds: float

    def identify(self, caller: Caller, claimed: str) -> str:
        """The caller's organization (its certificate's name under mTLS); raises WireError."""
        ...

    async def join(self, organization: str, request: JoinRequest) -> JoinReply:
        """Admit an organization to a run."""
        ...

    async def pull(self, organization: str, request: PullRequest) -> Pulled:
        """Long-poll: the organization's next instructions (cancelled when the client goes away)."""
        ...

    def admit_push(self, organization: str, run_id: str, round_: int, announced_bytes: int) -> AdmittedPush:
        """Refuse a push before its chunks are read (unknown run or organization, wrong round, push limits)."""
        ...

    async def push(self, organization: str, run_id: str, round_: int, data: Bytes, digest: bytes,
                   wire_bytes: int, chunks: int) -> PushReply:
        """Parse, check, persist and fold in a reassembled update (``digest``: its BLAKE3 digest); records its traffic.

        ``data`` is handed over: the handler should drop it as soon as the update is logged."""
        ...

    async def push_progress(self, organization: str, run_id: str, round_: int, update_digest: bytes,
                            total_bytes: int) -> tuple[int, int]:
        """(chunks, bytes) the handler holds of the push of ``update_digest``: (0, 0) when none."""
        ...

    async def status(self, caller: Caller, run_id: str) -> list[RunStatus]:
        """The runs the caller may see."""
        ...

    async def secure_stage(self, organization: str, run_id: str, round_: int, payload: Payload | None,
                           wait_seconds: float) -> SecureStageReply:
        """Take the organization's stage message of secure aggregation (None: none), then long-poll up to
        ``wait_seconds`` for what the stage's close gives it."""
        ...

    async def blocking(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` where it may block (the handler's worker pool) and await its result."""
        ...

    def count(self, run_id: str, organization: str, round_: int, direction: Direction, traffic: TrafficBreakdown,
              in_round: bool = True) -> None:
        """Record the traffic of one RPC (``in_round`` false: in the metrics only, not the round's record)."""
        ...

    def rejected(self, run_id: str, peer: str, err: WireError) -> None:
        """Count and log a rejection."""
        ...


def rich_status(err: WireError) -> grpc.Status:
    """The gRPC status of a rejection, with an ErrorInfo detail naming its reason (the message clipped)."""
    text = clip(f"{err.reason}: {err.message}")
    status = status_pb2.Status(code=getattr(code_pb2, err.status), message=text)
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=err.reason.upper(), domain=ERROR_DOMAIN))
    return rpc_status.to_status(status)


M = TypeVar("M", bound=Message)


def parse(cls: type[M], data: bytes, what: str = "request") -> M:
    """A message (a request, or ``what``) parsed from its bytes; undecodable bytes are ``malformed``."""
    try:
        return cls.FromString(data)
    except DecodeError as exc:
        raise WireError("malformed", f"the {what} is not a valid {cls.DESCRIPTOR.full_name}: {exc}") from None


def parse_chunked(cls: type[M], raw: bytes, chunk_field: int, what: str = "request") -> tuple[M, Bytes | None]:
    """A chunked message parsed without its chunk's data, and that data as a view of ``raw`` (None when
    ``chunks.unframed`` left it in the message: read ``chunk.data`` then). Malformed bytes are ``malformed``."""
    small, data = chunks.unframed(raw, chunk_field)
    return parse(cls, small, what), data


def _detached(err: WireError) -> WireError:
    """``err`` without its traceback and context. The traceback refers to the frames that raised it, and the
    frame that keeps the error refers back to it: a cycle that would hold a refused push's partial update (tens
    of MB) until the next garbage collection, not the end of the push."""
    err.__traceback__ = None
    err.__context__ = None
    err.__cause__ = None
    return err


def _check_ids(*ids: str) -> None:
    for value in ids:
        if len(value) > MAX_ID_CHARS:
            raise WireError("malformed", f"an id of {len(value)} characters (at most {MAX_ID_CHARS}): "
                                         f"{clip(value, 32)!r}")


def _caller(context: grpc.aio.ServicerContext) -> Caller:  # type: ignore[type-arg]
    header = ""
    for key, value in context.invocation_metadata() or ():
        if key == ORGANIZATION_METADATA_KEY:
            header = value if isinstance(value, str) else value.decode(errors="replace")
    _check_ids(header)
    return Caller(peer_identity(context), header, context.peer())


class _ChunkCache:
    """The chunk responses of instructions, by message, planned once however many pulls want them.

    The plan (``chunks.Framed``: the digest of the whole message and its chunk boundaries) is taken once per
    message; every pull streams its responses from it, each built as it is sent, so a broadcast costs one copy of
    the message whatever the number of organizations pulling it. An entry lives exactly as long as the engine
    keeps its message (a weak reference drops it when the engine moves on), so closed rounds' broadcasts are not
    held here. Pulls that arrive while a message is being planned share that one digest (at a round's start
    every organization pulls at once).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[int, asyncio.Future[chunks.Framed]] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def responses(self, encoded: Encoded, chunk_bytes: int,
                  blocking: Callable[[Callable[[], chunks.Framed]], Awaitable[chunks.Framed]],
                  ) -> Awaitable[chunks.Framed]:
        """The responses of ``encoded``: planned, being planned, or planned now with ``blocking``.

        Call it on the event loop; a cancelled pull does not cancel the plan the others wait on."""
        key = id(encoded)
        with self._lock:
            fut = self._items.get(key)
            if fut is None:
                fut = asyncio.ensure_future(blocking(lambda: self._build(encoded, chunk_bytes)))
                self._items[key] = fut
                weakref.finalize(encoded, self._forget, key, fut)
                fut.add_done_callback(lambda f: None if not f.cancelled() and f.exception() is None
                                      else self._forget(key, f))
        return asyncio.shield(fut)

    def _forget(self, key: int, fut: asyncio.Future[chunks.Framed]) -> None:
        with self._lock:
            if self._items.get(key) is fut:
                del self._items[key]

    @staticmethod
    def _build(encoded: Encoded, chunk_bytes: int) -> chunks.Framed:
        return chunks.framed(b"", chunks.PULL_CHUNK_FIELD, encoded.data, chunk_bytes)


@dataclass(frozen=True)
class _Answer:
    """A unary RPC's response, and the (organization, round) whose traffic it is (None: not counted)."""

    response: bytes
    counted: tuple[str, int] | None = None
    # The payloads the request and the response carry, counted per kind (the rest is envelope).
    up: Sequence[pb.Payload] = ()
    down: Sequence[pb.Payload] = ()
    up_counted: bool = False  # the request was counted before it was answered


class AggregatorServicer:
    """The Aggregator service on a ``grpc.aio`` server: requests arrive as bytes and are parsed here.

    Parsing in the handler makes a malformed request an ordinary, counted ``malformed`` rejection (gRPC's own
    deserializer would fail inside grpcio, uncounted). A ``WireError`` becomes its gRPC status with an
    ErrorInfo reason; any other exception is logged with its traceback and answered ``internal``, never
    UNKNOWN. Traffic of every RPC is counted here.
    """

    def __init__(self, handler: AggregatorHandler) -> None:
        self.handler = handler
        self._chunks = _ChunkCache()

    async def _fail(self, context: grpc.aio.ServicerContext, run_id: str,  # type: ignore[type-arg]
                    err: WireError) -> NoReturn:
        self.handler.rejected(run_id, context.peer(), err)
        await context.abort_with_status(rich_status(err))
        raise AssertionError("unreachable")  # abort_with_status raises

    @staticmethod
    def _internal(what: str, exc: Exception) -> WireError:
        log.error("%s failed unexpectedly", what, exc_info=exc)
        return WireError("internal", f"{what} failed inside the aggregator ({type(exc).__name__}); it is logged there")

    async def _unary(self, what: str, cls: type[M], request: bytes,
                     context: grpc.aio.ServicerContext,  # type: ignore[type-arg]
                     answer: Callable[[M, Caller], Awaitable[_Answer]]) -> bytes:
        """One unary RPC: parse the request, check its ids, ``answer`` it, count its traffic both ways when the
        answer names whose it is; a refusal (or any failure) becomes its gRPC status."""
        run_id = ""
        try:
            msg = parse(cls, request)
            run_id = str(getattr(msg, "run_id", ""))
            _check_ids(run_id, getattr(msg, "organization_id", ""))
            done = await answer(msg, _caller(context))
        except WireError as err:
            failure = err
        except Exception as exc:
            failure = self._internal(what, exc)
        else:
            if done.counted is not None:
                org, round_ = done.counted
                if not done.up_counted:
                    self.handler.count(run_id, org, round_, Direction.UP, breakdown(done.up, len(request)))
                self.handler.count(run_id, org, round_, Direction.DOWN, breakdown(done.down, len(done.response)))
            return done.response
        return await self._fail(context, run_id, failure)

    async def join(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:  # type: ignore[type-arg]
        """Join: admit an organization to a run."""

        async def answer(msg: apb.JoinRequest, caller: Caller) -> _Answer:
            org = self.handler.identify(caller, msg.organization_id)
            reply = await self.handler.join(org, messages.join_request_from_proto(msg))
            proto = messages.join_reply_to_proto(reply)
            proto.push_admission_headers = True  # as ``push`` sends them
            return _Answer(proto.SerializeToString(), (org, reply.current_round))

        return await self._unary("Join", apb.JoinRequest, request, context, answer)

    async def pull(self, request: bytes,
                   context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:  # type: ignore[type-arg]
        """PullInstructions: long-poll, then stream the instructions' chunks."""
        run_id = ""
        try:
            msg = parse(apb.PullInstructionsRequest, request)
            _check_ids(msg.run_id, msg.organization_id)
            run_id = msg.run_id
            org = self.handler.identify(_caller(context), msg.organization_id)
            pulled = await self.handler.pull(org, messages.pull_request_from_proto(msg))
            built = await self._chunks.responses(pulled.encoded, self.handler.chunk_bytes, self.handler.blocking)
        except WireError as err:
            failure = err
        except Exception as exc:
            failure = self._internal("PullInstructions", exc)
        else:
            # The request is traffic too: an envelope-only message up.
            self.handler.count(run_id, org, pulled.round, Direction.UP, with_envelope(TrafficBreakdown(), len(request)),
                               in_round=not pulled.waiting)
            self.handler.count(run_id, org, pulled.round, Direction.DOWN,
                               with_envelope(pulled.encoded.payloads, built.total_bytes, len(built)),
                               in_round=not pulled.waiting)
            for r in built:
                yield r
            return
        await self._fail(context, run_id, failure)

    async def push(self, request_iterator: AsyncIterator[bytes],
                   context: grpc.aio.ServicerContext) -> bytes:  # type: ignore[type-arg]
        """PushUpdate: reassemble a chunked update within the limits, then hand it to the handler."""
        run_id = ""
        admitted: AdmittedPush | None = None
        accepted = False
        try:
            stream = request_iterator.__aiter__()
            raw = await anext(stream, None)
            if raw is None:
                raise WireError("malformed", "an empty PushUpdate stream")
            first, data = parse_chunked(apb.PushUpdateRequest, raw, chunks.PUSH_CHUNK_FIELD)
            _check_ids(first.run_id, first.organization_id)
            run_id = first.run_id
            org = self.handler.identify(_caller(context), first.organization_id)
            # Refuse a stale, foreign or over-limit push before reading it.
            admitted = self.handler.admit_push(org, run_id, first.round, first.chunk.total_bytes)
            await admitted.reassembly_slot()
            # Admitted: a client that waits for the headers before its other chunks sends them now.
            await context.send_initial_metadata(((PUSH_ADMITTED_METADATA_KEY, "1"),))
            head = first.chunk
            receiving = await admitted.receive(first.update_blake3, head.index, head.count, head.total_bytes)
            received = [(first, data, len(raw))]
            del raw, data
            update, digest = await self._reassemble(stream, received, receiving)
            # Handed over, not kept here: the handler frees the bytes as soon as they are logged.
            reply = await self.handler.push(org, run_id, first.round, update, digest, receiving.wire_bytes,
                                            receiving.messages)
            resp = messages.push_reply_to_proto(reply).SerializeToString()
            accepted = True
        except WireError as err:
            failure = _detached(err)
        except Exception as exc:
            failure = self._internal("PushUpdate", exc)
        else:
            return resp
        finally:
            if admitted is not None:
                admitted.release(refused=not accepted)
        return await self._fail(context, run_id, failure)

    async def _reassemble(self, stream: AsyncIterator[bytes],
                          received: list[tuple[apb.PushUpdateRequest, Bytes | None, int]],
                          receiving: Receiving) -> tuple[Bytes, bytes]:
        """The update a push stream carries (its first chunk in ``received``, handed over; earlier streams of a
        resumed push in ``receiving``): the bytes and their BLAKE3 digest. Raises WireError; the partial update
        lives only in ``receiving``, which a refusal's traceback no longer reaches once ``_detached``."""
        first, data, size = received.pop()
        assembler = receiving.assembler
        address = (first.run_id, first.round, first.organization_id)
        done = False
        req: apb.PushUpdateRequest | None = first
        while req is not None:
            if (req.run_id, req.round, req.organization_id) != address:
                raise WireError("envelope_mismatch", "chunks of one push name different runs, rounds or organizations")
            if done:
                raise WireError("malformed", "chunks after the last announced chunk")
            done = assembler.add(req.chunk, data)
            receiving.wire_bytes += size
            receiving.messages += 1
            if receiving.after_chunk is not None:
                receiving.after_chunk()
            data = None
            receiving.waiting = not done
            raw = await self._next_chunk(stream)
            if raw is None:
                req, size = None, 0
            else:
                receiving.waiting = False
                (req, data), size = parse_chunked(apb.PushUpdateRequest, raw, chunks.PUSH_CHUNK_FIELD), len(raw)
                del raw
        return assembler.take(), assembler.digest

    async def _next_chunk(self, stream: AsyncIterator[bytes]) -> bytes | None:
        """The stream's next message (None at its end); a stream silent for ``push_idle_seconds`` is refused,
        so a stalled sender cannot hold a reassembly slot."""
        try:
            return await asyncio.wait_for(anext(stream, None), self.handler.push_idle_seconds)
        except TimeoutError:
            raise WireError("stalled", f"no chunk for {self.handler.push_idle_seconds:g} s "
                                       "(server.push_idle_seconds); push the update again") from None

    async def progress(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:  # type: ignore[type-arg]
        """PushProgress: how much of a cut push the aggregator holds."""

        async def answer(msg: apb.PushProgressRequest, caller: Caller) -> _Answer:
            org = self.handler.identify(caller, msg.organization_id)
            held, size = await self.handler.push_progress(org, msg.run_id, msg.round, msg.update_blake3,
                                                          msg.total_bytes)
            return _Answer(apb.PushProgressResponse(chunks_held=held, bytes_held=size).SerializeToString(),
                           (org, msg.round))

        return await self._unary("PushProgress", apb.PushProgressRequest, request, context, answer)

    async def status(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:  # type: ignore[type-arg]
        """Status: the runs the caller may see (not counted: it is no organization's round traffic)."""

        async def answer(msg: apb.StatusRequest, caller: Caller) -> _Answer:
            runs = await self.handler.status(caller, msg.run_id)
            return _Answer(await self.handler.blocking(
                lambda: apb.StatusResponse(runs=[messages.run_status_to_proto(r) for r in runs]).SerializeToString()))

        return await self._unary("Status", apb.StatusRequest, request, context, answer)

    async def secure_stage(self, request: bytes,
                           context: grpc.aio.ServicerContext) -> bytes:  # type: ignore[type-arg]
        """SecureStage: take a stage message of secure aggregation, long-poll for the next one; both payloads are
        counted per kind, a stage message before it is taken (so also when it is then refused)."""

        async def answer(msg: apb.SecureStageRequest, caller: Caller) -> _Answer:
            org = self.handler.identify(caller, msg.organization_id)
            sent = msg.HasField("payload")
            payload = codec.payload_from_proto(msg.payload) if sent else None
            if sent:  # counted in its round before taking it can close the round (as the last unmask reply does)
                self.handler.count(msg.run_id, org, msg.round, Direction.UP, breakdown([msg.payload], len(request)))
            reply = await self.handler.secure_stage(org, msg.run_id, msg.round, payload, msg.wait_seconds)
            resp = apb.SecureStageResponse(stage=reply.stage, abandoned=reply.abandoned)
            if reply.payload is not None:
                codec.fill_payload(resp.payload, reply.payload)
            return _Answer(resp.SerializeToString(), (org, msg.round), [msg.payload] if sent else [],
                           [resp.payload] if reply.payload is not None else [], up_counted=sent)

        return await self._unary("SecureStage", apb.SecureStageRequest, request, context, answer)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """The service's method handlers, with raw-bytes requests and responses (no gRPC (de)serializer)."""
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Join": grpc.unary_unary_rpc_method_handler(self.join),
            "PullInstructions": grpc.unary_stream_rpc_method_handler(self.pull),
            "PushUpdate": grpc.stream_unary_rpc_method_handler(self.push),
            "PushProgress": grpc.unary_unary_rpc_method_handler(self.progress),
            "Status": grpc.unary_unary_rpc_method_handler(self.status),
            "SecureStage": grpc.unary_unary_rpc_method_handler(self.secure_stage),
        })


def add_aggregator_handler(server: grpc.aio.Server, handler: AggregatorHandler) -> AggregatorServicer:
    """Serve ``handler`` as the hetfed.v1.Aggregator service on an asyncio ``server``."""
    servicer = AggregatorServicer(handler)
    server.add_generic_rpc_handlers((servicer.generic_handler(),))
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


class _PushStreams:
    """The streams of one push: the first from chunk 0, each later one from where the aggregator says it holds
    the push. Each stream's first message carries the update's digest (appended, after the chunk), which names
    the push for a resume, unless the push is one chunk.

    ``resumed``: the push continues one that an earlier process of this organization began (``OutgoingPush``
    reopened): its first stream asks where to resume, and the earlier process's stream counts as one that the
    aggregator may have kept. ``sending(index, count)`` is called as each message is taken for sending."""

    def __init__(self, requests: chunks.Framed, resumed: bool = False,
                 sending: Callable[[int, int], None] | None = None) -> None:
        self.requests = requests
        # A push of one chunk has nothing to resume: it goes without the digest's 34 bytes.
        self.resumable = len(requests) > 1
        self._named = (apb.PushUpdateRequest(update_blake3=requests.digest).SerializeToString() if self.resumable
                       else b"")
        # The first chunk of each stream whose chunks the aggregator kept; a stream is ahead of every earlier
        # one that the aggregator kept (a resume at k drops the streams from k on).
        self._starts: list[int] = [0] if resumed and self.resumable else []
        self.cut = resumed and self.resumable  # a stream of this push was cut: the next one asks where to resume
        self._sending = sending

    def stream(self, start: int) -> Iterator[bytes]:
        """The messages from chunk ``start`` on (0 when it is past the last chunk)."""
        start = start if start < len(self.requests) else 0
        while self._starts and self._starts[-1] >= start:
            self._starts.pop()
        self._starts.append(start)
        if self._sending is not None:
            return self._watched(start)
        rest = (self.requests[i] for i in range(start + 1, len(self.requests)))  # each framed when it is sent
        return itertools.chain((self.requests[start] + self._named,), rest)

    def _watched(self, start: int) -> Iterator[bytes]:
        """``stream``'s messages, each announced to ``sending`` as it is taken."""
        assert self._sending is not None
        count = len(self.requests)
        for i in range(start, count):
            self._sending(i, count)
            yield self.requests[i] + self._named if i == start else self.requests[i]

    def wire_bytes(self) -> int:
        """The bytes of the messages that made up the accepted push: every chunk once, and one digest field per
        stream that carried some of them (what the aggregator counts too)."""
        return self.requests.total_bytes + len(self._named) * len(self._starts)


def push_after_admission(push: grpc.StreamUnaryMultiCallable, requests: Iterator[bytes], **call: Any) -> bytes:
    """A PushUpdate call (``push``, raw bytes) of ``requests`` whose first message goes alone and the others
    after the call's response headers, which the aggregator sends once it has admitted the push
    (``JoinResponse.push_admission_headers``). A push waiting for a reassembly slot then holds its first chunk
    in the aggregator, not a stream window of its chunks; a push of more than one message takes one round trip
    more. Raises grpc.RpcError."""
    made = threading.Event()
    calls: list[grpc.Call] = []
    caller = threading.get_ident()

    def after_admission() -> Iterator[bytes]:
        yield next(requests)
        second = next(requests, None)
        if second is None:  # one message: nothing to hold back
            return
        # gRPC sends the messages from a thread of its own once the call has started. Read here, in the
        # caller's thread, they are being taken before the call starts (an interceptor keeping them): no wait.
        if threading.get_ident() != caller:
            made.wait()
            calls[0].initial_metadata()  # returns at admission, or once the call has ended
        yield second
        del second  # not kept while the next messages are built
        yield from requests

    future = push.future(after_admission(), **call)
    calls.append(future)
    made.set()
    return future.result()  # type: ignore[no-any-return]


class OutgoingPush:
    """An update ready to be pushed: its serialized bytes (``data``, a view: no copy), the messages that carry them
    in chunks and their BLAKE3 ``digest``, which names the push for a resume.

    ``AggregatorClient.prepare_push`` encodes one; ``AggregatorClient.reopen_push`` makes one of bytes an earlier
    process of the organization kept (a memory map, for instance), to resume its push."""

    def __init__(self, round_: int, envelope: bytes, data: Bytes, payloads: TrafficBreakdown) -> None:
        self.round = round_
        self.data = data
        self.payloads = payloads
        self.requests = chunks.framed(envelope, chunks.PUSH_CHUNK_FIELD, data, first_bytes=chunks.FIRST_PUSH_CHUNK_BYTES)

    @property
    def digest(self) -> bytes:
        """The BLAKE3 digest of ``data``."""
        return self.requests.digest

    @property
    def size(self) -> int:
        """The bytes of ``data``."""
        return self.requests.data_bytes

    def __len__(self) -> int:
        """The chunks the push takes."""
        return len(self.requests)


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
        self._address, self._tls = address, tls
        self._tls_signature = tls.signature() if tls else None
        self._channel = make_channel(address, tls)
        self._bind(self._channel)
        self._metadata = () if tls else ((ORGANIZATION_METADATA_KEY, organization),)
        self._push_admission = False  # whether the aggregator answers a push's headers at admission (Join)

    def _follow_renewed_files(self) -> None:
        """After the TLS files changed (a renewed certificate), make the next call on a new connection with them."""
        if self._tls is None:
            return
        signature = self._tls.signature()
        if signature is None or signature == self._tls_signature:
            return
        try:
            channel = make_channel(self._address, self._tls)
        except OSError:  # a renewal half-written: the next call looks again
            return
        self._tls_signature = signature
        old, self._channel = self._channel, channel
        self._bind(channel)
        old.close()

    def _bind(self, channel: grpc.Channel) -> None:
        """Make the calls on ``channel`` (the client's own, or one wrapped by interceptors)."""
        self._stub = agrpc.AggregatorStub(channel)
        # The two calls that carry payloads move bytes both ways, so the traffic counted is the length of the
        # messages sent and received, not a protobuf ByteSize(), which serializes the message once more.
        self._pull_raw = channel.unary_stream(f"/{SERVICE_NAME}/PullInstructions")
        self._push_raw = channel.stream_unary(f"/{SERVICE_NAME}/PushUpdate")
        self._progress_raw = channel.unary_unary(f"/{SERVICE_NAME}/PushProgress")
        self._secure_raw = channel.unary_unary(f"/{SERVICE_NAME}/SecureStage")

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> AggregatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count(self, direction: Direction, b: TrafficBreakdown) -> None:
        if self._traffic is not None:
            self._traffic.record(self.run_id, self.algorithm, self.organization, direction, b)

    def _call(self, what: str, call: Callable[[], T]) -> T:
        def once() -> T:
            self._follow_renewed_files()
            try:
                return call()
            except grpc.RpcError as err:
                raise RemoteError.of(err) from None

        return self._retry(what, once)

    def join(self, declared: Sequence[messages.contract.DeclaredTensor] = (),
             seed_set: messages.Fingerprint | None = None, num_train_examples: int = 0, num_classes: int = 0,
             input_shape: Sequence[int] = ()) -> JoinReply:
        """Join the run (declaring ``declared`` tensors, and the label count and input shape its model and data
        are built for); learns the algorithm, config and seed."""
        req = messages.join_request_to_proto(JoinRequest(self.run_id, self.organization, tuple(declared), seed_set,
                                                         num_train_examples, num_classes,
                                                         tuple(int(s) for s in input_shape)))
        resp = self._call("Join", lambda: self._stub.Join(req, metadata=self._metadata, timeout=self._timeout))
        reply = messages.join_reply_from_proto(resp)
        self.algorithm = reply.algorithm
        self._push_admission = reply.push_admission_headers
        self._count(Direction.UP, with_envelope(TrafficBreakdown(), req.ByteSize()))
        self._count(Direction.DOWN, with_envelope(TrafficBreakdown(), resp.ByteSize()))
        return reply

    def pull(self, completed_round: int, wait_seconds: float, spec: AlgorithmSpec | None) -> Instructions:
        """Long-poll for the next instructions; their payloads are checked against ``spec``'s download contract."""
        req = messages.pull_request_to_proto(PullRequest(self.run_id, self.organization, completed_round, wait_seconds))

        raw_req = req.SerializeToString()

        def call() -> tuple[Bytes, int, int]:
            asm = chunks.Reassembler(max_bytes=1 << 40)
            wire, n = 0, 0
            for raw in self._pull_raw(raw_req, metadata=self._metadata, timeout=wait_seconds + 60):
                wire += len(raw)
                n += 1
                resp, data = parse_chunked(apb.PullInstructionsResponse, raw, chunks.PULL_CHUNK_FIELD, "response")
                asm.add(resp.chunk, data)
            return asm.data(), wire, n

        data, wire, n = self._call("PullInstructions", call)
        ins, payloads = messages.decode_instructions(data, spec)
        self._count(Direction.UP, with_envelope(TrafficBreakdown(), len(raw_req)))
        self._count(Direction.DOWN, with_envelope(payloads, wire, n))
        return ins

    def secure_stage(self, round_: int, payload: Payload | None, wait_seconds: float) -> SecureStageReply:
        """Send this organization's stage message of secure aggregation for ``round_`` (None: none) and wait up to
        ``wait_seconds`` for what the stage's close gives it (a reply without a payload: nothing yet)."""
        req = apb.SecureStageRequest(run_id=self.run_id, round=round_, organization_id=self.organization,
                                     wait_seconds=wait_seconds)
        if payload is not None:
            codec.fill_payload(req.payload, payload)
        raw_req = req.SerializeToString()
        raw = self._call("SecureStage", lambda: self._secure_raw(raw_req, metadata=self._metadata,
                                                                 timeout=wait_seconds + 60))
        resp = parse(apb.SecureStageResponse, raw, "response")
        got = codec.payload_from_proto(resp.payload) if resp.HasField("payload") else None
        self._count(Direction.UP, breakdown([req.payload] if payload is not None else [], len(raw_req)))
        self._count(Direction.DOWN, breakdown([resp.payload] if got is not None else [], len(raw)))
        return SecureStageReply(got, resp.stage, resp.abandoned)

    def push(self, round_: int, payloads: Sequence[Payload], wire_dtype: str | None = None,
             privacy: PrivacyDeclaration | None = None, leave_reason: str = "") -> PushReply:
        """Upload this organization's update for ``round_`` as a chunked stream (idempotent on retry); ``privacy``:
        what protects its payloads (docs/privacy.md), None when the client declares none; ``leave_reason``: a leave
        notice instead (no payloads), which the aggregator refuses ``organization_left`` (a ``RemoteError``).

        A retry after a stream failed resumes the push from the chunks the aggregator holds (``PushProgress``)."""
        return self.send_push(self.prepare_push(round_, payloads, wire_dtype, privacy, leave_reason))

    def _envelope(self, round_: int) -> bytes:
        return apb.PushUpdateRequest(run_id=self.run_id, round=round_,
                                     organization_id=self.organization).SerializeToString()

    def prepare_push(self, round_: int, payloads: Sequence[Payload], wire_dtype: str | None = None,
                     privacy: PrivacyDeclaration | None = None, leave_reason: str = "") -> OutgoingPush:
        """The update ``push`` sends, encoded (one buffer) and planned in chunks, not sent (``send_push``)."""
        encoded = messages.encode_update(messages.Update(self.run_id, round_, self.organization, payloads, privacy,
                                                         leave_reason), wire_dtype)
        return OutgoingPush(round_, self._envelope(round_), encoded.data, encoded.payloads)  # type: ignore[arg-type]

    def reopen_push(self, round_: int, data: Bytes) -> OutgoingPush:
        """A push of the serialized update ``data`` (kept by an earlier process of this organization, as
        ``OutgoingPush.data`` was); WireError (``malformed``, ``envelope_mismatch``) when ``data`` is not an update
        of this run, round and organization. Its tensors are not copied."""
        parsed = messages.ParsedUpdate(data)
        parsed.check_envelope(self.run_id, round_, self.organization)
        return OutgoingPush(round_, self._envelope(round_), data, parsed.payload_traffic)

    def send_push(self, outgoing: OutgoingPush, resume: bool = False,
                  sending: Callable[[int, int], None] | None = None) -> PushReply:
        """Push ``outgoing`` (``push``); ``resume``: it continues the push of an earlier process of this
        organization, so the first stream starts where the aggregator holds it (``PushProgress``);
        ``sending(index, count)``: called as each chunk's message is taken for sending."""
        streams = _PushStreams(outgoing.requests, resume, sending)
        round_ = outgoing.round
        raw = self._call("PushUpdate", lambda: self._push_stream(round_, streams))
        reply = messages.push_reply_from_proto(parse(apb.PushUpdateResponse, raw, "response"))
        if not reply.duplicate:
            self._count(Direction.UP, with_envelope(outgoing.payloads, streams.wire_bytes(), len(outgoing)))
            self._count(Direction.DOWN, with_envelope(TrafficBreakdown(), len(raw)))
        return reply

    def _push_stream(self, round_: int, streams: _PushStreams) -> bytes:
        """One attempt of a push: after a failed one, from where the aggregator holds it (raises grpc.RpcError)."""
        start = self._push_progress(round_, streams) if streams.cut else 0
        try:
            return self._send_push(streams.stream(start))
        except grpc.RpcError as err:
            reason = RemoteError.of(err).reason
            # Only a stream cut under the aggregator (a transport failure, no reason, or one that reached it as
            # incomplete) or one it refused as stalled can have left chunks held; a refusal at admission
            # (too_many_streams, busy, ...) held none, and a push of one chunk is never held. So a retry asks
            # PushProgress only then: its bytes are counted.
            streams.cut = streams.resumable and reason in ("", "stalled", "incomplete")
            if start == 0 or reason != "not_resumable":
                raise
        # The aggregator dropped what it held meanwhile: the whole push again.
        return self._send_push(streams.stream(0))

    def _send_push(self, requests: Iterator[bytes]) -> bytes:
        """One PushUpdate stream of ``requests`` (raises grpc.RpcError), after admission where the aggregator
        answers a push's headers then (:func:`push_after_admission`)."""
        if not self._push_admission:
            return self._push_raw(requests, metadata=self._metadata, timeout=600)  # type: ignore[no-any-return]
        return push_after_admission(self._push_raw, requests, metadata=self._metadata, timeout=600)

    def _push_progress(self, round_: int, streams: _PushStreams) -> int:
        """The chunks of the push the aggregator holds (PushProgress)."""
        req = apb.PushProgressRequest(run_id=self.run_id, round=round_, organization_id=self.organization,
                                      update_blake3=streams.requests.digest,
                                      total_bytes=streams.requests.data_bytes).SerializeToString()
        raw = self._progress_raw(req, metadata=self._metadata, timeout=self._timeout)
        resp = parse(apb.PushProgressResponse, raw, "response")
        self._count(Direction.UP, with_envelope(TrafficBreakdown(), len(req)))
        self._count(Direction.DOWN, with_envelope(TrafficBreakdown(), len(raw)))
        log.info("resuming the push of round %d at chunk %d (%d bytes held)", round_, resp.chunks_held, resp.bytes_held)
        return int(resp.chunks_held)

    def leave(self, round_: int, leave_reason: str = "", privacy: PrivacyDeclaration | None = None,
              wire_dtype: str | None = None, attempts: int = 3) -> RemoteError | None:
        """Send a leave notice for ``round_`` (a ``leave_reason``, or a ``privacy`` declaration with budget_spent) and
        return the aggregator's refusal of it, which is how it takes one (None: it was accepted as an update).

        A notice refused ``late`` (its round closed before it arrived, or had not opened) would leave every later
        round waiting for this organization until its deadline, so it is sent again for the run's current round, as
        Status gives it, up to ``attempts`` times in all. The last refusal is returned when Status fails, the run has
        finished, or the round does not move."""
        for attempt in range(1, attempts + 1):
            try:
                self.push(round_, [], wire_dtype, privacy=privacy, leave_reason=leave_reason)
            except RemoteError as err:
                refused = err
            else:
                return None
            if refused.reason != "late" or attempt == attempts:
                return refused
            try:
                runs = self.status(self.run_id)
            except RemoteError:
                return refused
            if not runs or runs[0].finished or runs[0].round == round_:
                return refused
            round_ = runs[0].round
        raise ValueError(f"attempts must be at least 1, got {attempts}")

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
