"""Foundation-size models through real processes: one aggregator, N synthetic clients, FedAvg, against the floor.

    python benchmarks/large_model.py --size-gb 0.4,3.2 --clients 4,8 --rounds 3 --json large.json
    python benchmarks/large_model.py --size-gb 0.4 --clients 4 --rtt-ms 100 --mbit 1000

The aggregator is the product's: ``hetfed aggregator --config FILE`` started by ``LocalFederation``, one FedAvg
run of N organizations with its plausibility bounds on (``max_abs_weight`` 10, ``max_update_norm_ratio`` 10).
The model is benchmarks/synthetic_model.py's GPT-2-Large-like list of float32 tensors of the declared size.

Each client is a process of this script (``_client``) that speaks the wire protocol itself, so that its own
memory does not limit N: it joins declaring the tensors, and in each round it pulls the instructions as a
stream of chunks, hashing them and checking the BLAKE3 digest without keeping the model, and pushes an
``Update`` whose ``ModelWeights`` bytes it generates a block of 1 MiB at a time (synthetic_model.py: the same
base for everyone plus seeded noise), framing the Update's protobuf fields around them by hand and the
``PushUpdateRequest`` chunks as ``hetfed.wire.chunks.framed`` does (the BLAKE3 digest of the whole Update in
the last chunk). A client holds about one chunk, not the update. The aggregator checks and folds it as any
update.

Figures per configuration (one table row, one JSON row with ``--json``):

- ``round_s``: the median over rounds 2..R of the period from one train round's close to the next (the
  aggregator's log), a whole round; ``open_close_s``: the median of the rounds' own durations (Status);
- ``agg_cpu_s`` and ``clients_cpu_s``: core-seconds per round (utime + stime, /proc/PID/stat) between the
  close of round 1 and the close of round R, over R - 1;
- ``agg_peak_rss_gb`` (VmHWM), with the peaks of its RssAnon and RssFile as sampled every 50 ms, and
  ``client_peak_rss_gb``, the largest client's VmHWM; ``/model``: the aggregator's peak over the model size;
- the floor, measured in the same run after the federation: ``disk_s``, writing the round's update bytes
  (N x model) to a file in the state directory's file system once, fsync included, and ``net_s``, moving them
  once through a loopback TCP connection (with ``--rtt-ms``/``--mbit``: through a relay of the same settings);
  ``floor_s`` is their sum and ``ratio`` the round over it.

A memory guard stops a federation when the machine's available memory falls under ``--guard-gb`` or the
federation's processes together hold more than ``--max-total-gb``; its row then reads "stopped at X GB in
round R". GB = 10^9 bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import numpy as np

from hetfed.cli.localrun import LocalFederation, stop_all
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import payloads_pb2 as ppb
from hetfed.v1 import tensor_pb2 as tpb
from hetfed.wire import chunks, framing
from hetfed.wire import digest as content
from hetfed.wire.rpc import AggregatorClient, RemoteError, push_after_admission
from hetfed.wire.transport import ORGANIZATION_METADATA_KEY, make_channel


def _sibling(name: str) -> ModuleType:
    """benchmarks/<name>.py (the benchmarks folder is scripts, not a package), imported once."""
    if name not in sys.modules:
        path = Path(__file__).resolve().with_name(f"{name}.py")
        if not path.exists():
            raise FileNotFoundError(f"{path} is needed (--rtt-ms and --mbit route through its LinkRelay)")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


synth = _sibling("synthetic_model")

RUN = "large"
EXAMPLES = 1000  # every organization's aggregation weight: the aggregate is the plain mean
SAMPLE_S = 0.05
STATUS_S = 0.5
SERVICE = "/hetfed.v1.Aggregator"
_LEN, _VARINT = framing.WIRE_LEN, framing.WIRE_VARINT


# --------------------------------------------------------------------------------------------- the Update's bytes

def _field(number: int, length: int) -> bytes:
    """The key and length of a length-delimited field."""
    return framing.tag(number, _LEN) + framing.write_varint(length)


def update_layout(shapes: dict[str, tuple[int, ...]], round_: int, organization: str) -> tuple[
        bytes, list[bytes], bytes, int]:
    """An Update of ModelWeights (the tensors, in order) and EvalMetrics, as protobuf serializes it: the bytes
    before the first tensor's data, the bytes before each later tensor's data (index k: before tensor k + 1's),
    the bytes after the last tensor's data, and the total length."""
    envelope = apb.Update(envelope=apb.Envelope(
        run_id=RUN, round=round_, organization_id=organization,
        payload_kinds=[ppb.PAYLOAD_KIND_MODEL_WEIGHTS, ppb.PAYLOAD_KIND_EVAL_METRICS])).SerializeToString()
    heads, data = [], []
    for name, shape in shapes.items():
        n = 4 * math.prod(shape)
        t_head = tpb.Tensor(dtype=tpb.DTYPE_FLOAT32, shape=shape).SerializeToString() + (
            framing.tag(3, _LEN) + framing.write_varint(n) if n else b"")
        named = tpb.NamedTensor(name=name).SerializeToString() + _field(2, len(t_head) + n) + t_head
        heads.append(_field(1, len(named) + n) + named)
        data.append(n)
    num_examples = framing.tag(2, _VARINT) + framing.write_varint(EXAMPLES)
    mw_len = sum(len(h) for h in heads) + sum(data) + len(num_examples)
    payload_len = len(_field(1, mw_len)) + mw_len
    metrics = apb.Update(payloads=[ppb.Payload(eval_metrics=ppb.EvalMetrics(
        train_loss=0.5, num_train_examples=EXAMPLES))]).SerializeToString()
    first = envelope + _field(2, payload_len) + _field(1, mw_len) + heads[0]
    last = num_examples + metrics
    total = len(envelope) + len(_field(2, payload_len)) + payload_len + len(metrics)
    return first, heads[1:], last, total


def update_pieces(shapes: dict[str, tuple[int, ...]], seed: int, index: int, round_: int,
                  organization: str) -> tuple[Iterator[bytes | memoryview], int]:
    """The Update's bytes as a stream of pieces (framing, then 1 MiB blocks of generated tensor data), and its
    total length."""
    first, heads, last, total = update_layout(shapes, round_, organization)

    def pieces() -> Iterator[bytes | memoryview]:
        yield first
        current = 0
        for k, block in synth.update_blocks(shapes, seed, index, round_):
            while current < k:  # the next tensor's framing (a tensor of no elements has no blocks)
                yield heads[current]
                current += 1
            yield memoryview(block).cast("B")
        yield from heads[current:]
        yield last

    return pieces(), total


def push_messages(envelope: bytes, pieces: Iterable[bytes | memoryview], total: int, chunk_bytes: int,
                  first_bytes: int, sent: list[int]) -> Iterator[bytes]:
    """Serialized ``PushUpdateRequest`` messages carrying ``pieces`` (``total`` bytes), chunk by chunk, exactly
    as ``chunks.framed`` frames a whole buffer: the first chunk ``first_bytes`` long, the digest in the last.
    ``sent`` gets the bytes of each message."""
    first = min(first_bytes, chunk_bytes)
    bounds = [0, *range(first, total, chunk_bytes), total] if total > first else [0, total]
    count = len(bounds) - 1
    hasher = content.hasher()
    chunk_tag = framing.tag(chunks.PUSH_CHUNK_FIELD, _LEN)
    buf = bytearray()
    index = 0

    def message(data: bytes | bytearray, last: bool) -> bytes:
        head = apb.Chunk(index=index, count=count, total_bytes=total).SerializeToString()
        data_head = _field(apb.Chunk.DATA_FIELD_NUMBER, len(data)) if data else b""
        tail = _field(apb.Chunk.BLAKE3_FIELD_NUMBER, content.SIZE) + hasher.digest() if last else b""
        size = len(head) + len(data_head) + len(data) + len(tail)
        raw = b"".join((envelope, chunk_tag, framing.write_varint(size), head, data_head, data, tail))
        sent.append(len(raw))
        return raw

    for piece in pieces:
        view = memoryview(piece).cast("B")
        while view.nbytes:
            want = bounds[index + 1] - bounds[index] - len(buf)
            take = view[:want]
            hasher.update(take)
            buf += take
            view = view[take.nbytes:]
            if len(buf) == bounds[index + 1] - bounds[index] and index < count - 1:
                yield message(buf, False)
                buf = bytearray()
                index += 1
    if index != count - 1 or len(buf) != bounds[-1] - bounds[-2]:
        raise AssertionError(f"the pieces carry a different length than the {total} bytes announced")
    yield message(buf, True)


class FieldScanner:
    """Reads a message's top-level fields from a stream of pieces, keeping all but one length-delimited field
    (``skip``: Instructions' payloads), whose bytes are only counted."""

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.kept = bytearray()
        self.skipped = 0
        self._head = bytearray()
        self._left = 0
        self._keeping = False

    def feed(self, data: memoryview) -> None:
        """The next piece of the message."""
        pos, n = 0, data.nbytes
        while pos < n:
            if self._left:
                take = min(self._left, n - pos)
                if self._keeping:
                    self.kept += data[pos:pos + take]
                else:
                    self.skipped += take
                pos += take
                self._left -= take
                continue
            self._head.append(data[pos])
            pos += 1
            self._parse_head()

    def _parse_head(self) -> None:
        head = memoryview(bytes(self._head))
        try:
            key, at = framing.read_varint(head, 0)
            wire_type = key & 7
            if wire_type == _VARINT:
                framing.read_varint(head, at)
                self.kept += head
            elif wire_type == _LEN:
                length, _ = framing.read_varint(head, at)
                self._keeping = key >> 3 != self.skip
                if self._keeping:
                    self.kept += head
                self._left = length
            elif wire_type in (1, 5):
                self.kept += head
                self._keeping, self._left = True, 8 if wire_type == 1 else 4
            else:
                raise ValueError(f"wire type {wire_type} in a pulled message")
        except ValueError as exc:
            if "truncated" in str(exc) and len(self._head) < 20:
                return  # more bytes of this field's key or length to come
            raise
        self._head.clear()


# --------------------------------------------------------------------------------------------- client process

class SyntheticClient:
    """One organization speaking the wire protocol with streamed, generated updates."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.org = f"org-{args.index}"
        self.shapes = {k: tuple(v) for k, v in json.loads(Path(args.shapes).read_text()).items()}
        self.md = ((ORGANIZATION_METADATA_KEY, self.org),)
        self.channel = make_channel(args.aggregator, None)
        self._pull = self.channel.unary_stream(f"{SERVICE}/PullInstructions")
        self._push = self.channel.stream_unary(f"{SERVICE}/PushUpdate")
        self.marks: list[dict[str, Any]] = []
        self.admission = False

    def join(self) -> None:
        req = apb.JoinRequest(run_id=RUN, organization_id=self.org, num_train_examples=EXAMPLES)
        for name, shape in self.shapes.items():
            req.declared_tensors.add(payload_kind=ppb.PAYLOAD_KIND_MODEL_WEIGHTS, name=name,
                                     dtype=tpb.DTYPE_FLOAT32, shape=shape)
        raw = self.channel.unary_unary(f"{SERVICE}/Join")(req.SerializeToString(), metadata=self.md, timeout=120)
        self.admission = apb.JoinResponse.FromString(raw).push_admission_headers

    def pull(self, completed: int, dump: Path | None) -> tuple[apb.Instructions, dict[str, Any]]:
        """PullInstructions read chunk by chunk: hashed, checked, its payloads skipped (or written to ``dump``)."""
        req = apb.PullInstructionsRequest(run_id=RUN, organization_id=self.org, completed_round=completed,
                                          wait_seconds=30).SerializeToString()
        hasher, scanner = content.hasher(), FieldScanner(apb.Instructions.PAYLOADS_FIELD_NUMBER)
        wire = received = 0
        last = apb.Chunk()
        out = open(dump, "wb") if dump else None  # noqa: SIM115 - closed below
        try:
            for raw in self._pull(req, metadata=self.md, timeout=3600):
                wire += len(raw)
                small, data = chunks.unframed(raw, chunks.PULL_CHUNK_FIELD)
                last = apb.PullInstructionsResponse.FromString(small).chunk
                view = memoryview(last.data if data is None else data)
                hasher.update(view)
                scanner.feed(view)
                received += view.nbytes
                if out:
                    out.write(view)
        finally:
            if out:
                out.close()
        digest = hasher.digest()
        if received != last.total_bytes or digest != last.blake3:
            raise RuntimeError(f"{self.org}: pulled {received} of {last.total_bytes} bytes, digest "
                               f"{'matches' if digest == last.blake3 else 'differs'}")
        ins = apb.Instructions.FromString(bytes(scanner.kept))
        return ins, {"pulled_wire_bytes": wire, "payload_bytes": scanner.skipped, "digest": digest.hex()}

    def push(self, round_: int, train: bool) -> dict[str, Any]:
        """PushUpdate of a generated update (``train``) or of EvalMetrics alone."""
        if train:
            pieces, total = update_pieces(self.shapes, self.args.seed, self.args.index, round_, self.org)
        else:
            data = apb.Update(envelope=apb.Envelope(run_id=RUN, round=round_, organization_id=self.org,
                                                    payload_kinds=[ppb.PAYLOAD_KIND_EVAL_METRICS]),
                              payloads=[ppb.Payload(eval_metrics=ppb.EvalMetrics(num_train_examples=EXAMPLES))]
                              ).SerializeToString()
            pieces, total = iter([data]), len(data)
        envelope = apb.PushUpdateRequest(run_id=RUN, round=round_, organization_id=self.org).SerializeToString()
        sent: list[int] = []
        msgs = push_messages(envelope, pieces, total, self.args.chunk_bytes, chunks.FIRST_PUSH_CHUNK_BYTES, sent)
        if self.admission:  # as hetfed's client: the chunks after the first once the push is admitted
            raw = push_after_admission(self._push, msgs, metadata=self.md, timeout=3600)
        else:
            raw = self._push(msgs, metadata=self.md, timeout=3600)
        reply = apb.PushUpdateResponse.FromString(raw)
        if not reply.accepted:
            raise RuntimeError(f"{self.org}: round {round_} refused: {reply}")
        return {"update_bytes": total, "pushed_wire_bytes": sum(sent), "messages": len(sent)}

    def run(self) -> None:
        self.join()
        completed = -1
        while True:
            t0 = time.monotonic()
            dump = Path(self.args.dump) / f"{self.org}-after-{completed}.bin" if self.args.dump else None
            ins, pulled = self.pull(completed, dump)
            if ins.action == apb.ACTION_WAIT:
                continue
            if ins.action == apb.ACTION_FINISH:
                return
            if ins.action not in (apb.ACTION_TRAIN, apb.ACTION_EVALUATE):
                raise RuntimeError(f"{self.org}: unexpected action {ins.action}")
            r = ins.envelope.round
            if dump:
                dump.rename(dump.with_name(f"{self.org}-round-{r}.bin"))
            t1 = time.monotonic()
            pushed = self.push(r, ins.action == apb.ACTION_TRAIN)
            self.marks.append({"round": r, "action": apb.Action.Name(ins.action), "pull_s": t1 - t0,
                               "push_s": time.monotonic() - t1, **pulled, **pushed})
            completed = r


def client_main(args: argparse.Namespace) -> int:
    client = SyntheticClient(args)
    try:
        client.run()
    finally:
        client.channel.close()
        Path(args.out).write_text(json.dumps({"marks": client.marks, "vm_hwm": proc_status(os.getpid())[0]}))
    return 0


# --------------------------------------------------------------------------------------------- measurement

def proc_status(pid: int) -> tuple[int, int, int]:
    """(VmHWM, RssAnon, RssFile) of a process in bytes; zeros once it is gone."""
    out = {"VmHWM:": 0, "RssAnon:": 0, "RssFile:": 0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = line.split(":", 1)[0] + ":"
            if key in out:
                out[key] = int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out["VmHWM:"], out["RssAnon:"], out["RssFile:"]


def proc_cpu(pid: int) -> float | None:
    """utime + stime of a process in seconds, all threads; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mem_available() -> int:
    """The machine's MemAvailable in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


class Sampler:
    """Every SAMPLE_S: each process's VmHWM and the peaks of its RssAnon and RssFile, and the CPU seconds of
    the aggregator and of all clients together, with the wall-clock time of the sample."""

    def __init__(self, aggregator: int, clients: list[int]) -> None:
        self.pids = {"aggregator": aggregator, **{f"client-{i}": p for i, p in enumerate(clients)}}
        self.hwm: dict[str, int] = dict.fromkeys(self.pids, 0)
        self.anon: dict[str, int] = dict.fromkeys(self.pids, 0)
        self.file: dict[str, int] = dict.fromkeys(self.pids, 0)
        self.rss_now: dict[str, int] = dict.fromkeys(self.pids, 0)
        self.cpu_last: dict[str, float] = dict.fromkeys(self.pids, 0.0)
        self.cpu: list[tuple[float, float, float]] = []  # (time.time(), aggregator CPU, clients' CPU)

    def sample(self) -> None:
        for name, pid in self.pids.items():
            hwm, anon, file = proc_status(pid)
            if hwm:
                self.hwm[name] = max(self.hwm[name], hwm)
                self.anon[name] = max(self.anon[name], anon)
                self.file[name] = max(self.file[name], file)
                self.rss_now[name] = anon + file
            else:
                self.rss_now[name] = 0
            cpu = proc_cpu(pid)
            if cpu is not None:  # a process that has exited keeps its last reading
                self.cpu_last[name] = cpu
        clients = sum(v for k, v in self.cpu_last.items() if k != "aggregator")
        self.cpu.append((time.time(), self.cpu_last["aggregator"], clients))

    def cpu_at(self, t: float) -> tuple[float, float]:
        """(aggregator, clients) CPU seconds at wall-clock time ``t``, interpolated between samples."""
        times = [c[0] for c in self.cpu]
        agg = float(np.interp(t, times, [c[1] for c in self.cpu]))
        return agg, float(np.interp(t, times, [c[2] for c in self.cpu]))


# logging's timestamp at the start of every line the CLI logs (hetfed.cli's format), to the millisecond.
_CLOSE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \S+: run (\S+) closed train round (\d+) ")


def train_closes(log: Path) -> dict[int, float]:
    """Wall-clock time of each train round's close, by round, from the aggregator's log."""
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        m = _CLOSE.match(line)
        if m and m.group(2) == RUN:
            out[int(m.group(3))] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return out


def _drain_server(n_bytes: int) -> tuple[socket.socket, list[int]]:
    """A listening socket whose one connection is read in a thread until ``n_bytes`` or its end have come;
    the list then gets the count."""
    server = socket.create_server(("127.0.0.1", 0))
    got: list[int] = []

    def drain() -> None:
        conn, _ = server.accept()
        n = 0
        with conn:
            while n < n_bytes and (chunk := conn.recv(1 << 20)):
                n += len(chunk)
        got.append(n)

    threading.Thread(target=drain, daemon=True).start()
    return server, got


def stream_seconds(n_bytes: int, relay_args: dict[str, Any] | None) -> float:
    """Seconds to move ``n_bytes`` through one TCP connection on loopback (through a LinkRelay with
    ``relay_args``), from the first byte sent to the receiver's last."""
    server, got = _drain_server(n_bytes)
    port = server.getsockname()[1]
    relay = None
    if relay_args is not None:
        relay = _sibling("linkrelay").LinkRelay(("127.0.0.1", port), **relay_args)
        port = relay.start()
    block = np.random.default_rng(0).integers(0, 256, 16 << 20, np.uint8).tobytes()
    try:
        with socket.create_connection(("127.0.0.1", port)) as c:
            start = time.perf_counter()
            sent = 0
            while sent < n_bytes:
                k = min(len(block), n_bytes - sent)
                c.sendall(memoryview(block)[:k])
                sent += k
            c.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + 3600
            while not got and time.monotonic() < deadline:
                time.sleep(0.001)
            seconds = time.perf_counter() - start
    finally:
        if relay is not None:
            relay.stop()
        server.close()
    if got != [n_bytes]:
        raise RuntimeError(f"the floor's stream delivered {got} of {n_bytes} bytes")
    return seconds


def disk_seconds(n_bytes: int, directory: Path) -> float:
    """Seconds to write ``n_bytes`` (random, 16 MiB at a time) to a new file in ``directory`` and fsync it."""
    block = np.random.default_rng(1).integers(0, 256, 16 << 20, np.uint8).tobytes()
    path = directory / "floor.bin"
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        written = 0
        while written < n_bytes:
            k = min(len(block), n_bytes - written)
            f.write(memoryview(block)[:k])
            written += k
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


# --------------------------------------------------------------------------------------------- driver

def tree_commit() -> str:
    """The commit of the tree whose aggregator runs (``git describe --always --dirty``), "" outside git."""
    import hetfed.aggregator

    root = Path(hetfed.aggregator.__file__).resolve().parents[3]
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def aggregator_config(clients: int, rounds: int, state: Path, chunk_bytes: int, update_bytes: int,
                      largest: int, window_bytes: int | None = None, reassemblies: int | None = None) -> dict[str, Any]:
    """One FedAvg run of ``clients`` organizations, limits above the update, plausibility bounds on;
    ``window_bytes``: ``server.stream_window_bytes`` (None: the product's default)."""
    window = {} if window_bytes is None else {"stream_window_bytes": window_bytes}
    if reassemblies is not None:
        window["max_concurrent_reassemblies"] = reassemblies
    return {
        "server": {"listen": "127.0.0.1:0", "metrics_port": -1, "state_dir": str(state), "chunk_bytes": chunk_bytes,
                   "max_update_bytes": update_bytes + (64 << 20), "max_tensor_elements": max(1 << 31, largest),
                   # The synthetic clients do not retry a push refused "busy" (as hetfed's client does): a push
                   # waits for a reassembly slot until one frees, however long multi-GB pushes take to land.
                   "reassembly_wait_seconds": 3600.0, "push_idle_seconds": 3600.0,
                   **window},
        "runs": [{"id": RUN, "algorithm": "fedavg", "organizations": [f"org-{i}" for i in range(clients)],
                  "rounds": rounds, "seed": 0, "round_deadline_seconds": 3600.0,
                  "algorithm_config": {"max_abs_weight": 10.0, "max_update_norm_ratio": 10.0}}],
    }


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


class Federation:
    """The aggregator (``LocalFederation``), the relay when asked for, and N synthetic client processes."""

    def __init__(self, workdir: Path, relay_args: dict[str, Any] | None) -> None:
        self.workdir = workdir
        self.relay_args = relay_args
        self.fed = LocalFederation(workdir, fork_clients=False)
        self.relay: Any = None
        self.clients: list[subprocess.Popen[bytes]] = []

    def start(self, config: dict[str, Any], client_args: list[str], n: int) -> None:
        self.fed.start_aggregator(config)
        port = self.fed.port
        if self.relay_args is not None:
            self.relay = _sibling("linkrelay").LinkRelay(("127.0.0.1", port), **self.relay_args)
            port = self.relay.start()
        for i in range(n):
            log = open(self.workdir / f"client-{i}.log", "wb")  # noqa: SIM115 - owned by the child
            self.clients.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "_client", "--aggregator", f"127.0.0.1:{port}",
                 "--index", str(i), "--out", str(self.workdir / f"client-{i}.json"), *client_args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.fed.env))

    def raise_if_failed(self) -> None:
        self.fed.raise_if_failed()
        for i, p in enumerate(self.clients):
            if p.poll() not in (None, 0):
                raise RuntimeError(f"client {i} exited with {p.returncode}:\n{_tail(self.workdir / f'client-{i}.log')}")

    def stop(self) -> None:
        for p in self.clients:
            if p.poll() is None:
                p.terminate()
        for p in self.clients:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.relay is not None:
            self.relay.stop()
        self.fed.stop()


