"""What waiting for admission costs a push when a reassembly slot is free: one push of an update through a
``LinkRelay`` into a real in-process aggregator, sent as hetfed's client sends it (the first chunk, then the
rest after the aggregator's admission headers: ``rpc.push_after_admission``) and sent on at once.

    python benchmarks/push_admission.py --rtt-ms 100 --mbit 100 --elements 2000,2000000

Each figure is the wall time of one push from its first message to its answer; ``--repeats`` pushes of each
way, alternating, each into a fresh aggregator (round 1 of a two-organization FedAvg run).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from linkrelay import LinkRelay

from hetfed.aggregator.config import aggregator_config_from_mapping
from hetfed.aggregator.serving.server import start_aggregator
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import chunks, messages
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from hetfed.wire.rpc import SERVICE_NAME, AggregatorClient, push_after_admission
from hetfed.wire.transport import ORGANIZATION_METADATA_KEY, make_channel


def one_push(rtt_ms: float, mbit: float, elements: int, wait: bool) -> float:
    """Seconds of one push of a ``elements``-float32 update (after the organization's Join)."""
    w = np.arange(elements, dtype=np.float32) / elements
    payloads = [ModelWeights({"w": w}, 1), EvalMetrics(num_test_examples=1)]
    with tempfile.TemporaryDirectory() as state:
        cfg = aggregator_config_from_mapping({
            "server": {"listen": "127.0.0.1:0", "metrics_port": -1, "state_dir": state},
            "runs": [{"id": "r", "algorithm": "fedavg", "organizations": ["a", "b"], "rounds": 2}]})
        agg = start_aggregator(cfg, None)
        relay = LinkRelay(("127.0.0.1", agg.port), rtt_ms, mbit)
        port = relay.start()
        try:
            with AggregatorClient(f"127.0.0.1:{port}", None, "a", "r") as client:
                assert client.join([DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, "w", w)]).push_admission_headers
            data = messages.encode_update(messages.Update("r", 1, "a", payloads, None, ""), None).data
            envelope = apb.PushUpdateRequest(run_id="r", round=1, organization_id="a").SerializeToString()
            framed = chunks.framed(envelope, chunks.PUSH_CHUNK_FIELD, data, first_bytes=chunks.FIRST_PUSH_CHUNK_BYTES)
            requests = (framed[i] for i in range(len(framed)))
            call = {"metadata": ((ORGANIZATION_METADATA_KEY, "a"),), "timeout": 600}
            with make_channel(f"127.0.0.1:{port}", None) as channel:
                push = channel.stream_unary(f"/{SERVICE_NAME}/PushUpdate")
                start = time.perf_counter()
                raw = push_after_admission(push, requests, **call) if wait else push(requests, **call)
                seconds = time.perf_counter() - start
            assert apb.PushUpdateResponse.FromString(raw).accepted
        finally:
            relay.stop()
            agg.stop(grace=0.5)
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rtt-ms", type=float, default=100.0)
    ap.add_argument("--mbit", type=float, default=100.0, help="bandwidth cap of the relay, Mbit/s (0: none)")
    ap.add_argument("--elements", default="2000,2000000", help="float32 elements of the update")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    print(f"$ python benchmarks/push_admission.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    rows = []
    for elements in (int(x) for x in args.elements.split(",")):
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for wait in (True, False):
                times[wait].append(one_push(args.rtt_ms, args.mbit, elements, wait))
        rows.append({"elements": elements, "waits_s": times[True], "sends_on_s": times[False]})
        print(f"{elements * 4 / 1e6:8.3f} MB: waits {min(times[True]):.3f}-{max(times[True]):.3f} s, "
              f"sends on {min(times[False]):.3f}-{max(times[False]):.3f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rtt_ms": args.rtt_ms, "mbit": args.mbit, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
