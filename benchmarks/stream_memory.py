"""Streaming check: a client's peak RSS on an imagefolder tree of 70,000 images against one of 7,000.

    python benchmarks/stream_memory.py                      # trees of 7,000 and 70,000 Fashion-MNIST PNGs
    python benchmarks/stream_memory.py --sizes 7000,70000 --workers 2 --workdir /tmp/stream

Each size gets its own tree (``<workdir>/tree-N/<class>/<i>.png``, the first N of Fashion-MNIST's 70,000 images
in Debian's ``dataset-fashion-mnist``; written once, then reused). A real aggregator and one real client process
(``hetfed client``, dataset ``imagefolder``, ``lenet``) train one round of one epoch on it (80 % of the tree; the
other 20 % is the own test set, evaluated each round), over loopback gRPC. The client's peak RSS is exact: the
kernel's ``ru_maxrss`` of the process, read with ``wait4``. If the client loaded the data, 10× the images would
cost 70,000 × 28 × 28 × 4 bytes = 220 MB more; streamed, the peak should stay within 1.3× (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np

from hetfed.cli.localrun import LocalFederation
from hetfed.client.data.fmnist import data_dir, read_split
from hetfed.wire.rpc import AggregatorClient

RUN = "stream"
CLASSES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot")


def write_tree(root: Path, size: int) -> Path:
    """``root/tree-<size>``: the first ``size`` Fashion-MNIST images (train, then test) as PNGs, a folder a class."""
    from PIL import Image

    tree = root / f"tree-{size}"
    done = tree / ".complete"
    if done.exists():
        return tree
    parts = [read_split(data_dir(), split) for split in ("train", "t10k")]
    x = np.concatenate([p[0] for p in parts])[:size]
    y = np.concatenate([p[1] for p in parts])[:size]
    for name in CLASSES:
        (tree / name).mkdir(parents=True, exist_ok=True)
    for i, (image, label) in enumerate(zip(x, y, strict=True)):
        Image.fromarray(np.asarray(image, dtype=np.uint8).reshape(28, 28), mode="L").save(
            tree / CLASSES[int(label)] / f"{i:05d}.png")
    done.write_text(str(size))
    return tree


def toml_of(mapping: dict[str, Any]) -> str:
    """A flat-enough TOML writer for the configs below (tables of scalars and lists)."""
    def value(v: Any) -> str:
        return json.dumps(v) if not isinstance(v, bool) else ("true" if v else "false")

    lines: list[str] = []
    tables: list[tuple[str, dict[str, Any]]] = []
    for k, v in mapping.items():
        if isinstance(v, dict):
            tables.append((k, v))
        else:
            lines.append(f"{k} = {value(v)}")
    for name, table in tables:
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {value(v)}" for k, v in table.items())
    return "\n".join(lines) + "\n"


def measure(tree: Path, workdir: Path, workers: int, batch_size: int) -> dict[str, Any]:
    """One round of one epoch over ``tree`` by one real client; its peak RSS, wall time and accuracy."""
    fed = LocalFederation(workdir)
    try:
        fed.start_aggregator({
            "server": {"listen": "127.0.0.1:0", "metrics_port": -1, "state_dir": str(workdir / "state")},
            "runs": [{"id": RUN, "algorithm": "local", "organizations": ["org-0"], "rounds": 1, "seed": 0,
                      "algorithm_config": {"local_epochs": 1, "batch_size": batch_size, "lr": 0.05,
                                           "momentum": 0.9}}],
        })
        config = {"organization": "org-0", "run": RUN, "aggregator": f"127.0.0.1:{fed.port}", "device": "cpu",
                  "threads": 1, "retry": {"give_up_after_seconds": 120.0},
                  "data": {"dataset": "imagefolder", "partition": "natural", "path": str(tree),
                           "num_workers": workers},
                  "model": {"name": "lenet"}}
        path = workdir / "client.toml"
        path.write_text(toml_of(config))
        tomllib.loads(path.read_text())
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", "import sys; from hetfed.cli import main; sys.exit(main())",
                                 "client", "--config", str(path)], env=fed.env,
                                stdout=open(workdir / "client.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"client exited {proc.returncode}: {(workdir / 'client.log').read_text()[-2000:]}")
        with AggregatorClient(f"127.0.0.1:{fed.port}", None, "", "", call_timeout=30.0) as watcher:
            (status_,) = watcher.status(RUN)
        report = status_.history[-1].reports["org-0"]
    finally:
        fed.stop()
    # ru_maxrss (kilobytes): the largest of the client and its DataLoader workers, which it reaps.
    return {"images": sum(1 for _ in tree.rglob("*.png")), "workers": workers, "peak_rss_mb": usage.ru_maxrss / 1024,
            "wall_s": wall, "test_accuracy": report.test_accuracy, "train_examples": report.num_train_examples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="7000,70000", help="tree sizes (images), smallest first")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes of the client")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workdir", default=None, help="where the trees are written (kept) and the runs work")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="hetfed-stream-")).resolve()
    rows = []
    print(f"{'images':>7} {'workers':>7} {'peak_RSS_MB':>11} {'wall_s':>7} {'train':>6} {'test_acc':>8}")
    for size in (int(s) for s in args.sizes.split(",")):
        tree = write_tree(root, size)
        run_dir = Path(tempfile.mkdtemp(prefix=f"run-{size}-", dir=root))
        r = measure(tree, run_dir, args.workers, args.batch_size)
        rows.append(r)
        print(f"{r['images']:>7} {r['workers']:>7} {r['peak_rss_mb']:>11.0f} {r['wall_s']:>7.1f} "
              f"{r['train_examples']:>6} {r['test_accuracy']:>8.3f}", flush=True)
    if len(rows) > 1:
        print(f"peak RSS ratio, largest / smallest tree: {rows[-1]['peak_rss_mb'] / rows[0]['peak_rss_mb']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
