"""The throwaway algorithm's client half (torch): train, upload the head, report the received head's norm."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from hetfed.client.algorithms.base import ClientHalf
from hetfed.client.training import Objective, epoch_batches, fit, make_optimizer, trainable
from hetfed.wire.payloads import EvalMetrics, HeadWeights, Payload, Received
from tests.throwaway.spec import ShrinkConfig


class ShrinkClient(ClientHalf[ShrinkConfig]):
    """Take the global head, train the whole model, upload the head."""

    def _receive(self, received: Received) -> float:
        hw = received.maybe(HeadWeights)
        if hw is None:
            return -1.0
        head = self.ctx.model.head
        with torch.no_grad():
            head.weight.copy_(torch.from_numpy(np.array(hw.weight, dtype=np.float32)))
            head.bias.copy_(torch.from_numpy(np.array(hw.bias, dtype=np.float32)))
        return float(np.sqrt(np.sum(np.square(hw.weight)) + np.sum(np.square(hw.bias))))

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """Load the head, evaluate, train, upload the head and the metrics."""
        ctx = self.ctx
        norm = self._receive(received)
        before = ctx.metrics(0.0, evaluated_round=round_ - 1, extra={"received_head_norm": norm})
        opt = make_optimizer(trainable(ctx.model), self.config)
        result = fit([Objective(ctx.model, opt)], epoch_batches(ctx.train, self.config, ctx.rng(round_seed)))
        head = ctx.model.head
        return [HeadWeights(head.weight.detach().cpu().numpy(), head.bias.detach().cpu().numpy(), len(ctx.train)),
                dataclasses.replace(before, train_loss=result.loss)]

    def evaluate(self, round_: int, received: Received) -> EvalMetrics:
        """The model with the final global head."""
        norm = self._receive(received)
        return self.ctx.metrics(0.0, evaluated_round=round_ - 1, extra={"received_head_norm": norm})
