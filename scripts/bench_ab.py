"""Before and after: one commit's round against another's, interleaved in one hour on this machine.

    python scripts/bench_ab.py main                        # main against the working tree
    python scripts/bench_ab.py 535d4f8 main --pairs 5      # two commits
    python scripts/bench_ab.py main --workload B --clients 4 --rounds 12

BASE (and HEAD, when it is given) are checked out into temporary git worktrees; without HEAD the working
tree is measured as it is, uncommitted changes included. Each pair runs ``benchmarks/round_overhead.py`` once
in each tree, alternating which goes first, with the same virtual environment and each tree's own packages
first on ``PYTHONPATH`` (checked before measuring: the aggregator's and the client's modules must load from
that tree). Printed: every run's figures, then HEAD/BASE for the round median, the aggregator's CPU seconds per
round, every process's CPU per round (the aggregator's and its clients') and the aggregator's peak RSS, as the
median ratio over the pairs and its range. Each tree runs its own harness by default (the harness drives the
tree's own CLI code); ``--harness head`` runs HEAD's harness against both trees, and ``--harness this`` the
harness of the checkout this script is in, for figures an older harness lacks (every process's CPU), where the
older trees' CLI still fits it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIGURES = (("round_median_s", "round median"), ("period_median_s", "period, close to close"),
           ("aggregator_cpu_s_per_round", "aggregator CPU per round"),
           ("cpu_s_per_round", "all processes' CPU per round"), ("aggregator_peak_rss_mb", "aggregator peak RSS"))


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """``rev`` checked out in a temporary worktree, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=f"hetfed-ab-{rev.replace('/', '_')}-"))
    git("worktree", "add", "--detach", "--force", str(path), rev)
    try:
        yield path
    finally:
        git("worktree", "remove", "--force", str(path))


def tree_env(tree: Path) -> dict[str, str]:
    """The environment that makes ``tree``'s packages the ones every process imports."""
    paths = [str(tree / d) for d in ("proto", "services", "clients")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def check_tree(tree: Path) -> None:
    """Fail unless the aggregator, client and wire packages load from ``tree`` with its environment."""
    probe = ("import hetfed.aggregator.config, hetfed.client.config, hetfed.wire.codec as c;"
             "print(hetfed.aggregator.config.__file__); print(hetfed.client.config.__file__); print(c.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], env=tree_env(tree), check=True, capture_output=True,
                         text=True, cwd=tree).stdout.split()
    strays = [f for f in out if not Path(f).resolve().is_relative_to(tree.resolve())]
    if strays:
        sys.exit(f"bench_ab: with PYTHONPATH on {tree}, these load from elsewhere: {strays}")


def measure(tree: Path, harness: Path, args: argparse.Namespace) -> list[dict[str, float]]:
    """One run of the round-overhead harness of ``harness`` (a tree) against ``tree``'s packages; its rows."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, str(harness / "benchmarks/round_overhead.py"), "--workload", args.workload, "--clients", args.clients,
               "--rounds", str(args.rounds), "--json", out.name, *(["--client-state"] if args.client_state else [])]
        subprocess.run(cmd, env=tree_env(tree), check=True, cwd=tree, stdout=subprocess.DEVNULL)
        return list(json.loads(Path(out.name).read_text()))


def print_ratios(top: list[list[dict[str, float]]], bottom: list[list[dict[str, float]]], clients: list[str],
                 figures: list[tuple[str, str, str]]) -> dict[str, dict[str, list[float]]]:
    """Print top/bottom for each N and figure (its key in the top rows, in the bottom rows, its name) as the median
    of the pairs and their range, and return the ratios; a figure an older harness lacks is left out."""
    ratios: dict[str, dict[str, list[float]]] = {}
    for j, n in enumerate(clients):
        for top_key, bottom_key, name in figures:
            if not all(top_key in r[j] for r in top) or not all(bottom_key in r[j] for r in bottom):
                continue
            values = [t[j][top_key] / b[j][bottom_key] for t, b in zip(top, bottom, strict=True)]
            ratios.setdefault(f"N={n}", {})[top_key] = values
            print(f"  N={n:<4} {name:<32} {statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})")
    return ratios


def save(args: argparse.Namespace, runs: dict[str, list[list[dict[str, float]]]], ratios: Mapping[str, object]) -> None:
    """Write the arguments, every run and the ratios to ``args.json``, when it is set."""
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": runs,
                                         "ratios": ratios}, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="the commit to compare against (e.g. main)")
    ap.add_argument("head", nargs="?", help="the commit measured (default: the working tree as it is)")
    ap.add_argument("--workload", default="A", help="round_overhead.py's workload: A (default) or B")
    ap.add_argument("--clients", default="4", help="comma-separated N (default 4)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--pairs", type=int, default=3, help="alternating pairs of runs (default 3)")
    ap.add_argument("--harness", choices=("own", "head", "this"), default="own",
                    help="each tree's own round_overhead.py (default), HEAD's for both, or this checkout's for both")
    ap.add_argument("--json", type=Path, help="also write every run and the ratios here")
    ap.add_argument("--client-state", action="store_true",
                    help="the clients keep a state directory (round_overhead.py --client-state; needs a harness "
                         "that has it: --harness this or head)")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(worktree(args.base))
        head = stack.enter_context(worktree(args.head)) if args.head else REPO
        for tree in (base, head):
            check_tree(tree)
        label = {base: f"base {args.base} ({git('rev-parse', '--short', args.base)})",
                 head: f"head {args.head or 'working tree'} ({git('rev-parse', '--short', args.head or 'HEAD')}"
                       f"{'' if args.head else ', plus uncommitted changes'})"}
        print(f"workload {args.workload}, N = {args.clients}, {args.rounds} rounds, {args.pairs} pairs; load "
              f"{os.getloadavg()[0]:.2f}\n{label[base]}\n{label[head]}", flush=True)
        runs: dict[str, list[list[dict[str, float]]]] = {"base": [], "head": []}
        for i in range(args.pairs):
            order = [("base", base), ("head", head)] if i % 2 == 0 else [("head", head), ("base", base)]
            for name, tree in order:
                harness = {"own": tree, "head": head, "this": REPO}[args.harness]
                rows = measure(tree, harness, args)
                runs[name].append(rows)
                print(f"pair {i + 1} {name}: " + "; ".join(
                    f"N={r['clients']} round {r['round_median_s']:.4f} s, aggregator CPU "
                    f"{r['aggregator_cpu_s_per_round']:.4f} s, all CPU {r.get('cpu_s_per_round', float('nan')):.4f} s, "
                    f"RSS {r['aggregator_peak_rss_mb']:.0f} MB" for r in rows), flush=True)
    print("\nHEAD / BASE, median of the pairs (range):")
    ratios = print_ratios(runs["head"], runs["base"], args.clients.split(","), [(k, k, name) for k, name in FIGURES])
    save(args, runs, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
