"""IN-PROCESS PROTOTYPE, not hetfed's runtime: FedSR vs FedAvg leave-one-domain-out on Rotated MNIST.

This script simulates the federation inside one process (no aggregator, no gRPC, no wire) to choose
FedSR's hyperparameters and a round count before the algorithm was wired into hetfed.
Its numbers are a preview; the reproduction of record runs real processes.

Protocol (FedSR §4.2 and the reference code atuannguyen/FedSR, read for understanding only): each source
rotation of ``fedsr_rotated.build_fedsr_rotated`` is a client; a round is E local SGD steps per client
on batches of 64 drawn afresh each step, then a uniform average of the whole model (encoder, classifier,
batch-norm buffers) over the sources; each client keeps its optimiser (momentum) state across rounds, as
the reference code does. FedAvg and FedL2R use the deterministic network, FedCMI and FedSR the
probabilistic one (§3.3.2). r_μ, r_σ (and the reference code's scalar C) stay local unless ``shared_r``,
in which case they are averaged with the model. The final global model is evaluated on each source's
validation split (selection) and on the held-out target (reported), predicting with 20 z samples.

    nice -n 10 python benchmarks/prototypes/fedsr_tuning.py pilot
    nice -n 10 python benchmarks/prototypes/fedsr_tuning.py tune
    nice -n 10 python benchmarks/prototypes/fedsr_tuning.py preview --variant <chosen>
    python benchmarks/prototypes/fedsr_tuning.py report
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fedsr_rotated import RotatedSplit, build_fedsr_rotated

from hetfed.client.algorithms.fedsr.losses import (
    CMITerm,
    L2RTerm,
    ProbabilisticSplitModel,
    build_probabilistic_model,
    predict_proba,
)
from hetfed.client.models import SplitModel, rmnist_cnn

RMNIST_LATENT_DIM = 64

RESULTS = Path(__file__).resolve().parent / "results"
TUNING_SEEDS = (100, 101, 102)
PREVIEW_SEEDS = (0, 1, 2)
TARGETS = (0, 75)
NUM_CLASSES = 10


@dataclass(frozen=True)
class Method:
    """One algorithm configuration: which network, which terms, which forms."""

    name: str
    probabilistic: bool
    alpha_l2r: float = 0.0
    alpha_cmi: float = 0.0
    l2r_squared: bool = True  # False: the reference code's unsquared norm
    cmi_scale: bool = False  # True: the reference code's learnable scalar C in the CMI term
    shared_r: bool = False  # True: average r_μ, r_σ (and C) with the model


@dataclass(frozen=True)
class Schedule:
    """Optimisation settings shared by every method (the paper's §4.2 and the reference code's SGD)."""

    rounds: int = 100
    local_steps: int = 5
    batch: int = 64
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 5e-4
    num_samples: int = 20
    eval_every: int = 25


FEDAVG = Method("FedAvg", probabilistic=False)

# FedSR variants compared on source validation: the paper's tuned values (supp. C.1) in the paper's forms,
# the reference code's defaults in its forms, the paper's values in the code's forms; r local or shared.
VARIANTS: dict[str, Method] = {
    "paper-local": Method("FedSR", True, 0.1, 0.3),
    "paper-shared": Method("FedSR", True, 0.1, 0.3, shared_r=True),
    "refcode-local": Method("FedSR", True, 0.01, 5e-4, l2r_squared=False, cmi_scale=True),
    "refcode-shared": Method("FedSR", True, 0.01, 5e-4, l2r_squared=False, cmi_scale=True, shared_r=True),
    "paper-in-codeform-local": Method("FedSR", True, 0.1, 0.3, l2r_squared=False, cmi_scale=True),
}


def methods_for(variant: Method) -> list[Method]:
    """FedAvg and the three FedSR family members with one variant's coefficients, forms and r sharing."""
    return [
        FEDAVG,
        replace(variant, name="FedL2R", probabilistic=False, alpha_cmi=0.0, cmi_scale=False, shared_r=False),
        replace(variant, name="FedCMI", alpha_l2r=0.0),
        variant,
    ]


def _subseed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


