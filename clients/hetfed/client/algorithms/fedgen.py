"""FedGen's client half: FedAvg's round with the server's generator as a regulariser of the head, then the
encoder, the head and the round's label counts up.

Each round (users/userpFedGen.py:33-77 of the reference code): take the averaged encoder and head, and from round 2
the generator G; evaluate; then train ``local_steps`` steps of

    CE(model(x), y)  +  α_t·(B̂/B)·CE(head(G(ε̂, ŷ)), ŷ)  +  β_t·KL(softmax(head(G(ε, y))) ‖ softmax(model(x)))

on real batches (x, y), with ŷ drawn uniformly from the run's labels (B̂ of them) and ε, ε̂ uniform noise.
α_t = max(1e-4, α·0.98^(t−1)) and β_t alike. G runs in eval mode and is never trained here; the KL target is a
constant, so the first generated term trains the head only and the second the whole model through its output on
x. The counts sent are the labels of the round's training batches (the reference code's update_label_counts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import ClassVar, cast

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from hetfed.client.algorithms.base import ClientContext
from hetfed.client.algorithms.fedavg import (
    ModelAveragingClient,
    check_received,
    load_shared_state,
    shared_state,
)
from hetfed.client.models import SplitModel
from hetfed.client.training import Batch, Forward, LossTerm, Objective, cross_entropy, epoch_batches, fit
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import ClassCounts, HeadWeights, ModelWeights, Payload, PayloadKind, Received
from hetfed.wire.specs import fedgen
from hetfed.wire.specs.fedgen import GENERATOR_PREFIX, GENERATOR_TENSORS, FedGenConfig, regulariser_weight

HEAD = "head."


class Generator(nn.Module):
    """G(ε, y): Linear(n + K, hidden), BatchNorm1d, ReLU, Linear(hidden, d_e) (trainmodel/generator.py:34-79)."""

    def __init__(self, noise_dim: int, num_classes: int, hidden_dim: int, latent_dim: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.fc = nn.Linear(noise_dim + num_classes, hidden_dim)
        self.bn = nn.BatchNorm1d(hidden_dim)
        self.out = nn.Linear(hidden_dim, latent_dim)

    def forward(self, eps: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The latents of ``labels`` from noise ``eps``."""
        x = torch.cat([eps, F.one_hot(labels, self.num_classes).to(eps.dtype)], dim=1)
        return self.out(F.relu(self.bn(self.fc(x))))


class Regulariser:
    """FedGen's two generated terms of round t, drawing their labels and noise from ``rng``."""

    def __init__(self, model: SplitModel, generator: Generator, cfg: FedGenConfig, round_: int,
                 rng: np.random.Generator) -> None:
        self.model, self.generator, self.cfg, self.rng = model, generator, cfg, rng
        self.alpha = regulariser_weight(cfg.gen_alpha, cfg.gen_decay, round_)
        self.beta = regulariser_weight(cfg.gen_beta, cfg.gen_decay, round_)
        self.noise_dim = generator.fc.in_features - generator.num_classes

    def noise(self, n: int, device: torch.device) -> torch.Tensor:
        """Uniform noise in [0, 1) (the reference code's torch.rand, generator.py:63)."""
        return torch.from_numpy(self.rng.random((n, self.noise_dim), dtype=np.float32)).to(device)

    def latent(self, batch: Batch, out: Forward) -> torch.Tensor:
        """β_t·KL(softmax(head(G(ε, y))) ‖ softmax(logits)), batch mean (KLDivLoss "batchmean"); the target is a
        constant."""
        with torch.no_grad():
            z = self.generator(self.noise(batch.y.shape[0], batch.y.device), batch.y)
            target = F.softmax(self.model.head(z), dim=1)
        return self.beta * F.kl_div(F.log_softmax(out.logits, dim=1), target, reduction="batchmean")

    def teacher(self, batch: Batch, out: Forward) -> torch.Tensor:
        """α_t·(B̂/B)·CE(head(G(ε̂, ŷ)), ŷ) on B̂ labels drawn uniformly from the run's K."""
        cfg, device = self.cfg, batch.y.device
        labels = torch.from_numpy(self.rng.integers(0, cfg.num_classes, cfg.gen_batch_size)).to(device)
        with torch.no_grad():
            z = self.generator(self.noise(cfg.gen_batch_size, device), labels)
        return self.alpha * (cfg.gen_batch_size / cfg.batch_size) * F.cross_entropy(self.model.head(z), labels)

    def terms(self) -> list[LossTerm]:
        """The two terms, in the reference code's order of draws (G(ε, y) first, then ŷ and ε̂)."""
        return [self.latent, self.teacher]


