"""Diagnostics computed from organizations' local snapshots (never from anything on the wire).

Used by local runs and benchmarks: the gauss4 picture of latent spaces and decision boundaries, the
latent client-discriminator of Fed-CMA's evaluation, and the majority-class baseline of label-skewed data. torch and matplotlib are imported when they run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def discriminator_accuracy(latents: list[np.ndarray], seed: int = 0, steps: int = 500) -> float:
    """Held-out accuracy of a linear classifier predicting the organization from z (chance: 1/organizations).

    ``latents[i]`` are organization i's latents of the same probe images; the images are split in half, the
    classifier is fitted (full-batch Adam on cross-entropy) on one half and scored on the other, so it must
    tell organizations apart by how their encoders map an image, not by which images they hold.
    """
    import torch

    n = latents[0].shape[0]
    order = np.random.default_rng(seed).permutation(n)
    train_idx, test_idx = order[: n // 2], order[n // 2 :]

    def stack(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        x = np.concatenate([z[idx] for z in latents]).astype(np.float32)
        y = np.repeat(np.arange(len(latents)), idx.size)
        return torch.as_tensor(x), torch.as_tensor(y)

    xtr, ytr = stack(train_idx)
    xte, yte = stack(test_idx)
    mu, sd = xtr.mean(0), xtr.std(0) + 1e-6
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clf = torch.nn.Linear(xtr.shape[1], len(latents))
        opt = torch.optim.Adam(clf.parameters(), lr=0.05)
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(clf((xtr - mu) / sd), ytr).backward()
            opt.step()
        with torch.no_grad():
            return float((clf((xte - mu) / sd).argmax(1) == yte).float().mean())


def latent_discriminator(workdir: Path, summary: dict[str, Any], seed: int) -> float:
    """Held-out accuracy of a linear classifier telling a local run's organizations apart from their latents.

    Every client wrote the latents z of the same probe images with its final model to its own output
    directory (``artifacts/<run>/<organization>/final.npz``); nothing extra crossed the wire.
    """
    from hetfed.client.artifacts import read_snapshot

    orgs = sorted(summary["rounds"][-1]["per_organization"])
    latents = [read_snapshot(workdir / "artifacts" / summary["run"] / org / "final.npz")[1] for org in orgs]
    return discriminator_accuracy(latents, seed)


def majority_class(workdir: Path, summary: dict[str, Any], seed: int) -> float:
    """The accuracy of each organization predicting its own most frequent training class on its own test set,
    averaged uniformly over organizations: what a model learns without learning anything from the inputs.

    Read from the organizations' data configs in the run's work directory (``client-<run>-org-<i>.json``).
    """
    from hetfed.client.data import DataConfig, load_client_data
    from hetfed.wire.config import from_mapping

    configs = sorted(workdir.glob(f"client-{summary['run']}-org-*.json"))
    if not configs:
        raise FileNotFoundError(f"no client configs of run {summary['run']!r} in {workdir}")
    rates = []
    for path in configs:
        data = load_client_data(from_mapping(DataConfig, json.loads(path.read_text())["data"], str(path)))
        top = int(np.bincount(data.train.y, minlength=data.num_classes).argmax())
        rates.append(float(np.mean(data.test.y == top)) if len(data.test.y) else 0.0)
    return float(np.mean(rates))


# Figures a reproduction computes from the clients' local snapshots or data, by name (``diagnostic:<name>`` in a
# grid).
DIAGNOSTICS: dict[str, Callable[[Path, dict[str, Any], int], float]] = {
    "latent_discriminator": latent_discriminator,
    "majority_class": majority_class,
}


def plot_gauss4(workdir: Path, run_id: str, out: Path) -> Path | None:
    """Latent spaces and decision boundaries of every organization after round 1 and at the end, as a PNG.

    Rebuilds each organization's real model from the snapshots its client wrote (``round-1``: before
    anything learned from others reached it; ``final``: after the federation), on its own data.
    Row pairs show, per organization, the input space with the full model's decision regions and its
    training points, and the latent space [0, 1]² with the head's regions and the training latents;
    the last column overlays every organization's latents of the shared test set.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import torch

    from hetfed.client.artifacts import embed, read_snapshot
    from hetfed.client.data import ArrayDataset, DataConfig, load_client_data
    from hetfed.client.models import build_model, load_state_arrays
    from hetfed.wire.specs import get_spec

    clients = sorted(workdir.glob(f"client-{run_id}-org-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    if not clients:
        return None
    algorithm = json.loads((workdir / "aggregator.json").read_text())
    run = next(r for r in algorithm["runs"] if r["id"] == run_id)
    algo = run["algorithm"]
    spec = get_spec(algo)
    bounded = spec.latent_bounded(spec.parse(run.get("algorithm_config", {})))
    stages = ("round-1", "final")
    colors = np.array(["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"])
    markers = "o^sD"
    n = len(clients)
    fig, axes = plt.subplots(4, n + 1, figsize=(3.1 * (n + 1), 12.0), squeeze=False)
    grid_in = np.stack(np.meshgrid(np.linspace(-5, 5, 200), np.linspace(-5, 5, 200)), -1).reshape(-1, 2)
    drawn = False
    for col, path in enumerate(clients):
        ccfg = json.loads(path.read_text())
        out_dir = workdir / ccfg.get("output_dir", "")
        data = load_client_data(DataConfig(**ccfg["data"]))
        train = data.train
        assert isinstance(train, ArrayDataset), "the gauss4 picture draws the 2-D toy's arrays"
        meta_file = out_dir / "meta.json"
        if not meta_file.exists():
            continue
        meta = json.loads(meta_file.read_text())
        model = build_model(meta["model"], tuple(meta["input_shape"]), meta["num_classes"],
                            latent_dim=meta["latent_dim"], bounded_latent=bounded)
        for s, stage in enumerate(stages):
            snap = out_dir / f"{stage}.npz"
            if not snap.exists():
                continue
            state, probe_z, probe_y = read_snapshot(snap)
            load_state_arrays(model, state)
            model.eval()
            x = torch.as_tensor(train.x)
            z = embed(model, x)
            ax_in, ax_z, ax_all = axes[2 * s, col], axes[2 * s + 1, col], axes[2 * s + 1, n]
            with torch.no_grad():
                pred_in = model(torch.as_tensor(grid_in, dtype=torch.float32)).argmax(1).numpy()
            ax_in.contourf(grid_in[:, 0].reshape(200, 200), grid_in[:, 1].reshape(200, 200),
                           pred_in.reshape(200, 200), levels=np.arange(-0.5, 4), colors=colors, alpha=0.25)
            ax_in.scatter(train.x[:, 0], train.x[:, 1], c=colors[train.y], s=8, edgecolors="none")
            ax_in.set_title(f"org-{col} ({meta['model']}, {len(data.train)} pts)\ninput space, {stage}", fontsize=8)
            if meta["latent_dim"] == 2:
                _draw_latents(ax_z, model, z, train.y, bounded, colors)
                ax_all.scatter(probe_z[:, 0], probe_z[:, 1], c=colors[probe_y], marker=markers[col % 4], s=6,
                               alpha=0.5, edgecolors="none")
                ax_all.set_title(f"every org's latents of the shared test set, {stage}", fontsize=8)
                if bounded:
                    ax_all.set_xlim(0, 1)
                    ax_all.set_ylim(0, 1)
            ax_z.set_title(f"latent space z, {stage}", fontsize=8)
            drawn = True
    _legends(axes, n, colors, markers)
    if not drawn:
        plt.close(fig)
        return None
    fig.suptitle(f"gauss4, {algo}: decision boundaries and latent spaces after round 1 (before anything from "
                 "other organizations reached a model) and after federation", fontsize=10)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"gauss4-{run_id}.png"
    fig.savefig(target, dpi=90)
    plt.close(fig)
    return target


def _draw_latents(ax: Any, model: Any, z: Any, y: Any, bounded: bool, colors: Any) -> None:
    """The head's decision regions over the 2-D latent space (the unit square when bounded) and the latents ``z``
    of the training points, coloured by their labels ``y``."""
    import torch

    lo, hi = (0.0, 1.0) if bounded else (float(z.min()) - 0.1, float(z.max()) + 0.1)
    g = np.linspace(lo, hi, 150)
    grid_z = np.stack(np.meshgrid(g, g), -1).reshape(-1, 2)
    with torch.no_grad():
        pred_z = model.head(torch.as_tensor(grid_z, dtype=torch.float32)).argmax(1).numpy()
    ax.contourf(grid_z[:, 0].reshape(150, 150), grid_z[:, 1].reshape(150, 150),
                pred_z.reshape(150, 150), levels=np.arange(-0.5, 4), colors=colors, alpha=0.25)
    ax.scatter(z[:, 0], z[:, 1], c=colors[y], s=8, edgecolors="none")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)


def _legends(axes: Any, n: int, colors: Any, markers: str) -> None:
    """The last column's legends: one marker per organization, one colour per class."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="gray", marker=markers[i % 4], linestyle="", label=f"org-{i}") for i in range(n)]
    handles += [Line2D([], [], color=colors[k], marker="s", linestyle="", label=f"class {k}") for k in range(4)]
    for s in range(2):
        axes[2 * s, n].axis("off")
        axes[2 * s + 1, n].legend(handles=handles, fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
