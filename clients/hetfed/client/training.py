"""The one local training loop and the one evaluation routine every algorithm uses.

An algorithm expresses its local objective as ``Objective``s: a model, its optimiser, the loss terms summed
on each batch, optionally its own forward pass (a stochastic encoder, a feature hook) and a hook between the
backward pass and the optimiser step (a gradient projection). ``fit`` steps every objective on every batch
in order, so two models trained on the same batch (a global and a personal model), several optimisers (a
local step and a mutual-learning step, called one after the other), stochastic forward passes (a
probabilistic encoder) and terms on any parameters (a sparsity penalty on masks) all use this loop.
Batches come from ``epoch_batches`` (shuffled epochs or a number of steps) or ``sampled_batches``
(independent draws).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Union

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from hetfed.client.data.core import ArrayDataset, Examples, StreamedDataset
from hetfed.client.errors import PrivacyError
from hetfed.wire.specs import TrainConfig

if TYPE_CHECKING:
    from hetfed.client.privacy.mechanisms import PrivateData, PrivateStep


@dataclass
class DeviceData:
    """A data set held on the training device (the built-in in-memory sets), read in batches by index."""

    x: torch.Tensor
    y: torch.Tensor

    @classmethod
    def of(cls, ds: ArrayDataset, device: torch.device) -> DeviceData:
        """Copy ``ds`` to ``device``."""
        return cls(torch.as_tensor(ds.x, device=device), torch.as_tensor(ds.y, device=device))

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def device(self) -> torch.device:
        """Where the batches are."""
        return self.y.device

    def take(self, idx: np.ndarray) -> Batch:
        """The examples at ``idx`` as a batch."""
        return self.take_at(torch.as_tensor(idx, device=self.x.device))

    def take_at(self, idx: torch.Tensor) -> Batch:
        """The examples at ``idx``, an index tensor on the data's device, as a batch."""
        return Batch(self.x[idx], self.y[idx])

    def batches(self, indices: Iterable[torch.Tensor | slice]) -> Iterator[Batch]:
        """One batch per element of ``indices`` (index tensors on the device, or slices): each batch is one
        gather on the device, with no worker, copy or collation.

        A plain loop, not a DataLoader: one costs 0.19 ms to start and 0.06 ms a batch on the CPU (measured on
        this project's 2-core machine), which a round of a few steps, and each evaluation, would pay for nothing."""
        for idx in indices:
            yield Batch(self.x[idx], self.y[idx])


class _Order(torch.utils.data.Sampler[list[int]]):
    """A batch sampler whose batches are set before each pass (one DataLoader, its workers kept, every epoch)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class StreamData:
    """A data set read from the organization's files in batches (a ``StreamedDataset``): only its labels are
    held, on the device; inputs stream through a DataLoader (``num_workers`` processes, pinned memory and
    non-blocking copies on CUDA) batch by batch, in the order the training loop's seeded sampler draws."""

    def __init__(self, ds: StreamedDataset, device: torch.device, *, num_workers: int = 0,
                 pin_memory: bool = True, seed: int = 0) -> None:
        self.ds = ds
        self.y = torch.as_tensor(ds.y, device=device)
        self._device = device
        self._cuda = device.type == "cuda"
        self._order = _Order()
        self._loader = torch.utils.data.DataLoader(
            ds.dataset, batch_sampler=self._order, num_workers=num_workers,
            pin_memory=pin_memory and self._cuda, persistent_workers=num_workers > 0,
            # Worker seeds (for datasets that draw augmentations) follow the run's seed.
            generator=torch.Generator().manual_seed(int(seed)),
        )

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def device(self) -> torch.device:
        """Where the batches are."""
        return self._device

    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> Batch:
        x = x.to(self._device, dtype=torch.float32, non_blocking=self._cuda)
        return Batch(x, y.to(self._device, dtype=torch.int64, non_blocking=self._cuda))

    def take(self, idx: np.ndarray) -> Batch:
        """The examples at ``idx`` as one batch on the device (read now)."""
        rows = [int(i) for i in np.asarray(idx).reshape(-1)]
        if not rows:
            return self._empty()
        x, y = torch.utils.data.default_collate([self.ds.dataset[i] for i in rows])
        return self._to_device(torch.as_tensor(x), torch.as_tensor(y))

    def _empty(self) -> Batch:
        """A batch of no example, of the inputs' shape (collating nothing fails)."""
        return Batch(torch.zeros((0, *self.ds.input_shape), device=self._device),
                     torch.zeros(0, dtype=torch.int64, device=self._device))

    def take_at(self, idx: torch.Tensor) -> Batch:
        """The examples at ``idx`` (an index tensor) as one batch."""
        return self.take(idx.cpu().numpy())

    def batches(self, indices: Iterable[torch.Tensor | slice]) -> Iterator[Batch]:
        """One batch per element of ``indices`` (index tensors or slices), streamed through the DataLoader; an
        empty element (a Poisson sample of no example) gives an empty batch without a read."""
        n = len(self)
        order = [list(range(*i.indices(n))) if isinstance(i, slice) else i.cpu().tolist() for i in indices]
        self._order.batches = [rows for rows in order if rows]
        loaded = iter(self._loader)
        for rows in order:
            if rows:
                x, y = next(loaded)
                yield self._to_device(x, y)
            else:
                yield self._empty()
        next(loaded, None)  # ends the loader's pass


