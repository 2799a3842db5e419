"""A ModelWeights of N MB through a real aggregator: push, round close, pull the average back, compare.

    python benchmarks/large_payload.py --size-mb 500 [--chunk-bytes 1048576] [--workdir DIR]
    python benchmarks/large_payload.py --size-mb 2200 --wire-only

An aggregator starts in this process (``start_aggregator``) with one FedAvg run of one organization
and limits raised for the payload. A raw gRPC client (``AggregatorStub`` on the product's channel
factory, identity in the ``x-hetfed-organization`` header) joins with the model's tensors declared,
pulls its round-1 instructions, and pushes an Update holding the ModelWeights (float32, tensors of
at most 256 MB) and EvalMetrics as a stream of ``PushUpdateRequest`` chunks. The round closes; the
evaluate instructions it then pulls carry the FedAvg average of one model, which must equal, bit for
bit, what was pushed. MB = 10^6 bytes of tensor data. Client and aggregator share this process, so
the peak RSS printed is both sides together; a sampler thread also records the peak of each phase.

``--wire-only`` leaves the aggregator out and runs just the wire path on both sides: encode and
serialize the Update, split it, serialize and parse every PushUpdateRequest (what gRPC does with
them), reassemble and verify, parse the Update and decode it. It needs about 4x the payload in
memory instead of 11x, so payloads beyond 2 GiB fit on a small machine: the whole-message size has
no limit of its own (Protobuf's only limit is 2 GiB per bytes field, that is per tensor).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from hetfed.aggregator.config import aggregator_config_from_mapping
from hetfed.aggregator.serving.server import start_aggregator
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import aggregator_pb2_grpc as agrpc
from hetfed.wire import chunks, codec
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from hetfed.wire.transport import ORGANIZATION_METADATA_KEY, make_channel

RUN, ORG = "big", "org-0"
MAX_TENSOR_MB = 256
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRss:
    """Samples RSS every few milliseconds and keeps the peak of each named phase."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.phase = "start"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            r = rss_bytes()
            if r > self.peaks.get(self.phase, 0):
                self.peaks[self.phase] = r
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @contextmanager
    def during(self, phase: str, timings: dict[str, float]) -> Iterator[None]:
        """Attribute samples to ``phase`` and record its wall time."""
        self.phase = phase
        self.peaks[phase] = max(self.peaks.get(phase, 0), rss_bytes())
        start = time.perf_counter()
        try:
            yield
        finally:
            timings[phase] = time.perf_counter() - start