def watch(fed: Federation, sampler: Sampler, guard: tuple[float, float], timeout: float) -> tuple[Any, str]:
    """Sample until the run finishes (returns its last Status and "") or the memory guard stops it (returns
    the last Status and why)."""
    assert fed.fed.aggregator is not None
    deadline = time.monotonic() + timeout
    next_status, status = 0.0, None
    # A short deadline: the aggregator answers Status from its worker pool and under the run's lock, which a
    # close of a multi-GB model holds for a while; the memory is sampled meanwhile, and Status asked again.
    with AggregatorClient(f"127.0.0.1:{fed.fed.port}", None, "", "", call_timeout=5.0) as watcher:
        while True:
            sampler.sample()
            fed.raise_if_failed()
            held = sum(sampler.rss_now.values())
            available = mem_available()
            if available < guard[0] * 1e9 or (guard[1] and held > guard[1] * 1e9):
                return status, (f"stopped at {held / 1e9:.1f} GB in round {status.round if status else 1} "
                                f"(available {available / 1e9:.1f} GB)")
            if time.monotonic() >= next_status:
                try:
                    (status,) = watcher.status(RUN)
                except RemoteError as err:
                    if err.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise
                    continue  # busy: sample, then ask again
                next_status = time.monotonic() + STATUS_S
                if status.finished:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the federation did not finish within {timeout:.0f} s")
            time.sleep(SAMPLE_S)
    for p in fed.clients:  # they pull FINISH and exit
        p.wait(timeout=120)
    sampler.sample()
    return status, ""