DataSource = Union[DeviceData, StreamData, "PrivateData"]
"""A data set as the training loop reads it: resident on the device, or streamed from files; under DP the
training set is wrapped so that the loop draws Poisson samples and privatises each step on them."""


def source_of(ds: Examples, device: torch.device, *, num_workers: int = 0, pin_memory: bool = True,
              seed: int = 0) -> DataSource:
    """The training loop's view of ``ds``: arrays go to the device once, streamed datasets stay on disk."""
    if isinstance(ds, StreamedDataset):
        return StreamData(ds, device, num_workers=num_workers, pin_memory=pin_memory, seed=seed)
    return DeviceData.of(ds, device)


@dataclass
class Batch:
    """One minibatch: inputs and labels on the training device."""

    x: torch.Tensor
    y: torch.Tensor
    # Set on batches of private examples under DP (hetfed.client.privacy): every step on them is DP-SGD's.
    private: PrivateStep | None = None
    # Under group-level DP (privacy.unit = "group"): each example's group in the batch, 0 .. g-1, whose summed
    # gradient DP-SGD clips as one.
    groups: torch.Tensor | None = None


@dataclass
class Forward:
    """A forward pass's outputs: the logits and any named intermediate tensors (latents, μ and σ, features)."""

    logits: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.extras[name]
        except KeyError:
            raise KeyError(f"the forward pass produced no {name!r} (it produced {sorted(self.extras)})") from None


class LossTerm(Protocol):
    """One term of a local objective, computed from the batch and the forward pass."""

    def __call__(self, batch: Batch, out: Forward) -> torch.Tensor:
        """A scalar tensor added to the objective."""
        ...


def data_free(term: Callable[[Batch, Forward], torch.Tensor]) -> LossTerm:
    """Mark ``term`` as depending on no example (a penalty on the parameters against received values): under
    DP-SGD its gradient is added after the privatised one instead of being clipped per example."""
    term.data_free = True  # type: ignore[attr-defined]
    return term  # type: ignore[return-value]


class PerExample:
    """A loss term given per example: ``values(batch, out)`` is a tensor [n], one value per example of the batch.

    On a batch the term's value is ``value(batch, out)`` when given (the mean of the values, computed as the plain
    path always has), else the mean of the values. Under DP-SGD the step backpropagates the sum of the values,
    so each example's gradient is that of its own value, whatever else the batch holds: its objective is one
    example's share of the mean objective over the N training examples (a weight over N/n_k for a class term).
    """

    def __init__(self, values: Callable[[Batch, Forward], torch.Tensor],
                 value: Callable[[Batch, Forward], torch.Tensor] | None = None, name: str | None = None) -> None:
        self.values = values
        self.value = value
        self.__qualname__ = self.__name__ = name or getattr(value or values, "__qualname__", type(self).__name__)

    def __call__(self, batch: Batch, out: Forward) -> torch.Tensor:
        """The term's value on the batch."""
        return self.value(batch, out) if self.value is not None else self.values(batch, out).mean()

    def per_example(self, batch: Batch, out: Forward) -> torch.Tensor:
        """Each example's value, a tensor [n]."""
        return self.values(batch, out)


