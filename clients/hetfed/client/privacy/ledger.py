"""One organization's privacy ledger for one run: every DP-SGD step and Gaussian release, composed by dp-accounting.

The ledger lists releases as runs of identical events (a Poisson-sampled Gaussian step with its sampling rate
and noise multiplier, or an unsampled Gaussian release), and ε at δ is dp-accounting's for their composition:
Rényi DP (``rdp``, Mironov 2017; Mironov, Talwar and Zhang 2019 for the sampled Gaussian) or privacy loss
distributions (``pld``, Koskela et al. 2020; Doroshenko et al. 2022), both under add-or-remove-one neighbours.
With a state directory it lives in ``<state_dir>/<run>/privacy-ledger.json``, written atomically before each
upload leaves, so a restarted client continues it: ε never goes down.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dp_accounting
from dp_accounting import pld, rdp

FORMAT = 1
FILE_NAME = "privacy-ledger.json"


class _Unconverged(logging.Filter):
    """dp-accounting's RDP skips fractional orders whose series does not converge (ε takes the others) and logs
    each skip; one round of a client would log dozens."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


logging.getLogger("absl").addFilter(_Unconverged())


class LedgerError(RuntimeError):
    """The ledger on disk cannot be continued by this client (another run, organization, δ or accountant)."""


@dataclass(frozen=True)
class Release:
    """``count`` identical releases: a Gaussian of noise multiplier ``sigma`` (per unit of sensitivity) on a
    Poisson sample of rate ``q`` (``q = 1``: on the whole data set, no sampling)."""

    q: float
    sigma: float
    count: int = 1

    def event(self) -> dp_accounting.DpEvent:
        """This run of releases as a dp-accounting event."""
        one: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(self.sigma)
        if self.q < 1:
            one = dp_accounting.PoissonSampledDpEvent(self.q, one)
        return one if self.count == 1 else dp_accounting.SelfComposedDpEvent(one, self.count)


def merged(releases: Sequence[Release]) -> list[Release]:
    """``releases`` with runs of the same event joined, in the order each event first appears (composition is
    commutative, so ε is the same)."""
    counts: dict[tuple[float, float], int] = {}
    for r in releases:
        if r.count > 0:
            counts[(r.q, r.sigma)] = counts.get((r.q, r.sigma), 0) + r.count
    return [Release(q, sigma, count) for (q, sigma), count in counts.items()]


def epsilon_of(releases: Sequence[Release], delta: float, accountant: str = "rdp") -> float:
    """ε at ``delta`` of the composition of ``releases`` (0 for none)."""
    runs = merged(releases)
    if not runs:
        return 0.0
    acc: dp_accounting.PrivacyAccountant = rdp.RdpAccountant() if accountant == "rdp" else pld.PLDAccountant()
    acc.compose(dp_accounting.ComposedDpEvent([r.event() for r in runs]))
    return float(acc.get_epsilon(delta))


def solve_noise_multiplier(plan: Sequence[Release], target_epsilon: float, delta: float,
                           accountant: str = "rdp") -> float:
    """The smallest σ ≥ 0.05 (to 0.1%) at which the releases of ``plan`` (their ``sigma`` the multiple of σ each gets:
    1 for a plain step, 1/√k for k objectives on one batch) spend at most ``target_epsilon`` at ``delta``."""
    if not merged(plan):
        raise ValueError("nothing to account: the run plans no private release")

    def spent(sigma: float) -> float:
        return epsilon_of([Release(r.q, r.sigma * sigma, r.count) for r in plan], delta, accountant)

    lo, hi = 0.05, 1.0
    while spent(hi) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            raise ValueError(f"no noise multiplier up to 10^4 reaches ε={target_epsilon} at δ={delta:.3g} over the "
                             "planned rounds; plan fewer steps or allow a larger ε")
    if spent(lo) <= target_epsilon:
        return lo
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if spent(mid) <= target_epsilon else (mid, hi)
    return hi


