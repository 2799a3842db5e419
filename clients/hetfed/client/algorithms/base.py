"""The client-half interface and the context every client half is built with.

A client half is generic in its algorithm's config type (the registry pairs it with its spec, and a test
checks the pairing), receives typed payloads (``Received``) and trains through the one training loop
(``hetfed.client.training.fit``). The runtime owns the round loop and calls these hooks.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import numpy as np
import torch
from torch import nn

from hetfed.client.data import ClientData
from hetfed.client.data.core import Examples
from hetfed.client.models import SplitModel, build_model
from hetfed.client.training import DataSource, evaluate, make_optimizer, source_of, trainable
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import EvalMetrics, Payload, Received
from hetfed.wire.specs import TrainConfig

if TYPE_CHECKING:
    from hetfed.client.privacy.ledger import Release
    from hetfed.client.privacy.session import PrivacySession
    from hetfed.wire.distributed import DistributedSum

C = TypeVar("C", bound=TrainConfig)


@dataclass
class ClientContext(Generic[C]):
    """Everything a client half works with: the private model and data, the run's config and seed."""

    organization: str
    model: SplitModel
    data: ClientData
    device: torch.device
    config: C
    seed: int
    # Builds another model of this organization's architecture with the run's initial weights (two-model
    # algorithms keep a second copy).
    build_model: Callable[[], SplitModel] | None = None
    # Streamed data sets (an organization's own files): DataLoader worker processes, pinned memory on CUDA.
    num_workers: int = 0
    pin_memory: bool = True
    # Under DP (the organization's [privacy]): the session whose mechanisms and ledger the half's releases use;
    # ``train`` is then read through DP-SGD's Poisson sampling.
    privacy: PrivacySession | None = None
    # Under secure aggregation with distributed DP (``TrainConfig.distributed_sum``): the summed kind and its plan,
    # which the half uploads exact (clipped per example, unnoised) for the round's secure sum to encode and noise.
    distributed: DistributedSum | None = None
    eval_sets: dict[str, DataSource] = field(init=False)
    # Set by the round loop each round: evaluate on the held-out sets, or resend the last evaluation's figures.
    evaluating: bool = field(default=True, init=False)
    last_evaluation: EvalMetrics | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.train: DataSource = self.source(self.data.train)
        if self.privacy is not None:
            self.train = self.privacy.wrap(self.train)
        self.test = self.source(self.data.test)
        self.eval_sets = {name: self.source(ds) for name, ds in self.data.eval_sets().items()}

    def source(self, ds: Examples) -> DataSource:
        """``ds`` as the training loop reads it: in-memory arrays moved to the device once, an organization's
        own files streamed batch by batch."""
        return source_of(ds, self.device, num_workers=self.num_workers, pin_memory=self.pin_memory, seed=self.seed)

    @property
    def num_examples(self) -> int:
        """The training examples this organization declares in what it sends: under DP its released count N̂
        (the true count never leaves), else the true count."""
        return self.privacy.num_examples if self.privacy is not None else len(self.train)

    def rng(self, round_seed: int) -> np.random.Generator:
        """A generator for this organization's draws in a round (seeded by the run, round and organization)."""
        return np.random.default_rng([self.seed, round_seed, zlib.crc32(self.organization.encode())])

    @property
    def evaluates(self) -> bool:
        """Whether ``metrics`` evaluates this round: the round loop asks for it, or nothing was evaluated yet."""
        return self.evaluating or self.last_evaluation is None

    def metrics(self, train_loss: float, evaluated_round: int, extra: Mapping[str, float] | None = None, *,
                model: nn.Module | None = None,
                predict: Callable[[torch.Tensor], torch.Tensor] | None = None,
                under_dp: bool | None = None) -> EvalMetrics:
        """Evaluate ``model`` (default: the organization's model) on its own test set and every further held-out
        set the data provides, reported as ``<set>_accuracy`` and ``<set>_loss``, with ``extra`` figures; in a
        round the round loop does not evaluate, the last evaluation's figures with this round's loss and extra.

        The figures are exact: they are the organization's. Under DP the runtime gates them before they leave
        (``PrivacySession.protect``); here an evaluation is released through the metric mechanism when
        ``release_metrics`` is set and the evaluated model is trained under DP (``under_dp``; default: only the
        organization's own model, which the training loop trains with DP-SGD, not a model kept beside it)."""
        if not self.evaluates:
            assert self.last_evaluation is not None
            last = self.last_evaluation
            return dataclasses.replace(last, train_loss=train_loss, extra={**last.extra, **(extra or {})})
        net = model if model is not None else self.model
        figures = {"evaluated_round": float(evaluated_round), **(extra or {})}
        if self.privacy is None:
            acc, loss = evaluate(net, self.test, predict=predict)
            for name, data in self.eval_sets.items():
                figures[f"{name}_accuracy"], figures[f"{name}_loss"] = evaluate(net, data, predict=predict)
        else:
            from hetfed.client.privacy.metrics import TEST_SET, evaluation_sums

            bound = self.privacy.cfg.metric_loss_bound
            sums = {TEST_SET: evaluation_sums(net, self.test, bound, predict=predict)}
            sums.update({name: evaluation_sums(net, data, bound, predict=predict)
                         for name, data in self.eval_sets.items()})
            acc, loss = sums[TEST_SET].accuracy, sums[TEST_SET].mean_loss
            for name, s in sums.items():
                if name != TEST_SET:
                    figures[f"{name}_accuracy"], figures[f"{name}_loss"] = s.accuracy, s.mean_loss
            if self.privacy.cfg.release_metrics and (model is None if under_dp is None else under_dp):
                self.privacy.release_evaluation(sums)
            else:
                self.privacy.withhold_evaluation()
        self.last_evaluation = EvalMetrics(
            train_loss=train_loss,
            num_train_examples=self.num_examples,
            test_accuracy=acc,
            test_loss=loss,
            num_test_examples=len(self.test),
            extra=figures,
        )
        return self.last_evaluation


