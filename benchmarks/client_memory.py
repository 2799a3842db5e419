"""A client's memory for one round of a large model: push its weights, pull the average, load it.

    python benchmarks/client_memory.py --size-mb 400 [--chunk-bytes 1048576] [--wire-dtype bfloat16]

An aggregator starts in this process (``start_aggregator``, one FedAvg run of one organization, limits raised
for the payload, as benchmarks/large_payload.py). The client is a second process: it builds a torch model of
``--size-mb`` MB of float32 Linear layers (seeded), joins with its tensors declared through the product's typed
client (``AggregatorClient``), and then, as the client runtime does, pushes ``fedavg.model_weights(model)`` with
``AggregatorClient.push``, pulls the evaluate instructions that carry the average and loads them into the model
with ``fedavg.load_shared_state``. The client reads its own peak RSS (VmHWM of /proc/self/status, reset through
/proc/self/clear_refs before each phase) and prints what each phase added to the RSS it had before the round
(the model, torch, gRPC), also in units of the model's size. MB = 10^6 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RUN, ORG = "big", "org-0"
WIDTH = 4096


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (VmHWM) to the current RSS
        f.write("5")


def client(address: str, size_mb: float, wire_dtype: str | None) -> dict[str, Any]:
    """The client process's round; returns RSS figures in bytes."""
    import torch

    from hetfed.client.algorithms.fedavg import load_shared_state, model_weights, shared_state
    from hetfed.wire.contract import DeclaredTensor
    from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
    from hetfed.wire.phases import Action
    from hetfed.wire.rpc import AggregatorClient
    from hetfed.wire.specs import get_spec

    torch.manual_seed(0)
    layers = max(1, round(size_mb * 1e6 / (4 * (WIDTH * WIDTH + WIDTH))))
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    model_bytes = sum(v.numel() * v.element_size() for v in shared_state(model).values())
    spec = get_spec("fedavg")
    out: dict[str, Any] = {"model_bytes": model_bytes, "tensors": len(shared_state(model))}
    with AggregatorClient(address, None, ORG, RUN, call_timeout=600) as c:
        c.join([DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, k, v.numpy(), wire_dtype)
                for k, v in shared_state(model).items()])
        first = c.pull(-1, 30, spec)
        assert first.action is Action.TRAIN, first.action
        before = model_weights(model, 1).tensors["0.weight"].copy()
        out["rss_before_round"] = _status_kib("VmRSS") * 1024
        _reset_peak()
        start = time.perf_counter()
        reply = c.push(1, [model_weights(model, 1000), EvalMetrics(0.5, 1000)], wire_dtype)
        out["push_seconds"] = time.perf_counter() - start
        assert reply.accepted, reply
        out["push_peak"] = _status_kib("VmHWM") * 1024
        _reset_peak()
        ins = c.pull(1, 600, spec)
        assert ins.action is Action.EVALUATE, ins.action
        weights = next(p for p in ins.payloads if isinstance(p, ModelWeights))
        with torch.no_grad():
            for v in shared_state(model).values():
                v.zero_()
        load_shared_state(model, weights)
        del weights, ins
        out["pull_load_peak"] = _status_kib("VmHWM") * 1024
        got = model_weights(model, 1).tensors["0.weight"]
        out["equal"] = bool((got == before).all()) if wire_dtype is None else None
        c.push(2, [EvalMetrics(0.5, 1000)], wire_dtype)
    return out


def run(size_mb: float, chunk_bytes: int, wire_dtype: str | None, workdir: Path) -> dict[str, Any]:
    """Start the aggregator here and the client as a process of its own; returns the client's figures."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from large_payload import aggregator_mapping

    from hetfed.aggregator.config import aggregator_config_from_mapping
    from hetfed.aggregator.serving.server import start_aggregator

    cfg = aggregator_config_from_mapping(aggregator_mapping(size_mb, str(workdir / "state"), chunk_bytes))
    agg = start_aggregator(cfg)
    try:
        cmd = [sys.executable, __file__, "--client", f"127.0.0.1:{agg.port}", "--size-mb", str(size_mb)]
        if wire_dtype:
            cmd += ["--wire-dtype", wire_dtype]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=os.environ.copy())
        if done.returncode != 0:
            raise RuntimeError(f"the client failed:\n{done.stderr[-4000:]}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        agg.stop(grace=1.0)
    base, model = result["rss_before_round"], result["model_bytes"]
    for phase in ("push", "pull_load"):
        result[f"{phase}_added_x_model"] = round((result[f"{phase}_peak"] - base) / model, 2)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=400.0)
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20)
    ap.add_argument("--wire-dtype", default=None)
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        print(json.dumps(client(args.client, args.size_mb, args.wire_dtype)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        r = run(args.size_mb, args.chunk_bytes, args.wire_dtype, Path(tmp))
    mb = 1e6
    print(f"model {r['model_bytes'] / mb:.0f} MB in {r['tensors']} tensors; client RSS before the round "
          f"{r['rss_before_round'] / mb:.0f} MB")
    print(f"push: peak +{(r['push_peak'] - r['rss_before_round']) / mb:.0f} MB ({r['push_added_x_model']}x the "
          f"model), {r['push_seconds']:.2f} s")
    print(f"pull + load: peak +{(r['pull_load_peak'] - r['rss_before_round']) / mb:.0f} MB "
          f"({r['pull_load_added_x_model']}x the model); average equals the pushed model: {r['equal']}")


if __name__ == "__main__":
    main()