def _mean_cross_entropy(batch: Batch, out: Forward) -> torch.Tensor:
    return F.cross_entropy(out.logits, batch.y)


cross_entropy = PerExample(lambda batch, out: F.cross_entropy(out.logits, batch.y, reduction="none"),
                           _mean_cross_entropy, "cross_entropy")
"""The classification loss: cross-entropy of the logits against the labels (per example under DP-SGD)."""


def plain_forward(model: nn.Module, batch: Batch) -> Forward:
    """The model's logits, nothing else."""
    return Forward(model(batch.x))


@dataclass
class Objective:
    """One model trained on every batch: its optimiser and the loss terms summed into its objective."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    terms: Sequence[LossTerm] = (cross_entropy,)
    forward: Callable[[nn.Module, Batch], Forward] = plain_forward
    # Called after the backward pass and before the optimiser step (to read or change the gradients); under
    # DP-SGD it sees the privatised gradients.
    before_step: Callable[[], None] | None = None
    # The model never leaves the organization, nor does anything computed from it (the reported metrics aside):
    # DP-SGD leaves it alone (a personal model trained beside the one that is sent).
    kept: bool = False


class TrainingDivergedError(ArithmeticError):
    """Local training diverged: an objective's mean training loss over the round is NaN or infinite, so its
    model's weights have overflowed and nothing computed from them may be sent."""


@dataclass
class FitResult:
    """Mean objective value of each objective over the steps taken."""

    losses: list[float]
    steps: int

    @property
    def loss(self) -> float:
        """The first objective's mean loss (the one an organization reports)."""
        return self.losses[0] if self.losses else 0.0


def fit(objectives: Sequence[Objective], batches: Iterable[Batch]) -> FitResult:
    """Step every objective on every batch, in order; returns the mean loss of each.

    The losses are summed on the training device, in float64, and read once at the end: reading each step's
    loss would make the host wait for the device at every step. The sums are those of Python floats, bit for
    bit (the same float64 additions in the same order). A mean that is NaN or infinite raises
    ``TrainingDivergedError``: the weights have overflowed, and the round must not send anything made from them.
    An optimiser from ``make_optimizer`` with a ``max_grad_norm`` steps on the gradient scaled to at most that
    norm (over all its parameters, after ``before_step``).
    """
    for o in objectives:
        o.model.train()
        apply_lr_factor(o.optimizer)
    caps = [_capped(o.optimizer) for o in objectives]
    totals: list[float | torch.Tensor] = [0.0] * len(objectives)
    taken = [0] * len(objectives)
    steps = 0
    for batch in batches:
        for i, o in enumerate(objectives):
            if batch.private is not None and not o.kept:
                loss = _private_step(o, batch, batch.private)
            elif batch.private is not None and batch.y.shape[0] == 0:
                continue  # a kept model's step on an empty Poisson sample: no example, no step (a mean of none is NaN)
            else:
                loss = summed(o.terms, batch, o.forward(o.model, batch))
                o.optimizer.zero_grad(set_to_none=True)
                loss.backward()
            if o.before_step is not None:
                o.before_step()
            params, cap = caps[i]
            # The gradient the step uses, after any change before_step made; torch skips parameters without a
            # gradient and scales on the device (no host sync).
            if cap:
                nn.utils.clip_grad_norm_(params, cap)
            o.optimizer.step()
            totals[i] = totals[i] + loss.detach().to(torch.float64)
            taken[i] += 1
        if batch.private is not None:
            batch.private.end_batch()
        steps += 1
    means = [float(t) / max(n, 1) for t, n in zip(totals, taken, strict=True)]
    for i, (o, mean) in enumerate(zip(objectives, means, strict=True)):
        if not math.isfinite(mean):  # one check per round, on the value read anyway: no wait per step
            which = f"objective {i + 1} of {len(objectives)}: " if len(objectives) > 1 else ""
            lr = o.optimizer.param_groups[0].get("lr") if o.optimizer.param_groups else None
            at = f" at lr {lr:g}" if isinstance(lr, (int, float)) else ""
            raise TrainingDivergedError(f"{which}the mean training loss is {mean} over {steps} steps{at}")
    return FitResult(means, steps)