def measure(size_gb: float, clients: int, rounds: int, workdir: Path, *, chunk_bytes: int = chunks.DEFAULT_CHUNK_BYTES,
            rtt_ms: float = 0.0, mbit: float = 0.0, seed: int = 0, guard: tuple[float, float] = (3.0, 0.0),
            dump: Path | None = None, timeout: float = 7200.0, window_bytes: int | None = None,
            reassemblies: int | None = None) -> dict[str, Any]:
    """One federation of ``clients`` synthetic organizations on a ``size_gb`` model for ``rounds`` rounds."""
    if rounds < 2:
        raise ValueError("rounds must be at least 2 (the round time is the median over rounds 2..R)")
    shapes = synth.model_shapes(int(size_gb * 1e9))
    model = synth.model_bytes(shapes)
    shapes_file = workdir / "shapes.json"
    shapes_file.write_text(json.dumps(shapes))
    update_bytes = update_layout(shapes, rounds, "org-0")[3]
    relay_args = {"rtt_ms": rtt_ms, "mbit": mbit} if rtt_ms or mbit else None
    row: dict[str, Any] = {"size_gb": size_gb, "model_bytes": model, "tensors": len(shapes), "clients": clients,
                           "rounds": rounds, "rtt_ms": rtt_ms, "mbit": mbit, "chunk_bytes": chunk_bytes,
                           "update_bytes": update_bytes, "window_bytes": window_bytes, "reassemblies": reassemblies,
                           "commit": tree_commit()}
    client_args = ["--shapes", str(shapes_file), "--seed", str(seed), "--chunk-bytes", str(chunk_bytes),
                   *(["--dump", str(dump)] if dump else [])]
    fed = Federation(workdir, relay_args)
    try:
        fed.start(aggregator_config(clients, rounds, workdir / "state", chunk_bytes, update_bytes,
                                    max(math.prod(s) for s in shapes.values()), window_bytes, reassemblies),
                  client_args, clients)
        assert fed.fed.aggregator is not None
        sampler = Sampler(fed.fed.aggregator.pid, [p.pid for p in fed.clients])
        status, stopped = watch(fed, sampler, guard, timeout)
    finally:
        fed.stop()
        if fed.relay is not None:
            row["relay_bytes_up"], row["relay_bytes_down"] = fed.relay.bytes_up, fed.relay.bytes_down
    row.update(memory_figures(sampler, model))
    row["stopped"] = stopped
    if stopped:
        return row
    row.update(round_figures(workdir, status, sampler, rounds, clients))
    floor_bytes = clients * model
    row["disk_s"] = disk_seconds(floor_bytes, workdir / "state")
    row["net_s"] = stream_seconds(floor_bytes, relay_args)
    row["floor_s"] = row["disk_s"] + row["net_s"]
    row["ratio"] = row["round_s"] / row["floor_s"]
    row["load_average"] = os.getloadavg()[0]
    return row


