"""FedGen's server half (numpy only): FedAvg of encoders and heads, and the conditional generator trained
against the round's heads.

The generator (the reference code's Generator, trainmodel/generator.py:34-79) maps uniform noise ε ∈ [0, 1)^n
and the one-hot label y to a latent:

    h = W₁·[ε, onehot(y)] + b₁,  a = γ·(h − μ_B)/√(σ²_B + 1e-5) + β  (BatchNorm1d, batch statistics),
    g = W₂·ReLU(a) + b₂.

Each round it takes Adam steps (L2 weight decay, lr ×decay a round; servers/serverpFedGen.py:42-47, 113-182) on

    L = α_T·Σ_k (1/B)·Σ_b w_{y_b,k}·CE(head_k(g_b), y_b)  +  α_D·exp(−(1/B²)·Σ_{i,j} N_ij·D_ij)

with head_k the round's heads, w_{y,k} = c_k[y]/Σ_j c_j[y] over the label counts c_k (each count plus one, as the
reference code starts every count at 1), N_ij = mean_d (ε_i − ε_j)² and D_ij = mean_d |g_i − g_j| (its
DiversityLoss, generator.py:176-218). Labels are drawn uniformly from those some organization counted more than
once. Every array here is float64; the generator goes down as float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetfed.aggregator.algorithms.base import RunInfo, round_seed
from hetfed.aggregator.algorithms.fedavg import AveragingServer
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import ClassCounts, HeadWeights, ModelWeights, Payload, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import fedgen
from hetfed.wire.specs.fedgen import GENERATOR_PREFIX, GENERATOR_TENSORS, FedGenConfig

BN_EPS = 1e-5  # torch's BatchNorm1d default
BN_MOMENTUM = 0.1
ADAM_BETAS = (0.9, 0.999)  # servers/serverpFedGen.py:42-45
ADAM_EPS = 1e-8
# A label enters the generator's batches once some organization counted it more than this (MIN_SAMPLES_PER_LABEL,
# servers/serverpFedGen.py:12, 192), counts starting at 1.
MIN_SAMPLES_PER_LABEL = 1
HEAD = "head:"  # the head's entries among the averaged arrays
TRAINED = ("fc.weight", "fc.bias", "bn.weight", "bn.bias", "out.weight", "out.bias")


def init_generator(rng: np.random.Generator, noise_dim: int, num_classes: int, hidden_dim: int,
                   latent_dim: int) -> dict[str, np.ndarray]:
    """torch's initialisation of the generator: each Linear's weight and bias uniform in ±1/√fan_in, the
    BatchNorm's γ = 1, β = 0, running mean 0 and variance 1 (float64)."""
    def linear(fan_in: int, fan_out: int) -> tuple[np.ndarray, np.ndarray]:
        bound = 1.0 / np.sqrt(fan_in)
        return (rng.uniform(-bound, bound, (fan_out, fan_in)), rng.uniform(-bound, bound, fan_out))

    w1, b1 = linear(noise_dim + num_classes, hidden_dim)
    w2, b2 = linear(hidden_dim, latent_dim)
    return {"fc.weight": w1, "fc.bias": b1, "bn.weight": np.ones(hidden_dim), "bn.bias": np.zeros(hidden_dim),
            "bn.running_mean": np.zeros(hidden_dim), "bn.running_var": np.ones(hidden_dim),
            "out.weight": w2, "out.bias": b2}


@dataclass
class Forward:
    """One training-mode pass of the generator and what its backward pass needs."""

    x: np.ndarray  # [B, n + K]: noise and one-hot label
    x_hat: np.ndarray  # normalised pre-activations
    inv_std: np.ndarray
    a: np.ndarray  # after BatchNorm, before ReLU
    r: np.ndarray  # after ReLU
    g: np.ndarray  # the latents [B, d]
    mean: np.ndarray  # the batch statistics (biased variance)
    var: np.ndarray


