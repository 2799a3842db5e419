"""One organization's privacy ledger for one run: every DP-SGD step and Gaussian release, composed by dp-accounting,
and every round of a distributed Skellam sum under secure aggregation (``DistributedRelease``).

The ledger lists releases as runs of identical events (a Poisson-sampled Gaussian step with its sampling rate
and noise multiplier, or an unsampled Gaussian release), and ε at δ is dp-accounting's for their composition:
Rényi DP (``rdp``, Mironov 2017; Mironov, Talwar and Zhang 2019 for the sampled Gaussian) or privacy loss
distributions (``pld``, Koskela et al. 2020; Doroshenko et al. 2022), both under add-or-remove-one neighbours.
With a state directory it lives in ``<state_dir>/<run>/privacy-ledger.json``, written atomically before each
upload leaves, so a restarted client continues it: ε never goes down. It also keeps the values the organization
released (its example count N̂, an algorithm's noisy counts) in the same write as the releases that paid for them,
so a restart sends them again instead of releasing new ones.

A distributed release (``hetfed.secagg.ddp``) is accounted in Rényi DP only: dp-accounting has no Skellam event,
so its RDP (Agarwal, Kairouz and Liu 2021, Theorem 3.5) is added, order by order, to dp-accounting's RDP of the
ledger's Gaussian releases at the integer orders 2..128 and 256, and ε at δ is dp-accounting's conversion of the
total. It records the assumption the noise rests on (at least ``honest`` of ``clients`` organizations add their
share and keep it secret) and the ring it was reduced in; a ledger under the PLD accountant refuses it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting import pld, rdp
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

from hetfed.secagg import ddp

# 2: the released values and the round the ledger first joined at (format 1 kept neither).
# 3: distributed releases. A format-2 ledger (none) is continued; one written as 3 is refused by code that reads 2,
# which would otherwise drop the distributed releases and lower ε.
FORMAT = 3
READS = (2, 3)
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


@dataclass(frozen=True)
class DistributedRelease:
    """``count`` rounds of a distributed Skellam sum (``hetfed.secagg.ddp.Plan``): sensitivities ``l2`` and ``l1``
    after rounding and the noise variance ``variance`` the accountant counts, all in the integer domain, under the
    declared assumption that at least ``honest`` of the ``clients`` organizations add their share and keep it
    secret. ``ring_bits``, ``scale`` and ``wrap`` (the bound on a round's wrap-around probability) are recorded
    for the reader: reduction mod 2^ring_bits is post-processing and costs no privacy."""

    l2: float
    l1: float
    variance: float
    honest: int
    clients: int
    ring_bits: int
    scale: float
    wrap: float
    count: int = 1

    @classmethod
    def of(cls, plan: ddp.Plan, count: int = 1) -> DistributedRelease:
        """``count`` rounds of ``plan``."""
        l2, l1 = plan.sensitivity_bounds()
        return cls(l2, l1, plan.central_variance, plan.honest, plan.clients, plan.ring_bits, plan.scale,
                   plan.wrap_bound(), count)

    def key(self) -> tuple[float | int, ...]:
        """Everything but the count: releases with the same key are the same event."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.name != "count")

    def rdp(self) -> np.ndarray:
        """Its RDP at ``ddp.ORDERS``, ``count`` rounds composed."""
        return self.count * ddp.skellam_rdp(self.l2, self.l1, self.variance)


def merged_distributed(releases: Sequence[DistributedRelease]) -> list[DistributedRelease]:
    """``releases`` with runs of the same event joined, in the order each first appears."""
    counts: dict[tuple[float | int, ...], tuple[DistributedRelease, int]] = {}
    for r in releases:
        if r.count > 0:
            first, count = counts.get(r.key(), (r, 0))
            counts[r.key()] = (first, count + r.count)
    return [replace(first, count=count) for first, count in counts.values()]


def epsilon_with_distributed(releases: Sequence[Release], distributed: Sequence[DistributedRelease],
                             delta: float) -> float:
    """ε at ``delta`` of Gaussian ``releases`` and ``distributed`` ones composed in RDP at ``ddp.ORDERS``: the
    Gaussian ones' RDP from dp-accounting, the Skellam ones' from Theorem 3.5, converted by dp-accounting."""
    acc = rdp.RdpAccountant(orders=[float(a) for a in ddp.ORDERS])
    runs = merged(releases)
    if runs:
        acc.compose(dp_accounting.ComposedDpEvent([r.event() for r in runs]))
    # dp-accounting keeps the composed RDP curve in ``_rdp`` and takes no custom curve; it is read, not changed.
    total = np.array(acc._rdp, dtype=np.float64)
    for d in merged_distributed(distributed):
        total += d.rdp()
    eps, _ = compute_epsilon(ddp.ORDERS, total, delta)
    return float(eps)


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
                           accountant: str = "rdp", fixed: Sequence[Release] = (),
                           distributed: Sequence[DistributedRelease] = ()) -> float:
    """The smallest σ ≥ 0.05 (to 0.1%) at which the releases of ``plan`` (their ``sigma`` the multiple of σ each gets:
    1 for a plain step, 1/√k for k objectives on one batch), composed with the ``fixed`` releases (their ``sigma``
    their own noise multiplier, such as the example count's) and the ``distributed`` ones (whose noise the run's
    plan fixes), spend at most ``target_epsilon`` at ``delta``."""
    if not merged(plan):
        raise ValueError("nothing to account: the run plans no private release")
    if merged_distributed(distributed):
        if accountant != "rdp":
            raise ValueError(f"distributed DP is accounted in Rényi DP, and this organization's accountant is "
                             f"{accountant!r}: use privacy.accountant = \"rdp\"")
        before = epsilon_with_distributed(fixed, distributed, delta)
        if before >= target_epsilon:
            raise ValueError(f"the run's distributed class sums (the run's ddp_epsilon), with the releases made "
                             f"before the plan, already spend ε={before:.4g} of this organization's target "
                             f"ε={target_epsilon} at δ={delta:.3g}; allow a larger ε or plan a smaller ddp_epsilon")
    elif merged(fixed) and epsilon_of(fixed, delta, accountant) >= target_epsilon:
        raise ValueError(f"the releases made before the run's plan (the example count) already spend "
                         f"ε={epsilon_of(fixed, delta, accountant):.4g} of the target ε={target_epsilon} at "
                         f"δ={delta:.3g}; allow a larger ε or a larger count_noise_multiplier")

    def spent(sigma: float) -> float:
        releases = [*[Release(r.q, r.sigma * sigma, r.count) for r in plan], *fixed]
        if merged_distributed(distributed):
            return epsilon_with_distributed(releases, distributed, delta)
        return epsilon_of(releases, delta, accountant)

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
    """The releases one organization made in one run, with ε after each round and the values it released; kept on
    disk when given a path."""

    def __init__(self, run: str, organization: str, delta: float | None, accountant: str, noise_multiplier: float,
                 clip_norm: float, path: Path | None = None, unit: str = "record") -> None:
        self.run, self.organization = run, organization
        # The unit of privacy ("record" or "group"): releases accounted per record and per group do not compose
        # into one ε, so a ledger kept under one unit cannot be continued under the other.
        self.unit = unit
        self.delta, self.accountant = delta, accountant
        self.noise_multiplier, self.clip_norm = noise_multiplier, clip_norm
        self.path = path
        # Whether this ledger was read from disk (False: it starts in this process).
        self.loaded = False
        self.releases: list[Release] = []
        # Rounds of distributed DP under secure aggregation (accounted in RDP).
        self.distributed: list[DistributedRelease] = []
        # ε after each round this ledger saw (round -> ε), for the operator and the tests.
        self.rounds: dict[int, float] = {}
        # What the organization released, by name ("examples": N̂; an algorithm's noisy counts), JSON values.
        self.released: dict[str, Any] = {}
        # The run's round when this ledger first joined it (None: not yet).
        self.joined_at: int | None = None
        self._pending: list[Release] = []
        self._pending_distributed: list[DistributedRelease] = []
        self._pending_values: dict[str, Any] = {}
        # ε of the committed releases, kept with the releases it was computed for: a round asks for it several
        # times (its declaration, the file, the budget check), and the PLD accountant takes most of a second.
        self._spent: tuple[tuple[tuple[Release, ...], tuple[DistributedRelease, ...]], float] = (((), ()), 0.0)

    @property
    def identity(self) -> dict[str, Any]:
        """What a ledger on disk must match to be continued."""
        return {"run": self.run, "organization": self.organization, "delta": self.delta, "accountant": self.accountant,
                "unit": self.unit}

    @classmethod
    def open(cls, state_dir: str | None, run: str, organization: str, *, delta: float | None = None, accountant: str,
             noise_multiplier: float, clip_norm: float, unit: str = "record") -> Ledger:
        """The run's ledger: continued from ``<state_dir>/<run>/privacy-ledger.json`` when there is one (its σ
        wins, so a restart keeps the noise it planned with), else a new one (in memory without ``state_dir``).
        ``delta`` None: taken from the file, or fixed later by ``bind_delta`` (δ may depend on a released value)."""
        path = Path(state_dir) / run / FILE_NAME if state_dir else None
        ledger = cls(run, organization, delta, accountant, noise_multiplier, clip_norm, path, unit)
        if path is not None and path.exists():
            ledger._load(path)
        return ledger

    def _load(self, path: Path) -> None:
        try:
            raw: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise LedgerError(f"{path} cannot be read ({type(exc).__name__}: {exc}); a lost ledger cannot be "
                              "rebuilt, so this organization cannot go on in this run under DP") from None
        if not isinstance(raw, dict) or raw.get("format") not in READS:
            found = raw.get("format") if isinstance(raw, dict) else None
            if isinstance(found, int) and found < min(READS):
                raise LedgerError(f"{path} is a privacy ledger of format {found}, which kept no released values, so "
                                  "a restart could not send the same ones again; finish this run with the hetfed "
                                  "version that wrote it, or start a new run")
            raise LedgerError(f"{path} is not a hetfed privacy ledger of format {FORMAT}")
        saved = raw.get("identity", {})
        saved = saved if isinstance(saved, dict) else {}
        wanted = {k: v for k, v in self.identity.items() if not (k == "delta" and v is None)}
        differ = [f"{k} {saved.get(k)!r} (now {v!r})" for k, v in wanted.items() if saved.get(k) != v]
        if differ:
            raise LedgerError(f"{path} was kept under other settings: {', '.join(differ)}; ε cannot be continued "
                              "across them")
        try:
            self.delta = float(saved["delta"])
            self.noise_multiplier = float(raw["noise_multiplier"])
            self.clip_norm = float(raw["clip_norm"])
            self.releases = [Release(float(q), float(s), int(c)) for q, s, c in raw["releases"]]
            self.distributed = [DistributedRelease(**d) for d in raw.get("distributed", [])]
            self.rounds = {int(k): float(v) for k, v in raw["rounds"].items()}
            self.released = dict(raw["released"])
            self.joined_at = None if raw["joined_at"] is None else int(raw["joined_at"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise LedgerError(f"{path} is damaged ({type(exc).__name__}: {exc}); a lost ledger cannot be rebuilt, so "
                              "this organization cannot go on in this run under DP") from None
        self.loaded = True

    def bind_delta(self, delta: float) -> None:
        """Fix δ (computed from a released value); a ledger kept under another δ cannot be continued."""
        if self.delta is not None and self.delta != delta:
            raise LedgerError(f"{self.path} was kept under other settings: delta {self.delta!r} (now {delta!r}); ε "
                              "cannot be continued across them")
        self.delta = delta

    # ------------------------------------------------------------------ recording
    def record(self, q: float, sigma: float, count: int = 1) -> None:
        """Note ``count`` releases of the current round (committed by ``close_round``)."""
        self._pending = merged([*self._pending, Release(q, sigma, count)])

    def record_distributed(self, release: DistributedRelease) -> None:
        """Note a round of distributed DP (committed by ``close_round``). Refused under the PLD accountant, which
        cannot compose it."""
        if self.accountant != "rdp":
            raise LedgerError(f"distributed DP is accounted in Rényi DP; this ledger composes with {self.accountant!r}"
                              " and cannot take it (use privacy.accountant = \"rdp\")")
        self._pending_distributed = merged_distributed([*self._pending_distributed, release])

    def hold(self, name: str, value: Any) -> None:
        """Keep a released value (JSON-serialisable), written with the releases that paid for it."""
        self._pending_values[name] = value

    @property
    def pending(self) -> list[Release]:
        """The current round's releases so far."""
        return list(self._pending)

    def commit(self, round_: int | None = None) -> float:
        """Commit the pending releases and values and write the ledger (atomically, before anything they made
        leaves); with ``round_``, note ε after that round. ε so far."""
        self.releases = merged([*self.releases, *self._pending])
        self.distributed = merged_distributed([*self.distributed, *self._pending_distributed])
        self.released.update(self._pending_values)
        self._pending, self._pending_distributed, self._pending_values = [], [], {}
        eps = self.epsilon()
        if round_ is not None:
            self.rounds[int(round_)] = max(eps, self.rounds.get(int(round_), 0.0))
        self.save()
        return eps

    def close_round(self, round_: int) -> float:
        """Commit the round's releases and values, write the ledger (atomically, before the upload leaves); ε."""
        return self.commit(round_)

    def epsilon(self, extra: Sequence[Release] = (), extra_distributed: Sequence[DistributedRelease] = ()) -> float:
        """ε at δ of every committed release (and ``extra`` ones, to ask what a next round would cost)."""
        distributed = [*self.distributed, *extra_distributed]
        if not merged([*self.releases, *extra]) and not merged_distributed(distributed):
            return 0.0
        if self.delta is None:
            raise LedgerError("δ is not fixed yet: the ledger cannot give ε")
        delta = self.delta

        def of(releases: Sequence[Release]) -> float:
            if merged_distributed(distributed):
                return epsilon_with_distributed(releases, distributed, delta)
            return epsilon_of(releases, delta, self.accountant)

        if extra or extra_distributed:
            return of([*self.releases, *extra])
        committed = (tuple(self.releases), tuple(self.distributed))
        if self._spent[0] != committed:
            self._spent = (committed, of(self.releases))
        return self._spent[1]

    def save(self) -> None:
        """Write the ledger atomically (temporary file, fsync, rename, directory fsync); nothing without a path."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = {"format": FORMAT, "identity": self.identity, "noise_multiplier": self.noise_multiplier,
                "clip_norm": self.clip_norm, "epsilon": self.epsilon(),
                "releases": [[r.q, r.sigma, r.count] for r in self.releases],
                "distributed": [asdict(d) for d in self.distributed],
                "rounds": {str(k): v for k, v in sorted(self.rounds.items())},
                "released": self.released, "joined_at": self.joined_at}
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
