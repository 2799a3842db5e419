"""Draw a probe set's latents (2-D PCA, coloured by class) of several methods of a reproduction grid, side by side.

    python scripts/latent_picture.py --grid fedsr --methods fedavg,fedsr --cell data.target_domain=0 --seed 0 \\
        --workdir /tmp/hetfed-bench-fedsr --out docs/images/fedsr-target-latents.png

Every client of a federation writes, when its output directory is set, the latents of its data's probe set
under its final model (``hetfed.client.artifacts``; for a leave-one-domain-out partition the probe is the
held-out target domain). This script reads organization 0's ``final.npz`` of each method's federation in
``--workdir`` (where ``hetfed bench GRID`` left them when the grid keeps artifacts) and runs the federation
first, with the grid's settings, when it is not there. Nothing here crosses a wire: the latents are local files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def pca_2d(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(points projected on the two leading principal axes, the share of variance each explains)."""
    centred = z - z.mean(axis=0)
    _, s, vt = np.linalg.svd(centred, full_matrices=False)
    return centred @ vt[:2].T, (s[:2] ** 2) / float((s**2).sum())


def class_separation(z: np.ndarray, y: np.ndarray) -> float:
    """trace of the between-class scatter over the within-class scatter in the full latent space."""
    mean = z.mean(axis=0)
    between = within = 0.0
    for c in np.unique(y):
        zc = z[y == c]
        between += len(zc) * float(((zc.mean(axis=0) - mean) ** 2).sum())
        within += float(((zc - zc.mean(axis=0)) ** 2).sum())
    return between / within


def snapshot(grid_name: str, method_id: str, cell: dict[str, object], seed: int, workdir: Path) -> Path:
    """organization 0's final snapshot of one federation of the grid, run first if it is missing."""
    from hetfed.cli import reproduce as rp
    from hetfed.cli.localrun import federate, run_id_of

    grid = rp.load_grid(grid_name)
    method = grid.method(method_id)
    fed_dir = rp.federation_dir(workdir, method, cell, seed)
    path = fed_dir / "artifacts" / run_id_of(method.algorithm) / "org-0" / "final.npz"
    if not path.exists():
        print(f"running {method.label} ({fed_dir}) for its snapshot", flush=True)
        fed_dir.mkdir(parents=True, exist_ok=True)
        federate(rp.federation_options(grid, method, cell, seed, artifacts=True), fed_dir)
    return path


def main() -> int:
    """Read (or make) the snapshots and draw the picture."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", required=True, help="a reproduction grid (hetfed bench --list)")
    p.add_argument("--methods", required=True, help="comma-separated method ids of the grid, drawn left to right")
    p.add_argument("--cell", action="append", default=[], metavar="AXIS=VALUE", help="the grid cell (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, required=True, help="the grid's work directory (hetfed bench --workdir)")
    p.add_argument("--title", default="", help="a line above the panels")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    from hetfed.cli import reproduce as rp
    from hetfed.client.artifacts import read_snapshot

    cell: dict[str, object] = {}
    for item in args.cell:
        key, _, raw = item.partition("=")
        try:
            cell[key] = json.loads(raw)
        except json.JSONDecodeError:
            cell[key] = raw
    grid = rp.load_grid(args.grid)
    methods = [grid.method(m) for m in args.methods.split(",")]
    panels = []
    for m in methods:
        path = snapshot(args.grid, m.id, cell, args.seed, args.workdir.resolve())
        _, z, y = read_snapshot(path)
        meta = json.loads((path.parent / "meta.json").read_text())
        panels.append((m.label, z, y, meta))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 5.0), squeeze=False)
    colours = plt.get_cmap("tab10")
    for ax, (label, z, y, meta) in zip(axes[0], panels, strict=True):
        xy, share = pca_2d(z.astype(np.float64))
        for c in np.unique(y):
            pts = xy[y == c]
            ax.scatter(pts[:, 0], pts[:, 1], s=6, alpha=0.6, color=colours(int(c) % 10), label=str(int(c)))
        ax.set_title(f"{label}: between/within-class scatter {class_separation(z.astype(np.float64), y):.2f}",
                     fontsize=10)
        ax.set_xlabel(f"PC 1 ({100 * share[0]:.0f}% of variance)")
        ax.set_ylabel(f"PC 2 ({100 * share[1]:.0f}%)")
        ax.set_xticks([])
        ax.set_yticks([])
        print(f"{label}: {len(y)} {meta['probe']} latents of width {z.shape[1]} ({meta['data']})")
    axes[0][-1].legend(title="class", markerscale=3, fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    if args.title:
        fig.suptitle(args.title, fontsize=11)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
