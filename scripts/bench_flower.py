"""hetfed's round against Flower's on workload A, interleaved in one hour on this machine.

    python scripts/bench_flower.py --flower-python "$FLWR_VENV/bin/python" --clients 4,8,32 --pairs 3

Each pair runs ``benchmarks/round_overhead.py --workload A`` (hetfed, this checkout, this interpreter) and
``benchmarks/flower_round.py`` (Flower 1.42's legacy gRPC path, under ``--flower-python``: a virtual environment
with torch 2.13.0 and flwr, as that script's docstring says) once each for every N, alternating which goes
first. Printed: every run's figures, then hetfed/Flower for the round period (hetfed's close to close, as
Flower's round is timed), every process's CPU per round and the server's peak RSS, as the median ratio over the
pairs and its range. A ratio of 0.5 on the period is the performance issue's goal: half of Flower's round.

``--floor`` adds ``benchmarks/grpc_round_floor.py`` to every pair (the same workload over hetfed's transport with
nothing but the bytes and the step; this interpreter), rotating the three runs' order, and prints floor/Flower
and hetfed/floor too: how far below Flower any round over grpcio can go here, and how far hetfed is above that.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_ab import print_ratios, save  # scripts/, this script's folder, is first on sys.path

REPO = Path(__file__).resolve().parents[1]
# (hetfed's key, Flower's key, what it is)
FIGURES = (("period_median_s", "round_median_s", "round period, close to close"),
           ("cpu_s_per_round", "cpu_s_per_round", "every process's CPU per round"),
           ("aggregator_peak_rss_mb", "server_peak_rss_mb", "server peak RSS"))


def run(cmd: list[str], env: dict[str, str]) -> list[dict[str, float]]:
    """One run of a harness with ``--json``; its rows."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([*cmd, "--json", out.name], check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
        return list(json.loads(Path(out.name).read_text()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flower-python", required=True, help="the interpreter of a virtual environment with flwr")
    ap.add_argument("--clients", default="4", help="comma-separated N (default 4)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--pairs", type=int, default=3, help="alternating pairs of runs (default 3)")
    ap.add_argument("--floor", action="store_true", help="also run grpc_round_floor.py in every pair")
    ap.add_argument("--json", type=Path, help="also write every run and the ratios here")
    args = ap.parse_args()
    paths = os.pathsep.join(str(REPO / d) for d in ("proto", "services", "clients"))
    hetfed_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [paths, os.environ.get("PYTHONPATH")]))}
    flower_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    sides = {
        "hetfed": ([sys.executable, "benchmarks/round_overhead.py", "--workload", "A", "--clients", args.clients,
                    "--rounds", str(args.rounds)], hetfed_env),
        "flower": ([args.flower_python, "benchmarks/flower_round.py", "--clients", args.clients,
                    "--rounds", str(args.rounds)], flower_env),
    }
    if args.floor:
        sides["floor"] = ([sys.executable, "benchmarks/grpc_round_floor.py", "--clients", args.clients,
                           "--rounds", str(args.rounds)], hetfed_env)
    print(f"workload A, N = {args.clients}, {args.rounds} rounds, {args.pairs} pairs; load {os.getloadavg()[0]:.2f}",
          flush=True)
    runs: dict[str, list[list[dict[str, float]]]] = {name: [] for name in sides}
    names = list(sides)
    for i in range(args.pairs):
        # Rotate the order by one each pair (with two sides: reversed every other pair).
        for name in names[i % len(names):] + names[:i % len(names)]:
            rows = run(*sides[name])
            runs[name].append(rows)
            key = "period_median_s" if name == "hetfed" else "round_median_s"
            print(f"pair {i + 1} {name}: " + "; ".join(
                f"N={r['clients']} period {r[key]:.4f} s, all CPU {r['cpu_s_per_round']:.4f} s, server RSS "
                f"{r['aggregator_peak_rss_mb' if name == 'hetfed' else 'server_peak_rss_mb']:.0f} MB"
                for r in rows), flush=True)
    clients = args.clients.split(",")
    print("\nhetfed / Flower, median of the pairs (range):")
    ratios = {"hetfed/flower": print_ratios(runs["hetfed"], runs["flower"], clients, list(FIGURES))}
    if args.floor:
        print("\nfloor / Flower:")
        ratios["floor/flower"] = print_ratios(runs["floor"], runs["flower"], clients,
                                              [(b, b, name) for _, b, name in FIGURES])
        print("\nhetfed / floor:")
        ratios["hetfed/floor"] = print_ratios(runs["hetfed"], runs["floor"], clients, list(FIGURES))
    save(args, runs, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
