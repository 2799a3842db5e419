"""One organization's DP in one run: σ (given or solved for the planned rounds), the ledger, each round's private
step, the budget, and the declaration every upload carries (docs/privacy.md)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from hetfed.client.privacy.config import PrivacyConfig
from hetfed.client.privacy.ledger import Ledger, LedgerError, Release, epsilon_of, solve_noise_multiplier
from hetfed.client.privacy.mechanisms import PrivateData, PrivateStep, secret_generator
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
                 device: torch.device) -> None:
        self.cfg = cfg
        self.run, self.organization = run, organization
        # N, the true count: it never leaves the organization under DP; N̂ (``num_examples``) stands for it.
        self.num_train = int(num_train)
        self._num_examples: int | None = None
        self.q = 0.0
        self.device = device
        self.ledger = Ledger.open(state_dir, run, organization, delta=cfg.delta, accountant=cfg.accountant,
                                  noise_multiplier=cfg.noise_multiplier or 0.0, clip_norm=cfg.clip_norm)
        # ε of the whole plan σ was solved for (None: σ was given or kept from the ledger).
        self.planned_epsilon: float | None = None
        self.mechanism = ""
        # The releases ``plan`` expects of the setup round and of each training round (multiples of σ).
        self._setup: list[Release] = []
        self._per_round: list[Release] = []
        self._data: PrivateData | None = None
        # The models DP-SGD attached Opacus' hooks to (removed by ``release`` before a model is exported).
        self.hooked: dict[int, tuple[nn.Module, object]] = {}

    def release_examples(self) -> int:
        """N̂ = max(1, round(N + N(0, σ_N²))), the organization's released training example count: drawn once per
        run (the Gaussian mechanism, sensitivity 1, σ_N = ``count_noise_multiplier``) and kept in the ledger in
        the same write as its release, before anything leaves; a restart reads it back and releases nothing."""
        held = self.ledger.released.get("examples")
        if held is None:
            sigma_n = self.cfg.count_noise_multiplier
            gen = secret_generator(self.cfg.noise_seed, ["example-count", self.organization], self.device)
            noise = float(torch.normal(0.0, sigma_n, size=(1,), generator=gen, dtype=torch.float64,
                                       device=gen.device)[0])
            held = max(1, round(self.num_train + noise))
            self.ledger.bind_delta(self.cfg.delta_for(held))
            self.ledger.record(1.0, sigma_n)
            self.ledger.hold("examples", held)
            self.ledger.commit()
        else:
            self.ledger.bind_delta(self.cfg.delta_for(int(held)))
        self._num_examples = int(held)
        return self._num_examples

    @property
    def num_examples(self) -> int:
        """N̂: what the organization declares as its training examples (Join, every payload's count)."""
        if self._num_examples is None:
            raise LedgerError("the example count is not released yet (release_examples)")
        return self._num_examples

    @property
    def delta(self) -> float:
        """δ of the (ε, δ) statement: the configured one, else 1/N̂²."""
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
        """Poisson sampling at rate q = B/N̂: the expected batch is the run's batch size. q is computed from the
        released N̂, so it is public; the sampler then draws at rate q over the N real examples, which is what
        the accountant assumes of a Poisson-sampled Gaussian at rate q."""
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
    def clip_norm(self) -> float:
        """C of every release."""
        return self.ledger.clip_norm

    def spent(self) -> float:
        """ε spent so far at δ."""
        return self.ledger.epsilon()

    def plan(self, mechanism: str, setup: Sequence[Release], per_round: Sequence[Release], rounds: int) -> float:
        """Fix σ: the ledger's when it was kept before, the configured one, or the one at which the releases already
        committed (the example count N̂), the setup releases and ``rounds`` rounds of ``per_round`` spend the target
        ε together (the planned ``sigma`` are multiples of σ, the committed ones noise multipliers)."""
        self.mechanism = mechanism
        self._setup, self._per_round = list(setup), list(per_round)
        if self.ledger.noise_multiplier <= 0:
            target = self.cfg.solve_for
            if target is None:
                self.ledger.noise_multiplier = float(self.cfg.noise_multiplier or 0.0)
            else:
                plan = [*setup, *[Release(r.q, r.sigma, r.count * rounds) for r in per_round]]
                fixed = list(self.ledger.releases)
                self.ledger.noise_multiplier = solve_noise_multiplier(plan, target, self.delta, self.cfg.accountant,
                                                                      fixed)
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
        after = self.ledger.epsilon(self.scaled(self._setup if setup else self._per_round))
        if after > budget * (1 + _BUDGET_SLACK):
            return (f"{self.organization}: privacy budget ε={budget:g} at δ={self.delta:.3g} would be exceeded by the "
                    f"next round (ε {spent:.4g} spent, {after:.4g} after it); this organization sends nothing more "
                    "and leaves the run")
        return None

    def wrap(self, train: DataSource) -> PrivateData:
        """The training set as the training loop reads it under DP-SGD (its step set per round)."""
        self._data = PrivateData(train, self.step_for(0, 0), self.num_examples)
        return self._data

    def generator(self, round_: int, round_seed: int) -> torch.Generator:
        """This round's secret generator; a redone round (after a restart) draws other noise, since the ledger
        kept the first attempt's releases."""
        return secret_generator(self.cfg.noise_seed, [round_, round_seed, self.organization,
                                                      sum(r.count for r in self.ledger.releases)], self.device)

    def step_for(self, round_: int, round_seed: int) -> PrivateStep:
        """This round's DP-SGD step (its noise and Poisson samples from the round's secret generator)."""
        return PrivateStep(self.sigma, self.clip_norm, self.q, self.q * self.num_examples,
                           self.generator(round_, round_seed), self.ledger, self.hooked)

    def begin_round(self, round_: int, round_seed: int) -> torch.Generator:
        """Set up a round's private step; returns its generator for the algorithm's own releases."""
        assert self._data is not None
        self._data.step = self.step_for(round_, round_seed)
        return self._data.step.generator

    @property
    def generator_now(self) -> torch.Generator:
        """The current round's secret generator (for an algorithm's own releases)."""
        assert self._data is not None
        return self._data.step.generator

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