class Client:
    """One source organization: its data, its copy of the model, its CMI reference and its optimiser."""

    def __init__(self, index: int, x: np.ndarray, y: np.ndarray, model: nn.Module, method: Method,
                 schedule: Schedule, seed: int) -> None:
        self.x = torch.from_numpy(x).contiguous(memory_format=torch.channels_last)
        self.y = torch.from_numpy(y)
        self.model = model
        self.method = method
        self.schedule = schedule
        self.l2r = L2RTerm(method.alpha_l2r, squared=method.l2r_squared) if method.alpha_l2r > 0 else None
        self.cmi = (CMITerm(method.alpha_cmi, NUM_CLASSES, RMNIST_LATENT_DIM, learnable_scale=method.cmi_scale)
                    if method.alpha_cmi > 0 else None)
        params = list(model.parameters()) + (list(self.cmi.parameters()) if self.cmi is not None else [])
        self.optim = torch.optim.SGD(params, lr=schedule.lr, momentum=schedule.momentum,
                                     weight_decay=schedule.weight_decay)
        self.gen = torch.Generator().manual_seed(_subseed(seed, 41, index))

    def shared_state(self) -> dict[str, torch.Tensor]:
        """What this client contributes to the average: the model, plus r when it is shared."""
        state = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        if self.cmi is not None and self.method.shared_r:
            state.update({f"cmi.{k}": v for k, v in self.cmi.state_dict().items()})
        return state

    def load_shared(self, state: dict[str, torch.Tensor]) -> None:
        """Take the averaged state."""
        self.model.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("model.")})
        if self.cmi is not None and self.method.shared_r:
            self.cmi.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("cmi.")})

    def train_round(self) -> float:
        """E local steps on fresh batches; returns the mean objective."""
        self.model.train()
        total = 0.0
        for _ in range(self.schedule.local_steps):
            idx = torch.randperm(self.y.numel(), generator=self.gen)[: self.schedule.batch]
            x, y = self.x[idx], self.y[idx]
            if isinstance(self.model, ProbabilisticSplitModel):
                logits, z, mu, sigma = self.model.forward_sample(x, self.gen)
            else:
                assert isinstance(self.model, SplitModel)
                z = self.model.embed(x)
                logits = self.model.head(z)
            loss = F.cross_entropy(logits, y)
            if self.l2r is not None:
                loss = loss + self.l2r(z)
            if self.cmi is not None:  # only probabilistic methods have a CMI term
                loss = loss + self.cmi(mu, sigma, y)
            self.optim.zero_grad(set_to_none=True)
            loss.backward()
            self.optim.step()
            total += float(loss.detach())
        return total / self.schedule.local_steps


