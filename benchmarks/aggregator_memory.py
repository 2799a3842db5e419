"""The aggregator's peak memory for one round of a model of N MB from K organizations, in a real process.

    python benchmarks/aggregator_memory.py --size-mb 300 --orgs 3 [--rounds 1] [--workdir DIR]

A real ``hetfed aggregator`` process (``faults.AggregatorProcess``) hosts one FedAvg run. Raw gRPC clients in
this process join with the model's tensors declared (float32 tensors of at most 64 MB) and push one update
each, one after the other; the last push closes the round; every organization then pulls the new global model.
The aggregator's VmHWM (peak resident memory: anonymous and file pages), VmRSS, RssAnon and RssFile are read from
/proc/<pid>/status after the joins (its base) and after the pulls. MB = 10^6 bytes of tensor data. The pushed
models are the seeded model times 0.5, 1.5 and 1, so their average is the model, checked bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from faults import AggregatorProcess

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import aggregator_pb2_grpc as agrpc
from hetfed.wire import chunks, codec
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from hetfed.wire.transport import ORGANIZATION_METADATA_KEY, make_channel

TENSOR_ELEMENTS = 16 << 20  # 64 MB of float32 per tensor
# Each organization's model is the seeded model times one of these; every full group averages to 1 and the
# rest push the model itself, so the average is the model, exactly.
SCALES = (0.5, 1.5, 1.0)


def status(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon and RssFile of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def model(size_mb: float) -> dict[str, np.ndarray]:
    """Float32 tensors of ``size_mb`` MB in all (seeded), at most TENSOR_ELEMENTS each."""
    total = int(size_mb * 1e6) // 4
    rng = np.random.default_rng(0)
    out, i = {}, 0
    while total > 0:
        n = min(TENSOR_ELEMENTS, total)
        out[f"t{i}"] = rng.standard_normal(n, dtype=np.float32)
        total -= n
        i += 1
    return out


def _requests(org: str, round_: int, data: bytes, chunk_bytes: int) -> Iterator[apb.PushUpdateRequest]:
    for c in chunks.split(data, chunk_bytes):
        yield apb.PushUpdateRequest(run_id="big", round=round_, organization_id=org, chunk=c)


def _round(stub: agrpc.AggregatorStub, meta: dict[str, tuple[tuple[str, str]]], weights: dict[str, np.ndarray],
           round_: int, chunk_bytes: int, pid: int, phases: dict[str, dict[str, int]]) -> bool:
    """Every organization pushes its update of ``round_``, then pulls the next instructions; whether every
    pulled model is the average, exactly. The aggregator's memory is read after each step."""
    names = list(meta)
    orgs = len(names)
    for i, o in enumerate(names):
        scale = np.float32(SCALES[i % len(SCALES)] if orgs % len(SCALES) == 0 or i < orgs - orgs % len(SCALES)
                           else 1.0)
        mw = ModelWeights({k: v * scale for k, v in weights.items()}, 1)
        ev = EvalMetrics(test_accuracy=0.5, num_test_examples=1)
        data = apb.Update(envelope=apb.Envelope(run_id="big", round=round_, organization_id=o,
                                                payload_kinds=[p.kind.proto_enum for p in (mw, ev)]),  # type: ignore[misc]
                          payloads=[codec.payload_to_proto(p) for p in (mw, ev)]).SerializeToString()
        del mw
        reply = stub.PushUpdate(_requests(o, round_, data, chunk_bytes), metadata=meta[o], timeout=600)
        assert reply.accepted, reply
        del data
        phases[f"round {round_} push {i + 1}"] = status(pid)
    equal = True
    for o in names:
        asm = chunks.Reassembler(1 << 40)
        pull = apb.PullInstructionsRequest(run_id="big", organization_id=o, completed_round=round_, wait_seconds=60)
        for resp in stub.PullInstructions(pull, metadata=meta[o], timeout=600):
            asm.add(resp.chunk)
        got = codec.payload_from_proto(apb.Instructions.FromString(bytes(asm.data())).payloads[0])
        assert isinstance(got, ModelWeights)
        equal = equal and all(np.array_equal(got.tensors[k], v) for k, v in weights.items())
        del got, asm
        phases[f"round {round_} pull {o}"] = status(pid)
    return equal