def memory_figures(sampler: Sampler, model: int) -> dict[str, Any]:
    """Peak RSS figures in GB (10^9 bytes)."""
    clients = [k for k in sampler.hwm if k != "aggregator"]
    return {"agg_peak_rss_gb": sampler.hwm["aggregator"] / 1e9, "agg_rss_anon_gb": sampler.anon["aggregator"] / 1e9,
            "agg_rss_file_gb": sampler.file["aggregator"] / 1e9, "agg_rss_over_model": sampler.hwm["aggregator"] / model,
            "client_peak_rss_gb": max(sampler.hwm[k] for k in clients) / 1e9,
            "client_peak_rss_each_gb": [sampler.hwm[k] / 1e9 for k in clients]}


def round_figures(workdir: Path, status: Any, sampler: Sampler, rounds: int, clients: int) -> dict[str, Any]:
    """Round times, CPU per round, what the clients pushed and pulled, and whether they all pulled the same."""
    closes = train_closes(workdir / "aggregator.log")
    if sorted(closes) != list(range(1, rounds + 1)):
        raise RuntimeError(f"expected train rounds 1..{rounds} to close, the log shows {sorted(closes)}")
    periods = [closes[r] - closes[r - 1] for r in range(2, rounds + 1)]
    durations = [h.duration_seconds for h in status.history if 2 <= h.round <= rounds]
    (a1, c1), (a2, c2) = sampler.cpu_at(closes[1]), sampler.cpu_at(closes[rounds])
    marks = [json.loads((workdir / f"client-{i}.json").read_text())["marks"] for i in range(clients)]
    digests: dict[int, set[str]] = {}
    for ms in marks:
        for m in ms:
            digests.setdefault(m["round"], set()).add(m["digest"])
    train = [m for ms in marks for m in ms if m["action"] == "ACTION_TRAIN" and 2 <= m["round"] <= rounds]
    return {
        "round_s": statistics.median(periods), "round_max_s": max(periods),
        "open_close_s": statistics.median(durations) if durations else float("nan"),
        "agg_cpu_s": (a2 - a1) / (rounds - 1), "clients_cpu_s": (c2 - c1) / (rounds - 1),
        "pushed_wire_bytes": statistics.median(m["pushed_wire_bytes"] for m in train),
        "pulled_wire_bytes": statistics.median(m["pulled_wire_bytes"] for m in train),
        "same_broadcast": all(len(d) == 1 for d in digests.values()),
        "client_push_s": statistics.median(m["push_s"] for m in train),
    }