def average(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Uniform mean of every floating entry; integer buffers (num_batches_tracked) from the first client."""
    out: dict[str, torch.Tensor] = {}
    for key, first in states[0].items():
        if first.is_floating_point():
            out[key] = torch.stack([s[key] for s in states]).mean(dim=0)
        else:
            out[key] = first.clone()
    return out


@torch.no_grad()
def probabilities(model: nn.Module, x: np.ndarray, num_samples: int, seed: int) -> torch.Tensor:
    """Class probabilities of the global model in eval mode (20-sample average when probabilistic)."""
    model.eval()
    xt = torch.from_numpy(x).contiguous(memory_format=torch.channels_last)
    if isinstance(model, ProbabilisticSplitModel):
        return predict_proba(model, xt, num_samples=num_samples, generator=torch.Generator().manual_seed(seed))
    return F.softmax(model(xt), dim=1)


def evaluate(model: nn.Module, data: RotatedSplit, schedule: Schedule, seed: int) -> dict[str, Any]:
    """Source validation accuracy and NLL (each source, and their mean) and target accuracy."""
    accs, nlls = [], []
    for i, d in enumerate(data.val):
        p = probabilities(model, d.x, schedule.num_samples, _subseed(seed, 51, i))
        y = torch.from_numpy(d.y)
        accs.append(float((p.argmax(1) == y).float().mean()))
        nlls.append(float(-torch.log(p[torch.arange(y.numel()), y].clamp_min(1e-12)).mean()))
    p = probabilities(model, data.target.x, schedule.num_samples, _subseed(seed, 52))
    target = float((p.argmax(1) == torch.from_numpy(data.target.y)).float().mean())
    return {"val_acc": float(np.mean(accs)), "val_nll": float(np.mean(nlls)), "val_accs": accs,
            "target_acc": target}


def build_model(method: Method, seed: int) -> nn.Module:
    """The deterministic or probabilistic Rotated MNIST network, initial weights from ``seed``."""
    if method.probabilistic:
        model: nn.Module = build_probabilistic_model(rmnist_cnn, (1, 28, 28), RMNIST_LATENT_DIM, NUM_CLASSES,
                                                     seed=seed)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = SplitModel(rmnist_cnn((1, 28, 28), RMNIST_LATENT_DIM, False), RMNIST_LATENT_DIM, NUM_CLASSES)
    return model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stub lacks it


def run_federation(method: Method, schedule: Schedule, target: int, seed: int) -> dict[str, Any]:
    """One leave-one-domain-out federation; the final global model's metrics, a curve and the timings."""
    data = build_fedsr_rotated(seed, target)
    init = build_model(method, seed)
    clients = []
    for i, d in enumerate(data.train):
        model = build_model(method, seed)
        model.load_state_dict(init.state_dict())
        clients.append(Client(i, d.x, d.y, model, method, schedule, seed))
    wall0, cpu0 = time.perf_counter(), time.process_time()
    train_cpu = 0.0
    curve = []
    for r in range(1, schedule.rounds + 1):
        t0 = time.process_time()
        losses = [c.train_round() for c in clients]
        state = average([c.shared_state() for c in clients])
        for c in clients:
            c.load_shared(state)
        init.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("model.")})
        train_cpu += time.process_time() - t0
        if not all(math.isfinite(v) for v in losses):
            raise FloatingPointError(f"{method.name} diverged at round {r}: losses {losses}")
        if r % schedule.eval_every == 0 or r == schedule.rounds:
            m = evaluate(init, data, schedule, seed)
            curve.append({"round": r, "train_loss": float(np.mean(losses)), **{k: m[k] for k in
                                                                              ("val_acc", "val_nll", "target_acc")}})
    final = evaluate(init, data, schedule, seed)
    return {"method": asdict(method), "schedule": asdict(schedule), "target": target, "seed": seed, **final,
            "curve": curve, "wall_s": time.perf_counter() - wall0, "cpu_s": time.process_time() - cpu0,
            "train_cpu_per_round_s": train_cpu / schedule.rounds}


