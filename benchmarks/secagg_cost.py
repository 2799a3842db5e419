"""What secure aggregation costs a FedAvg round: real processes on loopback, with and without it, beside Flower.

    python benchmarks/secagg_cost.py --params 1000000 --clients 4,8,16,32 --rounds 4 --json f.json
    python benchmarks/secagg_cost.py --params 10000000 --clients 4,8 --rounds 3 --flower-python /work/flwr/bin/python
    python benchmarks/secagg_cost.py --quick        # N = 2, a 10k-parameter model, 3 rounds: the logic only

One federation per arm: the product's aggregator (``hetfed aggregator``) and N torch clients of the product's
runtime (``hetfed client``, forked by ``LocalFederation`` as ``hetfed run`` forks them), FedAvg over every
organization, the run's ``secure_aggregation`` off (plain) or on (secure, SecAgg+ over the complete graph with
the default threshold and ``SecureParams``). The model is the ``mlp1`` MLP 784-d-10 with d chosen so that it has
about ``--params`` float32 parameters (795·d + 10: 1,000,120 at 1M, 10,000,315 at 10M). Training is negligible,
as in Flower's harness: one SGD step on a batch of 8 random images per round, so the round is the protocol's
cost. For each (parameters, N) the plain and the secure arm run back to back, alternating which goes first
(A/B, then B/A at the next N; ``--repeats`` runs the pair again), so that the machine's load falls on both alike;
with ``--flower-python`` benchmarks/flower_secagg.py runs Flower 1.42's SecAgg+ on the same N and parameter
count right after, under that interpreter.

Figures per row (one JSON object each; ``--json`` writes them with the machine, the date and the command):

- ``round_s``: the median over rounds 2..R of the period from one train round's close to the next (the
  aggregator's log), a whole round as Flower's harness times its own (``aggregate_fit`` to ``aggregate_fit``);
- ``up`` / ``down``: bytes per organization per round by payload kind, the median over rounds 2..R of each
  round's record divided by N. The round record and ``hetfed_aggregator_bytes_total`` are fed by one call per
  RPC (``Run.record_traffic``); the Prometheus counters are scraped at the end of the run and must hold at least
  the rounds' sum for every (direction, kind) (``prometheus_covers_rounds``); ``prometheus_up_per_org`` is each
  organization's whole-run upload as the counter reads it. ``masked_up``: the weights or the masked input
  (``model_weights`` / ``secagg_masked_input``); ``stages_up`` / ``stages_down``: the other SecAgg+ kinds
  (keys, shares, unmasking);
- ``agg_cpu_s`` and ``clients_cpu_s``: core-seconds per round (utime + stime, /proc/PID/stat) of the aggregator
  and of all client processes together, from round 2's start to the end of training, per mean period;
- ``agg_peak_rss_mb`` (VmHWM) and ``client_peak_rss_mb`` (client 0's VmHWM);
- ``load_before`` / ``load_after``: the machine's 1-minute load average around the federation.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from hetfed.cli.localrun import LocalFederation, stop_all
from hetfed.wire.rpc import AggregatorClient


def _sibling(name: str) -> ModuleType:
    """benchmarks/<name>.py (the benchmarks folder is scripts, not a package), imported once."""
    if name not in sys.modules:
        path = Path(__file__).resolve().with_name(f"{name}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


overhead = _sibling("round_overhead")  # its data, client config, CPU probe and log reading

RUN = overhead.RUN
EXAMPLES = 64
TRAIN = {"local_steps": 1, "batch_size": 8, "lr": 0.01, "momentum": 0.0}
MASKED = {"model_weights", "secagg_masked_input"}
QUICK_PARAMS = 10_000


def latent_for(params: int) -> int:
    """mlp1's width d whose 795·d + 10 parameters are nearest ``params``."""
    return max(1, round((params - 10) / 795))


def mlp1_params(d: int) -> int:
    """Parameters of mlp1 784-d-10: two linear layers with their biases."""
    return 784 * d + d + 10 * d + 10


