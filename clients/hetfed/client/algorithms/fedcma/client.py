"""Fed-CMA's client half (Algorithm 1, worker side): eq. 5 through the shared training loop.

The encoder g_i (any architecture, sigmoid-bounded into [0, 1]^d_e unless ``bounded_latent`` is false) never
leaves the organization.
Setup: send the class counts n_i^k and fix one batch B_i^k of b_i^k = min(b, n_i^k) examples per class.
Each round: take ē and v̄ from the instructions (the first v̄ received initialises the head), train
with cross-entropy + (λ1/2)·p_i·||v_i - v̄||² + (λ2/2)·Σ_k (p_i^k/b_i^k)·Σ_{x∈B_i^k} ||g_i(x) - ē^k||²
(the alignment skipped for classes whose ē^k is not set, so entirely while ē is all zero), then upload
the class means over B_i^k (eval mode, no grad) and the head.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.nn import functional as F

from hetfed.client.algorithms.base import ClientContext, ClientHalf
from hetfed.client.algorithms.fedcma.losses import (
    BatchMeanSquaredAlignment,
    ClassMeanAlignment,
    HeadConsensusTerm,
)
from hetfed.client.data import class_counts
from hetfed.client.training import (
    Batch,
    DeviceData,
    Forward,
    LossTerm,
    Objective,
    PerExample,
    cross_entropy,
    data_free,
    epoch_batches,
    eval_mode,
    evaluate,
    fit,
)
from hetfed.wire.payloads import ClassCounts, ClassMeanEmbeddings, EvalMetrics, HeadWeights, Payload, Received
from hetfed.wire.specs import fedcma
from hetfed.wire.specs.fedcma import FedCMAConfig

if TYPE_CHECKING:  # dp-accounting is imported only by a client under DP (it takes over a second)
    from hetfed.client.privacy.ledger import Release

# Stream of (run seed, organization) that draws the fixed batches B_i^k: the same after a restart.
_BATCH_STREAM = 0xB1C
# The name of the noisy class counts among the values the privacy ledger keeps.
_RELEASED = "class_counts"


@fedcma.SPEC.client_half
class FedCMAClient(ClientHalf[FedCMAConfig]):
    """Fed-CMA worker: private encoder and head, class-conditional alignment to the global means."""

    # What the server sent last (the next round's consensus and alignment targets) and whether v̄⁰ was taken;
    # the fixed batches B_i^k are drawn again from the run seed, identically.
    private_attributes = ("_head_initialised", "global_means", "global_present", "class_totals", "global_head")
    # Under DP: DP-SGD for the encoder and head; the class counts and class-mean embeddings, computed from the
    # data directly, through the Gaussian class-sum release (docs/privacy.md).
    privacy_mechanism = "dp-sgd+gaussian-sums"

    def __init__(self, ctx: ClientContext[FedCMAConfig]) -> None:
        super().__init__(ctx)
        self.cfg = ctx.config
        self.counts = class_counts(ctx.data.train.y, ctx.data.num_classes)
        if ctx.privacy is not None and _RELEASED in ctx.privacy.ledger.released:
            # Released before (this process or an earlier one): the organization works with what it sent, and a
            # restart sends the same counts again rather than releasing new ones.
            self.counts = np.asarray(ctx.privacy.ledger.released[_RELEASED], dtype=np.int64)
        self._batch: DeviceData | None = None
        self._batch_sizes = np.zeros(ctx.data.num_classes, dtype=np.int64)
        self._head_initialised = False
        # What the server sent last: ē [K, d_e], its presence, the class totals Σ_j n_j^k, v̄.
        self.global_means: torch.Tensor | None = None
        self.global_present: torch.Tensor | None = None
        self.class_totals: np.ndarray | None = None
        self.global_head: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ setup
    def _check_model(self) -> None:
        model, k = self.ctx.model, self.ctx.data.num_classes
        if model.latent_dim != self.cfg.latent_dim or k != self.cfg.num_classes:
            raise ValueError(
                f"Fed-CMA run expects latent_dim={self.cfg.latent_dim} and num_classes={self.cfg.num_classes}; "
                f"this organization's model has latent_dim={model.latent_dim} and its data {k} classes "
                "(set model.latent_dim in the client config, or latent_dim/num_classes in the run's config)"
            )

    def fixed_batch(self) -> DeviceData:
        """B_i = ∪_k B_i^k: b_i^k = min(b, n_i^k) examples of each class, drawn once from the run seed."""
        if self._batch is None:
            rng = np.random.default_rng([self.ctx.seed, _BATCH_STREAM, zlib.crc32(self.ctx.organization.encode())])
            y = self.ctx.data.train.y
            chosen = []
            for k in range(self.ctx.data.num_classes):
                idx = np.flatnonzero(y == k)
                take = min(self.cfg.class_batch_size, idx.size)
                self._batch_sizes[k] = take
                chosen.append(np.sort(rng.choice(idx, size=take, replace=False)) if take else idx[:0])
            batch = self.ctx.train.take(np.concatenate(chosen))
            self._batch = DeviceData(batch.x, batch.y)
        return self._batch

    def setup(self, round_seed: int) -> list[Payload]:
        """Send n_i^k once and fix the per-class batches (under DP: n_i^k + N(0, σ²), rounded and floored at 0,
        which this organization then uses as its counts too; kept in the privacy ledger with their release, so a
        setup redone after a restart sends the same counts and releases nothing new)."""
        self._check_model()
        privacy = self.ctx.privacy
        if privacy is not None and not self.cfg.bounded_latent:
            raise ValueError("Fed-CMA under [privacy] needs bounded latents: its class-sum release takes its bound "
                             "C_z = sqrt(d_e) from [0, 1]^d_e (set bounded_latent = true, or leave [privacy] out)")
        if privacy is None:
            self.fixed_batch()
            return [ClassCounts(self.counts.copy())]
        if _RELEASED in privacy.ledger.released:
            return [ClassCounts(self.counts.copy())]
        from hetfed.client.privacy.mechanisms import noisy_counts

        sigma = privacy.direct_sigma
        self.counts = noisy_counts(self.counts, sigma, privacy.generator_now)
        privacy.ledger.record(1.0, sigma)
        privacy.ledger.hold(_RELEASED, self.counts.tolist())
        return [ClassCounts(self.counts.copy())]

    # ------------------------------------------------------------------ privacy
    def privacy_plan(self, q: float, steps: int) -> tuple[list[Release], list[Release]]:
        """Setup: the noisy counts (sensitivity 1, noise m·σ for m = ``direct_noise_multiple``). Each round:
        DP-SGD's steps and one class-sum release (sensitivity √2 in units of (C_z, 1), so m·σ/√2)."""
        assert self.ctx.privacy is not None
        m = self.ctx.privacy.cfg.direct_noise_multiple
        from hetfed.client.privacy.ledger import Release

        if self.ctx.distributed is not None:  # the class sums go through the run's distributed plan instead
            return [Release(1.0, m, 1)], [Release(q, 1.0, steps)]
        return [Release(1.0, m, 1)], [Release(q, 1.0, steps), Release(1.0, m / math.sqrt(2), 1)]

    # ------------------------------------------------------------------ rounds
    def _receive(self, received: Received) -> None:
        dev = self.ctx.device
        cme = received.maybe(ClassMeanEmbeddings)
        if cme is not None:
            self.global_means = torch.as_tensor(np.array(cme.means, dtype=np.float32), device=dev)
            self.global_present = torch.as_tensor(np.array(cme.presence, dtype=bool), device=dev)
            self.class_totals = np.array(cme.counts, dtype=np.int64)
        hw = received.maybe(HeadWeights)
        if hw is not None:
            weight = torch.as_tensor(np.array(hw.weight, dtype=np.float32), device=dev)
            bias = torch.as_tensor(np.array(hw.bias, dtype=np.float32), device=dev)
            self.global_head = (weight, bias)
            if not self._head_initialised:  # the common initialisation v̄⁰ (Algorithm 1's setup)
                with torch.no_grad():
                    self.ctx.model.head.weight.copy_(weight)
                    self.ctx.model.head.bias.copy_(bias)
                self._head_initialised = True

    def p_weights(self) -> tuple[np.ndarray, float]:
        """(p_i^k [K], p_i) from this organization's counts and the federation's class totals."""
        totals = self.class_totals if self.class_totals is not None else self.counts
        n = self.counts.astype(np.float64)
        p_class = np.divide(n, totals, out=np.zeros_like(n), where=totals > 0)
        p_org = float(n.sum() / totals.sum()) if totals.sum() > 0 else 0.0
        return p_class, p_org

    def alignment_active(self) -> bool:
        """Whether any ē^k is set (the alignment term is skipped while ē is all zero)."""
        return (
            self.global_means is not None
            and self.global_present is not None
            and bool(self.global_present.any())
            and bool(self.global_means.abs().sum() > 0)
        )

    def terms(self) -> list[LossTerm]:
        """Eq. 5 as loss terms: cross-entropy, the head consensus to v̄, the alignment to ē (when active)."""
        dev = self.ctx.device
        p_class, p_org = self.p_weights()
        paper = self.cfg.alignment == "paper"
        net = self.ctx.model
        terms: list[LossTerm] = [cross_entropy]
        if self.global_head is not None:
            scale = 0.5 * self.cfg.lambda1 * p_org if self.cfg.head_consensus == "paper" else self.cfg.lambda1
            head_term = HeadConsensusTerm(scale, *self.global_head)
            terms.append(data_free(lambda batch, out: head_term(net.head.weight, net.head.bias)))
        if self.alignment_active() and self.ctx.privacy is not None:
            terms.append(self._private_alignment(p_class))
        elif self.alignment_active():
            assert self.global_means is not None and self.global_present is not None
            if paper:
                fixed = self.fixed_batch()
                sizes = np.maximum(self._batch_sizes, 1).astype(np.float64)
                weight = torch.as_tensor(p_class / sizes, dtype=torch.float32, device=dev)
                align = ClassMeanAlignment(self.cfg.lambda2, self.global_means, weight, self.global_present)

                def over_fixed_batches(batch: Batch, out: Forward) -> torch.Tensor:
                    if self.cfg.alignment_bn == "eval":
                        with eval_mode(net):
                            return align(net.embed(fixed.x), fixed.y)
                    return align(net.embed(fixed.x), fixed.y)

                terms.append(over_fixed_batches)
            else:
                current = BatchMeanSquaredAlignment(self.cfg.lambda2, self.global_means, self.global_present)
                terms.append(lambda batch, out: current(net.embed(batch.x), batch.y))
        return terms

    def _private_alignment(self, p_class: np.ndarray) -> LossTerm:
        """The alignment under DP-SGD, one value per example of the step's Poisson sample (a term over the fixed
        batches B_i^k, or divided by the batch's own class counts, would mix examples). Example x of class k
        carries its share of the alignment over the training examples: N̂ times its class's weight over the
        n̂_i^k examples of k, both released counts. DP-SGD divides the sum over the sample by qN̂, so the step's
        gradient estimates the alignment's, and no example's value depends on the others. The true N would not
        do: adding one example would rescale every other example's weight. A class released as 0 counts as 1,
        so its weight stays finite."""
        assert self.global_means is not None and self.global_present is not None
        privacy, net = self.ctx.privacy, self.ctx.model
        assert privacy is not None
        share = privacy.num_examples / np.maximum(self.counts.astype(np.float64), 1.0)
        if self.cfg.alignment == "paper":  # (λ2/2)·(p_i^k / b_i^k)·Σ ‖g(x) − ē^k‖², b_i^k = n_i^k here
            weight, lam = p_class * share, self.cfg.lambda2
        else:  # the reference code's λ2·mean over class k's examples and dimensions of (g(x) − ē^k)²
            weight, lam = share / self.cfg.latent_dim, 2 * self.cfg.lambda2
        align = ClassMeanAlignment(lam, self.global_means,
                                   torch.as_tensor(weight, dtype=torch.float32, device=self.ctx.device),
                                   self.global_present)
        return PerExample(lambda batch, out: align.per_example(net.embed(batch.x), batch.y), name="private_alignment")

    @torch.no_grad()
    def private_class_means(self) -> ClassMeanEmbeddings:
        """Under DP: the Gaussian class-sum release over every training example, then post-processing. The
        embeddings are clipped to C_z = √d_e, the bound of Fed-CMA's latent space [0, 1]^d_e, so clipping changes
        no embedding and the means carry no shrinkage; the noise is σ_d·C_z on the sums and σ_d on the counts,
        σ_d = ``direct_noise_multiple``·σ. Post-processing: counts rounded and capped at the released
        setup counts, a class present when its count is at least 1, means the noisy sums over the counts,
        clipped into [0, 1]^d_e."""
        from hetfed.client.privacy.mechanisms import gaussian_class_sums

        privacy, model, k = self.ctx.privacy, self.ctx.model, self.ctx.data.num_classes
        assert privacy is not None
        train, n = self.ctx.train, len(self.ctx.train)
        zs, ys = [], []
        with eval_mode(model):
            for batch in train.batches(slice(s, s + 1024) for s in range(0, n, 1024)):
                zs.append(model.embed(batch.x))
                ys.append(batch.y)
        sigma, bound = privacy.direct_sigma, math.sqrt(self.cfg.latent_dim)
        sums, counts = gaussian_class_sums(torch.cat(zs), torch.cat(ys), k, bound, sigma, privacy.generator_now)
        privacy.ledger.record(1.0, sigma / math.sqrt(2))
        released = np.minimum(np.rint(counts.cpu().numpy()), self.counts).astype(np.int64)
        present = released >= 1
        released = np.where(present, released, 0)
        means = (sums.cpu().numpy() / np.maximum(released, 1)[:, None]).clip(0.0, 1.0)
        means[~present] = 0.0
        return ClassMeanEmbeddings(np.arange(k, dtype=np.int64), means.astype(np.float32), released, present)

    @torch.no_grad()
    def clipped_class_sums(self) -> tuple[np.ndarray, np.ndarray]:
        """(Σ over class k's training examples of g(x) clipped to C_z = √d_e [K, d_e], n^k [K]), float64, every
        training example in eval mode: the class sums and counts one example moves by at most √(C_z² + 1)."""
        model, k = self.ctx.model, self.ctx.data.num_classes
        train, n = self.ctx.train, len(self.ctx.train)
        bound = math.sqrt(self.cfg.latent_dim)
        sums = np.zeros((k, self.cfg.latent_dim), np.float64)
        counts = np.zeros(k, np.int64)
        with eval_mode(model):
            for batch in train.batches(slice(s, s + 1024) for s in range(0, n, 1024)):
                z = model.embed(batch.x).double()
                z = z * (bound / (z.norm(dim=1, keepdim=True) + 1e-12)).clamp(max=1.0)
                y = batch.y.cpu().numpy()
                np.add.at(sums, y, z.cpu().numpy())
                counts += np.bincount(y, minlength=k)
        return sums, counts

    def distributed_class_means(self) -> ClassMeanEmbeddings:
        """Under secure aggregation's distributed DP: the exact clipped class sums and counts, as the class means
        whose weighted form (Σ n^k e^k, n^k) they are (float64, so that the form gives the sums back to the last
        bits). They leave only through the round's secure sum, which encodes them with the run's plan and this
        organization's Skellam share; under [privacy] the ledger records the round's distributed release."""
        assert self.ctx.distributed is not None
        sums, counts = self.clipped_class_sums()
        if self.ctx.privacy is not None:
            from hetfed.client.privacy.ledger import DistributedRelease

            self.ctx.privacy.ledger.record_distributed(DistributedRelease.of(self.ctx.distributed.plan))
        present = counts > 0
        means = sums / np.maximum(counts, 1)[:, None]
        return ClassMeanEmbeddings(np.arange(len(counts), dtype=np.int64), means, counts, present)

    @torch.no_grad()
    def class_means(self) -> ClassMeanEmbeddings:
        """e_i^k = mean of g_i(x) over B_i^k, in eval mode without gradients; absent classes are zero rows. Their
        counts are the setup counts n_i^k (eq. 7 weighs e_i^k by p_i^k = n_i^k / Σ_j n_j^k, whatever b_i^k), so
        under secure aggregation the summed form (n_i^k·e_i^k, n_i^k) gives the plain round's weighted mean."""
        if self.ctx.distributed is not None:
            return self.distributed_class_means()
        if self.ctx.privacy is not None:
            return self.private_class_means()
        batch = self.fixed_batch()
        model = self.ctx.model
        with eval_mode(model):
            z = model.embed(batch.x).double()
        k = self.ctx.data.num_classes
        sums = torch.zeros(k, z.shape[1], dtype=torch.float64, device=z.device).index_add_(0, batch.y, z)
        sizes = torch.as_tensor(self._batch_sizes, dtype=torch.float64, device=z.device)
        means = (sums / sizes.clamp(min=1)[:, None]).cpu().numpy().astype(np.float32)
        counts = self.counts.copy()  # b_i^k > 0 exactly where n_i^k > 0: the same presence
        return ClassMeanEmbeddings(np.arange(k, dtype=np.int64), means, counts, counts > 0)

    def head(self) -> HeadWeights:
        """v_i: the head's weight and bias, with the organization's example count (without DP N_i = Σ_k n_i^k,
        the weight of eq. 7's p_i = N_i / N, which secure aggregation sums)."""
        head = self.ctx.model.head
        return HeadWeights(head.weight.detach().cpu().numpy().copy(), head.bias.detach().cpu().numpy().copy(),
                           self.ctx.num_examples)

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """Evaluate after the download (FedGen's protocol), run eq. 6 on eq. 5 for the round's local steps,
        then upload e_i (over B_i^k) and v_i."""
        ctx = self.ctx
        self._check_model()
        self._receive(received)
        active = self.alignment_active()
        # The model as the round starts (its own weights and the head v̄⁰ sets in round 1) and its encoder with
        # the v̄ just received: the figures of round - 1, so every round's v̄ is scored (top-N statistics).
        scored = {"global_head_test_accuracy": self._global_head_accuracy()} if ctx.evaluates else {}
        before = ctx.metrics(0.0, evaluated_round=round_ - 1, extra={**scored, "alignment_active": float(active)})
        result = fit([Objective(ctx.model, self.optimizer(), self.terms())],
                     epoch_batches(ctx.train, self.cfg, ctx.rng(round_seed)))
        return [self.class_means(), self.head(), dataclasses.replace(before, train_loss=result.loss)]

    def _global_head_accuracy(self) -> float:
        if self.global_head is None or len(self.ctx.test) == 0:
            return 0.0
        model, head = self.ctx.model, self.global_head
        return evaluate(model, self.ctx.test,
                        predict=lambda x: torch.log_softmax(F.linear(model.embed(x), *head), dim=1))[0]

    def evaluate(self, round_: int, received: Received) -> EvalMetrics:
        """The organization's own model (private encoder, personal head); also its encoder with v̄."""
        self._receive(received)
        return self.ctx.metrics(0.0, evaluated_round=round_ - 1,
                                extra={"global_head_test_accuracy": self._global_head_accuracy()})
