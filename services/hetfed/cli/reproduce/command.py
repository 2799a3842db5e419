"""``hetfed bench NAME``: run a grid's federations (resumable, several at once), save them, render the page."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hetfed.cli.localrun import FederationFailedError
from hetfed.cli.reproduce.grids import Grid, Method, load_grid, select_cells
from hetfed.cli.reproduce.measuring import run_bytes_reference, run_federation
from hetfed.cli.reproduce.pages import _cell_name, portable_command, render, write_page
from hetfed.cli.reproduce.statistics import check_claims
from hetfed.wire.config import to_mapping


def _parser(name: str, grid: Grid) -> argparse.ArgumentParser:
    """``hetfed bench NAME``'s options."""
    p = argparse.ArgumentParser(prog=f"hetfed bench {name}", description=grid.title)
    p.add_argument("--seeds", help=f"comma-separated seeds (default {','.join(map(str, grid.seeds))})")
    p.add_argument("--methods", help="comma-separated subset of " + ",".join(m.id for m in grid.methods))
    p.add_argument("--rounds", type=int, help=f"rounds of every federation (default: the grid's, {grid.rounds})")
    p.add_argument("--cell", action="append", default=[], metavar="AXIS=V[,V...]",
                   help="run only the cells whose AXIS takes one of these values (repeatable; axes: "
                   + (", ".join(a.name for a in grid.axes) or "none") + ")")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / f"hetfed-bench-{name}"),
                   help="where federations run and clients write their artifacts")
    p.add_argument("--json", default=None, help=f"measurements file (default: beside {grid.results})")
    p.add_argument("--page", default=grid.results, help="the results page to render (default %(default)s)")
    p.add_argument("--no-bytes", action="store_true", help="skip the reference byte-count federations")
    p.add_argument("--report-only", action="store_true", help="render the page from the saved measurements")
    p.add_argument("--jobs", type=int, default=1,
                   help="federations run at once (each is its own aggregator and client processes; the default, 1, "
                   "keeps timings comparable)")
    p.add_argument("--resume", action="store_true",
                   help="keep every federation already measured in the workdir's rows.json (same method, cell and "
                   "seed; any method or seed) and run only the missing ones")
    p.add_argument("--keep-going", action="store_true",
                   help="when a federation fails, report it and run the others (exit status 1 at the end); "
                   "without it the first failure stops the grid")
    return p


def main(name: str, argv: list[str]) -> int:
    """``hetfed bench NAME [options]``: run a reproduction grid and render its results page."""
    grid = load_grid(name)
    p = _parser(name, grid)
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    json_path = Path(args.json or Path(args.page).with_suffix(".json"))
    if args.report_only:
        write_page(Path(args.page), grid.title, render(grid, json.loads(json_path.read_text())))
        print(f"wrote {args.page}")
        return 0
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else list(grid.seeds)
    methods = [grid.method(m) for m in args.methods.split(",")] if args.methods else list(grid.methods)
    root = Path(args.workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    try:
        cells = select_cells(grid, args.cell)
    except ValueError as exc:
        p.error(str(exc))
    print(f"hetfed bench {name}: {len(cells) * len(seeds) * len(methods)} federations", flush=True)
    started, load0 = time.monotonic(), os.getloadavg()[0]
    saved = root / "rows.json"
    rows: list[dict[str, Any]] = json.loads(saved.read_text()) if args.resume and saved.exists() else []
    if rows:
        print(f"  resuming: {len(rows)} federations already measured in {saved}", flush=True)
    pending = [(cell, seed, method) for cell in cells for seed in seeds for method in methods
               if not any(r["method"] == method.id and r["cell"] == cell and r["seed"] == seed for r in rows)]
    failed = _run_pending(grid, pending, root, args, rows, saved)
    order = {(json.dumps(c, sort_keys=True), s, m.id): i
             for i, (c, s, m) in enumerate((c, s, m) for c in cells for s in seeds for m in methods)}
    rows.sort(key=lambda r: order.get((json.dumps(r["cell"], sort_keys=True), r["seed"], r["method"]), len(order)))
    refs = {} if args.no_bytes else {r.label: run_bytes_reference(grid, r, root) for r in grid.bytes_references}
    data = {
        "command": portable_command(shlex.join(["hetfed", "bench", name, *argv])),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), Python {platform.python_version()}",
        "jobs": args.jobs,
        "rounds": args.rounds,
        "ran": len(pending),
        "wall_seconds": time.monotonic() - started,
        "load": [load0, os.getloadavg()[0]],
        "grid": to_mapping(dataclasses.replace(grid)),
        "rows": rows,
        "bytes_references": refs,
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    write_page(Path(args.page), grid.title, render(grid, data))
    results = check_claims(grid, rows)
    for r in results:
        print(f"claim: {r.claim.text} [{_cell_name(r.cell)}]: {r.mean:+.2f} [{r.lower:+.2f}, {r.upper:+.2f}] -> {r.verdict}")
    print(f"wrote {json_path} and {args.page}")
    if failed:
        print(f"{len(failed)} of {len(pending)} federations failed (run again with --resume to retry them):",
              *failed, sep="\n  ")
        return 1
    return 0


def _run_pending(grid: Grid, pending: Sequence[tuple[dict[str, Any], int, Method]], root: Path,
                 args: argparse.Namespace, rows: list[dict[str, Any]], saved: Path) -> list[str]:
    """Run every pending federation (``args.jobs`` at once), each row appended to ``rows`` and saved as it ends;
    the failures, one line each, under ``--keep-going`` (without it the first one is raised)."""
    lock = threading.Lock()
    failed: list[str] = []
    stop = threading.Event()  # set by a failure without --keep-going: queued federations then never start

    def one(task: tuple[dict[str, Any], int, Method]) -> None:
        cell, seed, method = task
        if stop.is_set():
            return
        try:
            row = run_federation(grid, method, cell, seed, root, args.rounds)
        except Exception as exc:
            what = f"{method.id}{f' [{_cell_name(cell)}]' if cell else ''} seed={seed}"
            if not args.keep_going:
                stop.set()
                if isinstance(exc, FederationFailedError):  # name the federation; the process's log follows
                    raise FederationFailedError(f"{what}: {exc}") from None
                raise
            last = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
            print(f"  FAILED {what}: {last[0]}", flush=True)
            with lock:
                failed.append(f"{what}: {last[0]}")
            return
        with lock:  # every finished federation is saved at once, so --resume loses none of them
            rows.append(row)
            _save_rows(saved, rows)

    # Each federation is its own aggregator and client processes (its own fork server, ports and workdir), so
    # several can run at once on a machine with cores to spare; the threads here only wait on them.
    pool = ThreadPoolExecutor(max_workers=args.jobs)
    try:
        for done in [pool.submit(one, t) for t in pending]:
            done.result()
    finally:  # a failed federation or a SIGTERM: start no further one, wait for those running to end
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
    return failed


def _save_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """``rows`` written to ``path`` whole or not at all (a run stopped mid-write keeps the previous file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rows, indent=1))
    os.replace(tmp, path)