def workload(params: int) -> Any:
    d = latent_for(params)
    return overhead.Workload("secagg", "mlp1", d, EXAMPLES, TRAIN,
                             f"MLP 784-{d}-10 ({mlp1_params(d):,} parameters), one SGD step of batch 8 per round")


def aggregator_config(n: int, rounds: int, secure: bool, state: Path, seed: int) -> dict[str, Any]:
    """One FedAvg run over every organization, its secure aggregation ``secure``."""
    return {
        "server": {"listen": "127.0.0.1:0", "metrics_port": 0, "metrics_host": "127.0.0.1", "state_dir": str(state)},
        "runs": [{"id": RUN, "algorithm": "fedavg", "organizations": [f"org-{i}" for i in range(n)],
                  "rounds": rounds, "seed": seed, "algorithm_config": TRAIN, "secure_aggregation": secure}],
    }


def scrape(port: int) -> dict[tuple[str, str, str], float]:
    """``hetfed_aggregator_bytes_total`` of the run, by (organization, direction, payload kind)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "hetfed_aggregator_bytes_total" and s.labels.get("run") == RUN:
                out[(s.labels["organization"], s.labels["direction"], s.labels["payload_kind"])] = s.value
    return out


def per_round_kinds(history: Any, rounds: int, n: int) -> dict[str, dict[str, float]]:
    """{direction: {kind: bytes per organization}}: the median over train rounds 2..R of each round's record / N."""
    train = [h for h in history if 2 <= h.round <= rounds]
    keys = {(t.direction, t.payload_kind) for h in train for t in h.traffic}
    out: dict[str, dict[str, float]] = {"up": {}, "down": {}}
    for direction, kind in sorted(keys):
        per = [sum(t.bytes for t in h.traffic if (t.direction, t.payload_kind) == (direction, kind)) for h in train]
        out[direction][kind] = statistics.median(per) / n
    return out


def prometheus_figures(counters: dict[tuple[str, str, str], float], history: Any, n: int) -> dict[str, Any]:
    """What the Prometheus counters say over the whole run, and whether they hold every round's record."""
    totals: dict[tuple[str, str], float] = {}
    for (_, direction, kind), v in counters.items():
        totals[(direction, kind)] = totals.get((direction, kind), 0.0) + v
    rounds_sum: dict[tuple[str, str], int] = {}
    for h in history:
        for t in h.traffic:
            rounds_sum[(t.direction, t.payload_kind)] = rounds_sum.get((t.direction, t.payload_kind), 0) + t.bytes
    up = {org: sum(v for (o, d, _), v in counters.items() if o == org and d == "up")
          for org in sorted({o for o, _, _ in counters})}
    return {
        "prometheus_covers_rounds": bool(rounds_sum) and all(totals.get(k, 0.0) >= v for k, v in rounds_sum.items()),
        "prometheus_kinds": sorted(f"{d}:{k}" for d, k in totals),
        "prometheus_up_per_org": up,
        "prometheus_organizations": len(up) == n,
    }


