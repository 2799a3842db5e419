"""``hetfed bench fedcma``: Fed-CMA against Local and head-only FedAvg, reproducing the paper's Table 2 setting.

MNIST-5k, 20 organizations, Dirichlet α ∈ {0.05, 0.1} over classes, half CNN (FedGen's MNIST CNN) and
half MLP encoders, d_e = 32, at least three seeds. Every federation is a real aggregator and 20 real client
processes on loopback, one federation at a time. Each organization is tested on its own test set that
follows its own labels (FedGen's split: an equal share of the held-out images of every label it holds).

Reported per method: pooled accuracy (all organizations' test images together) and the mean per-client
accuracy of the final evaluate round; for Fed-CMA both its own model (u_i, v_i) and its encoder with the
global head v̄; the latent client-discriminator accuracy; bytes per training round. The discriminator is
trained here, by the benchmark: every client wrote the latents z of the shared held-out set with its final
model to its own output directory (nothing extra crosses the wire), and a linear classifier learns to
tell the organization from z on half of those images and is scored on the other half (chance: 1/20).
A short FedAvg run of the full homogeneous CNN measures the bytes per round Fed-CMA is compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hetfed.cli.localrun import LocalRunOptions, federate
from hetfed.client.diagnostics import discriminator_accuracy

METHODS = ("local", "fedavg_head", "fedcma")
LABELS = {"local": "Local", "fedavg_head": "head-only FedAvg", "fedcma": "Fed-CMA"}
MODELS = ("fedgen_cnn", "mlp")
LATENT_DIM = 32
# Paper, Table 2 (MNIST, 20 clients): Local / FedAvg (head only) / FedGen / Fed-CMA.
PAPER = {0.02: (76.28, 76.14, 75.95, 79.22), 0.03: (59.89, 59.82, 60.08, 64.03),
         0.05: (61.36, 61.26, 60.82, 62.57), 0.1: (62.27, 62.26, 62.84, 63.94)}
# The same local-training budget for every method: rounds x local SGD steps of one batch size. The learning
# rate of each method is the better of {0.05, 0.2} on tuning seeds 100-102 at α = 0.05 (never the reported
# seeds): Fed-CMA's sigmoid-bounded latents want the larger step, the baselines' unbounded encoders the smaller.
# Fed-CMA adds only its own λ1, λ2 and server step η, at the paper's / reference code's defaults.
TRAIN = {"local_steps": 5, "batch_size": 32, "momentum": 0.9}
LR = {"local": 0.05, "fedavg_head": 0.05, "fedcma": 0.2}
FEDCMA = {"lambda1": 0.5, "lambda2": 0.5, "server_lr": 0.9, "class_batch_size": 16, "alignment": "paper"}


def _opts(method: str, alpha: float, seed: int, rounds: int, clients: int) -> LocalRunOptions:
    config = {**TRAIN, "lr": LR[method], **(FEDCMA if method == "fedcma" else {})}
    return LocalRunOptions(
        algorithms=(method,), clients=clients, rounds=rounds, dataset="mnist5k", partition="dirichlet",
        alpha=alpha, seed=seed, models=MODELS, latent_dim=LATENT_DIM, test_split="fedgen", artifacts=True,
        lr=LR[method], momentum=float(TRAIN["momentum"]), batch_size=int(TRAIN["batch_size"]), quiet=True, timeout=3600,
        extra_algorithm_config={method: config},
    )


def _latents(workdir: Path, run_id: str, clients: int) -> list[np.ndarray]:
    from hetfed.client.artifacts import read_snapshot

    return [read_snapshot(workdir / "artifacts" / run_id / f"org-{i}" / "final.npz")[1] for i in range(clients)]


def _steady_bytes(summary: dict[str, Any]) -> float:
    """Mean bytes (up + down) per training round after the first (the first has no global state to send)."""
    rounds = [r for r in summary["rounds"] if 2 <= r["round"] < summary["rounds"][-1]["round"]]
    return statistics.fmean(sum(r["bytes_up"].values()) + sum(r["bytes_down"].values()) for r in rounds)


def run_one(method: str, alpha: float, seed: int, rounds: int, clients: int, root: Path) -> dict[str, Any]:
    """One federation: final accuracies, discriminator accuracy, bytes per round, wall time."""
    workdir = root / f"{method}-a{alpha:g}-s{seed}"
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    (summary,) = federate(_opts(method, alpha, seed, rounds, clients), workdir)
    wall = time.monotonic() - t0
    final = summary["rounds"][-1]["per_organization"]
    per_client = statistics.fmean(m["test_accuracy"] for m in final.values())
    row = {
        "method": method, "alpha": alpha, "seed": seed, "wall_seconds": wall,
        "pooled": summary["final_test_accuracy"], "per_client": per_client,
        "discriminator": discriminator_accuracy(_latents(workdir, summary["run"], clients), seed),
        "bytes_per_round": _steady_bytes(summary),
    }
    if method == "fedcma":
        # The same organizations' encoders with the global head v̄ (pooled over their own test images).
        row["pooled_global_head"] = _pooled_extra(workdir, summary, "global_head_test_accuracy")
        row["per_client_global_head"] = statistics.fmean(m["global_head_test_accuracy"] for m in final.values())
    print(f"  {LABELS[method]:<17} alpha={alpha:<5g} seed={seed}  pooled {100 * row['pooled']:5.1f}  "
          f"per-client {100 * per_client:5.1f}  discriminator {100 * row['discriminator']:5.1f}  "
          f"{row['bytes_per_round'] / 1e3:7.1f} KB/round  {wall:4.0f}s", flush=True)
    return row


def _pooled_extra(workdir: Path, summary: dict[str, Any], key: str) -> float:
    """Pool a per-organization accuracy figure over the organizations' own test images."""
    from hetfed.client.data import DataConfig, load_client_data

    final = summary["rounds"][-1]["per_organization"]
    total = correct = 0.0
    for org, m in final.items():
        cfg = json.loads((workdir / f"client-{summary['run']}-{org}.json").read_text())
        n = len(load_client_data(DataConfig(**cfg["data"])).test)
        total += n
        correct += m[key] * n
    return correct / total


