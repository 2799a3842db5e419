"""The client-half interface and the context every client half is built with."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from hetfed.client.data import ClientData
from hetfed.client.models import SplitModel
from hetfed.client.training import DeviceData, evaluate
from hetfed.wire.payloads import EvalMetrics, Payload, PayloadKind
from hetfed.wire.specs import TrainConfig


@dataclass
class ClientContext:
    """Everything a client half works with: the private model and data, the run's config and seed."""

    organization: str
    model: SplitModel
    data: ClientData
    device: torch.device
    config: TrainConfig
    seed: int

    def __post_init__(self) -> None:
        self.train = DeviceData.of(self.data.train, self.device)
        self.test = DeviceData.of(self.data.test, self.device)
        self.global_test = DeviceData.of(self.data.global_test, self.device) if self.data.global_test else None
        self.cross_test = DeviceData.of(self.data.cross_test, self.device) if self.data.cross_test else None

    def rng(self, round_seed: int) -> np.random.Generator:
        """A generator for this organization's draws in a round (seeded by the run, round and organization)."""
        return np.random.default_rng([self.seed, round_seed, zlib.crc32(self.organization.encode())])

    def metrics(self, train_loss: float, evaluated_round: int, **extra: float) -> EvalMetrics:
        """Evaluate the current model on the own test set (and the shared one when present)."""
        acc, loss = evaluate(self.model, self.test)
        figures = {"evaluated_round": float(evaluated_round), **extra}
        if self.global_test is not None:
            gacc, gloss = evaluate(self.model, self.global_test)
            figures["global_test_accuracy"] = gacc
            figures["global_test_loss"] = gloss
            if self.cross_test is not None:
                # Domain partitions: within-domain (own test set), cross-domain (the other organizations'
                # domains) and all-domain accuracy, FedH2L's WDP, CDP and ACC.
                figures["wdp"] = acc
                figures["cdp"] = evaluate(self.model, self.cross_test)[0]
                figures["acc"] = gacc
        return EvalMetrics(
            train_loss=train_loss,
            num_train_examples=len(self.train),
            test_accuracy=acc,
            test_loss=loss,
            num_test_examples=len(self.test),
            extra=figures,
        )


class ClientHalf(Protocol):
    """Hooks the client runtime calls; the loop itself lives in the runtime."""

    def declared(self) -> list[tuple[PayloadKind, str, np.ndarray]]:
        """Tensors this client will upload every round (declared at Join; checked by the aggregator)."""
        ...

    def setup(self, round_seed: int) -> list[Payload]:
        """The one-time setup upload (only for algorithms with a setup phase)."""
        ...

    def train(self, round_: int, round_seed: int, received: dict[PayloadKind, Payload]) -> list[Payload]:
        """One round of local work on what the aggregator sent; returns the upload."""
        ...

    def evaluate(self, round_: int, received: dict[PayloadKind, Payload]) -> EvalMetrics:
        """The final evaluation of what this organization would deploy."""
        ...