def summed(terms: Sequence[LossTerm], batch: Batch, out: Forward) -> torch.Tensor:
    """The objective's value: its terms added in order, the first one first."""
    loss = terms[0](batch, out)
    for term in terms[1:]:
        loss = loss + term(batch, out)
    return loss


def _private_step(o: Objective, batch: Batch, step: PrivateStep) -> torch.Tensor:
    """One objective's DP-SGD step on a Poisson-sampled batch: the gradient of the sum of its terms' per-example
    values privatised, then its data-free terms' gradient added; returns the objective's value (the mean of the
    per-example values plus the data-free terms)."""
    params = [p for group in o.optimizer.param_groups for p in group["params"] if p.requires_grad]
    size = int(batch.y.shape[0])
    example_terms = [t for t in o.terms if not getattr(t, "data_free", False)]
    free_terms = [t for t in o.terms if getattr(t, "data_free", False)]
    step.begin(o.model)
    try:
        if size == 0:  # an empty Poisson sample: the privatised gradient is noise alone (no forward pass)
            out = Forward(batch.x.new_zeros((0, 0)))
            loss = torch.zeros((), device=batch.y.device)
            step.backward(o.model, params, loss, 0)
        else:
            out = o.forward(o.model, batch)
            values = _per_example_values(example_terms, batch, out, size)
            step.backward(o.model, params, values.sum(), size, batch.groups)
            loss = values.detach().mean()
        if free_terms:  # on every sample, the empty one too: they depend on no example
            free = summed(free_terms, batch, out)
            for p, g in zip(params, torch.autograd.grad(free, params, allow_unused=True), strict=True):
                if g is not None:
                    p.grad = p.grad + g if p.grad is not None else g
            loss = loss + free.detach()
        step.check_buffers(o.model)
        return loss
    finally:
        step.end(o.model)


def _per_example_values(terms: Sequence[LossTerm], batch: Batch, out: Forward, size: int) -> torch.Tensor:
    """Σ over ``terms`` of each example's value, a tensor [n]; a term without a per-example form is refused (a
    term over the whole batch would let one example change the gradient of every other)."""
    total: torch.Tensor | None = None
    for term in terms:
        values_of = getattr(term, "per_example", None)
        name = getattr(term, "__qualname__", None) or type(term).__name__
        if values_of is None:
            raise PrivacyError(f"loss term {name!r} has no per-example form, so DP-SGD cannot bound one example's "
                               "influence on it: mark it data_free or give it a per-example form (PerExample)")
        values = values_of(batch, out)
        if tuple(values.shape) != (size,):
            raise PrivacyError(f"loss term {name!r} gave per-example values of shape {tuple(values.shape)} on a batch "
                               f"of {size}; its per-example form must give one value per example")
        total = values if total is None else total + values
    if total is None:
        raise ValueError("an objective under DP-SGD needs a term that depends on the examples")
    return total


def steps_per_round(n: int, cfg: TrainConfig) -> int:
    """The local steps of one round over ``n`` examples: ``local_steps``, else ``local_epochs`` epochs of ⌈n/B⌉."""
    if cfg.local_steps > 0:
        return int(cfg.local_steps)
    return int(cfg.local_epochs) * math.ceil(n / cfg.batch_size) if n else 0


def epoch_batches(data: DataSource, cfg: TrainConfig, rng: np.random.Generator) -> Iterator[Batch]:
    """``local_epochs`` shuffled epochs of minibatches, or exactly ``local_steps`` of them when it is > 0."""
    n = len(data)
    if n == 0:
        return
    # DP-SGD (PrivateData, which this module does not import): Poisson samples of rate B/N̂, as many as the steps
    # over the released count N̂, as the ledger's plan counted them.
    if hasattr(data, "poisson_batches") and hasattr(data, "num_examples"):
        yield from data.poisson_batches(steps_per_round(data.num_examples, cfg))
        return
    budget = cfg.local_steps if cfg.local_steps > 0 else None
    epochs = cfg.local_epochs if budget is None else 1 << 30
    steps = 0
    for _ in range(epochs):
        # The epoch's order goes to the device once; each batch is a slice of it (one copy per epoch, not one
        # per step, where a host-to-device copy waits for the device).
        order = torch.as_tensor(rng.permutation(n), device=data.device)
        starts = range(0, n, cfg.batch_size)
        if budget is not None:
            starts = starts[: budget - steps]
        yield from data.batches(order[start : start + cfg.batch_size] for start in starts)
        steps += len(starts)
        if budget is not None and steps >= budget:
            return


