"""DP-SGD's cost: one epoch of the training loop with and without DP-SGD, on one thread, per architecture.

    python benchmarks/dp_step_cost.py                              # lenet, cnn, rmnist_cnn on 4,096 examples
    python benchmarks/dp_step_cost.py --models lenet --examples 15000 --repeats 5
    python benchmarks/dp_step_cost.py --device cuda                # both arms on the GPU

Both arms run ``hetfed.client.training.fit`` on the same resident data (Fashion-MNIST's shape, 28 × 28, values drawn
from a fixed seed; the cost does not depend on the pixels), batch 32, plain SGD. The DP arm reads the set through
``PrivateData`` (Poisson samples at q = 32/N) and privatises every step (Opacus' per-example gradients, clipping to
C = 1, Gaussian noise), as a client under ``[privacy]`` does. Reported: the median wall seconds per epoch over the
repeats and their ratio (docs/privacy.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from hetfed.client.models import build_model
from hetfed.client.privacy.config import PrivacyConfig
from hetfed.client.privacy.ledger import Ledger
from hetfed.client.privacy.mechanisms import PrivateData, PrivateStep, prepare_model, secret_generator
from hetfed.client.training import DeviceData, Objective, epoch_batches, fit
from hetfed.wire.specs.fedavg import FedAvgConfig


def epoch_seconds(model_name: str, examples: int, private: bool, seed: int, device: torch.device) -> float:
    """Wall seconds of one epoch of batch-32 SGD over ``examples`` examples, with or without DP-SGD."""
    cfg = PrivacyConfig(noise_multiplier=1.0)
    model = prepare_model(build_model(model_name, (1, 28, 28), 10, seed=seed, latent_dim=None, bounded_latent=False),
                          cfg, "bench").to(device)
    gen = torch.Generator().manual_seed(seed)
    data = DeviceData(torch.rand(examples, 1, 28, 28, generator=gen).to(device),
                      torch.randint(0, 10, (examples,), generator=gen).to(device))
    source: DeviceData | PrivateData = data
    if private:
        step = PrivateStep(1.0, 1.0, 32 / examples, 32.0, secret_generator(seed, ["bench"], device),
                           Ledger("bench", "bench", 1e-5, "rdp", 1.0, 1.0))
        source = PrivateData(data, step)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train = FedAvgConfig(local_epochs=1, batch_size=32, momentum=0.0, lr=0.01)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fit([Objective(model, opt)], epoch_batches(source, train, np.random.default_rng(seed)))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="lenet,cnn,rmnist_cnn")
    parser.add_argument("--examples", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    rows = []
    for name in args.models.split(","):
        plain = [epoch_seconds(name, args.examples, False, s, device) for s in range(args.repeats)]
        dp = [epoch_seconds(name, args.examples, True, s, device) for s in range(args.repeats)]
        row = {"model": name, "device": args.device, "examples": args.examples, "plain_s": statistics.median(plain),
               "dp_sgd_s": statistics.median(dp)}
        row["ratio"] = row["dp_sgd_s"] / row["plain_s"]
        rows.append(row)
        print(f"{name:<12} plain {row['plain_s']:.2f} s  DP-SGD {row['dp_sgd_s']:.2f} s  ×{row['ratio']:.2f}", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