def measure(size_mb: float, orgs: int, workdir: Path, rounds: int = 1, chunk_bytes: int = 1 << 20) -> dict[str, Any]:
    """Run ``rounds`` rounds (see the module docstring); the figures and whether every average came back
    exact."""
    weights = model(size_mb)
    names = [f"org-{i}" for i in range(orgs)]
    update_bytes = int(size_mb * 1e6) + (64 << 20)
    agg = AggregatorProcess(workdir, [{"id": "big", "algorithm": "fedavg", "organizations": names, "rounds": rounds,
                                       "round_deadline_seconds": 3600}])
    cfg = json.loads(agg.config.read_text())
    cfg["server"].update(max_update_bytes=2 * update_bytes, max_tensor_elements=max(1 << 31, update_bytes),
                         chunk_bytes=chunk_bytes)
    agg.config.write_text(json.dumps(cfg))
    why = agg.start(timeout=120)
    if why:
        raise RuntimeError(f"the aggregator did not start: {why}")
    assert agg.proc is not None
    pid = agg.proc.pid
    channel = make_channel(agg.address, None)
    stub = agrpc.AggregatorStub(channel)
    meta = {o: ((ORGANIZATION_METADATA_KEY, o),) for o in names}
    try:
        for o in names:
            req = apb.JoinRequest(run_id="big", organization_id=o)
            for k, v in weights.items():
                req.declared_tensors.add(payload_kind=PayloadKind.MODEL_WEIGHTS.proto_enum, name=k,
                                         dtype=codec._WIRE[codec.wire_dtype_of(v)][0], shape=v.shape)
            stub.Join(req, metadata=meta[o], timeout=60)
        base = status(pid)
        phases: dict[str, dict[str, int]] = {}
        t0 = time.perf_counter()
        equal = True
        for r in range(1, rounds + 1):
            equal = _round(stub, meta, weights, r, chunk_bytes, pid, phases) and equal
        elapsed = time.perf_counter() - t0
        after = status(pid)
    finally:
        channel.close()
        agg.stop()
    model_bytes = sum(v.nbytes for v in weights.values())
    return {"size_mb": size_mb, "orgs": orgs, "model_bytes": model_bytes, "base": base, "after": after,
            "growth_bytes": after["VmHWM"] - base["VmRSS"], "growth_x_model": (after["VmHWM"] - base["VmRSS"]) / model_bytes,
            "rounds": rounds, "seconds": elapsed, "equal": equal,
            "phases": phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=300.0)
    ap.add_argument("--orgs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        r = measure(args.size_mb, args.orgs, Path(tmp), args.rounds)
    mb = 1e6
    print(f"model {r['model_bytes'] / mb:.0f} MB, {r['orgs']} organizations, {r['rounds']} rounds in "
          f"{r['seconds']:.1f} s, every average exact: {r['equal']}")
    print(f"aggregator base RSS {r['base']['VmRSS'] / mb:.0f} MB; peak (VmHWM) {r['after']['VmHWM'] / mb:.0f} MB: "
          f"+{r['growth_bytes'] / mb:.0f} MB = {r['growth_x_model']:.2f}x the model")
    for name, st in r["phases"].items():
        print(f"  after {name}: VmHWM {st['VmHWM'] / mb:.0f} MB, RssAnon {st['RssAnon'] / mb:.0f} MB, "
              f"RssFile {st['RssFile'] / mb:.0f} MB")
    print(f"at the end: RssAnon {r['after']['RssAnon'] / mb:.0f} MB, RssFile {r['after']['RssFile'] / mb:.0f} MB")


if __name__ == "__main__":
    main()
