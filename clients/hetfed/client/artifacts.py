"""Local artifacts a client writes for its own operator when ``output_dir`` is set; nothing here is sent.

A snapshot ``<tag>.npz`` holds the model's state (``state/<name>`` arrays, no pickle) and the latents
z of a probe set (``probe_z``, ``probe_y``): the set the data names as its probe (a held-out target
domain, say), else the shared ``global_test`` set when the data has one, else the organization's own test set. ``meta.json`` names the architecture so the model can be rebuilt.
The runtime writes ``round-1`` (after the first round's training, before anything learned from other
organizations has reached the model) and ``final`` (after the evaluate phase). Local runs draw the
gauss4 picture from these, and the Fed-CMA benchmark trains its latent client discriminator on them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from hetfed.client.data import ClientData
from hetfed.client.models import SplitModel, state_arrays
from hetfed.client.training import DataSource, DeviceData, eval_mode, source_of

STATE_PREFIX = "state/"


@torch.no_grad()
def embed(model: SplitModel, data: DataSource | torch.Tensor, batch_size: int = 1024) -> np.ndarray:
    """Latents z of ``data`` (a data source, streamed in batches, or a tensor of inputs) in eval mode (float32)."""
    if isinstance(data, torch.Tensor):
        data = DeviceData(data, torch.zeros(int(data.shape[0]), dtype=torch.int64, device=data.device))
    n = len(data)
    with eval_mode(model):
        out = [model.embed(b.x).float().cpu()
               for b in data.batches(slice(i, i + batch_size) for i in range(0, n, batch_size))]
    return torch.cat(out).numpy() if out else np.zeros((0, model.latent_dim), np.float32)


def write_snapshot(output_dir: str | Path, tag: str, model: SplitModel, data: ClientData, model_name: str,
                   probe_source: DataSource | None = None) -> Path:
    """Write ``<output_dir>/<tag>.npz`` (model state and probe latents) and ``meta.json``; returns the npz path.

    ``probe_source`` reads the probe set (the runtime's, which streams an organization's own files); default:
    the probe set's arrays on the model's device."""
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    probe_name, probe = data.probe_set()
    device = next(model.parameters()).device
    if probe_source is None:
        probe_source = source_of(probe, device)
    z = embed(model, probe_source)
    arrays = {STATE_PREFIX + k: v for k, v in state_arrays(model).items()}
    arrays["probe_z"] = z
    arrays["probe_y"] = probe.y
    path = root / f"{tag}.npz"
    tmp = root / f".{tag}.npz.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]
    tmp.replace(path)
    meta = {
        "model": model_name,
        "latent_dim": model.latent_dim,
        "num_classes": model.num_classes,
        "input_shape": list(data.input_shape),
        "probe": probe_name,
        "data": data.name,
    }
    (root / "meta.json").write_text(json.dumps(meta, indent=1))
    return path


def read_snapshot(path: str | Path) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """(model state arrays, probe latents, probe labels) of a snapshot written by :func:`write_snapshot`."""
    with np.load(path) as z:
        state = {k[len(STATE_PREFIX):]: z[k] for k in z.files if k.startswith(STATE_PREFIX)}
        return state, z["probe_z"], z["probe_y"]
