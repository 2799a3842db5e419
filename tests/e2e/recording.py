"""An in-process organization whose every request is recorded: the end-to-end contract tests' witness of what
crosses the wire."""

from __future__ import annotations

from typing import Any

import grpc

from hetfed.v1 import aggregator_pb2 as apb

# The request type of each method, for the calls the client makes with serialized bytes.
REQUESTS = {"Join": apb.JoinRequest, "PullInstructions": apb.PullInstructionsRequest,
            "PushUpdate": apb.PushUpdateRequest, "Status": apb.StatusRequest}


def _message(method: str, request: Any) -> Any:
    """A recorded request as its message (parsed from the bytes that were sent, when they were bytes)."""
    if isinstance(request, bytes):
        return REQUESTS[method.rsplit("/", 1)[-1]].FromString(request)
    return request


class Recorder(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
               grpc.StreamUnaryClientInterceptor):
    """Keeps every request message a client sends, by RPC method."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        self.sent.append((details.method, _message(details.method, request)))
        return continuation(details, request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        self.sent.append((details.method, _message(details.method, request)))
        return continuation(details, request)

    def intercept_stream_unary(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        items = list(request_iterator)
        self.sent.append((details.method, [_message(details.method, r) for r in items]))
        return continuation(details, iter(items))


def client_runtime(cfg: dict[str, Any]) -> Any:
    from hetfed.client.config import ClientConfig
    from hetfed.client.runtime import ClientRuntime
    from hetfed.wire.config import from_mapping

    return ClientRuntime(from_mapping(ClientConfig, cfg))


def run_recorded(cfg: dict[str, Any]) -> tuple[list[tuple[str, Any]], Any]:
    """Run one organization's client (config mapping ``cfg``) in this process until its run ends, recording every
    request it sends; returns (the requests by RPC method, its reports)."""
    rt = client_runtime(cfg)
    recorder = Recorder()
    rt.client._bind(grpc.intercept_channel(rt.client._channel, recorder))
    reports = rt.run()
    return recorder.sent, reports
