"""Time to round 1 of one ``hetfed client`` process started as a pod starts it: a fresh interpreter, no fork server.

    python benchmarks/client_startup.py --repeats 5
    python benchmarks/client_startup.py --workload B --repeats 5

For each repeat: a real aggregator with a one-organization FedAvg run of round_overhead.py's workload (A: the
1.0M-parameter MLP, one SGD step; B: the 100k CNN, one epoch) is started and ready; then ``python -m hetfed.cli
client --config FILE`` is started as a plain subprocess (exactly what the client image's entry point runs) and
timed from just before its exec:

- ``joined_s``: to the client's "joined run" log line (interpreter, imports, its data, its model, Join);
- ``round1_s``: to the aggregator's close of round 1 (the client's first round: pull, train, push);
- ``round2_s``: round 2 alone, close to close: what a round costs once everything is warm, so that
  ``round1_s - joined_s - round2_s`` is round 1's one-off cost.

Times are read from the two processes' log lines (logging's millisecond timestamps, the same clock as this
driver's ``time.time()``). Each repeat is a fresh aggregator and a fresh client; the median and range are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hetfed.cli.localrun import LocalFederation

sys.path.insert(0, str(Path(__file__).resolve().parent))
import round_overhead as ro  # the workloads, their data and configs


def once(w: ro.Workload, workdir: Path, timeout: float) -> dict[str, float]:
    """One aggregator, one client started fresh; the client's start-up figures."""
    fed = LocalFederation(workdir)
    try:
        fed.start_aggregator(ro.aggregator_config(w, 1, 2, workdir / "state"))
        (data,) = ro.write_data(workdir, w, 1, seed=1)
        cfg = workdir / "client.json"
        cfg.write_text(json.dumps(ro.client_config(w, 0, fed.port, data)))
        with open(workdir / "client.log", "wb") as log:
            start = time.time()
            proc = subprocess.Popen([sys.executable, "-m", "hetfed.cli", "client", "--config", str(cfg)],
                                    stdout=log, stderr=subprocess.STDOUT, env=fed.env, cwd=workdir)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
        if code != 0:
            raise RuntimeError(f"the client exited with {code}:\n{(workdir / 'client.log').read_text()[-2000:]}")
    finally:
        fed.stop()
    ((joined, _),) = ro.log_lines(workdir / "client.log", r"INFO hetfed\.client: \S+ joined run ")
    closes = [t for t, _ in ro.log_lines(workdir / "aggregator.log", r"INFO \S+: run \S+ closed train round ")]
    return {"joined_s": joined - start, "round1_s": closes[0] - start, "round2_s": closes[1] - closes[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--workload", choices=sorted(ro.WORKLOADS), default="A")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one client may take")
    ap.add_argument("--json", type=Path, help="also write every repeat here")
    args = ap.parse_args()
    w = ro.WORKLOADS[args.workload]
    print(f"$ python benchmarks/client_startup.py {' '.join(sys.argv[1:])}")
    print(f"workload {w.name}: {w.description}; one `hetfed client` process, fresh interpreter")
    rows = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="hetfed-startup-") as tmp:
            r = once(w, Path(tmp), args.timeout)
        rows.append(r)
        print(f"repeat {i + 1}: joined {r['joined_s']:.3f} s, round 1 closed {r['round1_s']:.3f} s, "
              f"round 2 {r['round2_s']:.3f} s", flush=True)
    for key in ("joined_s", "round1_s", "round2_s"):
        values = [r[key] for r in rows]
        print(f"{key:<10} median {statistics.median(values):.3f} s ({min(values):.3f}-{max(values):.3f})")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