def _append(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _done(out: Path, schedule: Schedule) -> set[tuple[str, int, int]]:
    key = json.dumps(asdict(schedule), sort_keys=True)
    return {(r["label"], r["target"], r["seed"]) for r in _load(out)
            if json.dumps(r["schedule"], sort_keys=True) == key}


def _run_all(jobs: list[tuple[str, Method]], schedule: Schedule, targets: tuple[int, ...],
             seeds: tuple[int, ...], out: Path) -> None:
    for label, method in jobs:
        for target in targets:
            for seed in seeds:
                if (label, target, seed) in _done(out, schedule):  # re-read: other processes may share `out`
                    continue
                rec = {"label": label, **run_federation(method, schedule, target, seed)}
                _append(out, rec)
                print(f"{label:28s} M{target:<2d} seed {seed:3d}: val {rec['val_acc']:.4f} nll {rec['val_nll']:.4f}"
                      f" target {rec['target_acc']:.4f}  ({rec['cpu_s']:.0f} s cpu, "
                      f"{rec['train_cpu_per_round_s']:.2f} s/round)", flush=True)


def _load(path: Path) -> list[dict[str, Any]]:
    """The records of a results file, the first of any repeated (label, target, seed, schedule) kept."""
    seen, out = set(), []
    for line in path.read_text().splitlines() if path.exists() else []:
        rec = json.loads(line)
        key = (rec["label"], rec["target"], rec["seed"], json.dumps(rec["schedule"], sort_keys=True))
        if key not in seen:
            seen.add(key)
            out.append(rec)
    return out


def _ms(values: list[float]) -> str:
    a = 100 * np.asarray(values)
    return f"{a.mean():5.1f} ± {a.std(ddof=1) if a.size > 1 else 0.0:3.1f}"


def report() -> None:
    """Print the tuning table (source validation only) and the preview table beside the paper's."""
    tune = _load(RESULTS / "fedsr_tune.jsonl")
    if tune:
        print("Tuning (seeds 100-102, targets M0 and M75; selection on source validation only)")
        print(f"{'label':28s} {'val acc':>14s} {'val nll':>8s} {'n':>3s}   (target acc, not used: M0 / M75)")
        for label in dict.fromkeys(r["label"] for r in tune):
            rs = [r for r in tune if r["label"] == label]
            t0 = [r["target_acc"] for r in rs if r["target"] == 0]
            t75 = [r["target_acc"] for r in rs if r["target"] == 75]
            print(f"{label:28s} {_ms([r['val_acc'] for r in rs]):>14s} {np.mean([r['val_nll'] for r in rs]):8.4f} "
                  f"{len(rs):3d}   ({_ms(t0) if t0 else '-'} / {_ms(t75) if t75 else '-'})")
    prev = _load(RESULTS / "fedsr_preview.jsonl")
    if prev:
        paper = {"FedAvg": (85.9, 86.2), "FedL2R": (90.5, 90.7), "FedCMI": (93.5, 93.0), "FedSR": (93.6, 93.5)}
        print("\nPreview (seeds 0-2): target accuracy, mean ± std over seeds; the paper's Table 1 beside")
        print(f"{'label':24s} {'M0':>12s} {'paper':>6s} {'M75':>12s} {'paper':>6s} {'avg':>6s} {'val acc':>14s}")
        avgs = {}
        for label in dict.fromkeys(r["label"] for r in prev):
            rs = [r for r in prev if r["label"] == label]
            name = rs[0]["method"]["name"]
            t0 = [r["target_acc"] for r in rs if r["target"] == 0]
            t75 = [r["target_acc"] for r in rs if r["target"] == 75]
            if not t0 or not t75:
                print(f"{label:24s} incomplete: {len(t0)} runs on M0, {len(t75)} on M75")
                continue
            avgs[name] = 50 * (np.mean(t0) + np.mean(t75))
            print(f"{label:24s} {_ms(t0):>12s} {paper[name][0]:6.1f} {_ms(t75):>12s} {paper[name][1]:6.1f} "
                  f"{avgs[name]:6.1f} {_ms([r['val_acc'] for r in rs]):>14s}")
        if "FedSR" in avgs and "FedAvg" in avgs:
            gap = avgs["FedSR"] - avgs["FedAvg"]
            print(f"FedSR - FedAvg averaged over M0 and M75: {gap:+.1f} points (claim: >= +2.0): "
                  f"{'REPRODUCED' if gap >= 2.0 else 'NOT REPRODUCED'}")


def main(argv: list[str] | None = None) -> None:
    """Run the pilot, the tuning grid or the preview, or print the report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=["pilot", "tune", "preview", "report"])
    p.add_argument("--rounds", type=int, default=Schedule.rounds)
    p.add_argument("--lr", type=float, default=Schedule.lr)
    p.add_argument("--variant", choices=sorted(VARIANTS), default="paper-local")
    p.add_argument("--labels", nargs="*", help="only these tuning labels / pilot methods")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reverse", action="store_true", help="targets and seeds in reverse order (a second worker)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    schedule = Schedule(rounds=args.rounds, lr=args.lr)
    if args.phase == "report":
        report()
    elif args.phase == "pilot":
        jobs = [("FedAvg", FEDAVG), *((f"FedSR-{k}", v) for k, v in VARIANTS.items())]
        jobs = [j for j in jobs if not args.labels or j[0] in args.labels]
        _run_all(jobs, replace(schedule, eval_every=10), (0,), (TUNING_SEEDS[0],), RESULTS / "fedsr_pilot.jsonl")
    elif args.phase == "tune":
        jobs = [(f"FedSR-{k}", v) for k, v in VARIANTS.items()]
        jobs = [j for j in jobs if not args.labels or j[0] in args.labels]
        _run_all(jobs, schedule, TARGETS, TUNING_SEEDS, RESULTS / "fedsr_tune.jsonl")
    else:
        jobs = [(m.name if m == FEDAVG else f"{m.name}[{args.variant}]", m) for m in methods_for(VARIANTS[args.variant])]
        jobs = [j for j in jobs if not args.labels or j[0] in args.labels]
        targets, seeds = (TARGETS[::-1], PREVIEW_SEEDS[::-1]) if args.reverse else (TARGETS, PREVIEW_SEEDS)
        _run_all(jobs, schedule, targets, seeds, RESULTS / "fedsr_preview.jsonl")


if __name__ == "__main__":
    main()
