"""Lightweight numpy clients: several organizations in one process speak the real protocol, without training.

    python benchmarks/light_clients.py --aggregator 127.0.0.1:50051 --run r --organizations a,b \\
        --shapes '{"w": [784, 1258], "b": [1258]}'

Each organization is a thread with its own typed client (hetfed.wire.rpc.AggregatorClient): it joins, declares
tensors of the given shapes as ModelWeights, and in every training round uploads the global model it received
(random weights in round 1) with its metrics, until the run finishes. No torch is imported: benchmarks use it
to stand in for many torch clients when only the protocol and the aggregator are measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading

import numpy as np

from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind, Received
from hetfed.wire.phases import Action
from hetfed.wire.rpc import AggregatorClient, RemoteError
from hetfed.wire.specs import get_spec


def organization(address: str, run: str, name: str, shapes: dict[str, tuple[int, ...]], seed: int,
                 errors: list[BaseException]) -> None:
    """One organization's whole participation."""
    try:
        rng = np.random.default_rng(seed)
        weights = {k: rng.standard_normal(s).astype(np.float32) * 0.01 for k, s in shapes.items()}
        with AggregatorClient(address, None, name, run) as client:
            reply = client.join(num_train_examples=64)
            spec = get_spec(reply.algorithm)
            if reply.declare_required:
                client.join(declared=[DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, k, v) for k, v in weights.items()],
                            num_train_examples=64)
            completed = -1
            while True:
                ins = client.pull(completed, 20.0, spec)
                if ins.action is Action.WAIT:
                    continue
                if ins.action is Action.FINISH:
                    return
                received = Received(ins.payloads, spec.repeated_download)
                mw = received.maybe(ModelWeights)
                if mw is not None:
                    weights = dict(mw.tensors)
                metrics = EvalMetrics(num_train_examples=64, num_test_examples=16)
                upload = [metrics] if ins.action is Action.EVALUATE else [ModelWeights(weights, 64), metrics]
                try:
                    client.push(ins.round, upload)
                except RemoteError as err:
                    if err.reason != "late":
                        raise
                completed = ins.round
    except BaseException as exc:  # reported by the main thread
        errors.append(exc)


def main(argv: list[str] | None = None) -> int:
    """Run every organization in its own thread until the run finishes."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aggregator", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--organizations", required=True, help="comma-separated organization names")
    ap.add_argument("--shapes", required=True, help='JSON: {"tensor name": [shape...]}')
    args = ap.parse_args(argv)
    shapes = {k: tuple(v) for k, v in json.loads(args.shapes).items()}
    errors: list[BaseException] = []
    threads = [threading.Thread(target=organization, args=(args.aggregator, args.run, org, shapes, i, errors))
               for i, org in enumerate(args.organizations.split(","))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for exc in errors:
        print(f"light client failed: {exc!r}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
