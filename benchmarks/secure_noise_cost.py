"""What ``privacy.secure_mode`` costs: the noise of one DP-SGD step of a 1M-parameter model, and the whole step.

    python benchmarks/secure_noise_cost.py                  # one thread, CPU
    python benchmarks/secure_noise_cost.py --repeats 20

The model is an MLP 784 → 1024 → 192 → 10 (1,002,570 parameters). "noise" draws N(0, σ²C²) for every parameter,
as ``PrivateStep.backward`` does: torch's generator (float32, the default) against ``SecureGenerator`` (a ChaCha20
keystream, Box-Muller in float64, each entry the sum of 4 draws). The secure draw is also split into its parts:
the keystream bytes alone, and one unguarded Gaussian per entry. "step" is one DP-SGD step of ``fit`` on a batch
of 32 (Opacus' per-example gradients, clipping, noise). Reported: median milliseconds over the repeats, the two
arms of each pair run in turn (docs/privacy.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from hetfed.client.privacy.ledger import Ledger
from hetfed.client.privacy.mechanisms import ChaChaStream, NoiseSource, PrivateStep, SecureGenerator, gaussian
from hetfed.client.training import Batch, Objective, fit

WIDTHS = (784, 1024, 192, 10)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def paired_ms(a: Callable[[], object], b: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median milliseconds of ``a`` and of ``b``, run in turn, so that a change in the machine's load (it is
    shared) reaches both arms alike."""
    a()  # warm-up: imports, allocations, Opacus' hooks
    b()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((a, times[0]), (b, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[0]), 1000 * statistics.median(times[1])


def noise(gen: NoiseSource, shapes: list[torch.Size]) -> None:
    for shape in shapes:
        gaussian(gen, 1.0, shape)


# Opacus' hooks of the model, shared by every step (as a session shares them over its rounds).
HOOKED: dict[int, tuple[nn.Module, object]] = {}


def step(model: nn.Module, gen: NoiseSource, batch: Batch) -> None:
    led = Ledger("bench", "bench", 1e-5, "rdp", 1.0, 1.0)
    private = PrivateStep(1.0, 1.0, 0.01, 32.0, gen, led, HOOKED)
    fit([Objective(model, torch.optim.SGD(model.parameters(), lr=0.0))],
        [Batch(batch.x, batch.y, private=private)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = mlp()
    shapes = [p.shape for p in model.parameters()]
    n = sum(math.prod(s) for s in shapes)
    default = torch.Generator().manual_seed(0)
    secure = SecureGenerator()
    stream = ChaChaStream()
    g = torch.Generator().manual_seed(1)
    batch = Batch(torch.rand(32, 784, generator=g), torch.randint(0, 10, (32,), generator=g))
    row: dict[str, float] = {"parameters": n}
    row["noise_default_ms"], row["noise_secure_ms"] = paired_ms(lambda: noise(default, shapes),
                                                                lambda: noise(secure, shapes), args.repeats)
    row["keystream_ms"], row["one_gaussian_secure_ms"] = paired_ms(lambda: stream(4 * 16 * ((n + 1) // 2)),
                                                                   lambda: secure.standard_normal(n), args.repeats)
    row["step_default_ms"], row["step_secure_ms"] = paired_ms(lambda: step(model, default, batch),
                                                              lambda: step(model, secure, batch), args.repeats)
    row["noise_ratio"] = row["noise_secure_ms"] / row["noise_default_ms"]
    row["step_ratio"] = row["step_secure_ms"] / row["step_default_ms"]
    print(f"{n:,} parameters: noise {row['noise_default_ms']:.1f} ms default, {row['noise_secure_ms']:.1f} ms secure "
          f"(×{row['noise_ratio']:.1f}; keystream {row['keystream_ms']:.1f} ms, one unguarded Gaussian each "
          f"{row['one_gaussian_secure_ms']:.1f} ms); DP-SGD step {row['step_default_ms']:.1f} ms default, "
          f"{row['step_secure_ms']:.1f} ms secure (×{row['step_ratio']:.2f})", flush=True)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
