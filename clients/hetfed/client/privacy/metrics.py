"""What an organization's evaluation figures may say to the aggregator under DP (docs/privacy.md, "Metrics under DP").

By default every figure computed from private data is withheld: the upload names it in ``EvalMetrics.withheld``
and carries no value. With ``release_metrics`` the evaluation of a model trained under DP is released through a
Gaussian mechanism on clipped sums, accounted in the ledger like every other release. Figures without a
mechanism (the training loss, the training-example count, an algorithm's own figures, the time a round took)
stay withheld either way. The neighbouring relation is one example added to or removed from any of the
organization's sets: a held-out example moves only the sums below; a training example moves them only through
the model, which DP-SGD covers (the figures are then post-processing).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from hetfed.client.privacy.ledger import Release
from hetfed.client.privacy.mechanisms import NoiseSource, gaussian
from hetfed.client.training import DataSource, eval_mode, log_softmax_of
from hetfed.wire.payloads import EvalMetrics

PUBLIC_FIGURES = frozenset({"evaluated_round"})
"""Extra figures that are not functions of private data: a round number. The runtime adds the privacy
declaration's figures (ε, δ, σ, C) after the gate; those are public too."""

TEST_SET = "test"
"""The name of the organization's own test set among the evaluated sets (its figures are EvalMetrics fields)."""

# One set's release moves together: one example added or removed changes its correct count by at most 1, its
# clipped loss sum by at most B and its count by exactly 1. With noise σ_m on the count and on the correct count
# and σ_m·B on the loss sum, the displacement in units of the noise is at most √(1 + 1 + 1): one Gaussian
# mechanism of noise multiplier σ_m/√3 (Dwork and Roth 2014, Thm. A.1), cheaper than two separate releases
# of (sum, count) with sensitivity √2 each (their composition is a Gaussian of σ_m/2).
SET_SENSITIVITY = math.sqrt(3.0)


@dataclass(frozen=True)
class SetSums:
    """One held-out set's evaluation as sums: correct predictions, the loss sum (exact, and with each example's
    loss clipped to the bound), the number of examples."""

    correct: int
    loss: float
    clipped_loss: float
    count: int

    @property
    def accuracy(self) -> float:
        """The exact accuracy (0 on an empty set), as ``training.evaluate`` computes it."""
        return self.correct / self.count if self.count else 0.0

    @property
    def mean_loss(self) -> float:
        """The exact mean loss (0 on an empty set)."""
        return self.loss / self.count if self.count else 0.0


def evaluation_sums(model: nn.Module, data: DataSource, loss_bound: float, batch_size: int = 1024,
                    predict: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SetSums:
    """``model``'s sums on ``data`` in eval mode (``predict``: log-probabilities, as in ``training.evaluate``)."""
    if len(data) == 0:
        return SetSums(0, 0.0, 0.0, 0)
    pred = predict or log_softmax_of(model)
    correct, loss, clipped = 0, 0.0, 0.0
    with eval_mode(model), torch.no_grad():
        for batch in data.batches(slice(start, start + batch_size) for start in range(0, len(data), batch_size)):
            log_probs = pred(batch.x)
            each = F.nll_loss(log_probs, batch.y, reduction="none").double()
            loss += float(each.sum())
            clipped += float(each.clamp(max=loss_bound).sum())
            correct += int((log_probs.argmax(dim=1) == batch.y).sum())
    return SetSums(correct, loss, clipped, len(data))


@dataclass(frozen=True)
class ReleasedSet:
    """One set's released figures: accuracy in [0, 1], mean loss in [0, B], and the example count (≥ 0)."""

    accuracy: float
    loss: float
    count: int


def release_set(sums: SetSums, noise_multiplier: float, loss_bound: float,
                generator: NoiseSource) -> ReleasedSet:
    """The Gaussian release of one set: N(0, σ_m²) on the correct count and on the count, N(0, σ_m²B²) on the
    clipped loss sum (one draw of three standard normals from ``generator``, in that order). Dividing by the
    noisy count (at least 1), clipping into the valid range and rounding the count are post-processing."""
    z = gaussian(generator, 1.0, (3,), torch.float64).cpu().tolist()
    correct = sums.correct + noise_multiplier * z[0]
    loss = sums.clipped_loss + noise_multiplier * loss_bound * z[1]
    count = sums.count + noise_multiplier * z[2]
    denominator = max(count, 1.0)
    return ReleasedSet(accuracy=min(max(correct / denominator, 0.0), 1.0),
                       loss=min(max(loss / denominator, 0.0), loss_bound),
                       count=max(round(count), 0))


def set_release(noise_multiplier: float, sets: int = 1) -> Release:
    """The ledger entry of ``sets`` set releases at noise multiplier σ_m each (unsampled Gaussians of σ_m/√3)."""
    return Release(1.0, noise_multiplier / SET_SENSITIVITY, sets)


def released_figures(released: Mapping[str, ReleasedSet]) -> dict[str, float]:
    """The figures of released sets by the names the upload carries them under."""
    out: dict[str, float] = {}
    for name, r in released.items():
        if name == TEST_SET:
            out.update(test_accuracy=r.accuracy, test_loss=r.loss, num_test_examples=float(r.count))
        else:
            out[f"{name}_accuracy"], out[f"{name}_loss"] = r.accuracy, r.loss
    return out


def gate(m: EvalMetrics, released: Mapping[str, float]) -> EvalMetrics:
    """What of ``m`` may leave: each figure released this evaluation takes its released value, the public ones
    stay, and every other figure is withheld (named in ``withheld``, its field 0, its extra key dropped)."""
    withheld: list[str] = []
    fields: dict[str, float] = {}
    for name in EvalMetrics.FIELDS:
        if name in released:
            fields[name] = released[name]
        else:
            fields[name] = 0.0
            withheld.append(name)
    extra: dict[str, float] = {}
    for key, value in m.extra.items():
        if key in PUBLIC_FIGURES:
            extra[key] = value
        elif key in released:
            extra[key] = released[key]
        else:
            withheld.append(key)
    return EvalMetrics(train_loss=fields["train_loss"], num_train_examples=int(fields["num_train_examples"]),
                       test_accuracy=fields["test_accuracy"], test_loss=fields["test_loss"],
                       num_test_examples=int(fields["num_test_examples"]), extra=extra, withheld=tuple(withheld))
