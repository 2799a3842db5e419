"""The aggregator never imports torch: checked in a fresh interpreter that serves a real Join and push."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_aggregator_process_never_imports_torch(tmp_path: object) -> None:
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        import grpc
        from hetfed.cli import build_parser
        from hetfed.aggregator.config import aggregator_config_from_mapping
        from hetfed.aggregator.serving.server import start_aggregator
        from hetfed.v1 import aggregator_pb2 as apb, aggregator_pb2_grpc as agrpc
        from hetfed.wire import chunks, codec
        from hetfed.wire.payloads import ModelWeights, EvalMetrics, PayloadKind
        from hetfed.wire.specs import SPECS
        build_parser()
        runs = [{{"id": name, "algorithm": name, "organizations": ["a"], "rounds": 1,
                  **({{"seed_set": {{"id": "s", "sha256": "0" * 64}}}} if SPECS[name].needs_seed_set else {{}})}}
                for name in SPECS]
        agg = start_aggregator(aggregator_config_from_mapping(
            {{"server": {{"listen": "127.0.0.1:0", "metrics_port": -1, "state_dir": {str(tmp_path)!r}}}, "runs": runs}}))
        ch = grpc.insecure_channel(f"127.0.0.1:{{agg.port}}")
        stub = agrpc.AggregatorStub(ch)
        md = (("x-hetfed-organization", "a"),)
        req = apb.JoinRequest(run_id="fedavg", organization_id="a")
        req.declared_tensors.add(payload_kind=PayloadKind.MODEL_WEIGHTS.proto_enum, name="w", dtype=1, shape=[2])
        stub.Join(req, metadata=md, timeout=10)
        payloads = [ModelWeights({{"w": np.ones(2, np.float32)}}, 1), EvalMetrics()]
        upd = apb.Update(envelope=apb.Envelope(run_id="fedavg", round=1, organization_id="a",
                         payload_kinds=[p.kind.proto_enum for p in payloads]),
                         payloads=[codec.payload_to_proto(p) for p in payloads]).SerializeToString()
        reqs = [apb.PushUpdateRequest(run_id="fedavg", round=1, organization_id="a", chunk=c) for c in chunks.split(upd)]
        assert stub.PushUpdate(iter(reqs), metadata=md, timeout=10).accepted
        agg.stop(0)
        leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert not leaked, leaked
        print("OK", len(sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("OK")


def test_services_source_has_no_torch_import() -> None:
    """A plain text check beside the import-linter contracts (tests/test_architecture.py)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "services" / "hetfed" / "aggregator"
    offenders = [str(p) for p in root.rglob("*.py") if "import torch" in p.read_text() or "from torch" in p.read_text()]
    assert offenders == []