# --------------------------------------------------------------------------------------------- output

HEADER = ("| system | model GB | N | link | round s | floor s (disk + net) | round / floor | agg CPU s | "
          "clients CPU s | agg peak RSS GB (anon / file) | agg / model | client peak RSS GB |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")


def _link(r: dict[str, Any]) -> str:
    if not r.get("rtt_ms") and not r.get("mbit"):
        return "loopback"
    return f"{r['rtt_ms']:g} ms" + (f", {r['mbit']:g} Mbit/s" if r.get("mbit") else "")


def _n(x: float) -> str:
    """A figure to three significant digits (whole numbers from 1000 on)."""
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def report(r: dict[str, Any]) -> str:
    """One markdown row."""
    head = f"| {r.get('system', 'hetfed')} | {_n(r['model_bytes'] / 1e9)} | {r['clients']} | {_link(r)} |"
    memory = (f"{_n(r.get('agg_peak_rss_gb', 0))} | {_n(r.get('agg_rss_over_model', 0))}x | "
              f"{_n(r.get('client_peak_rss_gb', 0))} |")
    if r.get("stopped"):
        return f"{head} {r['stopped']} | | | | | {memory}"
    if r.get("system") == "Flower":
        return f"{head} {_n(r['round_s'])} | | | {_n(r['agg_cpu_s'])} | {_n(r['clients_cpu_s'])} | {memory}"
    return (f"{head} {_n(r['round_s'])} | {_n(r['floor_s'])} ({_n(r['disk_s'])} + {_n(r['net_s'])}) | "
            f"{_n(r['ratio'])} | {_n(r['agg_cpu_s'])} | {_n(r['clients_cpu_s'])} | {_n(r['agg_peak_rss_gb'])} "
            f"({_n(r['agg_rss_anon_gb'])} / {_n(r['agg_rss_file_gb'])}) | {_n(r['agg_rss_over_model'])}x | "
            f"{_n(r['client_peak_rss_gb'])} |")


