"""CPU seconds of one local epoch of Ditto's real client half, per variant, against FedAvg's (one organization).

Builds each algorithm's client half exactly as the client runtime does (the registries, a ClientContext on
Synthetic(0.5, 0.5) data, the `linear` model) and times one round of `local_epochs = 1` in this process on one
thread, with the paper's batch 10: what each constraint adds to the local work, without processes or gRPC. The
reproduction (`hetfed bench ditto`) measures the same over real processes.

    nice -n 5 python benchmarks/ditto_round_cost.py [--variants ditto,ditto_mmdd_s5] [--repeat 2]
    nice -n 5 python benchmarks/ditto_round_cost.py --refit   # one refit, both dtypes
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from hetfed.client.algorithms import ClientContext, make_client_half
from hetfed.client.data import DataConfig, load_client_data
from hetfed.client.models import build_model
from hetfed.wire.payloads import Received
from hetfed.wire.specs import get_spec

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "fedavg": ("fedavg", {}),
    "ditto": ("ditto", {"lam": 0.01}),
    "ditto_cos": ("ditto_cos", {}),
    "ditto_mkmmd20_s5": ("ditto_mkmmd", {"refit_batches": 5}),
    "ditto_mkmmd-1": ("ditto_mkmmd", {"refit_every": -1}),
    "ditto_mmdd_s5": ("ditto_mmdd", {"refit_batches": 5}),
    "ditto_mkmmd20_s50": ("ditto_mkmmd", {"refit_batches": 50}),
    "ditto_mmdd_s50": ("ditto_mmdd", {"refit_batches": 50}),
    # the reference code's float32 kernel maths (kernel_dtype)
    "ditto_mkmmd-1_f32": ("ditto_mkmmd", {"refit_every": -1, "kernel_dtype": "float32"}),
    "ditto_mkmmd20_s50_f32": ("ditto_mkmmd", {"refit_batches": 50, "kernel_dtype": "float32"}),
    "ditto_mmdd_s50_f32": ("ditto_mmdd", {"refit_batches": 50, "kernel_dtype": "float32"}),
}


def epoch_cost(algorithm: str, config: dict[str, Any], seed: int = 100) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one round of one local epoch of ``algorithm``'s client half."""
    spec = get_spec(algorithm)
    data = load_client_data(DataConfig(dataset="synthetic", partition="natural", num_clients=8, client_index=0,
                                       seed=seed))
    cfg = spec.config(local_epochs=1, batch_size=10, lr=0.001, momentum=0.9, weight_decay=0.001, **config)

    def build() -> torch.nn.Module:
        return build_model("linear", data.input_shape, data.num_classes, seed=seed)

    ctx = ClientContext("org-0", build(), data, torch.device("cpu"), cfg, seed, build_model=build)  # type: ignore[arg-type]
    half = make_client_half(spec, ctx)
    cpu, wall = time.process_time(), time.perf_counter()
    half.train(1, 1, Received([], frozenset()))
    return time.process_time() - cpu, time.perf_counter() - wall


def refit_cost(measure: str, dtype: torch.dtype, rows: int = 500, width: int = 20, repeat: int = 5) -> float:
    """Least CPU seconds of one refit on ``rows`` + ``rows`` feature rows (s = 50 batches of 10): MMD-D's five
    kernel steps, or MK-MMD's (d̂, Q̂) and QP."""
    from hetfed.client.algorithms.ditto.mkmmd import MkMmdLoss
    from hetfed.client.algorithms.ditto.mmdd import MmdDLoss

    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=g)
    y = x + 0.1 * torch.randn(rows, width, generator=g)
    module = MmdDLoss(width, kernel_form="liu", dtype=dtype) if measure == "mmdd" else MkMmdLoss(dtype=dtype)
    best = float("inf")
    for _ in range(repeat + 1):  # the first warms up
        cpu = time.process_time()
        if isinstance(module, MmdDLoss):
            module.train_kernel(x, y)
        else:
            module.refit(x, y)
        best = min(best, time.process_time() - cpu)
    return best


def main() -> None:
    """Print each variant's CPU seconds per local epoch (the least of --repeat) and its ratio to Ditto's.

    Ditto is timed again beside every variant (alternating, the least of each): on a shared machine the
    ratio of two runs made side by side carries over far better than either time alone.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--repeat", type=int, default=2, help="rounds timed per variant; the least CPU time is shown")
    p.add_argument("--refit", action="store_true", help="time one refit of MK-MMD and MMD-D on 500 + 500 rows "
                                                          "in float64 and float32 instead")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.refit:
        print(f"{'refit (500 + 500 rows)':<24} {'float64 CPU ms':>15} {'float32 CPU ms':>15}")
        for measure in ("mkmmd", "mmdd"):
            f64, f32 = refit_cost(measure, torch.float64), refit_cost(measure, torch.float32)
            print(f"{measure:<24} {1e3 * f64:>15.1f} {1e3 * f32:>15.1f}", flush=True)
        return
    epoch_cost("ditto", {})  # warm up torch's first-call costs
    base_algorithm, base_config = VARIANTS["ditto"]
    print(f"{'variant':<20} {'CPU s / epoch':>14} {'wall s':>8} {'Ditto CPU s':>12} {'x Ditto':>8}")
    for name in args.variants.split(","):
        algorithm, config = VARIANTS[name]
        runs, base = [], []
        for _ in range(args.repeat):
            base.append(epoch_cost(base_algorithm, base_config))
            runs.append(epoch_cost(algorithm, config))
        cpu, wall = min(runs)
        ditto_cpu = min(base)[0]
        print(f"{name:<20} {cpu:>14.2f} {wall:>8.2f} {ditto_cpu:>12.2f} {cpu / ditto_cpu:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
