"""Fed-CMA's server half (numpy only): p weights from the setup counts, and the EMA updates of eq. 7.

Setup (round 0): every organization sends its class counts n_i^k once; the server keeps them and
derives p_i^k = n_i^k / Σ_j n_j^k and p_i = N_i / N. Train rounds: each organization sends its class
means e_i (K × d_e, with a presence mask) and its head v_i; at the round's close

    ē^k ← (1 - λ2η)·ē^k + λ2η·Σ_i p_i^k e_i^k     over the organizations that report class k,
    v̄   ← (1 - λ1η)·v̄   + λ1η·Σ_i p_i v_i         over the organizations that pushed,

with the p weights renormalised over those organizations (with every organization pushing and
reporting each class it holds this is eq. 7 exactly; a class missing from a client, or a straggler,
never pulls ē or v̄ toward 0). ē starts at 0 and a class nobody has reported yet is marked absent, so
clients skip its alignment term. v̄⁰ is drawn from the run seed (torch's Linear initialisation).
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction

import numpy as np

from hetfed.aggregator.algorithms.aggregators import ExactSum
from hetfed.aggregator.algorithms.base import RunInfo, ServerHalf
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import ClassCounts, ClassMeanEmbeddings, HeadWeights, Payload, PayloadKind, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import fedcma
from hetfed.wire.specs.fedcma import FedCMAConfig
from hetfed.wire.summation import Summed, shapes

# Stream of the run seed that draws v̄⁰ (independent of every other draw made from the seed).
_HEAD_INIT_STREAM = 0xC3A
# Latents are sigmoid-bounded (Assumption 2): means outside [0, 1] by more than this are rejected.
_BOUND_TOLERANCE = 1e-3
# How far a secure sum of integer class weights may lie above the survivors' setup counts (quantization only).
_WEIGHT_SLACK = 0.5


def initial_head(num_classes: int, latent_dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """v̄⁰: weight [K, d_e] and bias [K] ~ U(-1/√d_e, 1/√d_e) (torch's nn.Linear default), from the run seed."""
    rng = np.random.default_rng([int(seed), _HEAD_INIT_STREAM])
    bound = 1.0 / np.sqrt(latent_dim)
    weight = rng.uniform(-bound, bound, size=(num_classes, latent_dim))
    bias = rng.uniform(-bound, bound, size=num_classes)
    return weight, bias


def p_weights(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(p_i^k [M, K], p_i [M]) from the organizations' class counts n_i^k [M, K]; 0 where a class is absent."""
    n = np.asarray(counts, dtype=np.float64)
    per_class = n.sum(axis=0, keepdims=True)
    p_ik = np.divide(n, per_class, out=np.zeros_like(n), where=per_class > 0)
    total = n.sum()
    p_i = n.sum(axis=1) / total if total > 0 else np.zeros(n.shape[0])
    return p_ik, p_i


@fedcma.SPEC.server_half
class FedCMAServer(ServerHalf[FedCMAConfig]):
    """Fed-CMA (Algorithm 1, server side): global class means ē and global head v̄ by eq. 7."""

    def __init__(self, config: FedCMAConfig, run: RunInfo) -> None:
        super().__init__(config, run)
        k, d = config.num_classes, config.latent_dim
        self.head_step = config.lambda1 * config.head_eta
        self.mean_step = config.lambda2 * config.server_lr
        # Setup: organizations (sorted) and their class counts n_i^k.
        self.organizations: list[str] = []
        self.counts = np.zeros((0, k), dtype=np.int64)
        self.p_class = np.zeros((0, k))
        self.p_org = np.zeros(0)
        # Consensus state: ē (starts at 0; `present` marks classes set at least once) and v̄.
        self.means = np.zeros((k, d))
        self.present = np.zeros(k, dtype=bool)
        self.head_weight, self.head_bias = initial_head(k, d, run.seed)
        self._pending: dict[str, np.ndarray] = {}
        self._reset_sums()

    # ------------------------------------------------------------------ helpers
    def _reset_sums(self) -> None:
        # The round's sums are exact in any order of arrival (``ExactSum``; the head's total weight a
        # fraction), so the same pushes give the same ē and v̄ bit for bit however they interleave.
        k, d = self.config.num_classes, self.config.latent_dim
        self._e_sum = ExactSum((k, d))
        self._e_weight = ExactSum((k,))
        self._v_weight_sum = ExactSum((k, d))
        self._v_bias_sum = ExactSum((k,))
        self._v_weight = Fraction(0)

    def _set_counts(self, organizations: list[str], counts: np.ndarray) -> None:
        self.organizations = list(organizations)
        self.counts = np.asarray(counts, dtype=np.int64).reshape(len(organizations), self.config.num_classes)
        self.p_class, self.p_org = p_weights(self.counts)

    def _index(self, organization: str) -> int:
        try:
            return self.organizations.index(organization)
        except ValueError:
            raise WireError(
                "missing_payload",
                f"organization {organization!r} sent no class counts in the setup round, so it has no p weights",
            ) from None

    def _totals(self) -> np.ndarray:
        return self.counts.sum(axis=0).astype(np.int64)

    # ------------------------------------------------------------------ ServerHalf
    def payloads_for(self, phase: Phase, round_: int, organization: str) -> list[Payload]:
        """ē (with Σ_j n_j^k as counts, presence = set at least once) and v̄; nothing in the setup round."""
        if phase is Phase.SETUP:
            return []
        k = self.config.num_classes
        return [
            ClassMeanEmbeddings(
                labels=np.arange(k, dtype=np.int64),
                means=self.means.astype(np.float32),
                counts=self._totals(),
                presence=self.present.copy(),
            ),
            HeadWeights(self.head_weight.astype(np.float32), self.head_bias.astype(np.float32), 0),
        ]

    def validate(self, phase: Phase, organization: str, update: Received) -> None:
        """Shapes against K and d_e, counts against the setup counts, presence against counts, bounded means."""
        k, d = self.config.num_classes, self.config.latent_dim
        if phase is Phase.SETUP:
            cc = update.get(ClassCounts)
            _check_int(cc.counts, (k,), "class_counts.counts")
            if (cc.counts < 0).any() or cc.counts.sum() <= 0:
                raise WireError("invalid_value", "class_counts.counts must be >= 0 with a positive total")
            return
        if phase is not Phase.TRAIN:
            return
        i = self._index(organization)
        cme, head = update.get(ClassMeanEmbeddings), update.get(HeadWeights)
        _check_int(cme.labels, (k,), "class_mean_embeddings.labels")
        if not np.array_equal(cme.labels, np.arange(k)):
            raise WireError("invalid_value", f"class_mean_embeddings.labels must be 0..{k - 1} in order")
        _check_float(cme.means, (k, d), "class_mean_embeddings.means")
        _check_int(cme.counts, (k,), "class_mean_embeddings.counts")
        if cme.presence.dtype != np.bool_ or cme.presence.shape != (k,):
            raise WireError("shape_mismatch", f"class_mean_embeddings.presence must be bool [{k}], got "
                                              f"{cme.presence.dtype}{list(cme.presence.shape)}")
        if not np.array_equal(cme.presence, cme.counts > 0):
            raise WireError("invalid_value", "class_mean_embeddings.presence must be exactly counts > 0")
        if (cme.counts < 0).any() or (cme.counts > self.counts[i]).any():
            raise WireError("invalid_value", "class_mean_embeddings.counts must lie in [0, n_i^k] of the setup counts")
        rows = np.asarray(cme.means, dtype=np.float64)[cme.presence]
        bounded = self.config.bounded_latent
        if bounded and rows.size and (rows.min() < -_BOUND_TOLERANCE or rows.max() > 1 + _BOUND_TOLERANCE):
            raise WireError("invalid_value", "class means must lie in [0, 1]^d_e (Fed-CMA's latents are bounded)")
        _check_float(head.weight, (k, d), "head_weights.weight")
        _check_float(head.bias, (k,), "head_weights.bias")

    def accumulate(self, phase: Phase, organization: str, update: Received) -> None:
        """Setup: remember n_i^k. Train: add p_i^k·e_i^k per reported class and p_i·v_i to the sums."""
        if phase is Phase.SETUP:
            cc = update.get(ClassCounts)
            self._pending[organization] = np.asarray(cc.counts, dtype=np.int64).copy()
            return
        if phase is not Phase.TRAIN:
            return
        if update.maybe(ClassMeanEmbeddings) is None and update.maybe(HeadWeights) is None:
            return  # under secure aggregation both arrive summed (``accumulate_sum``)
        i = self._index(organization)
        cme, head = update.get(ClassMeanEmbeddings), update.get(HeadWeights)
        present = np.asarray(cme.presence, dtype=bool)
        w = np.where(present, self.p_class[i], 0.0)
        self._e_sum.add(w[:, None] * np.asarray(cme.means, dtype=np.float64))
        self._e_weight.add(w)
        p = float(self.p_org[i])
        self._v_weight_sum.add(np.asarray(head.weight), p)
        self._v_bias_sum.add(np.asarray(head.bias), p)
        self._v_weight += Fraction(p)

    def secure_aggregation_refusal(self) -> str:
        """Eq. 7 needs only Σ_i p_i^k e_i^k and Σ_i p_i v_i with their weights: a sum."""
        return ""

    def summed_shapes(self) -> dict[str, tuple[int, ...]]:
        """The summed form's arrays from K and d_e of the run's config (no organization declares a schema): the
        class means' n_i^k·e_i^k [K, d_e] with their weights n_i^k [K], the head's N_i·v_i and N_i."""
        k, d = self.config.num_classes, self.config.latent_dim
        ones = np.ones(k, dtype=np.int64)
        means = ClassMeanEmbeddings(np.arange(k, dtype=np.int64), np.zeros((k, d)), ones, ones > 0)
        return {**shapes(means), **shapes(HeadWeights(np.zeros((k, d)), np.zeros(k), 1))}

    def accumulate_sum(self, phase: Phase, sums: Mapping[PayloadKind, Summed], organizations: tuple[str, ...]) -> None:
        """Train: the secure sums Σ_i n_i^k e_i^k, Σ_i n_i^k (each organization's setup counts as its class
        weights) and Σ_i N_i v_i, Σ_i N_i (N_i = Σ_k n_i^k). p_i^k = n_i^k / N^k and p_i = N_i / N differ from
        them by a factor the same for every organization, which the renormalised ratios of eq. 7 cancel."""
        if phase is not Phase.TRAIN:
            return
        k, d = self.config.num_classes, self.config.latent_dim
        cme, head = sums[PayloadKind.CLASS_MEAN_EMBEDDINGS], sums[PayloadKind.HEAD_WEIGHTS]
        e_sum, e_weight = cme.values["means"], cme.weight
        v_weight_sum, v_bias_sum, v_weight = head.values["weight"], head.values["bias"], float(head.weight)
        if e_sum.shape != (k, d) or e_weight.shape != (k,) or v_weight_sum.shape != (k, d) or v_bias_sum.shape != (k,):
            raise WireError("shape_mismatch", f"the secure sums are not of K = {k}, d_e = {d}")
        if (e_weight < 0).any() or not v_weight > 0:
            raise WireError("implausible_update", "the summed class weights must be >= 0 and the head's > 0")
        # Each organization weighs its class means by its counts n_i^k, at most its setup counts (the plain round's
        # check of one upload, on the sum): a weight beyond them is refused. The weights are integers, quantized
        # on steps far under _WEIGHT_SLACK.
        setup = self.counts[[self._index(org) for org in organizations]].sum(axis=0)
        if self.config.ddp_epsilon > 0:
            # Under distributed DP the weights carry the noise, which alone may pass any bound: capped at the setup
            # counts instead, each class's sum scaled with its weight so its mean stays (post-processing of the
            # release, as a client caps its local release), not refused.
            capped = np.minimum(e_weight, setup).astype(np.float64)
            e_sum = e_sum * np.divide(capped, e_weight, out=np.zeros_like(capped), where=e_weight > 0)[:, None]
            e_weight = capped
        elif (e_weight > setup + _WEIGHT_SLACK).any():
            raise WireError("implausible_update", "the summed class weights exceed the survivors' setup counts: an "
                                                  "organization weighs its class means beyond the counts it sent")
        if self._e_weight.count or self._v_weight:
            raise ValueError("a round takes one secure sum and no single update")
        self._e_sum.add(e_sum)
        self._e_weight.add(e_weight)
        self._v_weight_sum.add(v_weight_sum)
        self._v_bias_sum.add(v_bias_sum)
        self._v_weight += Fraction(v_weight)

    def close_round(self, phase: Phase, round_: int) -> None:
        """Setup: fix the p weights. Train: eq. 7 over the reporting organizations."""
        if phase is Phase.SETUP:
            if self._pending:
                names = sorted(self._pending)
                self._set_counts(names, np.stack([self._pending[n] for n in names]))
            self._pending = {}
            return
        if phase is Phase.TRAIN:
            e_weight = self._e_weight.total()
            reported = e_weight > 0
            if reported.any():
                target = self._e_sum.total()[reported] / e_weight[reported, None]
                if self.config.bounded_latent:  # a no-op on exact sums; under distributed DP, post-processing
                    target = target.clip(0.0, 1.0)
                self.means[reported] = (1 - self.mean_step) * self.means[reported] + self.mean_step * target
                self.present |= reported
            if self._v_weight > 0:
                s, v_weight = self.head_step, float(self._v_weight)
                self.head_weight = (1 - s) * self.head_weight + s * self._v_weight_sum.total() / v_weight
                self.head_bias = (1 - s) * self.head_bias + s * self._v_bias_sum.total() / v_weight
        self._reset_sums()

    def state(self) -> dict[str, np.ndarray]:
        """Organizations and counts (the p weights), ē with its presence mask, and v̄."""
        return {
            "organizations": np.array(self.organizations, dtype=np.str_),
            "counts": self.counts.copy(),
            "means": self.means.copy(),
            "present": self.present.copy(),
            "head_weight": self.head_weight.copy(),
            "head_bias": self.head_bias.copy(),
        }

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore from ``state()``."""
        if not arrays:
            return
        self._set_counts([str(s) for s in arrays["organizations"].tolist()], arrays["counts"])
        self.means = np.asarray(arrays["means"], dtype=np.float64).copy()
        self.present = np.asarray(arrays["present"], dtype=bool).copy()
        self.head_weight = np.asarray(arrays["head_weight"], dtype=np.float64).copy()
        self.head_bias = np.asarray(arrays["head_bias"], dtype=np.float64).copy()
        self._pending = {}
        self._reset_sums()


def _check_int(array: np.ndarray, shape: tuple[int, ...], name: str) -> None:
    if array.dtype.kind not in "iu" or array.shape != shape:
        raise WireError("shape_mismatch", f"{name} must be an integer tensor of shape {list(shape)}, got "
                                          f"{array.dtype}{list(array.shape)}")


def _check_float(array: np.ndarray, shape: tuple[int, ...], name: str) -> None:
    if array.dtype.kind != "f" or array.shape != shape:
        raise WireError("shape_mismatch", f"{name} must be a floating tensor of shape {list(shape)} (K, d_e from "
                                          f"the run's config), got {array.dtype}{list(array.shape)}")
