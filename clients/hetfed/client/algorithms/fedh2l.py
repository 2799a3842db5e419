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
import time

import numpy as np
import torch
from torch.nn import functional as F

from hetfed.client.algorithms.base import ClientContext
from hetfed.client.losses import (
    ConfidenceWeightedDistillation,
    ConflictProjection,
    assign_flat_grad,
    flat_grad,
)
from hetfed.client.training import make_optimizer
from hetfed.wire.payloads import EvalMetrics, Payload, PayloadKind, SeedPosteriors
from hetfed.wire.specs import FedH2LConfig

SP = PayloadKind.SEED_POSTERIORS


class FedH2LClient:
    """One FedH2L node: a private model of any architecture, two optimisers, the shared seed set."""

    def __init__(self, ctx: ClientContext) -> None:
        if not isinstance(ctx.config, FedH2LConfig):
            raise TypeError(f"FedH2LClient needs a FedH2LConfig, got {type(ctx.config).__name__}")
        public = ctx.data.public
        if public is None:
            raise ValueError(f"fedh2l needs a seed set, and the data {ctx.data.name!r} has none; "
                             "use data.partition 'rotated'")
        self.ctx = ctx
        self.cfg: FedH2LConfig = ctx.config
        self.params = [p for p in ctx.model.parameters() if p.requires_grad]
        self.opt_local = make_optimizer(self.params, self.cfg)
        self.opt_global = make_optimizer(self.params, dataclasses.replace(self.cfg, lr=self.cfg.global_lr or self.cfg.lr))
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
        self.last_eval: EvalMetrics | None = None
        # Process CPU and wall time spent inside train(): what a benchmark compares with the whole run's.
        self.train_cpu_seconds = 0.0
        self.train_wall_seconds = 0.0

    def declared(self) -> list[tuple[PayloadKind, str, np.ndarray]]:
        """No shared tensor schema: posteriors are checked by the server half."""
        return []

    def setup(self, round_seed: int) -> list[Payload]:
        """No setup phase."""
        return []

    # ------------------------------------------------------------------ Algorithm 1's steps
    def local(self, rng: np.random.Generator) -> float:
        """E local steps on private batches (eqs. 1-2); keeps g_loc for the next learn step."""
        data, model = self.ctx.train, self.ctx.model
        model.train()
        e = self.cfg.local_steps
        start = torch.cat([p.detach().reshape(-1) for p in self.params]) if e > 1 else None
        total = 0.0
        for _ in range(e):
            idx = torch.as_tensor(rng.choice(len(data), size=min(self.cfg.batch_size, len(data)), replace=False),
                                  device=data.x.device)
            x, y = data.x[idx], data.y[idx]
            loss = F.cross_entropy(model(x), y)
            self.opt_local.zero_grad(set_to_none=True)
            loss.backward()
            if e == 1:
                self.g_loc = flat_grad(self.params).detach().clone()
            self.opt_local.step()
            total += float(loss.detach())
        if start is not None:
            self.g_loc = start - torch.cat([p.detach().reshape(-1) for p in self.params])
        if not self.cfg.labelled_seed:  # unlabelled seed data: confidence from the labels the node owns
            with torch.no_grad():
                model.eval()
                self.private_batch_accuracy = float((model(x).argmax(1) == y).float().mean())
                model.train()
        return total / e

    @torch.no_grad()
    def teach(self, rng: np.random.Generator) -> SeedPosteriors:
        """Posteriors p_i^pub(i) and Acc_i on a batch of the own domain's part of D_pub (eval mode)."""
        idx = np.sort(rng.choice(self.own_part, size=min(self.cfg.batch_size, self.own_part.size), replace=False))
        model = self.ctx.model
        model.eval()
        logits = model(self.pub_x[torch.as_tensor(idx, device=self.pub_x.device)])
        model.train()
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
        model = self.ctx.model
        model.train()
        logits = model(self.pub_x[torch.cat(idx)]).split([i.numel() for i in idx])
        probs = [torch.from_numpy(np.array(t.probabilities, dtype=np.float32)).to(device) for t in teachers]
        labels = [self.pub_y[i] for i in idx] if self.cfg.labelled_seed else None
        loss, kl, ce = self.distill(list(logits), probs, [t.teaching_confidence for t in teachers], labels)
        self.opt_global.zero_grad(set_to_none=True)
        loss.backward()
        g_pub = flat_grad(self.params)
        g_tilde, v = self.project(g_pub, self.g_loc) if self.cfg.project else (g_pub, 0.0)
        assign_flat_grad(self.params, g_tilde)
        self.opt_global.step()
        self.g_loc = None
        return {"teachers": float(len(teachers)), "loss_kl": float(kl.detach()), "loss_ce_pub": float(ce.detach()),
                "projected": float(v > 0), "projection_v": v}

    # ------------------------------------------------------------------ hooks
    def train(self, round_: int, round_seed: int, received: dict[PayloadKind, Payload]) -> list[Payload]:
        """learn(t − 1) from the relayed posteriors, then local(t) and teach(t); upload posteriors and metrics."""
        cpu, wall = time.process_time(), time.perf_counter()
        stats = self.learn(_teachers(received))
        if self.last_eval is None or (round_ - 1) % self.cfg.eval_every == 0:
            self.last_eval = self.ctx.metrics(0.0, evaluated_round=round_ - 1)
        rng = self.ctx.rng(round_seed)
        loss = self.local(rng)
        posteriors = self.teach(rng)
        m = self.last_eval
        now = time.process_time()
        self.train_cpu_seconds += now - cpu
        self.train_wall_seconds += time.perf_counter() - wall
        metrics = dataclasses.replace(m, train_loss=loss, extra={
            **m.extra, **stats, "teaching_confidence": posteriors.teaching_confidence,
            "train_cpu_seconds": self.train_cpu_seconds, "train_wall_seconds": self.train_wall_seconds,
            "process_cpu_seconds": now,
        })
        return [posteriors, metrics]

    def evaluate(self, round_: int, received: dict[PayloadKind, Payload]) -> EvalMetrics:
        """learn(T) from the last relayed posteriors, then the final model on every test set."""
        stats = self.learn(_teachers(received))
        return self.ctx.metrics(0.0, evaluated_round=round_ - 1, **stats)


def _teachers(received: dict[PayloadKind, Payload]) -> tuple[SeedPosteriors, ...]:
    """The relayed posteriors of a round (the runtime gathers the repeated kind into a tuple)."""
    got = received.get(SP, ())
    return tuple(t for t in (got if isinstance(got, tuple) else (got,)) if isinstance(t, SeedPosteriors))
