"""The aggregator's counted bytes agree with what the client sockets carried, for a whole FedAvg run.

A real federation (aggregator process + client processes) runs with every client behind a counting
TCP relay (benchmarks/socket_bytes.py), so the comparison is against real socket bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hetfed.cli.localrun import LocalRunOptions
from tests.conftest import load_benchmark


@pytest.mark.e2e
def test_counted_bytes_match_socket_bytes_for_fedavg(tmp_path: Path) -> None:
    bench = load_benchmark("socket_bytes")
    opts = LocalRunOptions(algorithms=("fedavg",), clients=2, rounds=2, dataset="digits", models=("mlp",),
                           train={"local_epochs": 1}, quiet=True)
    r = bench.measure(opts, tmp_path, timeout=300)
    print(bench.report(r))
    # Every client connection went through the relay, the orchestrator's Status polling did not.
    assert r["connections"] == 2
    for d in ("up", "down"):
        counted, sock = r["counted"][d], r["socket"][d]
        parts = r["socket_parts"][d]
        # The relay's HTTP/2 + gRPC parse accounts for every socket byte.
        assert parts["unparsed (padding, cut-off frames)"] == 0, parts
        assert sum(parts.values()) == sock
        # Counted bytes are serialized gRPC messages: never more than the messages on the socket.
        assert 0 < counted <= parts["gRPC messages (serialized Protobuf)"] < sock
        ratio = counted / sock
        assert abs(ratio - 1) < 0.05, f"{d}: counted {counted} B, socket {sock} B, ratio {ratio:.4f}"
    # Status history holds the same counting per round; only the final FINISH pulls (request up, answer
    # down) come after the last round's record.
    assert 0 < r["counted"]["up"] - r["status_counted"]["up"] < 100 * opts.clients
    assert 0 < r["counted"]["down"] - r["status_counted"]["down"] < 200 * opts.clients


def test_relay_parser_splits_http2_and_grpc_exactly() -> None:
    """The relay's frame parser on a hand-built byte stream, fed in awkward pieces."""
    bench = load_benchmark("socket_bytes")

    def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload

    def grpc(message: bytes) -> bytes:
        return b"\x00" + len(message).to_bytes(4, "big") + message

    msg_a, msg_b, msg_c = b"a" * 300, b"", b"c" * 70
    body = grpc(msg_a) + grpc(msg_b)
    stream = (
        bench.PREFACE
        + frame(4, 0, 0, b"\x00\x03\x00\x00\x00\x64")  # SETTINGS
        + frame(1, 4, 1, b"h" * 40)  # HEADERS
        + frame(0, 0, 1, body[:7])  # a gRPC prefix split across DATA frames
        + frame(0, 0, 1, body[7:])
        + frame(1, 4, 3, b"h" * 12)
        + frame(0, 1, 3, grpc(msg_c))
        + frame(8, 0, 0, b"\x00\x00\x10\x00")  # WINDOW_UPDATE
        + frame(6, 1, 0, b"p" * 8)  # PING ack
    )
    for piece in (1, 3, 7, 64, len(stream)):
        flow = bench.Flow(client_preface=True)
        for i in range(0, len(stream), piece):
            flow.feed(memoryview(stream[i : i + piece]))
        assert flow.bytes == len(stream)
        assert flow.grpc_messages == 3
        assert flow.grpc_message_bytes == 370
        assert flow.frames == {"SETTINGS": 1, "HEADERS": 2, "DATA": 3, "WINDOW_UPDATE": 1, "PING": 1}
        parts = flow.parts()
        assert parts == {
            "gRPC messages (serialized Protobuf)": 370,
            "gRPC 5-byte message prefixes": 15,
            "HTTP/2 DATA frame headers": 27,
            "HTTP/2 HEADERS (+CONTINUATION) frames": 9 + 40 + 9 + 12,
            "HTTP/2 control frames (SETTINGS, PING, WINDOW_UPDATE, RST_STREAM, GOAWAY)": 15 + 13 + 17,
            "HTTP/2 connection preface": 24,
            "unparsed (padding, cut-off frames)": 0,
        }
