"""Counted bytes against the bytes the sockets carried, for whole local federations.

    python benchmarks/socket_bytes.py [--algorithms fedavg,fedavg_head] [--clients 4] [--rounds 3]
                                      [--dataset mnist5k] [--model lenet] [--local-epochs 1]

For each algorithm a real federation runs (``LocalFederation``: one aggregator process, one process
per organization, the same commands a deployment runs), except that every client is pointed at a
counting TCP relay on 127.0.0.1 instead of the aggregator's port. The relay forwards each client
connection to the aggregator and counts every byte each way, so it sees everything the clients'
gRPC channels put on the wire: the HTTP/2 connection preface, SETTINGS, HEADERS (request headers
and trailers), DATA frames, WINDOW_UPDATE and PING frames, GOAWAY, for every RPC (Status, Join,
PullInstructions, PushUpdate). The orchestrator polls Status directly on the aggregator's port, so
none of its own traffic passes the relay.

The relay also parses the HTTP/2 frames and the gRPC length-prefixed messages inside DATA frames
(no HPACK: it does not need header contents), which splits the socket bytes into: gRPC message bytes
(serialized Protobuf), the 5-byte gRPC prefix of each message, HTTP/2 frame headers of DATA frames,
HEADERS frames, control frames and the preface.

The counted bytes are the aggregator's Prometheus counters ``hetfed_aggregator_bytes_total{run=...}`` scraped
from its /metrics endpoint after every client has exited, summed per direction ("up": client to
aggregator). The ratio printed is counted / socket; the design's claim is that it is within 5% of 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from hetfed.cli.localrun import LocalFederation, LocalRunOptions, aggregator_config, client_config, plan
from hetfed.wire.messages import RunStatus

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_TYPES = {0: "DATA", 1: "HEADERS", 2: "PRIORITY", 3: "RST_STREAM", 4: "SETTINGS", 5: "PUSH_PROMISE",
               6: "PING", 7: "GOAWAY", 8: "WINDOW_UPDATE", 9: "CONTINUATION"}
FLAG_PADDED = 0x8


class _GrpcMessages:
    """Splits one HTTP/2 stream's DATA payload into gRPC length-prefixed messages (1-byte flag, 4-byte length)."""

    def __init__(self) -> None:
        self.prefix = bytearray()
        self.body_left = 0

    def feed(self, data: memoryview, out: Flow) -> None:
        i, n = 0, len(data)
        while i < n:
            if self.body_left:
                take = min(self.body_left, n - i)
                self.body_left -= take
                i += take
                continue
            take = min(5 - len(self.prefix), n - i)
            self.prefix += data[i : i + take]
            i += take
            if len(self.prefix) == 5:
                length = int.from_bytes(self.prefix[1:5], "big")
                out.grpc_messages += 1
                out.grpc_message_bytes += length
                self.prefix.clear()
                self.body_left = length


@dataclass
class Flow:
    """Bytes of one direction of one connection, split by HTTP/2 frame type and gRPC message."""

    client_preface: bool
    bytes: int = 0
    preface_bytes: int = 0
    frame_bytes: Counter[str] = field(default_factory=Counter)  # 9-byte header + payload, by frame type
    frames: Counter[str] = field(default_factory=Counter)
    grpc_messages: int = 0
    grpc_message_bytes: int = 0
    padded_frames: int = 0
    _preface_left: int = -1
    _hdr: bytearray = field(default_factory=bytearray)
    _left: int = 0
    _type: int = 0
    _stream: int = 0
    _streams: dict[int, _GrpcMessages] = field(default_factory=dict)

    def feed(self, data: memoryview) -> None:
        """Account for the next bytes of this direction (any split of the byte stream)."""
        self.bytes += len(data)
        i, n = 0, len(data)
        if self._preface_left < 0:
            self._preface_left = len(PREFACE) if self.client_preface else 0
        if self._preface_left:
            take = min(self._preface_left, n)
            self._preface_left -= take
            self.preface_bytes += take
            i += take
        while i < n:
            if self._left == 0 and len(self._hdr) < 9:
                take = min(9 - len(self._hdr), n - i)
                self._hdr += data[i : i + take]
                i += take
                if len(self._hdr) < 9:
                    break
                length = int.from_bytes(self._hdr[0:3], "big")
                self._type, flags = self._hdr[3], self._hdr[4]
                self._stream = int.from_bytes(self._hdr[5:9], "big") & 0x7FFFFFFF
                name = FRAME_TYPES.get(self._type, f"type{self._type}")
                self.frame_bytes[name] += 9 + length
                self.frames[name] += 1
                if self._type == 0 and flags & FLAG_PADDED:
                    self.padded_frames += 1  # gRPC does not pad; such bytes would be misread below
                self._left = length
                if length == 0:
                    self._hdr.clear()
                continue
            take = min(self._left, n - i)
            if self._type == 0:
                self._streams.setdefault(self._stream, _GrpcMessages()).feed(data[i : i + take], self)
            i += take
            self._left -= take
            if self._left == 0:
                self._hdr.clear()

    def add(self, other: Flow) -> None:
        """Accumulate another connection's counts (not its parser state)."""
        self.bytes += other.bytes
        self.preface_bytes += other.preface_bytes
        self.frame_bytes.update(other.frame_bytes)
        self.frames.update(other.frames)
        self.grpc_messages += other.grpc_messages
        self.grpc_message_bytes += other.grpc_message_bytes
        self.padded_frames += other.padded_frames

    def parts(self) -> dict[str, int]:
        """The socket bytes split into what carried them; the values sum to ``bytes``."""
        data_headers = 9 * self.frames["DATA"]
        out = {
            "gRPC messages (serialized Protobuf)": self.grpc_message_bytes,
            "gRPC 5-byte message prefixes": 5 * self.grpc_messages,
            "HTTP/2 DATA frame headers": data_headers,
            "HTTP/2 HEADERS (+CONTINUATION) frames": self.frame_bytes["HEADERS"] + self.frame_bytes["CONTINUATION"],
            "HTTP/2 control frames (SETTINGS, PING, WINDOW_UPDATE, RST_STREAM, GOAWAY)": sum(
                v for k, v in self.frame_bytes.items() if k not in ("DATA", "HEADERS", "CONTINUATION")),
            "HTTP/2 connection preface": self.preface_bytes,
        }
        out["unparsed (padding, cut-off frames)"] = self.bytes - sum(out.values())
        return out