def sampled_batches(data: DataSource, batch_size: int, steps: int, rng: np.random.Generator) -> Iterator[Batch]:
    """``steps`` independent minibatches, each drawn without replacement (under DP-SGD, Poisson samples)."""
    n = len(data)
    if hasattr(data, "poisson_batches"):
        yield from data.poisson_batches(steps)
        return
    yield from data.batches(torch.as_tensor(rng.choice(n, size=min(batch_size, n), replace=False), device=data.device)
                            for _ in range(steps))


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that receive gradients."""
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(params: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """SGD (with momentum), Adam or AMSGrad, as the run configures. Its rate is ``cfg.lr``, its base: ``fit``
    steps it at the base times the round's factor (``TrainConfig.lr_decay``)."""
    opt: torch.optim.Optimizer
    if cfg.optimizer in ("adam", "amsgrad"):
        opt = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, amsgrad=cfg.optimizer == "amsgrad")
    else:
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    for group in opt.param_groups:
        group["base_lr"] = group["lr"]
        group["max_grad_norm"] = float(cfg.max_grad_norm)
    return opt


def _capped(optimizer: torch.optim.Optimizer) -> tuple[list[nn.Parameter], float]:
    """The parameters whose gradient ``fit`` caps before each step of ``optimizer``, and the cap (0.0: none): the
    groups ``make_optimizer`` built with a ``max_grad_norm``, whose norm is taken over all of them together."""
    caps = {float(g.get("max_grad_norm", 0.0)) for g in optimizer.param_groups} - {0.0}
    if not caps:
        return [], 0.0
    if len(caps) > 1:
        raise ValueError(f"one optimiser with several gradient caps {sorted(caps)}")
    return [p for g in optimizer.param_groups if g.get("max_grad_norm", 0.0) for p in g["params"]], caps.pop()


# The training round's factor on every base learning rate (TrainConfig.lr_factor). The round loop sets it around
# a half's training hook, so every algorithm follows the schedule without knowing of it.
_LR_FACTOR: contextvars.ContextVar[float] = contextvars.ContextVar("hetfed_lr_factor", default=1.0)


@contextlib.contextmanager
def round_lr_factor(factor: float) -> Iterator[None]:
    """Within the block, optimisers from ``make_optimizer`` step at their base rate times ``factor``."""
    token = _LR_FACTOR.set(float(factor))
    try:
        yield
    finally:
        _LR_FACTOR.reset(token)


def apply_lr_factor(optimizer: torch.optim.Optimizer) -> None:
    """Set each group's rate to its base times the round's factor (groups without a base are left alone)."""
    factor = _LR_FACTOR.get()
    for group in optimizer.param_groups:
        if "base_lr" in group:
            group["lr"] = group["base_lr"] * factor


@contextlib.contextmanager
def eval_mode(*models: nn.Module) -> Iterator[None]:
    """Put ``models`` in eval mode for the block and restore each one's previous mode after it."""
    modes = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(models, modes, strict=True):
            m.train(mode)


def log_softmax_of(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The default prediction: log-probabilities of the model's logits."""
    return lambda x: torch.log_softmax(model(x), dim=1)


@torch.no_grad()
def evaluate(model: nn.Module, data: DataSource, batch_size: int = 1024,
             predict: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on ``data``, in eval mode.

    ``predict(x)`` returns log-probabilities (default: log-softmax of the logits; a stochastic model may
    average its samples' probabilities).
    """
    if len(data) == 0:
        return 0.0, 0.0
    pred = predict or log_softmax_of(model)
    correct, loss = 0, 0.0
    with eval_mode(model):
        for batch in data.batches(slice(start, start + batch_size) for start in range(0, len(data), batch_size)):
            x, y = batch.x, batch.y
            log_probs = pred(x)
            loss += float(F.nll_loss(log_probs, y, reduction="sum"))
            correct += int((log_probs.argmax(dim=1) == y).sum())
    return correct / len(data), loss / len(data)
