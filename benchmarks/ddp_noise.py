"""The noise each organization adds under distributed DP (secure aggregation, Skellam shares) against what it adds
alone today (the local Gaussian mechanism), at the same (ε, δ) over the same rounds.

    python benchmarks/ddp_noise.py                    # Fed-CMA's class sums: K = 10, d_e = 32, 50 rounds
    python benchmarks/ddp_noise.py --trials 20 --json
    python benchmarks/ddp_noise.py --whole-vector      # FedAvg's weights, one organization's vector the unit

The released vector is Fed-CMA's: K class sums of d_e latents, each example's latent clipped to C, and the K
class counts times C, so d = K·(d_e + 1) and one example added or removed moves it by at most √2·C. Today each
organization adds N(0, (z·√2·C)²) to every coordinate, z the noise multiplier dp-accounting's RDP gives for the
rounds at the target (the ledger's ``solve_noise_multiplier``); the server sees every upload, and their sum carries
√n times that noise. Under distributed DP (``hetfed.secagg.ddp.choose``: ring 32 bits, t = n//2 + 1 honest of n,
each vector clipped to c = √2·N·C for N examples, wrap-around bound at most 10^-6) each adds its Skellam share;
the accountant counts the t honest shares. "measured" is the standard deviation of the decoded sum's error
against the exact sum of the clipped vectors, over ``--trials`` seeded rounds of n random organizations
(expected: √n times the share's). ε of both sides is RDP (dp-accounting's orders today, integer orders 2..256
for Skellam).

``--whole-vector`` asks what distributed DP would cost FedAvg's model weights, whose organizations have no per-example
form: the unit is one organization's vector (clipped to c) present or absent, the paper's unit. It prints the noise
per coordinate of the sum that the accountant needs, against the root-mean-square coordinate of one clipped vector
(c/√d): the ratio is how far the noise drowns one organization's update.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from hetfed.client.privacy.ledger import Release, solve_noise_multiplier
from hetfed.secagg.ddp import Plan, choose


def local_multiplier(epsilon: float, delta: float, rounds: int) -> float:
    """z: the Gaussian noise multiplier that spends ``epsilon`` over ``rounds`` unsampled releases."""
    return solve_noise_multiplier([Release(1.0, 1.0, rounds)], epsilon, delta)


def class_sums(rng: np.random.Generator, classes: int, latent: int, examples: int, clip: float) -> np.ndarray:
    """One organization's vector: per-class sums of ``examples`` latents in [0, 1]^d_e clipped to ``clip``, then
    the counts times ``clip``."""
    labels = rng.integers(0, classes, examples)
    z = rng.random((examples, latent))
    z *= np.minimum(1.0, clip / np.linalg.norm(z, axis=1, keepdims=True))
    sums = np.zeros((classes, latent))
    np.add.at(sums, labels, z)
    counts = np.bincount(labels, minlength=classes) * clip
    return np.concatenate([sums.ravel(), counts])


def measured_std(plan: Plan, vectors: list[np.ndarray], trials: int) -> float:
    """The standard deviation of (decoded sum - exact sum of the clipped vectors) over seeded rounds."""
    exact = sum(v * min(1.0, plan.clip / float(np.linalg.norm(v))) for v in vectors)
    errors = []
    for trial in range(trials):
        total = np.zeros(plan.size, plan.dtype)
        for i, v in enumerate(vectors):
            total += plan.encode(v, 1000 + trial, np.random.default_rng([trial, i]))  # wraps mod 2^32 as uint32
        errors.append(plan.decode(total, 1000 + trial, len(vectors)) - exact)
    return float(np.std(np.concatenate(errors)))


def cell(clients: int, epsilon: float, *, classes: int = 10, latent: int = 32, examples: int = 1000,
         clip: float = 1.0, rounds: int = 50, delta: float = 1e-5, trials: int = 10) -> dict[str, float]:
    """One row: the noise standard deviations (float units of the released vector) both ways."""
    dim = classes * (latent + 1)
    honest = clients // 2 + 1
    sensitivity = math.sqrt(2) * clip
    local = local_multiplier(epsilon, delta, rounds) * sensitivity
    start = time.perf_counter()
    plan = choose(epsilon=epsilon, delta=delta, rounds=rounds, dim=dim, clip=math.sqrt(2) * examples * clip,
                  clients=clients, honest=honest, ring_bits=32, sensitivity=sensitivity)
    solve_s = time.perf_counter() - start
    rng = np.random.default_rng(clients)
    vectors = [class_sums(rng, classes, latent, examples, clip) for _ in range(clients)]
    return {"clients": clients, "honest": honest, "epsilon": epsilon, "plan_epsilon": plan.epsilon(rounds, delta),
            "local_gaussian_std": local, "share_std": plan.local_std(), "counted_std": plan.central_std(),
            "sum_std_today": math.sqrt(clients) * local, "sum_std_ddp": math.sqrt(clients) * plan.local_std(),
            "measured_sum_std": measured_std(plan, vectors, trials), "scale": plan.scale,
            "rounding_inflation": plan.sensitivity_bounds()[0] / (plan.scale * sensitivity) - 1,
            "wrap_bound": plan.wrap_bound(), "solve_s": solve_s}


def wrap(bound: float) -> str:
    """The wrap bound as the table shows it (below float64's range: "< 1e-300")."""
    return "< 1e-300" if bound < 1e-300 else f"{bound:.1e}"


def table(rows: list[dict[str, float]]) -> str:
    head = ("| n | t | ε | per organization, today | per organization, DDP | ratio | the sum, today | the sum, DDP "
            "(measured) | counted by the accountant | wrap bound |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['clients']} | {r['honest']} | {r['epsilon']:g} | {r['local_gaussian_std']:.2f} | "
                     f"{r['share_std']:.2f} | {r['share_std'] / r['local_gaussian_std']:.2f} | "
                     f"{r['sum_std_today']:.2f} | {r['sum_std_ddp']:.2f} ({r['measured_sum_std']:.2f}) | "
                     f"{r['counted_std']:.2f} | {wrap(r['wrap_bound'])} |")
    return "\n".join(lines)


def whole_vector_rows(clients: list[int], epsilons: list[float], rounds: int, dims: list[int]) -> list[dict]:
    """Per (d, n, ε): the central noise per coordinate (units of c) for one organization's vector as the unit,
    and its ratio to a clipped vector's root-mean-square coordinate."""
    rows = []
    for d in dims:
        for n in clients:
            for e in epsilons:
                plan = choose(epsilon=e, delta=1e-5, rounds=rounds, dim=d, clip=1.0, clients=n, honest=n // 2 + 1,
                              ring_bits=32)
                rows.append({"dim": d, "n": n, "epsilon": e, "central_std": plan.central_std(),
                             "ratio": plan.central_std() * math.sqrt(d)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")
    ap.add_argument("--whole-vector", action="store_true",
                    help="FedAvg's weights instead: one organization's vector the unit, d = 7,850 and 101,770")
    args = ap.parse_args()
    if args.whole_vector:
        rows = whole_vector_rows(args.clients, args.epsilons, args.rounds, [7850, 101770])
        print("| d | n | t | ε | noise per coordinate of the sum (units of c) | over a clipped vector's rms coordinate |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['dim']:,} | {r['n']} | {r['n'] // 2 + 1} | {r['epsilon']:g} | {r['central_std']:.3f} | "
                  f"{r['ratio']:,.0f} |")
        if args.json:
            print(json.dumps(rows, indent=1))
        return
    rows = [cell(n, e, rounds=args.rounds, trials=args.trials) for n in args.clients for e in args.epsilons]
    print(table(rows))
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
