"""What an upload declares of its differential privacy (docs/privacy.md): the client's mechanism and its ε so far.

An ``Update`` carries one ``PrivacyDeclaration`` when its organization trains under DP (``messages.Update.privacy``).
The aggregator checks it (``check``: ``invalid_privacy``), may require it of every organization of a run, and
refuses an ε below the organization's last accepted one. This module is torch-free: both sides import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn

from hetfed.wire.errors import WireError

# The mechanisms a client may declare: DP-SGD on its training, alone, with Gaussian noise on the sums it uploads,
# or with its share of the distributed Skellam noise on the sums secure aggregation adds up.
MECHANISMS = ("dp-sgd", "dp-sgd+gaussian-sums", "dp-sgd+distributed-skellam")
# The privacy accountants that compute the declared ε: Rényi DP or privacy loss distributions.
ACCOUNTANTS = ("rdp", "pld")


@dataclass(frozen=True)
class PrivacyDeclaration:
    """An organization's differential privacy at one upload. ``epsilon``: the ε its accountant gives for
    everything it sent in this run so far, this upload included (with ``delta``). ``budget_spent``: a leave
    notice, sent with no payload: the organization's budget would be exceeded by its next round, so it leaves
    the run (the aggregator refuses it ``privacy_budget_spent`` and stops waiting for it). ``ephemeral_ledger``: the
    organization's privacy ledger ends with its process (an experiment), so a restart would count ε from zero; a
    run with ``refuse_ephemeral_ledgers`` refuses it."""

    mechanism: str
    noise_multiplier: float  # σ
    clip_norm: float  # C
    epsilon: float
    delta: float
    accountant: str
    budget_spent: bool = False
    ephemeral_ledger: bool = False

    def check(self) -> PrivacyDeclaration:
        """This declaration, or WireError ``invalid_privacy`` naming the first value out of its domain."""
        for name in ("noise_multiplier", "clip_norm", "epsilon", "delta"):
            value = getattr(self, name)
            if not math.isfinite(value):
                _refuse(f"privacy.{name} is {value}; it must be a finite number")
        if self.noise_multiplier <= 0:
            _refuse(f"privacy.noise_multiplier is {self.noise_multiplier:.6g}; σ must be > 0")
        if self.clip_norm <= 0:
            _refuse(f"privacy.clip_norm is {self.clip_norm:.6g}; C must be > 0")
        if self.epsilon < 0:
            _refuse(f"privacy.epsilon is {self.epsilon:.6g}; ε must be >= 0")
        if not 0.0 < self.delta < 1.0:
            _refuse(f"privacy.delta is {self.delta:.6g}; δ must be in (0, 1)")
        if self.accountant not in ACCOUNTANTS:
            _refuse(f"privacy.accountant is {self.accountant[:64]!r}; it must be one of {list(ACCOUNTANTS)}")
        if self.mechanism not in MECHANISMS:
            _refuse(f"privacy.mechanism is {self.mechanism[:64]!r}; it must be one of {list(MECHANISMS)}")
        return self


def _refuse(message: str) -> NoReturn:
    raise WireError("invalid_privacy", message)
