"""Clustered Federated Learning's server half (numpy only): one model per cluster of organizations, FedAvg of weight
updates within each cluster, and the split of a cluster whose FedAvg has stalled while its members still pull apart.

Setup: every organization sends its initial model θ_0 (the same one: each builds it from the run seed); the
server takes their mean, in sorted order, as the model of the one cluster everyone starts in.

Each training round r, organization i of cluster c sends Δθ_i = θ_i − θ_c (trained minus received), with its
example count |D_i|. At the close, for each cluster c in turn (float64, members in sorted order):

    G_ij = ⟨Δθ_i, Δθ_j⟩                        the Gram matrix of the members' updates
    w_i = |D_i| / Σ_{j∈c} |D_j|               (or 1/|c| under weighting "uniform")
    ‖Δθ_c‖ = sqrt(wᵀ G w),  max_i ‖Δθ_i‖ = sqrt(max_i G_ii)
    α_ij = G_ij / (‖Δθ_i‖·‖Δθ_j‖)            the cosine similarities (0 against a zero update)

When r ≥ split_from_round, every member of c pushed, |c| ≥ min_split_size, ‖Δθ_c‖ < ε1 and max_i ‖Δθ_i‖ > ε2,
c is bipartitioned into c1, c2 (``bipartition``) and split when γ_max < sqrt((1 − α_cross_max)/2), α_cross_max the
largest similarity across the parts. Then each resulting cluster g takes θ_g ← θ_c + Σ_{i∈g} w_i^g Δθ_i, w^g the
weights renormalised within g (the reference code aggregates the new clusters in the round of the split). c1 (the
part with the first organization in sorted order) keeps c's index; c2 becomes the last cluster.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np

from hetfed.aggregator.algorithms.aggregators import NORM_BLOCK
from hetfed.aggregator.algorithms.base import RunInfo, ServerHalf
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import ModelWeights, Payload, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import cfl
from hetfed.wire.specs.cfl import CFLConfig, Linkage

Arrays = Mapping[str, np.ndarray]
log = logging.getLogger(__name__)


def gram(updates: Sequence[Arrays]) -> np.ndarray:
    """G_ij = ⟨Δθ_i, Δθ_j⟩ over every tensor together, in float64, a block of elements at a time (no float64
    copy of a whole update): the inner products every quantity of the split criterion comes from."""
    m = len(updates)
    g = np.zeros((m, m), dtype=np.float64)
    names = sorted(updates[0]) if m else []
    for name in names:
        flats = [np.asarray(u[name]).reshape(-1) for u in updates]
        for lo in range(0, flats[0].size, NORM_BLOCK):
            block = [np.asarray(f[lo:lo + NORM_BLOCK], dtype=np.float64) for f in flats]
            for i in range(m):
                for j in range(i, m):
                    g[i, j] += float(np.dot(block[i], block[j]))
    return np.triu(g) + np.triu(g, 1).T


def cosine_similarities(g: np.ndarray) -> np.ndarray:
    """α_ij = G_ij / (‖Δθ_i‖·‖Δθ_j‖) from the Gram matrix; 0 where either update is zero."""
    norms = np.sqrt(np.maximum(np.diag(g), 0.0))
    denominator = np.outer(norms, norms)
    out = np.zeros_like(g)
    np.divide(g, denominator, out=out, where=denominator > 0)
    return out


def bipartition(alpha: np.ndarray, linkage: Linkage = "single") -> tuple[list[int], list[int]]:
    """Two parts of 0..M−1 (M ≥ 2) from the similarity matrix ``alpha``, the part holding 0 first, each sorted.

    "single": the paper's optimal bipartition: visit the pairs (i, j) in descending order of α_ij
    (ties in row-major order: a stable argsort of −α) and merge the clusters holding i and j until two are left.
    The parts minimise max_{i∈c1, j∈c2} α_ij over every bipartition. "complete": the reference code's
    agglomerative clustering with complete linkage on the distance −α: merge the two clusters whose least
    similar pair is the most similar (ties: the first pair of clusters in order) until two are left."""
    m = alpha.shape[0]
    if m < 2 or alpha.shape != (m, m):
        raise ValueError(f"need a square similarity matrix of at least 2 organizations, got {alpha.shape}")
    if linkage == "single":
        label = np.arange(m)
        count = m
        for s in np.argsort(-alpha.reshape(-1), kind="stable"):
            if count == 2:
                break
            a, b = label[s // m], label[s % m]
            if a != b:
                label[label == b] = a
                count -= 1
        parts = [sorted(np.flatnonzero(label == k).tolist()) for k in sorted(set(label.tolist()))]
    else:
        parts = [[i] for i in range(m)]
        while len(parts) > 2:
            best: tuple[float, int, int] | None = None
            for a in range(len(parts)):
                for b in range(a + 1, len(parts)):
                    link = float(alpha[np.ix_(parts[a], parts[b])].min())
                    if best is None or link > best[0]:
                        best = (link, a, b)
            assert best is not None
            _, a, b = best
            parts[a] = sorted(parts[a] + parts[b])
            del parts[b]
    first, second = sorted(parts, key=lambda p: p[0])
    return first, second


def cross_similarity(alpha: np.ndarray, c1: Sequence[int], c2: Sequence[int]) -> float:
    """α_cross_max = max_{i∈c1, j∈c2} α_ij."""
    return float(alpha[np.ix_(list(c1), list(c2))].max())


def split_allowed(config: CFLConfig, mean_norm: float, max_norm: float) -> bool:
    """The paper's criterion: ‖Δθ_c‖ < ε1 and max_i ‖Δθ_i‖ > ε2 (strict, both)."""
    return mean_norm < config.eps1 and max_norm > config.eps2