def fedavg_bytes(root: Path, clients: int, model: str) -> float:
    """Bytes per training round of FedAvg of the whole homogeneous model (two rounds, one step each)."""
    workdir = root / f"fedavg-{model}"
    workdir.mkdir(parents=True, exist_ok=True)
    opts = LocalRunOptions(algorithms=("fedavg",), clients=clients, rounds=3, dataset="mnist5k", alpha=0.05,
                           model=model, latent_dim=LATENT_DIM, quiet=True, timeout=3600,
                           extra_algorithm_config={"fedavg": {"local_steps": 1}})
    (summary,) = federate(opts, workdir)
    return _steady_bytes(summary)


# ------------------------------------------------------------------------------------------------ report
def _ms(values: list[float], scale: float = 100.0) -> str:
    m = statistics.fmean(values) * scale
    s = statistics.stdev(values) * scale if len(values) > 1 else 0.0
    return f"{m:.2f} ± {s:.2f}"


def report(rows: list[dict[str, Any]], fedavg: dict[str, float], args: argparse.Namespace, wall: float) -> str:
    """The markdown results page."""
    lines = [
        "# Fed-CMA: reproduction on MNIST-5k",
        "",
        f"Command: `{' '.join(['hetfed', 'bench', 'fedcma', *args.argv])}`  ",
        f"Measured: {time.strftime('%Y-%m-%d')}, {args.clients} organizations, {args.rounds} rounds, seeds "
        f"{', '.join(str(s) for s in args.seeds)}; encoders alternate {' / '.join(MODELS)}, d_e = {LATENT_DIM}; "
        f"every method {TRAIN['local_steps']} local SGD steps per round (batch {TRAIN['batch_size']}, momentum "
        f"{TRAIN['momentum']}, lr {', '.join(f'{LABELS[m]} {v}' for m, v in LR.items())}); Fed-CMA λ1 = {FEDCMA['lambda1']}, λ2 = {FEDCMA['lambda2']}, "
        f"η = {FEDCMA['server_lr']}, b = {FEDCMA['class_batch_size']}, alignment \"{FEDCMA['alignment']}\".  ",
        f"Total wall time: {wall / 60:.1f} min on {os.cpu_count()} CPU cores for {len(rows)} federations plus "
        f"the FedAvg byte runs (each federation: one aggregator and 20 client processes on loopback gRPC)"
        f"{'; ' + args.note if getattr(args, 'note', '') else ''}.",
        "",
        "Accuracy is in percent, mean ± standard deviation over seeds, of the final evaluate round on each "
        "organization's own test set (FedGen's split: an equal share of the held-out images of every label "
        "the organization holds). *Pooled* counts every organization's test images together; *per-client* "
        "averages the organizations' accuracies. Local and Fed-CMA are evaluated with each organization's own "
        "model; head-only FedAvg with its encoder and the global head (FedGen's protocol); Fed-CMA is also "
        "shown with its encoder and the global head v̄. The discriminator column is the held-out accuracy of "
        "a linear classifier telling the 20 organizations apart from their latents of the same images "
        "(chance 5.0).",
        "",
    ]
    for alpha in args.alphas:
        paper = PAPER.get(alpha)
        lines += [f"## Dirichlet α = {alpha:g}", "",
                  "| method | pooled acc | per-client acc | discriminator acc | bytes / round | paper (Table 2) |",
                  "|---|---|---|---|---|---|"]
        for method in METHODS:
            sel = [r for r in rows if r["method"] == method and r["alpha"] == alpha]
            if not sel:
                continue
            p = {"local": 0, "fedavg_head": 1, "fedcma": 3}[method]
            lines.append(
                f"| {LABELS[method]} | {_ms([r['pooled'] for r in sel])} | {_ms([r['per_client'] for r in sel])} | "
                f"{_ms([r['discriminator'] for r in sel])} | {statistics.fmean(r['bytes_per_round'] for r in sel):,.0f} | "
                f"{paper[p] if paper else '-'} |")
            if method == "fedcma":
                lines.append(
                    f"| Fed-CMA, encoder + global head v̄ | {_ms([r['pooled_global_head'] for r in sel])} | "
                    f"{_ms([r['per_client_global_head'] for r in sel])} | (same encoders) | | |")
        lines.append("")
        lines += _claims(rows, alpha)
    cma = [r["bytes_per_round"] for r in rows if r["method"] == "fedcma"]
    if cma and fedavg:
        b = statistics.fmean(cma)
        lines += ["## Communication", "", "| what crosses the wire per round (20 organizations, up + down) | bytes | "
                  "FedAvg ÷ Fed-CMA |", "|---|---|---|",
                  f"| Fed-CMA: K × d_e class means + the head Linear(d_e, K), each way | {b:,.0f} | 1 |"]
        for model, v in fedavg.items():
            lines.append(f"| FedAvg of the whole homogeneous `{model}` (d_e = {LATENT_DIM}) | {v:,.0f} | {v / b:.0f}× |")
        lines.append("")
    lines += [READING, *_tuning()]
    lines += ["## Runtime", "", "| federation | wall seconds (mean over seeds) |", "|---|---|"]
    for alpha in args.alphas:
        for method in METHODS:
            walls = [float(r["wall_seconds"]) for r in rows if r["method"] == method and r["alpha"] == alpha]
            if walls:
                lines.append(f"| {LABELS[method]}, α = {alpha:g} | {statistics.fmean(walls):.0f} |")
    lines.append("")
    return "\n".join(lines)