def flower_row(python: str, size_gb: float, clients: int, rounds: int, guard: tuple[float, float],
               workdir: Path) -> dict[str, Any]:
    """benchmarks/flower_large.py's row for the same model and N, run under ``python`` (Flower's venv)."""
    out = workdir / "flower.json"
    cmd = [python, str(Path(__file__).resolve().with_name("flower_large.py")), "--size-gb", f"{size_gb:g}",
           "--clients", str(clients), "--rounds", str(rounds), "--guard-gb", f"{guard[0]:g}",
           "--max-total-gb", f"{guard[1]:g}", "--json", str(out)]
    subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL, timeout=7200)
    row: dict[str, Any] = json.loads(out.read_text())[0]
    return row


def _on_sigterm(signum: int, _frame: object) -> None:
    """A SIGTERM stops the federation too: its clients would otherwise wait on a dead aggregator."""
    stop_all()
    sys.exit(128 + signum)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    """Measure each (size, N) and print one markdown row each (or run as one synthetic client)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_client":
        role = argparse.ArgumentParser(prog="large_model.py _client")
        for flag in ("--aggregator", "--shapes", "--out"):
            role.add_argument(flag, required=True)
        role.add_argument("--index", type=int, required=True)
        role.add_argument("--seed", type=int, default=0)
        role.add_argument("--chunk-bytes", type=int, default=chunks.DEFAULT_CHUNK_BYTES)
        role.add_argument("--dump", default="")
        return client_main(role.parse_args(argv[1:]))
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--size-gb", default="0.4", help="comma-separated model sizes in GB (10^9 bytes)")
    ap.add_argument("--clients", default="4", help="comma-separated N")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per federation (the median is over 2..R)")
    ap.add_argument("--chunk-bytes", type=int, default=chunks.DEFAULT_CHUNK_BYTES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rtt-ms", type=float, default=0.0, help="route the clients through a LinkRelay adding this RTT")
    ap.add_argument("--mbit", type=float, default=0.0, help="the relay's bandwidth cap in Mbit/s (0: none)")
    ap.add_argument("--guard-gb", type=float, default=3.0, help="stop when the machine's available memory is below")
    ap.add_argument("--max-total-gb", type=float, default=0.0,
                    help="stop when the federation's processes hold more than this together (0: no cap)")
    ap.add_argument("--flower-python", default="",
                    help="also run benchmarks/flower_large.py under this interpreter (Flower's venv) per row")
    ap.add_argument("--workdir", type=Path, default=None, help="parent of the state directories (default: temp)")
    ap.add_argument("--window-bytes", type=int, default=None,
                    help="server.stream_window_bytes (default: the product's; 4194304 for long links)")
    ap.add_argument("--reassemblies", type=int, default=None,
                    help="server.max_concurrent_reassemblies (default: the product's)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    guard = (args.guard_gb, args.max_total_gb)
    print(f"$ python benchmarks/large_model.py {' '.join(argv)}")
    print(f"hetfed {tree_commit()}; FedAvg, synthetic GPT-2-Large-like float32 models, {args.rounds} rounds; "
          f"{os.cpu_count()} CPU cores; {mem_available() / 1e9:.1f} GB available")
    print(HEADER, flush=True)
    rows = []
    for size in _floats(args.size_gb):
        for n in [int(x) for x in args.clients.split(",") if x]:
            with tempfile.TemporaryDirectory(prefix=f"hetfed-large-{size:g}-{n}-", dir=args.workdir) as tmp:
                r = measure(size, n, args.rounds, Path(tmp), chunk_bytes=args.chunk_bytes, rtt_ms=args.rtt_ms,
                            mbit=args.mbit, seed=args.seed, guard=guard, window_bytes=args.window_bytes,
                            reassemblies=args.reassemblies)
                rows.append(r)
                print(report(r), flush=True)
                if args.json:  # after each row: a later configuration that fails keeps the earlier ones
                    args.json.write_text(json.dumps(rows, indent=1))
                if args.flower_python and not (args.rtt_ms or args.mbit):
                    f = flower_row(args.flower_python, size, n, args.rounds, guard, Path(tmp))
                    rows.append(f)
                    print(report(f), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