def generator_inputs(eps: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """[ε, onehot(y)]."""
    onehot = np.zeros((labels.size, num_classes))
    onehot[np.arange(labels.size), labels] = 1.0
    return np.concatenate([eps, onehot], axis=1)


def forward(params: dict[str, np.ndarray], eps: np.ndarray, labels: np.ndarray, num_classes: int) -> Forward:
    """The generator in training mode (BatchNorm on the batch's statistics)."""
    x = generator_inputs(eps, labels, num_classes)
    h = x @ params["fc.weight"].T + params["fc.bias"]
    mean = h.mean(axis=0)
    var = ((h - mean) ** 2).mean(axis=0)
    inv_std = 1.0 / np.sqrt(var + BN_EPS)
    x_hat = (h - mean) * inv_std
    a = params["bn.weight"] * x_hat + params["bn.bias"]
    r = np.maximum(a, 0.0)
    g = r @ params["out.weight"].T + params["out.bias"]
    return Forward(x, x_hat, inv_std, a, r, g, mean, var)


def log_softmax(z: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax."""
    shifted = z - z.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def teacher_loss(g: np.ndarray, labels: np.ndarray, heads: list[tuple[np.ndarray, np.ndarray]],
                 weights: np.ndarray) -> tuple[float, np.ndarray]:
    """Σ_k (1/B)·Σ_b w[b, k]·CE(W_k g_b + b_k, y_b) and its gradient with respect to g. ``weights`` [B, N]."""
    b = g.shape[0]
    loss, grad = 0.0, np.zeros_like(g)
    for k, (w, bias) in enumerate(heads):
        logp = log_softmax(g @ w.T + bias)
        wk = weights[:, k]
        loss += float(np.mean(-logp[np.arange(b), labels] * wk))
        dlogits = np.exp(logp)
        dlogits[np.arange(b), labels] -= 1.0
        grad += (dlogits * (wk / b)[:, None]) @ w
    return loss, grad


def diversity_loss(eps: np.ndarray, g: np.ndarray) -> tuple[float, np.ndarray]:
    """exp(−mean_{i,j} N_ij·D_ij), N_ij = mean_d (ε_i − ε_j)², D_ij = mean_d |g_i − g_j|, and its gradient with
    respect to g (|·|' = sign, 0 at 0, as torch's)."""
    b, d = g.shape
    noise = ((eps[:, None, :] - eps[None, :, :]) ** 2).mean(axis=2)
    diff = g[:, None, :] - g[None, :, :]
    layer = np.abs(diff).mean(axis=2)
    loss = float(np.exp(-np.mean(noise * layer)))
    # ∂/∂g_i of mean_{i,j} N_ij·D_ij: D_ij and D_ji both hold g_i, N is symmetric.
    grad = -loss * 2.0 / (b * b * d) * np.einsum("ij,ijd->id", noise, np.sign(diff))
    return loss, grad


def loss_and_grads(params: dict[str, np.ndarray], eps: np.ndarray, labels: np.ndarray,
                   heads: list[tuple[np.ndarray, np.ndarray]], weights: np.ndarray, teacher_weight: float,
                   diversity_weight: float) -> tuple[dict[str, float], dict[str, np.ndarray], Forward]:
    """The generator's loss (its parts too), the gradient of every trained tensor, and the forward pass."""
    num_classes = heads[0][0].shape[0]
    f = forward(params, eps, labels, num_classes)
    teacher, dg_t = teacher_loss(f.g, labels, heads, weights)
    diversity, dg_d = diversity_loss(eps, f.g)
    dg = teacher_weight * dg_t + diversity_weight * dg_d
    grads = {"out.weight": dg.T @ f.r, "out.bias": dg.sum(axis=0)}
    da = (dg @ params["out.weight"]) * (f.a > 0)
    grads["bn.weight"] = (da * f.x_hat).sum(axis=0)
    grads["bn.bias"] = da.sum(axis=0)
    dx_hat = da * params["bn.weight"]
    b = eps.shape[0]
    dh = f.inv_std / b * (b * dx_hat - dx_hat.sum(axis=0) - f.x_hat * (dx_hat * f.x_hat).sum(axis=0))
    grads["fc.weight"] = dh.T @ f.x
    grads["fc.bias"] = dh.sum(axis=0)
    total = teacher_weight * teacher + diversity_weight * diversity
    return {"loss": total, "teacher": teacher, "diversity": diversity}, grads, f


@dataclass
class Adam:
    """torch.optim.Adam with L2 weight decay (added to the gradient), amsgrad off."""

    lr: float
    weight_decay: float
    step_count: int = 0

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray], m: dict[str, np.ndarray],
             v: dict[str, np.ndarray]) -> None:
        """One step on every tensor of ``grads``, in place."""
        self.step_count += 1
        b1, b2 = ADAM_BETAS
        c1, c2 = 1 - b1 ** self.step_count, 1 - b2 ** self.step_count
        for name, grad in grads.items():
            grad = grad + self.weight_decay * params[name] if self.weight_decay else grad
            m[name] = b1 * m[name] + (1 - b1) * grad
            v[name] = b2 * v[name] + (1 - b2) * grad * grad
            denom = np.sqrt(v[name]) / np.sqrt(c2) + ADAM_EPS
            params[name] = params[name] - (self.lr / c1) * m[name] / denom