@fedgen.SPEC.client_half
@fedgen.HEAD_SPEC.client_half
class FedGenClient(ModelAveragingClient[FedGenConfig]):
    """FedGen user: FedAvg's model, regularised by the generator; encoder (not under ``fedgen_head``), head and
    label counts go up."""

    # Under DP nothing would bound the label counts that go up with the weights (they are raw counts of the
    # round's batches): this half does not serve [privacy].
    privacy_mechanism: ClassVar[str | None] = None

    def __init__(self, ctx: ClientContext[FedGenConfig]) -> None:
        super().__init__(ctx)
        model, cfg = ctx.model, ctx.config
        if model.latent_dim != cfg.latent_dim or ctx.data.num_classes != cfg.num_classes:
            raise ValueError(
                f"FedGen run expects latent_dim={cfg.latent_dim} and num_classes={cfg.num_classes}; this "
                f"organization's model has latent_dim={model.latent_dim} and its data {ctx.data.num_classes} "
                "classes (the generator's latents go through every head)")
        self.generator: Generator | None = None

    def declarations(self, wire_dtype: str | None) -> list[DeclaredTensor]:
        """The encoder's shared state (not under ``fedgen_head``), and the head's weight and bias."""
        head = self.ctx.model.head
        body = super().declarations(wire_dtype) if self.config.shares_encoder else []
        return [d for d in body if not d.name.startswith(HEAD)] + [
            DeclaredTensor.of(PayloadKind.HEAD_WEIGHTS, "weight", head.weight.detach().cpu().numpy(), wire_dtype),
            DeclaredTensor.of(PayloadKind.HEAD_WEIGHTS, "bias", head.bias.detach().cpu().numpy(), wire_dtype)]

    def load(self, received: Received) -> None:
        """Take the averaged encoder and head, and the generator when one came."""
        mw = received.maybe(ModelWeights)
        if mw is not None:
            body = {k: v for k, v in mw.tensors.items() if not k.startswith(GENERATOR_PREFIX)}
            gen = {k[len(GENERATOR_PREFIX):]: v for k, v in mw.tensors.items() if k.startswith(GENERATOR_PREFIX)}
            weights = ModelWeights(body, mw.num_examples)
            check_received(self.ctx.model, weights)
            load_shared_state(self.ctx.model, weights)
            if gen:
                self.generator = self.build_generator(gen)
        hw = received.maybe(HeadWeights)
        if hw is not None:
            with torch.no_grad():
                self.ctx.model.head.weight.copy_(torch.from_numpy(np.array(hw.weight, dtype=np.float32)))
                self.ctx.model.head.bias.copy_(torch.from_numpy(np.array(hw.bias, dtype=np.float32)))

    def build_generator(self, tensors: dict[str, np.ndarray]) -> Generator:
        """The generator from the server's tensors, checked against the run's shape."""
        cfg = self.config
        missing = sorted(set(GENERATOR_TENSORS) - set(tensors))
        if missing or set(tensors) - set(GENERATOR_TENSORS):
            raise ValueError(f"the generator must carry exactly {GENERATOR_TENSORS}, missing {missing}")
        expected = {"fc.weight": (cfg.hidden_dim, cfg.noise_dim + cfg.num_classes),
                    "out.weight": (cfg.latent_dim, cfg.hidden_dim)}
        for name, shape in expected.items():
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"generator tensor {name} is {list(tensors[name].shape)}, the run's is {list(shape)}")
        gen = Generator(cfg.noise_dim, cfg.num_classes, cfg.hidden_dim, cfg.latent_dim)
        gen.load_state_dict({n: torch.from_numpy(np.array(tensors[n], dtype=np.float32)) for n in GENERATOR_TENSORS},
                            strict=False)
        gen.to(self.ctx.device).eval()
        for p in gen.parameters():
            p.requires_grad_(False)
        return gen

    def terms_for(self, round_: int, rng: np.random.Generator) -> list[LossTerm]:
        """Cross-entropy, and the generator's two terms once a generator has come."""
        if self.generator is None:
            return [cross_entropy]
        return [cross_entropy, *Regulariser(cast(SplitModel, self.ctx.model), self.generator, self.config, round_, rng).terms()]

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """Evaluate the received model, train it with the regulariser, send encoder, head and label counts."""
        ctx = self.ctx
        self.load(received)
        before = self.measure(round_ - 1)
        rng = ctx.rng(round_seed)
        counts = torch.zeros(ctx.data.num_classes, dtype=torch.int64, device=ctx.device)

        def counted(batches: Iterable[Batch]) -> Iterator[Batch]:
            for batch in batches:
                counts.add_(torch.bincount(batch.y, minlength=ctx.data.num_classes))
                yield batch

        terms = self.terms_for(round_, np.random.default_rng(rng.integers(1 << 62)))
        result = fit([Objective(ctx.model, self.optimizer(), terms)], counted(epoch_batches(ctx.train, self.config, rng)))
        head = ctx.model.head
        body = {k: v.detach().cpu().numpy() for k, v in shared_state(ctx.model).items() if not k.startswith(HEAD)}
        encoder = [ModelWeights(body, ctx.num_examples)] if self.config.shares_encoder else []
        return [*encoder,
                HeadWeights(head.weight.detach().cpu().numpy(), head.bias.detach().cpu().numpy(), ctx.num_examples),
                ClassCounts(counts.cpu().numpy()),
                dataclasses.replace(before, train_loss=result.loss)]
