"""One organization's DP in one run: σ (given or solved for the planned rounds), the ledger, each round's private
step, the budget, and the declaration every upload carries (docs/privacy.md)."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from hetfed.client.privacy.config import PrivacyConfig
from hetfed.client.privacy.ledger import (
    DistributedRelease,
    Ledger,
    LedgerError,
    Release,
    epsilon_of,
    epsilon_with_distributed,
    solve_noise_multiplier,
)
from hetfed.client.privacy.mechanisms import (
    NoiseSource,
    PrivacyError,
    PrivateData,
    PrivateStep,
    gaussian,
    secret_generator,
)
from hetfed.client.privacy.metrics import SetSums, gate, release_set, released_figures, set_release
from hetfed.wire.payloads import EvalMetrics
from hetfed.wire.privacy import PrivacyDeclaration

if TYPE_CHECKING:
    from hetfed.client.training import DataSource

log = logging.getLogger("hetfed.client")

# Relative slack of the budget check: the plan σ was solved on and the ledger compose the same releases in
# another order, whose ε may differ in the last floating-point digits.
_BUDGET_SLACK = 1e-9


class PrivacySession:
    """The privacy of one organization in one run, from join to its last upload."""

    def __init__(self, cfg: PrivacyConfig, run: str, organization: str, state_dir: str | None, num_train: int,
                 device: torch.device, groups: np.ndarray | None = None) -> None:
        self.cfg = cfg
        self.run, self.organization = run, organization
        # N, the true count of training examples: it never leaves the organization under DP.
        self.num_train = int(num_train)
        # Under unit = "group": every training example's group id; the unit of privacy is the group.
        self.groups: np.ndarray | None = None
        if cfg.unit == "group":
            if groups is None:
                raise PrivacyError(f"{organization}: privacy.unit = \"group\" needs a group id per training example, "
                                   "and this organization's data gives none (docs/data.md: group ids)")
            self.groups = np.asarray(groups)
        # The true count of units one neighbour adds or removes: N examples, or G groups. Its released value Û
        # (``num_examples``) stands for it in everything the organization declares.
        self.units = self.num_train if self.groups is None else int(np.unique(self.groups).size)
        self._num_examples: int | None = None
        self.q = 0.0
        self.device = device
        self.ledger = Ledger.open(state_dir, run, organization, delta=cfg.delta, accountant=cfg.accountant,
                                  noise_multiplier=cfg.noise_multiplier or 0.0, clip_norm=cfg.clip_norm, unit=cfg.unit)
        # ε of the whole plan σ was solved for (None: σ was given or kept from the ledger).
        self.planned_epsilon: float | None = None
        self.mechanism = ""
        # The releases ``plan`` expects of the setup round and of each training round (multiples of σ).
        self._setup: list[Release] = []
        self._per_round: list[Release] = []
        # The distributed releases each training round makes (under secure aggregation's distributed DP).
        self._per_round_distributed: list[DistributedRelease] = []
        self._data: PrivateData | None = None
        # The models DP-SGD attached Opacus' hooks to (removed by ``release`` before a model is exported).
        self.hooked: dict[int, tuple[nn.Module, object]] = {}
        # The figures of the last evaluation released through the metric mechanism (name -> value), which the
        # uploads carry until the next evaluation; empty: every evaluation figure is withheld.
        self.released: dict[str, float] = {}

    def release_examples(self) -> int:
        """Û = max(1, round(U + N(0, σ_N²))), the organization's released count of units (U: its N training
        examples, or its G groups under unit = "group"): drawn once per run (the Gaussian mechanism, sensitivity 1
        in the unit, σ_N = ``count_noise_multiplier``) and kept in the ledger in the same write as its release,
        before anything leaves; a restart reads it back and releases nothing. Under unit = "group" the example
        count N has no bound on its sensitivity (a group may hold any number of examples), so the organization
        declares Ĝ wherever it declares a count."""
        key = "examples" if self.groups is None else "groups"
        held = self.ledger.released.get(key)
        if held is None:
            sigma_n = self.cfg.count_noise_multiplier
            gen = secret_generator(self.cfg.noise_seed, [f"{key[:-1]}-count", self.organization], self.device,
                                   secure=self.cfg.secure_mode)
            noise = float(gaussian(gen, sigma_n, (1,), torch.float64)[0])
            held = max(1, round(self.units + noise))
            self.ledger.bind_delta(self.cfg.delta_for(held))
            self.ledger.record(1.0, sigma_n)
            self.ledger.hold(key, held)
            self.ledger.commit()
        else:
            self.ledger.bind_delta(self.cfg.delta_for(int(held)))
        self._num_examples = int(held)
        return self._num_examples

    @property
    def num_examples(self) -> int:
        """Û: what the organization declares as its count (Join, every payload's count): its released number of
        training examples N̂, or of groups Ĝ under unit = "group"."""
        if self._num_examples is None:
            raise LedgerError("the example count is not released yet (release_examples)")
        return self._num_examples

    @property
    def delta(self) -> float:
        """δ of the (ε, δ) statement: the configured one, else 1/Û²."""
        return self.cfg.delta_for(self.num_examples)

    def joined(self, current_round: int) -> None:
        """After Join: a ledger that starts in a run already past its first round is refused. A lost ledger and an
        organization joining late for the first time look the same from here, and in the first ε would start from
        zero; the round is kept in the ledger, so a restart is refused the same way."""
        if self.ledger.joined_at is None:
            self.ledger.joined_at = int(current_round)
            self.ledger.save()
        if self.ledger.joined_at > 1:
            where = self.ledger.path or "kept in memory"
            raise LedgerError(f"{self.organization}: privacy: run {self.run!r} was at round {self.ledger.joined_at} "
                              f"when this organization's privacy ledger ({where}) first joined it: the ledger was "
                              "lost, or the organization joins late for the first time, and hetfed cannot tell "
                              "these apart; ε cannot be continued, so it sends nothing (restore the ledger, or "
                              "start a new run)")

    def set_batch_size(self, batch_size: int) -> None:
        """Poisson sampling at rate q = B/Û: the expected batch is the run's batch size, in examples, or in groups
        under unit = "group" (a mean group size would be a function of the data). q is computed from the
        released Û, so it is public; the sampler then draws at rate q over the real examples or groups, which is
        what the accountant assumes of a Poisson-sampled Gaussian at rate q."""
        self.q = min(1.0, batch_size / max(self.num_examples, 1))

    @property
    def sigma(self) -> float:
        """σ of every release (0 until ``plan``)."""
        return self.ledger.noise_multiplier

    @property
    def direct_sigma(self) -> float:
        """The noise multiplier of direct releases (class counts and sums): ``direct_noise_multiple``·σ."""
        return self.cfg.direct_noise_multiple * self.sigma

    @property
    def metrics_sigma(self) -> float:
        """The noise multiplier of a metric release: ``metrics_noise_multiple``·σ."""
        return self.cfg.metrics_noise_multiple * self.sigma

    @property
    def clip_norm(self) -> float:
        """C of every release."""
        return self.ledger.clip_norm

    def spent(self) -> float:
        """ε spent so far at δ."""
        return self.ledger.epsilon()

    def evaluation_plan(self, sets: int, evaluations: int) -> list[Release]:
        """The metric releases of ``evaluations`` evaluations of ``sets`` held-out sets, their ``sigma`` multiples
        of σ (none without ``release_metrics``)."""
        if not self.cfg.release_metrics or sets <= 0 or evaluations <= 0:
            return []
        return [set_release(self.cfg.metrics_noise_multiple, sets * evaluations)]

    def plan(self, mechanism: str, setup: Sequence[Release], per_round: Sequence[Release], rounds: int,
             evaluations: Sequence[Release] = (), distributed: Sequence[DistributedRelease] = ()) -> float:
        """Fix σ: the ledger's when it was kept before, the configured one, or the one at which the setup releases,
        ``rounds`` rounds of ``per_round`` and the run's metric releases (``evaluations``) spend the target ε
        (their ``sigma`` are multiples of σ), together with the releases already committed (the count Û, whose
        ``sigma`` is a noise multiplier) and ``rounds`` rounds of the ``distributed`` releases (their noise fixed by
        the run's plan; Rényi DP only)."""
        self._per_round_distributed = list(distributed)
        if distributed and self.cfg.accountant != "rdp":
            raise PrivacyError(f"distributed DP is accounted in Rényi DP, and this organization's accountant is "
                               f"{self.cfg.accountant!r}: use privacy.accountant = \"rdp\"")
        if self.cfg.unit == "group" and mechanism != "dp-sgd":
            raise PrivacyError(f"privacy.unit = \"group\" serves DP-SGD alone, and {mechanism} also releases "
                               "class sums and counts computed per record; use unit = \"record\"")
        self.mechanism = mechanism
        self._setup, self._per_round = list(setup), list(per_round)
        if self.ledger.noise_multiplier <= 0:
            target = self.cfg.solve_for
            if target is None:
                self.ledger.noise_multiplier = float(self.cfg.noise_multiplier or 0.0)
            else:
                plan = [*setup, *[Release(r.q, r.sigma, r.count * rounds) for r in per_round], *evaluations]
                fixed = list(self.ledger.releases)
                planned = [dataclasses.replace(d, count=d.count * rounds) for d in distributed]
                self.ledger.noise_multiplier = solve_noise_multiplier(plan, target, self.delta, self.cfg.accountant,
                                                                      fixed, planned)
                if planned:
                    self.planned_epsilon = epsilon_with_distributed([*fixed, *self.scaled(plan)], planned, self.delta)
                else:
                    self.planned_epsilon = epsilon_of([*fixed, *self.scaled(plan)], self.delta, self.cfg.accountant)
                log.info("%s: privacy: σ=%.4f spends ε=%.3g at δ=%.3g over %d rounds (%s, %s accountant)",
                         self.organization, self.sigma, target, self.delta, rounds, mechanism, self.cfg.accountant)
        return self.sigma

    def scaled(self, releases: Sequence[Release]) -> list[Release]:
        """``releases`` with their σ multiples turned into noise multipliers."""
        return [Release(r.q, r.sigma * self.sigma, r.count) for r in releases]

    def exhausted_before(self, setup: bool) -> str | None:
        """Why the next round (the setup round, or a training round) would take ε past the budget; None if not."""
        budget = self.cfg.budget
        if budget is None:
            return None
        spent = self.spent()
        after = self.ledger.epsilon(self.scaled(self._setup if setup else self._per_round),
                                    () if setup else self._per_round_distributed)
        if after > budget * (1 + _BUDGET_SLACK):
            return (f"{self.organization}: privacy budget ε={budget:g} at δ={self.delta:.3g} would be exceeded by the "
                    f"next round (ε {spent:.4g} spent, {after:.4g} after it); this organization sends nothing more "
                    "and leaves the run")
        return None

    def wrap(self, train: DataSource) -> PrivateData:
        """The training set as the training loop reads it under DP-SGD (its step set per round)."""
        self._data = PrivateData(train, self.step_for(0, 0), self.groups, self.cfg.max_examples_per_group,
                                 num_examples=self.num_examples)
        return self._data

    def generator(self, round_: int, round_seed: int) -> NoiseSource:
        """This round's secret generator; a redone round (after a restart) draws other noise, since the ledger
        kept the first attempt's releases. In secure mode a ChaCha20 keystream under a fresh key."""
        return secret_generator(self.cfg.noise_seed, [round_, round_seed, self.organization,
                                                      sum(r.count for r in self.ledger.releases)], self.device,
                                secure=self.cfg.secure_mode)

    def step_for(self, round_: int, round_seed: int) -> PrivateStep:
        """This round's DP-SGD step (its noise and Poisson samples from the round's secret generator), over the
        expected batch qÛ (examples, or groups)."""
        return PrivateStep(self.sigma, self.clip_norm, self.q, self.q * self.num_examples,
                           self.generator(round_, round_seed), self.ledger, self.hooked,
                           grouped=self.groups is not None)

    def begin_round(self, round_: int, round_seed: int) -> NoiseSource:
        """Set up a round's private step; returns its generator for the algorithm's own releases."""
        assert self._data is not None
        self._data.step = self.step_for(round_, round_seed)
        return self._data.step.generator

    @property
    def generator_now(self) -> NoiseSource:
        """The current round's secret generator (for an algorithm's own releases)."""
        assert self._data is not None
        return self._data.step.generator

    def release_evaluation(self, sums: Mapping[str, SetSums], generator: NoiseSource | None = None) -> None:
        """Release one evaluation's sets through the metric mechanism (one Gaussian release per set, recorded in
        the ledger before the upload leaves); they stay withheld when the budget would not cover them."""
        self.released = {}
        if not sums:
            return
        entry = set_release(self.metrics_sigma, len(sums))
        budget = self.cfg.budget  # epsilon_budget, else the target: the same budget every other check enforces
        # Before the round's training (an algorithm that scores the model it received) its steps are not
        # recorded yet, so the planned ones stand in; at the final evaluation that errs on the safe side.
        round_ = self.ledger.pending or self.scaled(self._per_round)
        if budget is not None and self.ledger.epsilon([*round_, entry]) > budget * (1 + _BUDGET_SLACK):
            log.warning("%s: privacy: releasing the evaluation would take ε past the budget %g; its figures stay "
                        "withheld", self.organization, budget)
            return
        gen = generator if generator is not None else self.generator_now
        released = {name: release_set(s, self.metrics_sigma, self.cfg.metric_loss_bound, gen)
                    for name, s in sums.items()}
        self.ledger.record(entry.q, entry.sigma, entry.count)
        self.released = released_figures(released)

    def withhold_evaluation(self) -> None:
        """The last evaluation is not released (no mechanism covers it): its figures stay withheld."""
        self.released = {}

    def protect(self, metrics: EvalMetrics) -> EvalMetrics:
        """What of ``metrics`` may leave: released figures, public ones, and every other figure withheld."""
        return gate(metrics, self.released)

    def release(self) -> None:
        """Take Opacus' hooks off every model (TorchScript cannot compile a module with backward hooks)."""
        for model, hooks in self.hooked.values():
            hooks.remove_hooks()  # type: ignore[attr-defined]
            for p in model.parameters():
                for name in ("grad_sample", "_forward_counter"):
                    if hasattr(p, name):
                        delattr(p, name)
            if hasattr(model, "autograd_grad_sample_hooks"):
                del model.autograd_grad_sample_hooks
        self.hooked.clear()

    def close_round(self, round_: int) -> PrivacyDeclaration:
        """Commit the round's releases to the ledger (on disk before the upload leaves); the declaration."""
        return self.declaration(self.ledger.close_round(round_))

    def declaration(self, epsilon: float | None = None, *, budget_spent: bool = False) -> PrivacyDeclaration:
        """What an upload declares: the mechanism, σ, C, ε spent (default: the ledger's), δ and the accountant;
        ``budget_spent``: the leave notice of an organization whose budget the next round would exceed."""
        return PrivacyDeclaration(mechanism=self.mechanism, noise_multiplier=self.sigma, clip_norm=self.clip_norm,
                                  epsilon=self.spent() if epsilon is None else epsilon, delta=self.delta,
                                  accountant=self.cfg.accountant, budget_spent=budget_spent,
                                  ephemeral_ledger=self.ledger.path is None)

    def figures(self, declaration: PrivacyDeclaration) -> dict[str, float]:
        """What the organization reports beside its metrics."""
        return {"privacy_epsilon": declaration.epsilon, "privacy_delta": declaration.delta,
                "privacy_noise_multiplier": declaration.noise_multiplier, "privacy_clip_norm": declaration.clip_norm}


def sigma_multiple(objectives: int) -> float:
    """The noise multiplier, in units of σ, of one release of k objectives stepped on one sample: σ/√k."""
    return 1.0 / math.sqrt(objectives)