def label_weights(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """From the organizations' label counts [N, K] (as uploaded): w [K, N], w[y, k] = c̃_k[y]/Σ_j c̃_j[y] with
    c̃ = c + 1, and the labels some organization counted more than MIN_SAMPLES_PER_LABEL times (c̃ > 1)."""
    smoothed = np.asarray(counts, dtype=np.float64).T + 1.0
    qualified = np.flatnonzero(smoothed.max(axis=1) > MIN_SAMPLES_PER_LABEL)
    return smoothed / smoothed.sum(axis=1, keepdims=True), qualified


def update_running(params: dict[str, np.ndarray], f: Forward) -> None:
    """BatchNorm's running statistics after a training pass: momentum 0.1, the unbiased batch variance."""
    b = f.g.shape[0]
    params["bn.running_mean"] = (1 - BN_MOMENTUM) * params["bn.running_mean"] + BN_MOMENTUM * f.mean
    params["bn.running_var"] = (1 - BN_MOMENTUM) * params["bn.running_var"] + BN_MOMENTUM * f.var * b / (b - 1)


def eval_forward(params: dict[str, np.ndarray], eps: np.ndarray, labels: np.ndarray, num_classes: int
                 ) -> np.ndarray:
    """The generator in eval mode (BatchNorm on its running statistics), as the clients run it."""
    h = generator_inputs(eps, labels, num_classes) @ params["fc.weight"].T + params["fc.bias"]
    a = params["bn.weight"] * (h - params["bn.running_mean"]) / np.sqrt(params["bn.running_var"] + BN_EPS) \
        + params["bn.bias"]
    return np.maximum(a, 0.0) @ params["out.weight"].T + params["out.bias"]


class GeneratorTrainer:
    """The generator, its Adam state and its per-round learning-rate decay."""

    def __init__(self, config: FedGenConfig, seed: int) -> None:
        self.config = config
        rng = np.random.default_rng([seed, 0x6E6])
        self.params = init_generator(rng, config.noise_dim, config.num_classes, config.hidden_dim, config.latent_dim)
        self.m = {n: np.zeros_like(self.params[n]) for n in TRAINED}
        self.v = {n: np.zeros_like(self.params[n]) for n in TRAINED}
        self.adam = Adam(config.generator_lr, config.generator_weight_decay)
        self.rounds = 0  # rounds trained: the learning rate is generator_lr·decay^rounds
        self.last: dict[str, float] = {}

    def train_round(self, heads: list[tuple[np.ndarray, np.ndarray]], counts: np.ndarray, seed: int) -> bool:
        """generator_steps Adam steps against ``heads`` weighted by ``counts`` [N, K], then the lr decays; False
        (nothing done) when no label was counted."""
        cfg = self.config
        weights, qualified = label_weights(counts)
        if qualified.size == 0:
            return False
        rng = np.random.default_rng([seed, 0x6E6])
        self.adam.lr = cfg.generator_lr * cfg.generator_lr_decay ** self.rounds
        sums = {"loss": 0.0, "teacher": 0.0, "diversity": 0.0}
        for _ in range(cfg.generator_steps):
            labels = rng.choice(qualified, cfg.generator_batch_size)
            eps = rng.random((cfg.generator_batch_size, cfg.noise_dim))
            parts, grads, f = loss_and_grads(self.params, eps, labels, heads, weights[labels], cfg.teacher_weight,
                                             cfg.diversity_weight)
            update_running(self.params, f)
            self.adam.step(self.params, grads, self.m, self.v)
            for key in sums:
                sums[key] += parts[key]
        self.rounds += 1
        self.last = {k: s / cfg.generator_steps for k, s in sums.items()}
        return True

    def state(self) -> dict[str, np.ndarray]:
        """Everything a restart needs."""
        out = {f"g.{n}": a.copy() for n, a in self.params.items()}
        out |= {f"m.{n}": a.copy() for n, a in self.m.items()} | {f"v.{n}": a.copy() for n, a in self.v.items()}
        out["counters"] = np.array([self.adam.step_count, self.rounds], dtype=np.int64)
        return out

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore from ``state()``."""
        self.params = {n: np.asarray(arrays[f"g.{n}"], dtype=np.float64).copy() for n in GENERATOR_TENSORS}
        self.m = {n: np.asarray(arrays[f"m.{n}"], dtype=np.float64).copy() for n in TRAINED}
        self.v = {n: np.asarray(arrays[f"v.{n}"], dtype=np.float64).copy() for n in TRAINED}
        self.adam.step_count, self.rounds = (int(c) for c in arrays["counters"])


def examples(update: Received) -> int:
    """The update's example count: model_weights' (it weighs encoder and head alike), else head_weights'."""
    mw = update.maybe(ModelWeights)
    return mw.num_examples if mw is not None else update.get(HeadWeights).num_examples


@fedgen.SPEC.server_half
@fedgen.HEAD_SPEC.server_half
class FedGenServer(AveragingServer[FedGenConfig]):
    """FedAvg of every organization's encoder and head (weighted by example counts, as serverbase.py:90-102), or of
    the heads alone (``fedgen_head``), and the generator trained on the round's heads and label counts; all go
    down."""

    def __init__(self, config: FedGenConfig, run: RunInfo) -> None:
        super().__init__(config, run)
        self.generator = GeneratorTrainer(config, run.seed)
        self.trained = False  # whether the generator has been trained (sent from then on)
        self._heads: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def arrays(self, update: Received) -> tuple[dict[str, np.ndarray], int] | None:
        """The encoder's tensors (none under ``fedgen_head``) and the head's (as ``head:weight``, ``head:bias``),
        weighted by the example count (1 each under uniform weighting)."""
        mw, hw = update.maybe(ModelWeights), update.maybe(HeadWeights)
        if hw is None:
            return None
        arrays = {**(mw.tensors if mw is not None else {}), f"{HEAD}weight": hw.weight, f"{HEAD}bias": hw.bias}
        return arrays, 1 if self.config.weighting == "uniform" else examples(update)

    def payloads_for(self, phase: Phase, round_: int, organization: str) -> list[Payload]:
        """The averaged encoder with the generator's tensors (``generator:<name>``, float32) and the averaged head;
        nothing before the first close."""
        if self.global_ is None or phase is Phase.SETUP:
            return []
        body = {k: v for k, v in self.global_.items() if not k.startswith(HEAD)}
        if self.trained:
            body |= {GENERATOR_PREFIX + n: self.generator.params[n].astype(np.float32) for n in GENERATOR_TENSORS}
        head = HeadWeights(self.global_[f"{HEAD}weight"], self.global_[f"{HEAD}bias"])
        return [ModelWeights(body), head] if body else [head]

    def validate(self, phase: Phase, organization: str, update: Received) -> None:
        """A positive example count, no encoder tensor named like the head's or the generator's, a head [K, d_e] + [K] of the run, label counts int [K] and >= 0; then FedAvg's bounds."""
        if phase is not Phase.TRAIN:
            return
        cfg = self.config
        mw, hw, cc = update.maybe(ModelWeights), update.get(HeadWeights), update.get(ClassCounts)
        if examples(update) <= 0:
            raise WireError("invalid_value", f"num_examples must be > 0, got {examples(update)}")
        clash = sorted(n for n in (mw.tensors if mw is not None else {}) if n.startswith((HEAD, GENERATOR_PREFIX)))
        if clash:
            raise WireError("invalid_value", f"model_weights may not name {clash[:3]}: those names are the head's "
                                             "and the generator's")
        k, d = cfg.num_classes, cfg.latent_dim
        if hw.weight.shape != (k, d) or hw.bias.shape != (k,):
            raise WireError("shape_mismatch", f"head_weights must be [{k}, {d}] and [{k}] (K, d_e of the run), "
                                              f"got {list(hw.weight.shape)} and {list(hw.bias.shape)}")
        counts = cc.counts
        if counts.dtype.kind not in "iu" or counts.shape != (k,) or (counts < 0).any():
            raise WireError("invalid_value", f"class_counts must be {k} integers >= 0, got {counts.dtype}"
                                             f"{list(counts.shape)}")
        super().validate(phase, organization, update)

    def accumulate(self, phase: Phase, organization: str, update: Received) -> None:
        """FedAvg's accumulation, and the head and label counts kept for the generator."""
        if phase is not Phase.TRAIN:
            return
        super().accumulate(phase, organization, update)
        hw = update.get(HeadWeights)
        self._heads[organization] = (np.asarray(hw.weight, dtype=np.float64).copy(),
                                     np.asarray(hw.bias, dtype=np.float64).copy(),
                                     np.asarray(update.get(ClassCounts).counts, dtype=np.int64).copy())

    def close_round(self, phase: Phase, round_: int) -> None:
        """The generator trained on the round's heads (organizations in sorted order), then FedAvg's close."""
        if phase is Phase.TRAIN and self._heads:
            ordered = [self._heads[o] for o in sorted(self._heads)]
            trained = self.generator.train_round([(w, b) for w, b, _ in ordered],
                                                 np.stack([c for _, _, c in ordered]), round_seed(self.run.seed, round_))
            self.trained = self.trained or trained
        self._heads = {}
        super().close_round(phase, round_)

    def state(self) -> dict[str, np.ndarray]:
        """The global model's arrays and the generator's state."""
        out = {f"avg/{k}": v for k, v in super().state().items()}
        if self.trained:
            out |= {f"gen/{k}": v for k, v in self.generator.state().items()}
        return out

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore from ``state()``."""
        super().load_state({k[4:]: v for k, v in arrays.items() if k.startswith("avg/")})
        gen = {k[4:]: v for k, v in arrays.items() if k.startswith("gen/")}
        self.trained = bool(gen)
        if gen:
            self.generator.load_state(gen)
        self._heads = {}