class Ledger:
    """The releases one organization made in one run, with ε after each round; kept on disk when given a path."""

    def __init__(self, run: str, organization: str, delta: float, accountant: str, noise_multiplier: float,
                 clip_norm: float, path: Path | None = None) -> None:
        self.identity = {"run": run, "organization": organization, "delta": delta, "accountant": accountant}
        self.delta, self.accountant = delta, accountant
        self.noise_multiplier, self.clip_norm = noise_multiplier, clip_norm
        self.path = path
        self.releases: list[Release] = []
        # ε after each round this ledger saw (round -> ε), for the operator and the tests.
        self.rounds: dict[int, float] = {}
        self._pending: list[Release] = []
        # ε of the committed releases, kept with the releases it was computed for: a round asks for it several
        # times (its declaration, the file, the budget check), and the PLD accountant takes most of a second.
        self._spent: tuple[tuple[Release, ...], float] = ((), 0.0)

    @classmethod
    def open(cls, state_dir: str | None, run: str, organization: str, *, delta: float, accountant: str,
             noise_multiplier: float, clip_norm: float) -> Ledger:
        """The run's ledger: continued from ``<state_dir>/<run>/privacy-ledger.json`` when there is one (its σ
        wins, so a restart keeps the noise it planned with), else a new one (in memory without ``state_dir``)."""
        path = Path(state_dir) / run / FILE_NAME if state_dir else None
        ledger = cls(run, organization, delta, accountant, noise_multiplier, clip_norm, path)
        if path is not None and path.exists():
            ledger._load(path)
        return ledger

    def _load(self, path: Path) -> None:
        try:
            raw: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise LedgerError(f"{path} cannot be read ({type(exc).__name__}: {exc}); a lost ledger cannot be "
                              "rebuilt, so this organization cannot go on in this run under DP") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise LedgerError(f"{path} is not a hetfed privacy ledger of format {FORMAT}")
        saved = raw.get("identity", {})
        saved = saved if isinstance(saved, dict) else {}
        differ = [f"{k} {saved.get(k)!r} (now {v!r})" for k, v in self.identity.items() if saved.get(k) != v]
        if differ:
            raise LedgerError(f"{path} was kept under other settings: {', '.join(differ)}; ε cannot be continued "
                              "across them")
        try:
            self.noise_multiplier = float(raw["noise_multiplier"])
            self.clip_norm = float(raw["clip_norm"])
            self.releases = [Release(float(q), float(s), int(c)) for q, s, c in raw["releases"]]
            self.rounds = {int(k): float(v) for k, v in raw["rounds"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise LedgerError(f"{path} is damaged ({type(exc).__name__}: {exc}); a lost ledger cannot be rebuilt, so "
                              "this organization cannot go on in this run under DP") from None

    # ------------------------------------------------------------------ recording
    def record(self, q: float, sigma: float, count: int = 1) -> None:
        """Note ``count`` releases of the current round (committed by ``close_round``)."""
        self._pending = merged([*self._pending, Release(q, sigma, count)])

    @property
    def pending(self) -> list[Release]:
        """The current round's releases so far."""
        return list(self._pending)

    def close_round(self, round_: int) -> float:
        """Commit the round's releases, write the ledger (atomically, before the upload leaves); ε so far."""
        self.releases = merged([*self.releases, *self._pending])
        self._pending = []
        eps = self.epsilon()
        self.rounds[int(round_)] = max(eps, self.rounds.get(int(round_), 0.0))
        self.save()
        return eps

    def epsilon(self, extra: Sequence[Release] = ()) -> float:
        """ε at δ of every committed release (and ``extra`` ones, to ask what a next round would cost)."""
        if extra:
            return epsilon_of([*self.releases, *extra], self.delta, self.accountant)
        committed = tuple(self.releases)
        if self._spent[0] != committed:
            self._spent = (committed, epsilon_of(committed, self.delta, self.accountant))
        return self._spent[1]

    def save(self) -> None:
        """Write the ledger atomically (temporary file, fsync, rename, directory fsync); nothing without a path."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = {"format": FORMAT, "identity": self.identity, "noise_multiplier": self.noise_multiplier,
                "clip_norm": self.clip_norm, "epsilon": self.epsilon(),
                "releases": [[r.q, r.sigma, r.count] for r in self.releases],
                "rounds": {str(k): v for k, v in sorted(self.rounds.items())}}
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(body, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