def on_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (in dicts, lists, tuples) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(on_device(v, device) for v in value)
    return value


class ClientHalf(Generic[C]):
    """Hooks the client runtime calls; the round loop lives in the runtime, the training loop in ``training``."""

    # Attributes beyond the model that carry state from one round to the next (modules and optimizers by
    # their state_dict, tensors, numpy arrays, numbers, strings, containers of these); ``private_state``
    # saves them with the model, so a restarted client resumes them.
    private_attributes: tuple[str, ...] = ()
    # How this half's uploads are made differentially private (docs/privacy.md): "dp-sgd" when every payload is
    # computed by models trained on private data through the training loop, "dp-sgd+gaussian-sums" when some are
    # computed from the data directly through the Gaussian class-sum release; None: the half cannot serve DP.
    privacy_mechanism: ClassVar[str | None] = None
    # Whether the model this half deploys (``deployed_model``, the one its metrics evaluate) is trained under
    # DP-SGD when [privacy] is on. False for a model kept in the organization and trained outside DP: its card
    # then says it is not differentially private, and its figures are never released (docs/privacy.md).
    deployed_under_dp: ClassVar[bool] = True

    def __init__(self, ctx: ClientContext[C]) -> None:
        self.ctx = ctx
        self.config: C = ctx.config
        self._optimizers: dict[str, torch.optim.Optimizer] = {}

    def optimized(self) -> dict[str, list[nn.Parameter]]:
        """Each optimiser this half trains with, by name (its key in the private state), and the parameters it
        steps; default: one, ``"optimizer"``, over the model's trainable parameters."""
        return {"optimizer": trainable(self.ctx.model)}

    def optimizer_config(self, name: str) -> TrainConfig:
        """The config optimiser ``name`` is built from (its kind, rate, momentum, decay); default: the run's."""
        return self.config

    def optimizer(self, name: str = "optimizer") -> torch.optim.Optimizer:
        """This round's optimiser ``name`` (called once a round): a fresh one every round, or with
        ``keep_optimizer_state`` the same one throughout, its momentum carried over rounds and restarts."""
        kept = self._optimizers.get(name)
        if kept is None or not self.config.keep_optimizer_state:
            kept = self._optimizers[name] = make_optimizer(self.optimized()[name], self.optimizer_config(name))
        return kept

    @classmethod
    def make_model(cls, name: str, input_shape: tuple[int, ...], num_classes: int, *, seed: int,
                   latent_dim: int | None, bounded_latent: bool, config: C) -> SplitModel:
        """The organization's model on CPU, initial weights fixed by ``seed`` (the runtime calls it through the
        half's class before the half exists); default: the architecture ``name`` (a registry name or an
        organization's builder ``"package.module:function"``) as it is."""
        return build_model(name, input_shape, num_classes, seed=seed, latent_dim=latent_dim,
                           bounded_latent=bounded_latent)

    def declarations(self, wire_dtype: str | None) -> list[DeclaredTensor]:
        """Tensors this client will upload every round (declared at Join, checked by the aggregator)."""
        return []

    def check_privacy(self) -> None:
        """Raise ``PrivacyError`` when this half, as configured, cannot send under DP (called before training)."""

    def privacy_plan(self, q: float, steps: int) -> tuple[list[Release], list[Release]]:
        """(setup, per training round) releases, each ``sigma`` a multiple of σ: by default one DP-SGD step of
        one objective per batch, ``steps`` batches a round at Poisson rate ``q``, and no setup release."""
        from hetfed.client.privacy.ledger import Release

        return [], [Release(q, 1.0, steps)]

    def setup(self, round_seed: int) -> list[Payload]:
        """The one-time setup upload (only for algorithms with a setup phase)."""
        return []

    def train(self, round_: int, round_seed: int, received: Received) -> list[Payload]:
        """One round of local work on what the aggregator sent; returns the upload (its metrics from
        ``ctx.metrics``, which follows the round loop's evaluation cadence)."""
        raise NotImplementedError

    def evaluate(self, round_: int, received: Received) -> EvalMetrics:
        """The final evaluation of what this organization would deploy."""
        raise NotImplementedError

    def private_state(self) -> dict[str, Any]:
        """What this organization keeps across rounds: the model's state, every ``private_attributes`` entry and,
        with ``keep_optimizer_state``, each optimiser built so far (live references; the runtime copies them when
        it writes the state directory)."""
        state: dict[str, Any] = {"model": self.ctx.model.state_dict()}
        for name in self.private_attributes:
            value = getattr(self, name)
            state[name] = value.state_dict() if hasattr(value, "state_dict") else value
        if self.config.keep_optimizer_state:
            state.update((name, opt.state_dict()) for name, opt in self._optimizers.items())
        return state

    def load_private_state(self, state: Mapping[str, Any]) -> None:
        """Resume from what ``private_state`` returned in an earlier process (a half built the same way)."""
        self.ctx.model.load_state_dict(state["model"])
        for name in self.private_attributes:
            current, saved = getattr(self, name), state[name]
            if hasattr(current, "load_state_dict"):
                current.load_state_dict(saved)
            else:
                setattr(self, name, on_device(saved, self.ctx.device))
        for name in self.optimized():
            if name in state:
                self.optimizer(name).load_state_dict(state[name])

    def deployed_model(self) -> SplitModel:
        """The model this organization would deploy (what local artifacts snapshot)."""
        return self.ctx.model