def measure(params: int, n: int, rounds: int, secure: bool, workdir: Path, seed: int = 0) -> dict[str, Any]:
    """One federation of ``n`` organizations for ``rounds`` FedAvg rounds; returns the figures."""
    w = workload(params)
    fed = LocalFederation(workdir)
    probe = overhead.Probe()
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    try:
        fed.start_aggregator(aggregator_config(n, rounds, secure, workdir / "state", seed))
        assert fed.aggregator is not None
        for i, data in enumerate(overhead.write_data(workdir, w, n, seed=1)):
            fed.start_client(f"client-{i}", overhead.client_config(w, i, fed.port, data))
        first = fed.clients["client-0"]
        deadline = time.monotonic() + 3600
        with AggregatorClient(f"127.0.0.1:{fed.port}", None, "", "", call_timeout=30.0) as watcher:
            while True:
                fed.raise_if_failed()
                (status,) = watcher.status(RUN)
                probe(fed.aggregator.pid, first.pid if first.poll() is None else None, status,
                      [c.pid for c in fed.clients.values()])
                if status.finished:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("the federation did not finish within an hour")
                time.sleep(overhead.POLL_SECONDS)
        probe.sample("aggregator", fed.aggregator.pid)
        counters = scrape(fed.metrics_port)
    finally:
        fed.stop()
    wall = time.monotonic() - start
    train = [h for h in status.history if 2 <= h.round <= rounds]
    if [h.clients for h in status.history if h.round <= rounds] != [n] * rounds:
        raise RuntimeError(f"a round closed without every organization: {[h.clients for h in status.history]}")
    if any(h.secure_abandoned for h in status.history):
        raise RuntimeError("a secure round was abandoned")
    periods = [v for r, v in overhead.close_periods(workdir / "aggregator.log", RUN).items() if 2 <= r <= rounds]
    window = probe.marks.get("end_t", 0.0) - probe.marks.get("start_t", 0.0)
    per_round = statistics.fmean(periods) if periods else statistics.fmean(h.duration_seconds for h in train)
    agg_cpu = (probe.marks["end"] - probe.marks["start"]) / window * per_round if window > 0 else float("nan")
    all_cpu = (probe.marks["end_all"] - probe.marks["start_all"]) / window * per_round if window > 0 else float("nan")
    kinds = per_round_kinds(status.history, rounds, n)
    row = {
        "system": "hetfed", "arm": "secure" if secure else "plain", "params": mlp1_params(w.latent_dim),
        "model_bytes": 4 * mlp1_params(w.latent_dim), "clients": n, "rounds": rounds,
        "round_s": statistics.median(periods) if periods else float("nan"),
        "open_close_s": statistics.median(h.duration_seconds for h in train),
        "up": kinds["up"], "down": kinds["down"],
        "up_per_org": sum(kinds["up"].values()), "down_per_org": sum(kinds["down"].values()),
        "masked_up": sum(v for k, v in kinds["up"].items() if k in MASKED),
        "stages_up": sum(v for k, v in kinds["up"].items() if k.startswith("secagg_") and k not in MASKED),
        "stages_down": sum(v for k, v in kinds["down"].items() if k.startswith("secagg_")),
        "agg_cpu_s": agg_cpu, "clients_cpu_s": all_cpu - agg_cpu,
        "agg_peak_rss_mb": probe.rss.get("aggregator", 0) / 2**20,
        "client_peak_rss_mb": probe.rss.get("client", 0) / 2**20,
        "wall_s": wall, "load_before": load_before, "load_after": os.getloadavg()[0],
    }
    row.update(prometheus_figures(counters, status.history, n))
    return row


def flower_row(python: str, params: int, n: int, rounds: int, workdir: Path) -> dict[str, Any]:
    """benchmarks/flower_secagg.py's row for the same N and parameter count, under ``python`` (Flower's venv)."""
    out = workdir / "flower.json"
    load_before = os.getloadavg()[0]
    cmd = [python, str(Path(__file__).resolve().with_name("flower_secagg.py")), "--clients", str(n),
           "--params", str(params), "--rounds", str(rounds), "--json", str(out), "--logs", str(workdir / "flwr-logs")]
    subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, timeout=3600)
    (f,) = json.loads(out.read_text())
    return {"system": "Flower 1.42", "arm": "SecAgg+", "params": params, "model_bytes": 4 * params, "clients": n,
            "rounds": rounds, "round_s": f["round_median_s"],
            "up_per_org": f["bytes_up_per_round"] / n, "down_per_org": f["bytes_down_per_round"] / n,
            "all_cpu_s": f["cpu_s_per_round"], "wall_s": f["wall_s"], "load_before": load_before,
            "load_after": os.getloadavg()[0], "flower": f}


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


HEADER = ("| system | params | N | round s | MB up/org/round | of which weights or masked input MB | stages kB up / "
          "down | MB down/org/round | agg CPU s/round | clients CPU s/round | agg peak RSS MB | load |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")


