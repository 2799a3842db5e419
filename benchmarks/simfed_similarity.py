"""Draw SimFed's similarity matrix σ_kj after training, from the aggregator's checkpoint (nothing new on the wire).

The server keeps every organization's latest criteria embeddings and the σ it matched them with in its state;
the checkpoint (``<state_dir>/<run>/checkpoint.npz``) is written at every round close, so after a run it
holds σ of the last training round. This script reads it, draws σ ordered by organization (the cells in J_k,
σ_kj ≥ τ, outlined: whom each row's organization learns from) and prints what the server holds.

    python benchmarks/simfed_similarity.py /tmp/simfed2-bench/simfed-s0/state --out docs/images/simfed-similarity.png

(``hetfed bench simfed --workdir DIR`` leaves each federation's state under DIR/<method>-s<seed>/state.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from hetfed.aggregator.journal.store import RunStore, StateError


def load_similarity(state_dir: Path, run: str = "simfed") -> tuple[np.ndarray, list[str], dict[str, np.ndarray], dict]:
    """σ, the organizations in its order, every held array and the half's metadata, from a run's checkpoint."""
    try:
        engine, arrays = RunStore(state_dir, run).read_checkpoint()
    except StateError as exc:
        raise SystemExit(f"{state_dir / run}: {exc}") from None
    if "sigma" not in arrays:
        raise SystemExit(f"{state_dir / run}: no SimFed checkpoint with a similarity matrix")
    order = json.loads(bytes(arrays["sigma_order"]).decode())
    meta = json.loads(bytes(arrays["meta"]).decode())
    return arrays["sigma"], order, arrays, {"engine": engine, "half": meta}


def draw(sigma: np.ndarray, order: list[str], tau: float, title: str, out: Path) -> None:
    """A heatmap of σ with every value written in its cell and the cells of J_k outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    k = len(order)
    fig, ax = plt.subplots(figsize=(1.0 + 0.62 * k, 0.6 + 0.58 * k), dpi=110)
    im = ax.imshow(sigma, cmap="viridis", vmin=min(0.0, float(sigma.min())), vmax=1.0)
    for i in range(k):
        for j in range(k):
            ax.text(j, i, f"{sigma[i, j]:.2f}", ha="center", va="center", fontsize=7,
                    color="black" if sigma[i, j] > 0.6 else "white")
            if sigma[i, j] >= tau or i == j:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.6))
    labels = [o.replace("org-", "") for o in order]
    ax.set_xticks(range(k), labels)
    ax.set_yticks(range(k), labels)
    ax.set_xlabel("organization j")
    ax.set_ylabel("organization k")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="σ_kj = cos(z_N,k, z_N,j)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main() -> None:
    """Read the checkpoint, draw σ, print the figures the docs quote."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("state_dir", type=Path, help="the aggregator's state directory of a finished run")
    p.add_argument("--run", default="simfed", help="run id (default %(default)s)")
    p.add_argument("--tau", type=float, default=0.9, help="τ of the run, for the outlined J_k (default %(default)s)")
    p.add_argument("--title", default="", help="the picture's title")
    p.add_argument("--out", type=Path, default=Path("simfed-similarity.png"))
    args = p.parse_args()
    sigma, order, arrays, meta = load_similarity(args.state_dir, args.run)
    k = len(order)
    off = sigma[~np.eye(k, dtype=bool)]
    sets = [int(np.sum((sigma[i] >= args.tau) | (np.arange(k) == i))) for i in range(k)]
    held = sum(a.nbytes for name, a in arrays.items() if name != "meta" and name != "sigma_order")
    closed = meta["half"]["closed_round"]
    title = args.title or f"SimFed σ_kj after training round {closed} (outlined: σ ≥ τ = {args.tau:g}, j ∈ J_k)"
    draw(sigma, order, args.tau, title, args.out)
    print(f"{args.out}: σ over {k} organizations after round {closed}")
    print(f"off-diagonal σ: mean {off.mean():.3f}, min {off.min():.3f}, max {off.max():.3f}")
    print(f"|J_k| at tau {args.tau:g}: {sets} (mean {np.mean(sets):.2f})")
    print(f"server state held for the run (latest factors, embeddings, σ): {held:,} bytes "
          f"({held / k:,.0f} per organization)")


if __name__ == "__main__":
    main()