def separated(config: CFLConfig, alpha_cross: float) -> bool:
    """The paper's check of a bipartition: γ_max < sqrt((1 − α_cross_max) / 2)."""
    return config.gamma_max < math.sqrt(max(1.0 - alpha_cross, 0.0) / 2.0)


def add_mean_update(model: Arrays, updates: Sequence[Arrays], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """θ + Σ_i w_i Δθ_i / Σ_i w_i, summed in float64 in the order given, rounded once to float32."""
    total = float(sum(weights))
    out = {}
    for name, theta in model.items():
        acc = np.asarray(theta, dtype=np.float64).copy()
        step = np.zeros(acc.shape, dtype=np.float64)
        for u, w in zip(updates, weights, strict=True):
            step += (w / total) * np.asarray(u[name], dtype=np.float64)
        out[name] = (acc + step).astype(np.float32)
    return out


@cfl.SPEC.server_half
class CFLServer(ServerHalf[CFLConfig]):
    """CFL's server: the clusters, one model each, FedAvg of updates within a cluster and the split criterion."""

    broadcast: ClassVar[bool] = False  # each organization receives its own cluster's model
    keeps_updates: ClassVar[bool] = True  # the round's updates are all needed at the close (their Gram matrix)

    def __init__(self, config: CFLConfig, run: RunInfo) -> None:
        super().__init__(config, run)
        self.models: list[dict[str, np.ndarray]] = []
        self.cluster_of: dict[str, int] = dict.fromkeys(run.organizations, 0)
        self._round: dict[str, tuple[Arrays, int]] = {}

    def clusters(self) -> list[list[str]]:
        """The organizations of each cluster, sorted, by cluster index."""
        out: list[list[str]] = [[] for _ in range(max(len(self.models), 1))]
        for org in sorted(self.cluster_of):
            out[self.cluster_of[org]].append(org)
        return out

    def payloads_for(self, phase: Phase, round_: int, organization: str) -> list[Payload]:
        """The model of the organization's cluster (nothing in the setup phase)."""
        if phase is Phase.SETUP or not self.models:
            return []
        return [ModelWeights(dict(self.models[self.cluster_of.setdefault(organization, 0)]))]

    def validate(self, phase: Phase, organization: str, update: Received) -> None:
        """A positive example count with every update, and the cluster model's tensors (the contract has
        checked the shapes against the run's schema and every value for NaN and infinity)."""
        if phase is Phase.EVALUATE:
            return
        mw = update.get(ModelWeights)
        if phase is Phase.TRAIN and mw.num_examples <= 0:
            raise WireError("invalid_value", f"num_examples must be > 0, got {mw.num_examples}")
        if self.models and set(mw.tensors) != set(self.models[0]):
            raise WireError("invalid_value", "the update's tensors are not the cluster model's")

    def accumulate(self, phase: Phase, organization: str, update: Received) -> None:
        """Keep the organization's initial model (setup) or update (training) until the round closes."""
        if phase is Phase.EVALUATE:
            return
        mw = update.get(ModelWeights)
        self._round[organization] = (mw.tensors, mw.num_examples)

    def close_round(self, phase: Phase, round_: int) -> None:
        """Setup: θ_0, the mean of the initial models. Training: per cluster, the split criterion, then FedAvg of
        the updates within each resulting cluster."""
        try:
            if phase is Phase.SETUP and self._round:
                orgs = sorted(self._round)
                first = self._round[orgs[0]][0]
                self.models = [add_mean_update({k: np.zeros(np.shape(v), np.float32) for k, v in first.items()},
                                               [self._round[o][0] for o in orgs], [1.0] * len(orgs))]
                for org in orgs:
                    self.cluster_of.setdefault(org, 0)
            elif phase is Phase.TRAIN and self._round and self.models:
                self._close_training(round_)
        finally:
            self._round = {}

    def _weights(self, orgs: Sequence[str]) -> list[float]:
        if self.config.weighting == "uniform":
            return [1.0] * len(orgs)
        return [float(self._round[o][1]) for o in orgs]

    def _close_training(self, round_: int) -> None:
        cfg = self.config
        models = list(self.models)
        for index, members in enumerate(self.clusters()):
            pushed = [o for o in members if o in self._round]
            if not pushed:
                continue
            updates = [self._round[o][0] for o in pushed]
            weights = self._weights(pushed)
            groups = [pushed]
            if (round_ >= cfg.split_from_round and len(pushed) == len(members)
                    and len(members) >= cfg.min_split_size):
                g = gram(updates)
                w = np.asarray(weights) / sum(weights)
                mean_norm = math.sqrt(max(float(w @ g @ w), 0.0))
                max_norm = math.sqrt(max(float(np.diag(g).max()), 0.0))
                outcome = "no split"
                if split_allowed(cfg, mean_norm, max_norm):
                    alpha = cosine_similarities(g)
                    c1, c2 = bipartition(alpha, cfg.linkage)
                    cross = cross_similarity(alpha, c1, c2)
                    outcome = f"largest cross similarity {cross:.4g}, no split (gamma_max)"
                    if separated(cfg, cross):
                        groups = [[pushed[i] for i in c1], [pushed[i] for i in c2]]
                        outcome = f"largest cross similarity {cross:.4g}, split into {groups[0]} and {groups[1]}"
                # The figures the reference notebook plots, to set eps1 and eps2 by.
                log.info("cfl round %d, cluster %d %s: mean update norm %.4g (eps1 %g), largest update norm %.4g "
                         "(eps2 %g); %s", round_, index, members, mean_norm, cfg.eps1, max_norm, cfg.eps2, outcome)
            base = self.models[index]
            for k, group in enumerate(groups):
                model = add_mean_update(base, [self._round[o][0] for o in group], self._weights(group))
                if k == 0:
                    models[index] = model
                else:
                    for org in group:
                        self.cluster_of[org] = len(models)
                    models.append(model)
        self.models = models

    def state(self) -> dict[str, np.ndarray]:
        """Each organization's cluster (``cluster.<organization>``) and each cluster's model
        (``model.<index>.<tensor>``)."""
        out = {f"cluster.{org}": np.array(c, dtype=np.int64) for org, c in self.cluster_of.items()}
        for index, model in enumerate(self.models):
            out.update({f"model.{index}.{name}": a for name, a in model.items()})
        return out

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore from ``state()``."""
        if not arrays:
            return
        self.cluster_of = {key.partition(".")[2]: int(a) for key, a in arrays.items() if key.startswith("cluster.")}
        models: dict[int, dict[str, np.ndarray]] = {}
        for key, a in arrays.items():
            if key.startswith("model."):
                index, _, name = key[len("model."):].partition(".")
                models.setdefault(int(index), {})[name] = np.array(a, dtype=np.float32)
        self.models = [models[i] for i in range(len(models))]
        self._round = {}
