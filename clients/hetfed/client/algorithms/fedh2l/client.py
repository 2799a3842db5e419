"""FedH2L's client half (Li et al., Algorithm 1): local step, teach, learn from the peers, project.

One round is one iteration of Algorithm 1 for this node, with the learn step placed where the relay
allows it. Algorithm 1 runs, for every node i and iteration t: local(t) (g_loc on a private batch,
θ ← θ − β·g_loc), teach(t) (posteriors and Acc_i on a batch of its own domain's part of D_pub, with
the updated θ), then learn(t) from the peers' teach(t) outputs (g_pub = ∇(ℓ_KL + ℓ_CE), projected
against g_loc, θ ← θ − η·g̃). Over gRPC a node receives its peers' teach(t) outputs only in the
instructions of round t + 1, so round t + 1 runs learn(t) first and then local(t + 1) and
teach(t + 1); the final evaluate round runs learn(T). Each node's sequence of updates is therefore
exactly Algorithm 1's; what lags by one round is only when learn(t) executes. Round 1 has no
learn step (nothing was taught before it).

With E = ``local_steps`` > 1 a round makes E local steps and g_loc is the displacement θ_start − θ_end
over them (the paper's g_loc_E − g_loc_0); the global step and the exchange happen once per round.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from hetfed.client.algorithms.base import ClientContext, ClientHalf
from hetfed.client.algorithms.fedh2l.losses import ConfidenceWeightedDistillation, ConflictProjection
from hetfed.client.losses import assign_flat_grad, flat_grad
from hetfed.client.training import (
    Batch,
    Forward,
    Objective,
    cross_entropy,
    eval_mode,
    fit,
    sampled_batches,
    trainable,
)
from hetfed.wire.payloads import EvalMetrics, Payload, Received, SeedPosteriors
from hetfed.wire.specs import fedh2l
from hetfed.wire.specs.fedh2l import FedH2LConfig


@fedh2l.SPEC.client_half
class FedH2LClient(ClientHalf[FedH2LConfig]):
    """One FedH2L node: a private model of any architecture, two optimisers, the shared seed set."""

    # Under DP the local steps are DP-SGD's (g_loc is their privatised gradient or displacement); posteriors of the
    # model on the shared seed set, and its accuracy on the seed set's labels, are post-processing.
    privacy_mechanism = "dp-sgd"

    # g_loc with the confidence it waits to be used with in the next round's learn step (the two optimisers,
    # "opt_local" and "opt_global", are the base class's: kept with keep_optimizer_state).
    private_attributes = ("g_loc", "private_batch_accuracy")

    def __init__(self, ctx: ClientContext[FedH2LConfig]) -> None:
        super().__init__(ctx)
        public = ctx.data.public
        if public is None:
            raise ValueError(f"fedh2l needs a seed set, and the data {ctx.data.name!r} has none; "
                             "use data.partition 'rotated'")
        self.cfg = ctx.config
        self.params = trainable(ctx.model)
        self.seed_set_id = public.id
        self.pub_x = torch.as_tensor(public.features(), device=ctx.device)
        self.pub_y = torch.as_tensor(np.array(public.y), device=ctx.device)
        self.own_part = public.part(ctx.data.domain)
        if self.own_part.size == 0:
            raise ValueError(f"seed set {public.id!r} holds no examples of this organization's domain {ctx.data.domain}")
        self.distill = ConfidenceWeightedDistillation(labelled=self.cfg.labelled_seed)
        self.project = ConflictProjection()
        self.g_loc: torch.Tensor | None = None  # g_loc of the last local step(s), waiting for its learn step
        self.private_batch_accuracy = 0.0

    def optimized(self) -> dict[str, list[nn.Parameter]]:
        """The local step's optimiser and the mutual-learning step's, over the same parameters."""
        return {"opt_local": self.params, "opt_global": self.params}

    def optimizer_config(self, name: str) -> FedH2LConfig:
        """The global step's optimiser steps at ``global_lr`` (0: ``lr``)."""
        if name == "opt_global":
            return dataclasses.replace(self.cfg, lr=self.cfg.global_lr or self.cfg.lr)
        return self.cfg

    def check_privacy(self) -> None:
        """Unlabelled seed data take the teaching confidence from a private batch's accuracy, which no mechanism
        here releases: refused under DP."""
        if not self.cfg.labelled_seed:
            from hetfed.client.privacy.mechanisms import PrivacyError

            raise PrivacyError("fedh2l with labelled_seed = false sends the accuracy on a private batch as its teaching "
                               "confidence, which hetfed cannot release under DP; set labelled_seed = true")

    # ------------------------------------------------------------------ Algorithm 1's steps
    def local(self, rng: np.random.Generator) -> float:
        """E local steps on private batches (eqs. 1-2); keeps g_loc for the next learn step."""
        model, e = self.ctx.model, self.cfg.local_steps
        start = torch.cat([p.detach().reshape(-1) for p in self.params]) if e > 1 else None

        def keep_local_gradient() -> None:  # E = 1: g_loc is the local step's gradient (eq. 2)
            self.g_loc = flat_grad(self.params).detach().clone()

        batches = list(sampled_batches(self.ctx.train, self.cfg.batch_size, e, rng))
        result = fit([Objective(model, self.optimizer("opt_local"), [cross_entropy],
                                before_step=keep_local_gradient if e == 1 else None)], batches)
        if start is not None:
            self.g_loc = start - torch.cat([p.detach().reshape(-1) for p in self.params])
        if not self.cfg.labelled_seed:  # unlabelled seed data: confidence from the labels the node owns
            last = batches[-1]
            with torch.no_grad(), eval_mode(model):
                self.private_batch_accuracy = float((model(last.x).argmax(1) == last.y).float().mean())
        return result.loss

    @torch.no_grad()
    def teach(self, rng: np.random.Generator) -> SeedPosteriors:
        """Posteriors p_i^pub(i) and Acc_i on a batch of the own domain's part of D_pub (eval mode)."""
        idx = np.sort(rng.choice(self.own_part, size=min(self.cfg.batch_size, self.own_part.size), replace=False))
        model = self.ctx.model
        with eval_mode(model):
            logits = model(self.pub_x[torch.as_tensor(idx, device=self.pub_x.device)])
        probs = torch.softmax(logits.float(), dim=1)
        if self.cfg.labelled_seed:
            confidence = float((logits.argmax(1) == self.pub_y[torch.as_tensor(idx, device=self.pub_y.device)]).float().mean())
        else:
            confidence = self.private_batch_accuracy
        return SeedPosteriors(self.seed_set_id, idx.astype(np.int64), probs.cpu().numpy(), confidence)

    def learn(self, teachers: tuple[SeedPosteriors, ...]) -> dict[str, float]:
        """g_pub from the teachers' posteriors (eqs. 3-6), projected against g_loc (eq. 14), one global step."""
        if not teachers or self.g_loc is None:
            return {"teachers": float(len(teachers))}
        n, k = self.pub_x.shape[0], self.ctx.model.num_classes
        for t in teachers:
            if t.seed_set_id != self.seed_set_id:
                raise ValueError(f"posteriors from {t.source_organization!r} refer to seed set {t.seed_set_id!r}, "
                                 f"this organization holds {self.seed_set_id!r}")
            if t.indices.size == 0 or t.indices.min() < 0 or t.indices.max() >= n or t.probabilities.shape != (t.indices.size, k):
                raise ValueError(f"posteriors from {t.source_organization!r} do not fit the seed set "
                                 f"({t.indices.size} indices, probabilities {list(t.probabilities.shape)})")
        device = self.pub_x.device
        idx = [torch.from_numpy(np.array(t.indices, dtype=np.int64)).to(device) for t in teachers]
        probs = [torch.from_numpy(np.array(t.probabilities, dtype=np.float32)).to(device) for t in teachers]
        labels = [self.pub_y[i] for i in idx] if self.cfg.labelled_seed else None
        sizes = [i.numel() for i in idx]
        stats: dict[str, float] = {"teachers": float(len(teachers))}

        def distillation(batch: Batch, out: Forward) -> torch.Tensor:  # ℓ_KL + ℓ_CE on the teachers' batches
            loss, kl, ce = self.distill(list(out.logits.split(sizes)), probs,
                                        [t.teaching_confidence for t in teachers], labels)
            stats.update(loss_kl=float(kl.detach()), loss_ce_pub=float(ce.detach()))
            return loss

        def project() -> None:  # g̃ from g_pub and g_loc (eq. 14), then the global step takes g̃
            assert self.g_loc is not None
            g_pub = flat_grad(self.params)
            g_tilde, v = self.project(g_pub, self.g_loc) if self.cfg.project else (g_pub, 0.0)
            assign_flat_grad(self.params, g_tilde)
            stats.update(projected=float(v > 0), projection_v=v)

        at = torch.cat(idx)
        seed_batch = Batch(self.pub_x[at], self.pub_y[at])
        fit([Objective(self.ctx.model, self.optimizer("opt_global"), [distillation], before_step=project)],
            [seed_batch])
        self.g_loc = None
        return stats

    # ------------------------------------------------------------------ hooks
    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """learn(t − 1) from the relayed posteriors, then local(t) and teach(t); upload posteriors and metrics."""
        stats = self.learn(received.all(SeedPosteriors))
        m = self.ctx.metrics(0.0, evaluated_round=round_ - 1)
        rng = self.ctx.rng(round_seed)
        loss = self.local(rng)
        posteriors = self.teach(rng)
        metrics = dataclasses.replace(m, train_loss=loss, extra={
            **m.extra, **stats, "teaching_confidence": posteriors.teaching_confidence})
        return [posteriors, metrics]

    def evaluate(self, round_: int, received: Received) -> EvalMetrics:
        """learn(T) from the last relayed posteriors, then the final model on every test set."""
        stats = self.learn(received.all(SeedPosteriors))
        return self.ctx.metrics(0.0, evaluated_round=round_ - 1, extra=stats)
