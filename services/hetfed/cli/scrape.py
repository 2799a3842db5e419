"""A local run a Prometheus can scrape: client metrics ports, a file_sd targets file, a declared FedAvg reference.

``hetfed run --metrics-linger SECONDS`` uses these: every client serves /metrics on a loopback port, the run
directory gets ``prometheus-targets.json`` (Prometheus ``file_sd_configs`` format, rewritten as processes
start), runs whose organizations share one architecture declare ``fedavg_model_bytes``, and every process
keeps serving its final counts for SECONDS after the run.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetfed.cli.localrun import LocalRunOptions

TARGETS_FILE = "prometheus-targets.json"


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_targets(workdir: Path, aggregator_metrics_port: int, clients: dict[str, int]) -> Path:
    """Write the file_sd targets of a local federation atomically (``clients``: process name -> port)."""
    groups: list[dict[str, Any]] = [
        {"targets": [f"127.0.0.1:{aggregator_metrics_port}"], "labels": {"hetfed_component": "aggregator"}}
    ]
    groups += [{"targets": [f"127.0.0.1:{port}"], "labels": {"hetfed_component": "client", "hetfed_process": name}}
               for name, port in sorted(clients.items())]
    path = workdir / TARGETS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups, indent=1))
    tmp.replace(path)
    return path


def client_metrics(opts: LocalRunOptions, workdir: Path, aggregator_metrics_port: int,
                   names: list[str]) -> dict[str, dict[str, Any]]:
    """Per client process: the config fields that serve its metrics; also writes the targets file.

    Empty unless ``opts.metrics_linger`` > 0.
    """
    if opts.metrics_linger <= 0:
        return {}
    ports = {name: free_port() for name in names}
    write_targets(workdir, aggregator_metrics_port, ports)
    return {name: {"metrics_port": port, "metrics_host": "127.0.0.1", "metrics_linger_seconds": opts.metrics_linger}
            for name, port in ports.items()}


def model_bytes(dataset: str, model: str, latent_dim: int = 0) -> int:
    """Bytes of a model's floating state in float32: what one FedAvg message of that model carries."""
    from hetfed.client.data import DataConfig, load_client_data
    from hetfed.client.models import build_model

    data = load_client_data(DataConfig(dataset=dataset, partition="iid", num_clients=1))
    m = build_model(model, data.input_shape, data.num_classes, latent_dim=latent_dim or None)
    return sum(v.numel() * 4 for v in m.state_dict().values() if v.is_floating_point())


def declare_fedavg_reference(runs: list[dict[str, Any]], opts: LocalRunOptions) -> None:
    """Set ``fedavg_model_bytes`` on every run when scraping is on and all organizations share one model."""
    if opts.metrics_linger <= 0 or len(set(opts.models or (opts.model,))) != 1 or opts.dataset == "gauss4":
        return
    n = model_bytes(opts.dataset, (opts.models or (opts.model,))[0], opts.latent_dim)
    for run in runs:
        if run["algorithm"] != "fedh2l":  # its organizations train different architectures by default
            run["fedavg_model_bytes"] = n
