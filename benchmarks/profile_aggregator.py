"""Where the aggregator's CPU goes, function by function, every thread: yappi over a real federation.

    pip install yappi                                    # a profiling tool only; hetfed does not depend on it
    python benchmarks/profile_aggregator.py --out head.pstat
    python benchmarks/profile_aggregator.py --tree /path/to/worktree --out base.pstat
    python benchmarks/profile_aggregator.py --compare base.pstat head.pstat

The aggregator runs as ``hetfed aggregator`` would (``hetfed.cli.main``), under yappi's CPU clock with every
thread profiled (cProfile sees only the main thread, which here just waits). Its clients are round_overhead.py's
lightweight numpy clients, so the machine's cores are the aggregator's: one FedAvg run of workload A. At the end
the aggregator is stopped with SIGTERM, writes its profile (pstats format), and the top functions by own CPU per
round are printed. ``--tree`` runs another checkout's packages (a worktree of an older commit: its CLI must take
``aggregator --config --ready-file``); ``--compare`` prints the functions whose CPU per round changed most.
Figures include the process's start-up (imports), spread over the rounds: compare equal round counts.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _aggregator(out: str, argv: list[str]) -> int:
    """In the profiled process: ``hetfed ARGV`` under yappi; the profile is saved to ``out`` at exit."""
    import atexit

    import yappi  # type: ignore[import-not-found]

    yappi.set_clock_type("cpu")
    yappi.start(builtins=False, profile_threads=True)
    atexit.register(lambda: (yappi.stop(), yappi.get_func_stats().save(out, type="pstat")))
    from hetfed.cli import main

    return main(argv)


def _by_function(path: Path, rounds: int) -> dict[str, tuple[float, int]]:
    """(own CPU ms per round, calls per round) by ``file:function``, paths shortened to the package."""
    out: dict[str, list[float]] = {}
    for (file, _line, name), (_cc, calls, own, _cum, _callers) in pstats.Stats(str(path)).stats.items():  # type: ignore[attr-defined]
        file = re.sub(r".*/(site-packages|python3\.\d+|services|proto|clients)/", "", file)
        acc = out.setdefault(f"{file}:{name}", [0.0, 0.0])
        acc[0] += own * 1e3 / rounds
        acc[1] += calls / rounds
    return {k: (v[0], int(v[1])) for k, v in out.items()}


def profile(tree: Path, rounds: int, clients: int, out: Path) -> None:
    """One federation with the aggregator of ``tree`` profiled; its profile written to ``out``."""
    sys.path.insert(0, str(HERE))
    import round_overhead as ro

    from hetfed.wire.rpc import AggregatorClient

    w = ro.WORKLOADS["A"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(str(tree / d) for d in ("proto", "services", "clients"))}
    with tempfile.TemporaryDirectory(prefix="hetfed-profile-") as tmp:
        wd = Path(tmp)
        (wd / "aggregator.json").write_text(json.dumps(ro.aggregator_config(w, clients, rounds, wd / "state")))
        ready = wd / "ready"
        with open(wd / "aggregator.log", "wb") as log:
            agg = subprocess.Popen([sys.executable, __file__, "_aggregator", str(out.resolve()), "aggregator", "--config",
                                    str(wd / "aggregator.json"), "--ready-file", str(ready)],
                                   env=env, stdout=log, stderr=subprocess.STDOUT, cwd=wd)
        light = None
        try:
            deadline = time.monotonic() + 120
            while not ready.exists():
                if agg.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the aggregator did not start:\n{(wd / 'aggregator.log').read_text()[-2000:]}")
                time.sleep(0.1)
            port = int(json.loads(ready.read_text())["port"])
            with open(wd / "light.log", "wb") as log:
                light = subprocess.Popen(ro.light_command(port, [f"org-{i}" for i in range(clients)], ro.model_shapes(w)),
                                         env=env, stdout=log, stderr=subprocess.STDOUT)
            with AggregatorClient(f"127.0.0.1:{port}", None, "", "", call_timeout=30.0) as watcher:
                while not watcher.status(ro.RUN)[0].finished:
                    if light.poll() not in (None, 0) or time.monotonic() > deadline + 3600:
                        raise RuntimeError(f"the federation failed:\n{(wd / 'light.log').read_text()[-2000:]}")
                    time.sleep(1.0)
        finally:
            if light is not None and light.poll() is None:
                light.terminate()
                light.wait(30)
            agg.send_signal(signal.SIGTERM)
            agg.wait(60)
    if not out.exists():
        raise RuntimeError("the aggregator wrote no profile")


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "_aggregator":
        return _aggregator(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--tree", type=Path, default=HERE.parent, help="the checkout whose aggregator runs (default: this)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("aggregator.pstat"))
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BASE", "HEAD"),
                    help="two saved profiles of the same round count: the functions that changed most")
    args = ap.parse_args()
    if args.compare:
        base, head = (_by_function(p, args.rounds) for p in args.compare)
        print(f"own CPU ms per round: base {sum(v[0] for v in base.values()):.1f}, "
              f"head {sum(v[0] for v in head.values()):.1f} ({args.rounds} rounds, start-up included)")
        print(f"{'base':>8} {'head':>8} {'change':>8}  calls/round  function")
        names = sorted(set(base) | set(head), key=lambda k: -abs(head.get(k, (0, 0))[0] - base.get(k, (0, 0))[0]))
        for k in names[:args.top]:
            b, h = base.get(k, (0.0, 0)), head.get(k, (0.0, 0))
            print(f"{b[0]:8.2f} {h[0]:8.2f} {h[0] - b[0]:+8.2f}  {b[1]:5d} {h[1]:5d}  {k[:110]}")
        return 0
    profile(args.tree.resolve(), args.rounds, args.clients, args.out)
    funcs = _by_function(args.out, args.rounds)
    print(f"own CPU ms per round: {sum(v[0] for v in funcs.values()):.1f} ({args.rounds} rounds, start-up included); "
          f"profile in {args.out}")
    for k, (ms, calls) in sorted(funcs.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{ms:8.2f} ms {calls:6d} calls  {k[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