def model_tensors(size_mb: float, seed: int = 0) -> dict[str, np.ndarray]:
    """~``size_mb`` MB of float32 weights: at least 8 1024-wide matrices of at most 256 MB, each with a bias."""
    rng = np.random.default_rng(seed)
    total = int(size_mb * 1e6) // 4
    width = 1024
    max_rows = max(1, min(MAX_TENSOR_MB * 1_000_000 // 4, total // 8) // width)
    out: dict[str, np.ndarray] = {}
    i = 0
    while total > 0:
        rows = max(1, min(max_rows, (total - width) // width))
        out[f"layer{i}.weight"] = rng.random((rows, width), dtype=np.float32)
        out[f"layer{i}.bias"] = rng.random(width, dtype=np.float32) - 0.5
        total -= (rows + 1) * width
        i += 1
    return out


def aggregator_mapping(size_mb: float, state_dir: str, chunk_bytes: int) -> dict[str, Any]:
    """One FedAvg run of one organization, with limits above the payload."""
    payload_bytes = int(size_mb * 1e6)
    return {
        "server": {
            "listen": "127.0.0.1:0",
            "metrics_port": -1,
            "state_dir": state_dir,
            "chunk_bytes": chunk_bytes,
            "max_update_bytes": 2 * payload_bytes + (64 << 20),
            "max_tensor_elements": max(1 << 31, payload_bytes),
        },
        "runs": [{"id": RUN, "algorithm": "fedavg", "organizations": [ORG], "rounds": 1,
                  "round_deadline_seconds": 3600.0}],
    }


def pull(stub: agrpc.AggregatorStub, completed: int, metadata: Any, timeout: float) -> tuple[apb.Instructions, int]:
    """PullInstructions, reassembled; returns the instructions and the wire bytes received."""
    req = apb.PullInstructionsRequest(run_id=RUN, organization_id=ORG, completed_round=completed, wait_seconds=30)
    asm = chunks.Reassembler(1 << 40)
    wire = 0
    for resp in stub.PullInstructions(req, metadata=metadata, timeout=timeout):
        wire += resp.ByteSize()
        asm.add(resp.chunk)
    data = asm.data()
    del asm
    return apb.Instructions.FromString(data), wire


def push(stub: agrpc.AggregatorStub, round_: int, update_bytes: bytes, chunk_bytes: int, metadata: Any,
         timeout: float) -> apb.PushUpdateResponse:
    """PushUpdate of serialized Update bytes as a lazily built stream of chunks."""
    requests = (apb.PushUpdateRequest(run_id=RUN, round=round_, organization_id=ORG, chunk=c)
                for c in chunks.split(update_bytes, chunk_bytes))
    return stub.PushUpdate(requests, metadata=metadata, timeout=timeout)


def serialized_update(round_: int, payloads: list[Any]) -> bytes:
    """An Update's bytes, its payloads filled in place (no extra deep copy of the tensors)."""
    update = apb.Update(envelope=apb.Envelope(run_id=RUN, round=round_, organization_id=ORG,
                                              payload_kinds=[p.kind.proto_enum for p in payloads]))
    for p in payloads:
        codec.fill_payload(update.payloads.add(), p)
    return update.SerializeToString()


def run_large_payload(size_mb: float, workdir: Path, chunk_bytes: int = chunks.DEFAULT_CHUNK_BYTES,
                      timeout: float = 1800.0, verbose: bool = True) -> dict[str, Any]:
    """Push ``size_mb`` MB through a fresh aggregator, pull the average back; returns times, bytes and RSS."""
    say = print if verbose else (lambda *a, **k: None)
    timings: dict[str, float] = {}
    result: dict[str, Any] = {"size_mb": size_mb}
    with PeakRss() as rss:
        with rss.during("make model", timings):
            tensors = model_tensors(size_mb)
        n_bytes = sum(a.nbytes for a in tensors.values())
        result.update(tensors=len(tensors), payload_bytes=n_bytes,
                      largest_tensor_bytes=max(a.nbytes for a in tensors.values()))
        say(f"ModelWeights: {len(tensors)} float32 tensors, {n_bytes / 1e6:.1f} MB "
            f"(largest {result['largest_tensor_bytes'] / 1e6:.1f} MB)", flush=True)
        cfg = aggregator_config_from_mapping(aggregator_mapping(size_mb, str(workdir / "state"), chunk_bytes))
        agg = start_aggregator(cfg)
        channel = make_channel(f"127.0.0.1:{agg.port}", None)
        try:
            stub = agrpc.AggregatorStub(channel)
            md = ((ORGANIZATION_METADATA_KEY, ORG),)
            join = apb.JoinRequest(run_id=RUN, organization_id=ORG)
            for name, arr in tensors.items():
                join.declared_tensors.add(payload_kind=PayloadKind.MODEL_WEIGHTS.proto_enum, name=name,
                                          dtype=codec.tensor_to_proto(arr[:0]).dtype, shape=arr.shape)
            joined = stub.Join(join, metadata=md, timeout=60)
            first, _ = pull(stub, -1, md, 60)
            assert first.action == apb.ACTION_TRAIN and first.envelope.round == 1, first
            assert joined.current_round == 1

            metrics = EvalMetrics(train_loss=0.5, num_train_examples=1000)
            with rss.during("encode + serialize", timings):
                data = serialized_update(1, [ModelWeights(tensors, num_examples=1000), metrics])
            result["update_bytes"] = len(data)
            result["chunks"] = -(-len(data) // chunk_bytes)
            with rss.during("push (server: reassemble, check, store, fold, close)", timings):
                resp = push(stub, 1, data, chunk_bytes, md, timeout)
            assert resp.accepted and not resp.duplicate and resp.round == 1, resp
            del data
            with rss.during("pull (server: build and send the average)", timings):
                ins, pulled_wire = pull(stub, 1, md, timeout)
            result["pulled_wire_bytes"] = pulled_wire
            assert ins.action == apb.ACTION_EVALUATE and ins.envelope.round == 2, (ins.action, ins.envelope)
            with rss.during("decode + compare", timings):
                assert len(ins.payloads) == 1
                back = codec.payload_from_proto(ins.payloads[0])
                del ins
                assert isinstance(back, ModelWeights)
                assert list(back.tensors) == list(tensors), "tensor names or order differ"
                for name, arr in tensors.items():
                    got = back.tensors[name]
                    assert got.dtype == np.float32 and got.shape == arr.shape, name
                    assert np.array_equal(got, arr), f"{name}: the average differs from what was pushed"
                del back
            result["equal"] = True
            done = push(stub, 2, serialized_update(2, [metrics]), chunk_bytes, md, 60)
            assert done.accepted
            status = stub.Status(apb.StatusRequest(run_id=RUN), timeout=30).runs[0]
            assert status.state == apb.RUN_STATE_FINISHED, status.state
            up = sum(t.bytes for t in status.history[0].traffic if t.direction == "up")
            result["counted_up_bytes"] = up
        finally:
            channel.close()
            agg.stop(grace=1.0)
    result["seconds"] = timings
    result["phase_peak_rss"] = rss.peaks
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def run_wire_only(size_mb: float, chunk_bytes: int = chunks.DEFAULT_CHUNK_BYTES) -> dict[str, Any]:
    """The wire path alone, both sides in turn: returns times and the peak RSS of each phase."""
    timings: dict[str, float] = {}
    result: dict[str, Any] = {"size_mb": size_mb}
    with PeakRss() as rss:
        with rss.during("make model", timings):
            tensors = model_tensors(size_mb)
        result.update(tensors=len(tensors), payload_bytes=sum(a.nbytes for a in tensors.values()),
                      largest_tensor_bytes=max(a.nbytes for a in tensors.values()))
        with rss.during("encode + serialize", timings):
            data = serialized_update(1, [ModelWeights(tensors, num_examples=1000)])
        result["update_bytes"] = len(data)
        with rss.during("split + requests through Protobuf + reassemble + verify", timings):
            asm = chunks.Reassembler(len(data))
            n = 0
            for c in chunks.split(data, chunk_bytes):
                req = apb.PushUpdateRequest(run_id=RUN, round=1, organization_id=ORG, chunk=c)
                asm.add(apb.PushUpdateRequest.FromString(req.SerializeToString()).chunk)
                n += 1
            del data
            received = asm.data()
            del asm
        result["chunks"] = n
        with rss.during("parse Update + decode + compare", timings):
            update = apb.Update.FromString(received)
            del received
            back = codec.payload_from_proto(update.payloads[0])
            del update
            assert isinstance(back, ModelWeights) and list(back.tensors) == list(tensors)
            for name, arr in tensors.items():
                assert np.array_equal(back.tensors[name], arr), name
            del back
        result["equal"] = True
    result["seconds"] = timings
    result["phase_peak_rss"] = rss.peaks
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def main(argv: list[str] | None = None) -> int:
    """Run once and print times, throughput and peak RSS."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=500.0)
    ap.add_argument("--chunk-bytes", type=int, default=chunks.DEFAULT_CHUNK_BYTES)
    ap.add_argument("--workdir", type=Path, default=None, help="state directory parent (default: a temp dir)")
    ap.add_argument("--wire-only", action="store_true", help="codec + chunks + Protobuf only, no aggregator")
    args = ap.parse_args(argv)
    print(f"$ python benchmarks/large_payload.py --size-mb {args.size_mb:g} --chunk-bytes {args.chunk_bytes}"
          f"{' --wire-only' if args.wire_only else ''}", flush=True)
    if args.wire_only:
        r = run_wire_only(args.size_mb, args.chunk_bytes)
        print(f"ModelWeights: {r['tensors']} float32 tensors, {r['payload_bytes'] / 1e6:.1f} MB "
              f"(largest {r['largest_tensor_bytes'] / 1e6:.1f} MB); Update {r['update_bytes'] / 1e6:.1f} MB "
              f"= {r['update_bytes'] / (1 << 30):.3f} GiB in {r['chunks']} chunks")
    else:
        with tempfile.TemporaryDirectory(prefix="hetfed-large-", dir=args.workdir) as tmp:
            r = run_large_payload(args.size_mb, Path(tmp), args.chunk_bytes)
        print(f"Update {r['update_bytes'] / 1e6:.1f} MB in {r['chunks']} chunks of {args.chunk_bytes} B; "
              f"pulled back {r['pulled_wire_bytes'] / 1e6:.1f} MB; counted up {r['counted_up_bytes'] / 1e6:.1f} MB")
    mb = r["payload_bytes"] / 1e6
    print(f"{'phase':<56}{'seconds':>9}{'MB/s':>9}{'peak RSS MB':>13}")
    for phase, t in r["seconds"].items():
        rate = f"{mb / t:9.0f}" if phase != "make model" else f"{'':>9}"
        print(f"{phase:<56}{t:>9.2f}{rate}{r['phase_peak_rss'].get(phase, 0) / 1e6:>13.0f}")
    print(f"round trip equal: {r['equal']}; peak RSS of the process"
          f"{'' if args.wire_only else ' (client + aggregator)'}: "
          f"{r['peak_rss_bytes'] / 1e6:.0f} MB = {r['peak_rss_bytes'] / r['payload_bytes']:.1f}x the payload")
    return 0


if __name__ == "__main__":
    sys.exit(main())
