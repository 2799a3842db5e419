"""FedRep's client half: the head trains with the body frozen, then the body with the head frozen; the body goes up.

The head is the model's classification head (``head.*``), the body every other trainable parameter: the
reference code's split, whose head is the last linear layer (main_fedrep.py:68-76). Each phase has its own
optimiser over its own parameters, so the frozen part takes no step at all (the paper's Algorithm 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
from torch import nn

from hetfed.client.algorithms.base import ClientContext
from hetfed.client.algorithms.fedavg import ModelAveragingClient
from hetfed.client.training import FitResult, Objective, epoch_batches, fit
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import ModelWeights, Payload, Received
from hetfed.wire.specs import TrainConfig, fedrep
from hetfed.wire.specs.fedrep import FedRepConfig

HEAD = "head."


@contextmanager
def frozen(params: Sequence[nn.Parameter]) -> Iterator[None]:
    """Within the block, ``params`` take no gradient (the reference code's ``requires_grad = False``)."""
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


@fedrep.SPEC.client_half
class FedRepClient(ModelAveragingClient[FedRepConfig]):
    """Load the global body, evaluate, train the head for τ_h epochs, then the body for τ_b epochs; send the body."""

    def __init__(self, ctx: ClientContext[FedRepConfig]) -> None:
        super().__init__(ctx)
        empty = [name for name, params in self.optimized().items() if not params]
        if empty:
            raise ValueError(f"FedRep trains the head, then the body, but this organization's {' and '.join(empty)} "
                             "has no trainable parameter: let some of each train")

    def optimized(self) -> dict[str, list[nn.Parameter]]:
        """Two optimisers: ``head`` over the head's trainable parameters, ``body`` over the rest."""
        named = [(n, p) for n, p in self.ctx.model.named_parameters() if p.requires_grad]
        return {"head": [p for n, p in named if n.startswith(HEAD)],
                "body": [p for n, p in named if not n.startswith(HEAD)]}

    def declarations(self, wire_dtype: str | None) -> list[DeclaredTensor]:
        """The body's shared state: the head is never declared, so an upload that carries it is refused."""
        return [d for d in super().declarations(wire_dtype) if not d.name.startswith(HEAD)]

    def upload(self) -> ModelWeights:
        """The trained body's shared state (no head tensor)."""
        weights = super().upload()
        return dataclasses.replace(weights, tensors={k: v for k, v in weights.tensors.items()
                                                     if not k.startswith(HEAD)})

    def phase(self, name: str, epochs: int, rng: np.random.Generator) -> FitResult:
        """``epochs`` shuffled epochs on the ``name`` part ("head" or "body"), the other part frozen.

        Only ``name``'s optimiser steps, so the other part never moves. Outside DP it also takes no gradient
        (the head phase backpropagates through the head alone). Under DP it keeps its gradients: the
        per-example hooks of the private step need every module's activations, and clip over the stepped
        parameters only."""
        other = self.optimized()["body" if name == "head" else "head"]
        schedule = TrainConfig(local_epochs=epochs, batch_size=self.config.batch_size)
        objective = Objective(self.ctx.model, self.optimizer(name), self.terms(), self.forward)
        with frozen(other if self.ctx.privacy is None else []):
            return fit([objective], epoch_batches(self.ctx.train, schedule, rng))

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """Evaluate the received body with this organization's head, run both phases, upload the body; the
        reported loss is the mean over every step of the round."""
        self.load(received)
        before = self.measure(round_ - 1)
        rng = self.ctx.rng(round_seed)
        head = self.phase("head", self.config.head_epochs, rng)
        body = self.phase("body", self.config.body_epochs, rng)
        steps = head.steps + body.steps
        loss = (head.loss * head.steps + body.loss * body.steps) / steps if steps else 0.0
        return [self.upload(), dataclasses.replace(before, train_loss=loss)]
