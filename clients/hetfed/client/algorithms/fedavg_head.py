"""Head-only FedAvg's client half: the encoder stays private; only the classifier head is averaged."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from hetfed.client.algorithms.base import ClientContext, ClientHalf
from hetfed.client.training import Objective, epoch_batches, fit
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import EvalMetrics, HeadWeights, Payload, PayloadKind, Received
from hetfed.wire.specs import fedavg_head
from hetfed.wire.specs.fedavg_head import HeadFedAvgConfig


@fedavg_head.SPEC.client_half
class HeadFedAvgClient(ClientHalf[HeadFedAvgConfig]):
    """Evaluate own encoder + global head, train the whole model, upload the head."""

    # Under DP the model trains with DP-SGD; the head it uploads is post-processing.
    privacy_mechanism = "dp-sgd"

    def __init__(self, ctx: ClientContext[HeadFedAvgConfig]) -> None:
        super().__init__(ctx)
        frozen = [name for name, p in ctx.model.head.named_parameters() if not p.requires_grad]
        if frozen:
            raise ValueError(f"head-only FedAvg averages the classifier head, but this organization's head has frozen "
                             f"parameters {frozen}: a frozen tensor is never sent or overwritten, so let the head train")

    def declarations(self, wire_dtype: str | None) -> list[DeclaredTensor]:
        """The head's weight and bias."""
        head = self.ctx.model.head
        return [DeclaredTensor.of(PayloadKind.HEAD_WEIGHTS, "weight", head.weight.detach().cpu().numpy(), wire_dtype),
                DeclaredTensor.of(PayloadKind.HEAD_WEIGHTS, "bias", head.bias.detach().cpu().numpy(), wire_dtype)]

    def load(self, received: Received) -> None:
        """Take the global head, when the aggregator sent one."""
        hw = received.maybe(HeadWeights)
        if hw is not None:
            with torch.no_grad():
                self.ctx.model.head.weight.copy_(torch.from_numpy(np.array(hw.weight, dtype=np.float32)))
                self.ctx.model.head.bias.copy_(torch.from_numpy(np.array(hw.bias, dtype=np.float32)))

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """Evaluate own encoder + global head, train the whole model, upload the head."""
        ctx = self.ctx
        self.load(received)
        before = ctx.metrics(0.0, evaluated_round=round_ - 1)
        result = fit([Objective(ctx.model, self.optimizer())], epoch_batches(ctx.train, self.config, ctx.rng(round_seed)))
        head = ctx.model.head
        return [
            HeadWeights(head.weight.detach().cpu().numpy(), head.bias.detach().cpu().numpy(), ctx.num_examples),
            dataclasses.replace(before, train_loss=result.loss),
        ]

    def evaluate(self, round_: int, received: Received) -> EvalMetrics:
        """Own encoder with the final global head."""
        self.load(received)
        return self.ctx.metrics(0.0, evaluated_round=round_ - 1)