def report(r: dict[str, Any]) -> str:
    """One markdown row."""
    name = f"{r['system']} {r['arm']}"
    load = f"{r['load_before']:.0f}-{r['load_after']:.0f}"
    if r["system"] != "hetfed":
        return (f"| {name} | {r['params']:,} | {r['clients']} | {r['round_s']:.2f} | {_mb(r['up_per_org'])} | | | "
                f"{_mb(r['down_per_org'])} | {r['all_cpu_s']:.2f} (every process) | | | {load} |")
    stages = f"{r['stages_up'] / 1e3:.1f} / {r['stages_down'] / 1e3:.1f}" if r["arm"] == "secure" else ""
    return (f"| {name} | {r['params']:,} | {r['clients']} | {r['round_s']:.2f} | {_mb(r['up_per_org'])} | "
            f"{_mb(r['masked_up'])} | {stages} | {_mb(r['down_per_org'])} | {r['agg_cpu_s']:.2f} | "
            f"{r['clients_cpu_s']:.2f} | {r['agg_peak_rss_mb']:.0f} | {load} |")


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal"))
    return f"{os.cpu_count()} CPU cores ({cpu}), {mem / 2**20:.0f} GiB, Python {platform.python_version()}"


def tree_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    """Measure each (parameters, N): the plain and the secure arm, alternating, then Flower's if asked."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--params", default="1000000", help="comma-separated parameter counts")
    ap.add_argument("--clients", default="4,8,16,32", help="comma-separated N")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per federation, at least 3 (median over 2..R)")
    ap.add_argument("--repeats", type=int, default=1, help="plain/secure pairs per (parameters, N)")
    ap.add_argument("--arms", default="plain,secure", help="which arms to run (plain, secure or both)")
    ap.add_argument("--flower-python", default="", help="also run benchmarks/flower_secagg.py under this interpreter")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="N = 2, a 10k-parameter model, 3 rounds (a check)")
    ap.add_argument("--json", type=Path, help="also write the rows, the machine and the command here")
    ap.add_argument("--table", type=Path, help="print the table of a JSON this script wrote, and nothing else")
    args = ap.parse_args(argv)
    if args.table:
        print(HEADER)
        for r in json.loads(args.table.read_text())["rows"]:
            print(report(r))
        return 0
    if args.quick:
        args.params, args.clients, args.rounds = str(QUICK_PARAMS), "2", 3
    if args.rounds < 3:
        ap.error("--rounds must be at least 3 (the median is over rounds 2..R)")
    signal.signal(signal.SIGTERM, lambda signum, _frame: (stop_all(), sys.exit(128 + signum)))
    command = f"python benchmarks/secagg_cost.py {' '.join(argv)}".strip()
    doc: dict[str, Any] = {"command": command, "date": datetime.now(UTC).isoformat(timespec="seconds"),
                           "machine": machine(), "commit": tree_commit(), "rows": []}
    print(f"$ {command}\n{doc['machine']}; hetfed {doc['commit']}; FedAvg, mlp1, {args.rounds} rounds")
    print(HEADER, flush=True)
    arms = [a for a in ("plain", "secure") if a in args.arms.split(",")]
    flip = False
    for params in _ints(args.params):
        for n in _ints(args.clients):
            for _ in range(args.repeats):
                for arm in (reversed(arms) if flip else arms):
                    with tempfile.TemporaryDirectory(prefix=f"hetfed-secagg-{arm}-{n}-") as tmp:
                        r = measure(params, n, args.rounds, arm == "secure", Path(tmp), args.seed)
                    doc["rows"].append(r)
                    print(report(r), flush=True)
                    if args.json:  # after each row: a later configuration that fails keeps the earlier ones
                        args.json.write_text(json.dumps(doc, indent=1))
                flip = not flip
            if args.flower_python:
                with tempfile.TemporaryDirectory(prefix=f"flwr-secagg-{n}-") as tmp:
                    f = flower_row(args.flower_python, params, n, args.rounds, Path(tmp))
                doc["rows"].append(f)
                print(report(f), flush=True)
                if args.json:
                    args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