def _claims(rows: list[dict[str, Any]], alpha: float) -> list[str]:
    def mean(method: str, key: str) -> float | None:
        sel = [r[key] for r in rows if r["method"] == method and r["alpha"] == alpha and key in r]
        return 100 * statistics.fmean(sel) if sel else None

    out = []
    base = [v for v in (mean("local", "pooled"), mean("fedavg_head", "pooled")) if v is not None]
    if base and mean("fedcma", "pooled") is not None:
        best = max(base)
        for key, what in (("pooled", "own model"), ("pooled_global_head", "encoder + v̄")):
            v = mean("fedcma", key)
            assert v is not None
            verdict = "holds" if v - best >= 1.5 else "does NOT hold"
            out.append(f"- Fed-CMA ({what}) − better baseline, pooled: {v - best:+.2f} points "
                       f"(claim ≥ +1.5: {verdict}); per seed, paired: {_paired(rows, alpha, key)}.")
    d_local, d_cma = mean("local", "discriminator"), mean("fedcma", "discriminator")
    if d_local is not None and d_cma is not None:
        out.append(f"- Discriminator accuracy: Fed-CMA {d_cma:.1f} vs Local {d_local:.1f} (chance 5.0).")
    return [*out, ""] if out else []


# How the learning rates were chosen: pooled own-test accuracy (%), mean of tuning seeds 100-102 at α = 0.05,
# 60 rounds x 5 steps, measured with the same client and server halves driven in one process (no gRPC) to save
# time. (method, encoder latents, lr, own model, encoder + v̄ or None)
TUNING: list[tuple[str, str, float, float, float | None]] = [
    ("Local", "unbounded (ReLU / linear)", 0.05, 66.96, None),
    ("Local", "unbounded (ReLU / linear)", 0.2, 58.94, None),
    ("head-only FedAvg", "unbounded (ReLU / linear)", 0.05, 66.29, None),
    ("head-only FedAvg", "unbounded (ReLU / linear)", 0.2, 27.64, None),
    ("Fed-CMA", "sigmoid-bounded", 0.05, 61.61, 67.61),
    ("Fed-CMA", "sigmoid-bounded", 0.2, 66.45, 71.93),
    ("Local (ablation)", "sigmoid-bounded, as Fed-CMA", 0.05, 62.16, None),
    ("Local (ablation)", "sigmoid-bounded, as Fed-CMA", 0.2, 68.44, None),
    ("head-only FedAvg (ablation)", "sigmoid-bounded, as Fed-CMA", 0.05, 61.31, None),
    ("head-only FedAvg (ablation)", "sigmoid-bounded, as Fed-CMA", 0.2, 67.30, None),
]