class CountingRelay:
    """A TCP relay on 127.0.0.1 that forwards every connection to ``target_port`` and counts its bytes."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self.connections: list[tuple[Flow, Flow]] = []  # (up, down) per accepted connection
        self._open = 0
        self._idle = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._accepter = threading.Thread(target=self._accept_loop, name="relay-accept", daemon=True)

    def start(self) -> CountingRelay:
        """Start accepting connections."""
        self._accepter.start()
        return self

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            up, down = Flow(client_preface=True), Flow(client_preface=False)
            pumps_left = [2]  # the last pump of a connection to finish closes both sockets
            with self._lock:
                self.connections.append((up, down))
                self._open += 1
            for src, dst, flow, name in ((client, upstream, up, "up"), (upstream, client, down, "down")):
                threading.Thread(target=self._pump, args=(src, dst, flow, pumps_left), name=f"relay-{name}",
                                 daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, flow: Flow, pumps_left: list[int]) -> None:
        buf = bytearray(1 << 16)
        view = memoryview(buf)
        try:
            while True:
                try:
                    n = src.recv_into(buf)
                except OSError:
                    n = 0
                if n == 0:
                    break
                flow.feed(view[:n])
                try:
                    dst.sendall(view[:n])
                except OSError:
                    break
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)  # pass the end of this direction on
            with self._lock:
                pumps_left[0] -= 1
                last = pumps_left[0] == 0
                if last:
                    self._open -= 1
                    self._idle.notify_all()
            if last:
                for sock in (src, dst):
                    with contextlib.suppress(OSError):
                        sock.close()

    def wait_closed(self, timeout: float) -> bool:
        """Wait until every relayed connection has ended both ways; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._open:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def stop(self) -> None:
        """Stop accepting; connections still open are left to their pumps."""
        self._stop.set()
        self._listener.close()
        self._accepter.join(timeout=5)

    def totals(self) -> tuple[Flow, Flow]:
        """(up, down) summed over every connection so far."""
        up, down = Flow(client_preface=True), Flow(client_preface=False)
        with self._lock:
            for u, d in self.connections:
                up.add(u)
                down.add(d)
        return up, down


def scrape_counted(metrics_port: int, run_id: str) -> dict[str, dict[str, int]]:
    """The aggregator's ``hetfed_aggregator_bytes_total`` for ``run_id``: direction -> payload kind -> bytes."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, dict[str, int]] = {"up": {}, "down": {}}
    for family in text_string_to_metric_families(text):
        if family.name != "hetfed_aggregator_bytes":
            continue
        for s in family.samples:
            if s.name == "hetfed_aggregator_bytes_total" and s.labels.get("run") == run_id:
                side = out.setdefault(s.labels["direction"], {})
                side[s.labels["payload_kind"]] = side.get(s.labels["payload_kind"], 0) + int(s.value)
    return out


def status_counted(status: RunStatus) -> dict[str, int]:
    """Bytes per direction summed over a run's Status history (the same counting, per round)."""
    out = {"up": 0, "down": 0}
    for rec in status.history:
        for t in rec.traffic:
            out[t.direction] += t.bytes
    return out


