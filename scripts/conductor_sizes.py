"""The conductors' sizes: lines of ``Run`` and ``ClientRuntime``, of ``ClientRuntime._run``, and the calls ``Run``
makes to other modules during one push.

    python scripts/conductor_sizes.py [TREE]

TREE (default: this checkout) is a source tree of hetfed; it goes first on the import path, so the figures are
that tree's. The calls out are counted while one accepted FedAvg update (the first of two organizations, so the
round does not close) goes through ``Run.push``: every Python-level call from a frame of the file that defines
``Run`` into a function defined elsewhere (C functions such as a lock's acquire are not counted). Prints one JSON
object.
"""

from __future__ import annotations

import importlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

# The class and function spans of code_sizes.py (this folder is first on sys.path when run).
from code_sizes import definitions


def _calls_out_per_push(run_file: Path) -> int:
    import numpy as np

    from hetfed.aggregator.config import aggregator_config_from_mapping
    from hetfed.aggregator.run.admission import Limits
    from hetfed.wire import digest as content
    from hetfed.wire import messages
    from hetfed.wire.contract import DeclaredTensor
    from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
    from hetfed.wire.traffic import TrafficBreakdown

    run_cls: Any = importlib.import_module(f"hetfed.aggregator.run.{run_file.stem}").Run

    class Quiet:  # an observer that watches nothing: each of its calls counts once
        def folded(self, *a: Any) -> None: ...
        def closed(self, *a: Any) -> None: ...
        def round_opened(self, *a: Any) -> None: ...
        def refusal(self, *a: Any) -> None: ...
        def restored(self, *a: Any) -> None: ...
        def storage_error(self, *a: Any) -> None: ...
        def duplicate(self, *a: Any) -> None: ...
        def traffic(self, *a: Any) -> None: ...

    with tempfile.TemporaryDirectory() as state_dir:
        cfg = aggregator_config_from_mapping({
            "server": {"listen": "127.0.0.1:0", "metrics_port": -1, "state_dir": state_dir},
            "runs": [{"id": "r", "algorithm": "fedavg", "organizations": ["a", "b"], "rounds": 2}]})
        s = cfg.server
        limits = Limits(s.chunk_bytes, s.max_update_bytes, s.max_tensor_elements, s.max_examples_per_organization,
                        s.max_metrics_per_report, s.max_name_chars, s.max_declared_tensors)
        run = run_cls(cfg.runs[0], s.state_dir, Quiet(), limits)
        w = np.arange(6, dtype=np.float32).reshape(2, 3)
        for org in ("a", "b"):
            run.join(org, messages.JoinRequest("r", org, (DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, "w", w),),
                                               num_train_examples=10))
        data = messages.encode_update(messages.Update("r", 1, "a", [ModelWeights({"w": w}, 10),
                                                                    EvalMetrics(train_loss=0.5, test_accuracy=0.5, num_test_examples=5)])).data
        update, digest = messages.ParsedUpdate(data), content.digest(data)
        own = str(run_file.resolve())
        count = 0

        def profile(frame: Any, event: str, arg: Any) -> None:
            nonlocal count
            caller = frame.f_back
            if (event == "call" and caller is not None and caller.f_code.co_filename == own
                    and frame.f_code.co_filename != own):
                count += 1

        sys.setprofile(profile)
        try:
            reply = run.push("a", 1, update, digest, TrafficBreakdown())
        finally:
            sys.setprofile(None)
        assert reply.accepted and not reply.duplicate and run.round == 1
        run.close()
    return count


def main() -> None:
    tree = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]).resolve()
    sys.path[:0] = [str(tree / "proto"), str(tree / "services"), str(tree / "clients")]
    lines = {where: n for n, _, where in definitions(tree)}
    (run_at,) = [w for w in lines if w.startswith("services/hetfed/aggregator/run/") and w.endswith(".py:Run")]
    runtime = "clients/hetfed/client/runtime.py:ClientRuntime"
    print(json.dumps({"run_file": run_at.partition(":")[0], "Run_lines": lines[run_at],
                      "ClientRuntime_lines": lines[runtime], "ClientRuntime._run_lines": lines.get(f"{runtime}._run", 0),
                      "Run_calls_out_per_push": _calls_out_per_push(tree / run_at.partition(":")[0])}))


if __name__ == "__main__":
    main()