READING = """\
## Reading the numbers

- **Fed-CMA's own models (u_i, v_i) do not beat local training here.** Each organization's head v_i is
  pulled toward v̄ only by (λ1/2)·p_i·‖v_i − v̄‖², and p_i ≈ 1/20: over the local steps of a round the head
  drifts back to the organization's own label mix, which FedGen's test split (an equal share of every label
  held) punishes. The paper reports +1.2 points at α = 0.05 for Fed-CMA over Local (Table 2); we measure
  about −1 to −2 for the own models.
- **The aligned encoders with the global head v̄ do beat both baselines**, by about 3 points pooled and on
  every seed (paired differences above). Head-only FedAvg is evaluated the same way (own encoder + global
  head) and gains nothing over Local: without alignment an averaged head does not fit the private
  encoders. With Fed-CMA's class-conditional alignment it does; this is the quantity the paper's
  generalisation bound (Theorem 2) is about, the error of the global classifier on each client's own
  representation. The ≥ 1.5-point claim holds in this evaluation, not for the organizations' own heads.
- **Alignment is real but partial.** A linear discriminator tells Local's 20 encoders apart almost
  perfectly; for Fed-CMA it drops to 80-90%, far from chance (5%): the class means agree, the rest of each
  latent distribution (and the CNN/MLP difference) remains visible.
- **Baselines.** The benchmark runs the baselines in their own form (unbounded latents) at their best
  tuning lr. On the tuning seeds the baselines did about 1.5 points better with Fed-CMA's sigmoid-bounded
  encoders at lr 0.2 (table below); against those, Fed-CMA with v̄ kept its margin on the tuning seeds
  (71.9 vs 68.4) and its own models stayed behind (66.5).
"""


def _tuning() -> list[str]:
    lines = ["## How the settings were chosen", "",
             "Same budget for every method (60 rounds × 5 local SGD steps, batch 32, momentum 0.9); each "
             "method's learning rate is the better of {0.05, 0.2} on tuning seeds 100-102 at α = 0.05, "
             "never on the reported seeds. Fed-CMA keeps the paper's / reference code's λ1 = λ2 = 0.5, "
             "η = 0.9; in shorter exploratory runs on the tuning seeds (20-30 rounds of 1 epoch or 20 steps) "
             "larger λ (2 to 20, η lowered to keep λη ≤ 1) and the reference-code form were no better and "
             "mostly worse. Pooled own-test accuracy (%), mean of the three tuning seeds "
             "(measured with the same client and server halves driven in one process, without gRPC):", "",
             "| method | encoder latents | lr | own model | encoder + v̄ |", "|---|---|---|---|---|"]
    for method, enc, lr, own, vbar in TUNING:
        lines.append(f"| {method} | {enc} | {lr} | {own:.2f} | {'-' if vbar is None else f'{vbar:.2f}'} |")
    return [*lines, ""]


