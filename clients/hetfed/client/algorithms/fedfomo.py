"""FedFomo's client half: weigh the received models on a validation split, move toward the helpful ones, train.

FedFomo (Zhang et al. 2021) as its authors' code runs it (github:NVlabs/FedFomo, federation.py and client.py).
An organization keeps φ, its model as it was before its last local training (``first_model``), and θ, that
model after the training. In round r it receives up to ``peers_per_round`` peers' models θ_n of round r − 1 and
weighs every model it holds, its own θ first (the reference code puts the client itself first in its list of
models, client.py:320), by the first-order weight on its validation split

    w_n = (L(φ) − L(θ_n)) / ‖θ_n − φ‖₁            (federation.py:152-184; the L1 norm, args.py:180)

then moves φ ← φ + Σ_n ŵ_n (θ_n − φ), ŵ_n = max(w_n, 0) / Σ_m max(w_m, 0) (federation.py:420-458, 523-547);
with no positive w_n it keeps φ and drops θ (federation.py:446-458). That model is the new φ; it trains locally
and sends the trained model and every w_n (PeerWeights: itself, then the peers in the order received), which the
aggregator adds to its row of the affinity matrix. Round 1 has nothing to weigh: it trains and sends its model.
The final evaluate round weighs and moves once more, then evaluates (main.py:373-383).
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Sequence

import numpy as np
import torch

from hetfed.client.algorithms.base import ClientContext, ClientHalf
from hetfed.client.algorithms.fedavg import check_received, load_shared_state, model_weights, shared_state
from hetfed.client.training import Objective, cross_entropy, epoch_batches, evaluate, fit, trainable
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import EvalMetrics, ModelWeights, Payload, PayloadKind, PeerWeights, Received
from hetfed.wire.specs import fedfomo
from hetfed.wire.specs.fedfomo import FedFomoConfig

Arrays = dict[str, np.ndarray]


def fomo_weights(base_loss: float, losses: Sequence[float], distances: Sequence[float]) -> np.ndarray:
    """w_n = (L(φ) − L(θ_n)) / ‖θ_n − φ‖₁ in float64; a model at distance 0 from φ (nothing to step along)
    gets 0 (hetfed's own choice: the reference code divides by zero there)."""
    gain = float(base_loss) - np.asarray(losses, dtype=np.float64)
    dist = np.asarray(distances, dtype=np.float64)
    return np.divide(gain, dist, out=np.zeros_like(gain), where=dist > 0)


def update_weights(w: np.ndarray) -> np.ndarray | None:
    """ŵ_n = max(w_n, 0) / Σ_m max(w_m, 0); None when no w_n is positive (φ stays)."""
    positive = np.maximum(np.asarray(w, dtype=np.float64), 0.0)
    total = float(positive.sum())
    if total <= 0.0:
        return None
    return positive / total


def first_order_update(start: Arrays, models: Sequence[Arrays], weights: np.ndarray) -> Arrays:
    """φ + Σ_n ŵ_n (θ_n − φ) for every tensor of φ, in float64, the models taken in order."""
    out: Arrays = {}
    for name, phi in start.items():
        base = np.asarray(phi, dtype=np.float64)
        total = base.copy()
        for model, wn in zip(models, weights, strict=True):
            total += float(wn) * (np.asarray(model[name], dtype=np.float64) - base)
        out[name] = total
    return out


def l1_distance(a: Arrays, b: Arrays, names: Sequence[str]) -> float:
    """‖a − b‖₁ over the tensors ``names`` (the model's parameters), in float64."""
    return float(sum(np.abs(np.asarray(a[k], dtype=np.float64) - np.asarray(b[k], dtype=np.float64)).sum()
                     for k in names))


@fedfomo.SPEC.client_half
class FedFomoClient(ClientHalf[FedFomoConfig]):
    """FedFomo organization: a personalised model moved toward the peers' models that help on its own data."""

    # Under DP nothing here bounds what the validation losses (computed on private data, outside DP-SGD) reveal
    # through the weights sent up: this half does not serve [privacy].
    privacy_mechanism = None
    private_attributes = ("start",)

    def __init__(self, ctx: ClientContext[FedFomoConfig]) -> None:
        super().__init__(ctx)
        self.cfg = ctx.config
        data = ctx.data.train
        n = len(data)
        n_val = n - int(np.round((1.0 - self.cfg.val_fraction) * n))
        if n_val < 1 or n_val >= n:
            raise ValueError(f"fedfomo splits the training data into training and validation examples "
                             f"(val_fraction {self.cfg.val_fraction}); {n} examples leave {n_val} for validation")
        order = np.random.default_rng([ctx.seed, zlib.crc32(ctx.organization.encode())]).permutation(n)
        ctx.train = ctx.source(data.subset(np.sort(order[n_val:])))
        self.val = ctx.source(data.subset(np.sort(order[:n_val])))
        self.scratch = ctx.build_model() if ctx.build_model is not None else copy.deepcopy(ctx.model)
        self.params = [name for name, _ in ctx.model.named_parameters() if name in shared_state(ctx.model)]
        # φ: the model before the last local training (empty before the first).
        self.start: dict[str, torch.Tensor] = {}

    def declarations(self, wire_dtype: str | None) -> list[DeclaredTensor]:
        """The model's shared state, as the run's schema fixes it at Join (every organization's is relayed)."""
        return [DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, k, v.cpu().numpy(), wire_dtype)
                for k, v in shared_state(self.ctx.model).items()]

    def _snapshot(self) -> Arrays:
        return {k: v.detach().cpu().numpy().copy() for k, v in shared_state(self.ctx.model).items()}

    def _val_loss(self, tensors: Arrays | None) -> float:
        """The mean cross-entropy on the validation split of the model itself (None) or of ``tensors``."""
        if tensors is None:
            return evaluate(self.ctx.model, self.val)[1]
        load_shared_state(self.scratch, ModelWeights(tensors))
        return evaluate(self.scratch, self.val)[1]

    def weigh(self, received: Received) -> tuple[PeerWeights | None, dict[str, float]]:
        """Weigh the own model and the received ones against φ and move the model (module docstring); the report
        for the aggregator, or None when there is nothing to weigh (round 1)."""
        peers = received.all(ModelWeights)
        names = received.maybe(PeerWeights)
        sources = names.organizations if names is not None else ()
        if len(sources) != len(peers):
            raise ValueError(f"the aggregator sent {len(peers)} models named by {len(sources)} organizations")
        for mw in peers:
            check_received(self.ctx.model, mw)
        own = self._snapshot()
        if not self.start:
            if not peers:
                return None, {}
            self.start = {k: torch.from_numpy(v) for k, v in own.items()}  # joined late: φ is what it holds
        start = {k: v.numpy() for k, v in self.start.items()}
        models: list[Arrays] = [own, *({k: np.asarray(v) for k, v in mw.tensors.items()} for mw in peers)]
        losses = [self._val_loss(None), *(self._val_loss(m) for m in models[1:])]
        w = fomo_weights(self._val_loss(start), losses, [l1_distance(m, start, self.params) for m in models])
        step = update_weights(w)
        new = start if step is None else first_order_update(start, models, step)
        load_shared_state(self.ctx.model, ModelWeights({k: np.asarray(v, dtype=np.float32) for k, v in new.items()}))
        report = PeerWeights((self.ctx.organization, *sources), w.astype(np.float32))
        return report, {"fomo_helpful_models": float(np.count_nonzero(w > 0)), "fomo_own_weight": float(w[0])}

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """Weigh and move, keep the result as φ, train locally, then send the model and the weights."""
        ctx = self.ctx
        report, extra = self.weigh(received)
        self.start = {k: torch.from_numpy(v) for k, v in self._snapshot().items()}
        result = fit([Objective(ctx.model, self.optimizer(), [cross_entropy])],
                     epoch_batches(ctx.train, self.cfg, ctx.rng(round_seed)))
        metrics = ctx.metrics(result.loss, evaluated_round=round_, extra=extra)
        upload: list[Payload] = [model_weights(ctx.model, ctx.num_examples)]
        if report is not None:
            upload.append(report)
        return [*upload, metrics]

    def evaluate(self, round_: int, received: Received) -> EvalMetrics:
        """Weigh and move once more (the reference code's last federated update), then evaluate."""
        _, extra = self.weigh(received)
        return self.ctx.metrics(0.0, evaluated_round=round_ - 1, extra=extra)

    def optimized(self) -> dict[str, list[torch.nn.Parameter]]:
        """One SGD optimiser over the model's trainable parameters."""
        return {"optimizer": trainable(self.ctx.model)}