def measure(opts: LocalRunOptions, workdir: Path, timeout: float = 600.0) -> dict[str, Any]:
    """Run one federation of ``opts.algorithms[0]`` behind the relay; returns counted and socket bytes."""
    (algorithm,) = opts.algorithms
    run_id = algorithm.replace("_", "-")
    clients = plan(opts).clients  # the user's, else the partition's
    fed = LocalFederation(workdir)
    relay: CountingRelay | None = None
    started = time.monotonic()
    try:
        fed.start_aggregator(aggregator_config(opts, str(workdir / "state")))
        relay = CountingRelay(fed.port).start()
        for i in range(clients):
            fed.start_client(f"client-{run_id}-org-{i}", client_config(opts, run_id, i, relay.port))
        deadline = time.monotonic() + timeout
        while True:
            fed.raise_if_failed()
            status = fed.status()[0]  # directly on the aggregator's port: never through the relay
            if status.finished:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{algorithm} did not finish within {timeout}s (phase {status.phase.value})")
            time.sleep(0.2)
        fed.wait_clients(timeout=60)
        if not relay.wait_closed(timeout=30):
            raise TimeoutError("relayed connections still open 30s after every client exited")
        counted = scrape_counted(fed.metrics_port, run_id)
        from_status = status_counted(fed.status()[0])
        up, down = relay.totals()
        return {
            "algorithm": algorithm,
            "clients": clients,
            "rounds": opts.rounds,
            "dataset": opts.dataset,
            "model": ",".join(opts.models),
            "wall_seconds": time.monotonic() - started,
            "connections": len(relay.connections),
            "counted": {d: sum(k.values()) for d, k in counted.items()},
            "counted_by_kind": counted,
            "status_counted": from_status,
            "socket": {"up": up.bytes, "down": down.bytes},
            "socket_parts": {"up": up.parts(), "down": down.parts()},
            "grpc_messages": {"up": up.grpc_messages, "down": down.grpc_messages},
            "frames": {"up": dict(up.frames), "down": dict(down.frames)},
        }
    finally:
        fed.stop()
        if relay is not None:
            relay.stop()


def report(r: dict[str, Any]) -> str:
    """A plain-text account of one measurement."""
    lines = [f"{r['algorithm']}: {r['clients']} clients, {r['rounds']} rounds, {r['dataset']}/{r['model']}, "
             f"{r['connections']} client connections, {r['wall_seconds']:.0f}s"]
    lines.append(f"  {'direction':<10}{'counted B':>12}{'socket B':>12}{'counted/socket':>16}")
    for d in ("up", "down"):
        c, s = r["counted"].get(d, 0), r["socket"][d]
        lines.append(f"  {d:<10}{c:>12}{s:>12}{c / s if s else float('nan'):>16.4f}")
    c = sum(r["counted"].values())
    s = sum(r["socket"].values())
    lines.append(f"  {'both':<10}{c:>12}{s:>12}{c / s:>16.4f}")
    for d in ("up", "down"):
        lines.append(f"  socket bytes {d}, by what carried them ({r['grpc_messages'][d]} gRPC messages):")
        for k, v in r["socket_parts"][d].items():
            if v:
                lines.append(f"    {k:<78}{v:>10}")
        uncounted = r["socket_parts"][d]["gRPC messages (serialized Protobuf)"] - r["counted"].get(d, 0)
        lines.append(f"    {'of the gRPC messages, not in the counters':<78}{uncounted:>10}")
    lines.append(f"  counted per kind: {json.dumps(r['counted_by_kind'], sort_keys=True)}")
    lines.append(f"  Status history sums (no FINISH pulls): {r['status_counted']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure each algorithm and print counted, socket and their ratio per direction."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithms", default="fedavg,fedavg_head")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dataset", default="mnist5k")
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="also write the measurements here")
    args = ap.parse_args(argv)
    print(f"$ python benchmarks/socket_bytes.py --algorithms {args.algorithms} --clients {args.clients} "
          f"--rounds {args.rounds} --dataset {args.dataset} --model {args.model} "
          f"--local-epochs {args.local_epochs}", flush=True)
    results = []
    for algorithm in [a.strip() for a in args.algorithms.split(",") if a.strip()]:
        opts = LocalRunOptions(algorithms=(algorithm,), clients=args.clients, rounds=args.rounds,
                               dataset=args.dataset, models=(args.model,), train={"local_epochs": args.local_epochs},
                               quiet=True)
        with tempfile.TemporaryDirectory(prefix=f"hetfed-socket-{algorithm}-") as tmp:
            r = measure(opts, Path(tmp))
        results.append(r)
        print(report(r), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