def _paired(rows: list[dict[str, Any]], alpha: float, key: str) -> str:
    """Per-seed differences of Fed-CMA against each baseline on the same partition, mean ± std."""
    parts = []
    for base in ("local", "fedavg_head"):
        diffs = []
        for cma in (r for r in rows if r["method"] == "fedcma" and r["alpha"] == alpha and key in r):
            other = [r for r in rows if r["method"] == base and r["alpha"] == alpha and r["seed"] == cma["seed"]]
            if other:
                diffs.append(cma[key] - other[0]["pooled"])
        if diffs:
            parts.append(f"vs {LABELS[base]} {100 * statistics.fmean(diffs):+.2f} ± "
                         f"{100 * (statistics.stdev(diffs) if len(diffs) > 1 else 0.0):.2f} "
                         f"({', '.join(f'{100 * d:+.1f}' for d in diffs)})")
    return "; ".join(parts)


def main(argv: list[str]) -> int:
    """Entry point of ``hetfed bench fedcma``."""
    p = argparse.ArgumentParser(prog="hetfed bench fedcma", description=__doc__.split("\n\n")[0])
    p.add_argument("--alphas", default="0.05,0.1", help="Dirichlet concentrations (default 0.05,0.1)")
    p.add_argument("--seeds", default="0,1,2", help="seeds (default 0,1,2)")
    p.add_argument("--rounds", type=int, default=60, help="training rounds (default 60)")
    p.add_argument("--clients", type=int, default=20, help="organizations (default 20)")
    p.add_argument("--methods", default=",".join(METHODS), help="subset of local,fedavg_head,fedcma")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "hetfed-bench-fedcma"),
                   help="where federations run and clients write their artifacts (default: a temp folder)")
    p.add_argument("--out", default="docs/results/fedcma.md", help="markdown results file")
    p.add_argument("--no-bytes", action="store_true", help="skip the FedAvg byte-count runs")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the results page from the measurements saved in --workdir, running nothing")
    args = p.parse_args(argv)
    args.argv = argv
    args.alphas = [float(a) for a in args.alphas.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    root = Path(args.workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        saved = json.loads((root / "measurements.json").read_text())
        args.argv, args.alphas, args.seeds = saved["argv"], saved["alphas"], saved["seeds"]
        args.note = saved.get("note", "")
        return _write(report(saved["rows"], saved["fedavg"], args, saved["wall_seconds"]), args.out)
    started, load0 = time.monotonic(), os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    print(f"hetfed bench fedcma: {len(args.alphas) * len(args.seeds) * len(methods)} federations of "
          f"{args.clients} organizations, {args.rounds} rounds each", flush=True)
    for alpha in args.alphas:
        for seed in args.seeds:
            for method in methods:
                rows.append(run_one(method, alpha, seed, args.rounds, args.clients, root))
                (root / "rows.json").write_text(json.dumps(rows, indent=1))
    fedavg = {} if args.no_bytes else {m: fedavg_bytes(root, args.clients, m) for m in ("fedgen_cnn", "cnn")}
    wall = time.monotonic() - started
    args.note = f"1-minute load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    (root / "measurements.json").write_text(json.dumps(
        {"argv": argv, "alphas": args.alphas, "seeds": args.seeds, "rows": rows, "fedavg": fedavg,
         "wall_seconds": wall, "note": args.note}, indent=1))
    print(f"hetfed bench fedcma: {wall / 60:.1f} min wall on {os.cpu_count()} CPUs")
    return _write(report(rows, fedavg, args, wall), args.out)


def _write(text: str, path: str) -> int:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"wrote {out}")
    return 0

