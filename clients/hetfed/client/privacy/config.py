"""An organization's differential-privacy settings (``[privacy]`` of its client config; docs/privacy.md).

The organization chooses them, not the aggregator: the guarantee is made on the client, so it does not rest on
trusting the aggregator. Torch-free, so ``hetfed run`` validates them before any process starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from hetfed.wire.config import check


@dataclass(frozen=True)
class PrivacyConfig:
    """(ε, δ) differential privacy of everything this organization sends, per record or per group (``unit``).

    DP is on when any of ``epsilon_budget``, ``target_epsilon`` and ``noise_multiplier`` is set. The noise
    multiplier σ is given, or solved so that the run's planned rounds spend ``target_epsilon`` (the budget when
    only a budget is given).
    """

    # Stop before a round that would take ε past this; the organization leaves the run (exit status 3).
    # None: the target ε, when one is given (``budget``).
    epsilon_budget: float | None = None
    # Solve σ so that the run's planned rounds spend this ε (default: the budget). Excludes noise_multiplier.
    target_epsilon: float | None = None
    # σ: Gaussian noise of standard deviation σ·C on each clipped sum (DP-SGD steps and direct releases).
    noise_multiplier: float | None = None
    # C: each example's gradient (DP-SGD) or embedding (a class-sum release) is clipped to this L2 norm.
    clip_norm: float = 1.0
    # δ of the (ε, δ) statement; None: 1/N̂² for N̂ the training examples this organization released.
    delta: float | None = None
    # Noise multiplier of direct releases (class counts and sums, computed from the data without training) as a
    # multiple of σ. They get no amplification by sampling but average many examples, so more noise costs them
    # little accuracy and leaves the budget to the DP-SGD steps (hetfed's own default; docs/privacy.md).
    direct_noise_multiple: float = 10.0
    # Release the evaluation figures (accuracy, loss, test-example count per held-out set) through a Gaussian
    # mechanism, accounted in the ledger; false: they stay on the client and the upload marks them withheld.
    release_metrics: bool = False
    # Noise multiplier of a metric release as a multiple of σ. A release is not amplified by sampling and repeats
    # every evaluated round, so it needs much noise to cost little ε (hetfed's own default; docs/privacy.md).
    metrics_noise_multiple: float = 30.0
    # B: each held-out example's loss is clipped to this before the loss sum is released (nats; a sum's
    # sensitivity is B). Cross-entropy at a uniform guess over 100 classes is 4.6, so 5 clips only confident misses.
    metric_loss_bound: float = 5.0
    # How releases compose: "rdp" (Rényi DP, Mironov 2017) or "pld" (privacy loss distributions), dp-accounting's.
    accountant: Literal["rdp", "pld"] = "rdp"
    # BatchNorm mixes examples of a batch, which DP-SGD's per-example clipping cannot bound: "replace" it with
    # GroupNorm (Opacus' ModuleValidator.fix, logged) or "refuse" the model in one line.
    batchnorm: Literal["replace", "refuse"] = "replace"
    # Seed of the noise and of the Poisson batch sampling; -1: fresh OS entropy at every start (the secure choice:
    # whoever knows the seed can subtract the noise). A fixed seed makes experiments repeatable.
    noise_seed: int = -1
    # What one neighbour is: "record" (one training example) or "group" (every example of one group id the data
    # gives: a patient, a device, a site). "group" samples whole groups, clips each group's summed gradient to C
    # and accounts at the group sampling rate (user-level DP-SGD, McMahan et al. 2018).
    unit: Literal["record", "group"] = "record"
    # Under unit = "group": a sampled group contributes at most this many examples (a random choice from the
    # secret generator), which bounds a step's memory; the clipping bounds the privacy whatever the size.
    max_examples_per_group: int = 64
    # Noise and Poisson samples from a cryptographically secure generator (a ChaCha20 keystream keyed from
    # os.urandom) with the floating-point guard of Opacus' secure mode; excludes a fixed noise_seed.
    secure_mode: bool = False
    # Noise multiplier σ_N of the one release of the training example count N (sensitivity 1; the group count G
    # under unit = "group"): the organization declares N̂ = max(1, round(N + N(0, σ_N²))) and derives everything
    # else from it. Fixed, not a multiple of σ,
    # since σ is solved after N̂ is out. 20 moves N̂ by about ±20 examples, which changes no example weight that
    # matters, and costs a small ε next to the training's (hetfed's own default; docs/privacy.md).
    count_noise_multiplier: float = 20.0
    # Allow [privacy] without the client's state_dir, so the privacy ledger ends with the process: for
    # experiments only. Every declaration says so, and a run with refuse_ephemeral_ledgers refuses it.
    ephemeral_ledger: bool = False

    def __post_init__(self) -> None:
        for name in ("epsilon_budget", "target_epsilon", "noise_multiplier", "delta"):
            value = getattr(self, name)
            check(value is None or (math.isfinite(value) and value > 0),
                  f"{name} must be a number > 0 (leave it out to not set it), got {value!r}")
        check(math.isfinite(self.direct_noise_multiple) and self.direct_noise_multiple > 0,
              f"direct_noise_multiple must be a number > 0, got {self.direct_noise_multiple!r}")
        for name in ("metrics_noise_multiple", "metric_loss_bound"):
            value = getattr(self, name)
            check(math.isfinite(value) and value > 0, f"{name} must be a number > 0, got {value!r}")
        check(math.isfinite(self.count_noise_multiplier) and self.count_noise_multiplier > 0,
              f"count_noise_multiplier must be a number > 0, got {self.count_noise_multiplier!r}")
        check(math.isfinite(self.clip_norm) and self.clip_norm > 0,
              f"clip_norm must be a number > 0, got {self.clip_norm!r}")
        check(self.delta is None or self.delta < 1, f"delta must be < 1, got {self.delta!r}")
        check(self.noise_multiplier is None or self.target_epsilon is None,
              "noise_multiplier and target_epsilon exclude each other: give σ, or the ε to solve it for")
        check(self.epsilon_budget is None or self.target_epsilon is None or self.target_epsilon <= self.epsilon_budget,
              f"target_epsilon ({self.target_epsilon}) exceeds epsilon_budget ({self.epsilon_budget})")
        check(self.noise_seed >= -1, f"noise_seed must be >= 0, or -1 for OS entropy, got {self.noise_seed}")
        check(not (self.secure_mode and self.noise_seed >= 0),
              f"secure_mode refuses a fixed noise_seed ({self.noise_seed}): the noise must be unpredictable; "
              "leave noise_seed at -1")
        check(self.max_examples_per_group >= 1,
              f"max_examples_per_group must be >= 1, got {self.max_examples_per_group}")
        # A metric release bounds one held-out example (sensitivity √3 per record); one patient may hold any number
        # of held-out records, so under unit = "group" the figures stay withheld instead.
        check(not (self.release_metrics and self.unit == "group"),
              "release_metrics releases figures per record, and under unit = \"group\" one group may hold many "
              "held-out records: leave release_metrics off (the figures stay withheld) or use unit = \"record\"")

    @property
    def enabled(self) -> bool:
        """Whether this organization sends under differential privacy."""
        return any(v is not None for v in (self.epsilon_budget, self.target_epsilon, self.noise_multiplier))

    @property
    def solve_for(self) -> float | None:
        """The ε to solve σ for (None when σ is given)."""
        if self.noise_multiplier is not None:
            return None
        return self.target_epsilon if self.target_epsilon is not None else self.epsilon_budget

    @property
    def budget(self) -> float | None:
        """The ε no round may take the organization past: ``epsilon_budget``, else the target ε."""
        return self.epsilon_budget if self.epsilon_budget is not None else self.target_epsilon

    def delta_for(self, num_examples: int) -> float:
        """δ for an organization that declared ``num_examples`` units (its released count: N̂ training examples, or
        Ĝ groups under ``unit = "group"``): the configured one, else 1/Û²."""
        if self.delta is not None:
            return self.delta
        return 1.0 / max(int(num_examples), 2) ** 2
