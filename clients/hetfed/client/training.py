"""The one local training loop and the one evaluation routine every algorithm uses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from hetfed.client.data import ArrayDataset
from hetfed.wire.specs import TrainConfig

# extra_loss(model, x, y, logits) -> a scalar tensor added to the cross-entropy (FedProx, Fed-CMA, ...)
ExtraLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class DeviceData:
    """A data set moved to the training device once."""

    x: torch.Tensor
    y: torch.Tensor

    @classmethod
    def of(cls, ds: ArrayDataset, device: torch.device) -> DeviceData:
        """Copy ``ds`` to ``device``."""
        return cls(torch.as_tensor(ds.x, device=device), torch.as_tensor(ds.y, device=device))

    def __len__(self) -> int:
        return int(self.y.shape[0])


def minibatches(n: int, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Index batches of one seeded shuffled epoch."""
    order = rng.permutation(n)
    for start in range(0, n, batch_size):
        yield order[start : start + batch_size]


def make_optimizer(params: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """SGD (with momentum), Adam or AMSGrad, as the run configures."""
    if cfg.optimizer in ("adam", "amsgrad"):
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, amsgrad=cfg.optimizer == "amsgrad")
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def fit(
    model: nn.Module,
    data: DeviceData,
    cfg: TrainConfig,
    rng: np.random.Generator,
    extra_loss: ExtraLoss | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> float:
    """Train for ``local_epochs`` epochs (or ``local_steps`` steps); returns the mean training loss."""
    model.train()
    opt = optimizer or make_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
    n = len(data)
    if n == 0:
        return 0.0
    total, steps = 0.0, 0
    budget = cfg.local_steps if cfg.local_steps > 0 else None
    epochs = cfg.local_epochs if budget is None else 1 << 30
    for _ in range(epochs):
        for idx in minibatches(n, cfg.batch_size, rng):
            t = torch.as_tensor(idx, device=data.x.device)
            x, y = data.x[t], data.y[t]
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            if extra_loss is not None:
                loss = loss + extra_loss(model, x, y, logits)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach())
            steps += 1
            if budget is not None and steps >= budget:
                return total / steps
    return total / max(steps, 1)


@torch.no_grad()
def evaluate(model: nn.Module, data: DeviceData, batch_size: int = 1024) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on ``data``, in eval mode."""
    if len(data) == 0:
        return 0.0, 0.0
    was_training = model.training
    model.eval()
    correct, loss = 0, 0.0
    for start in range(0, len(data), batch_size):
        x, y = data.x[start : start + batch_size], data.y[start : start + batch_size]
        logits = model(x)
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(dim=1) == y).sum())
    model.train(was_training)
    return correct / len(data), loss / len(data)
