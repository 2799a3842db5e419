"""FedH2L's server half: a relay of seed-set posteriors between peers (numpy only).

FedH2L is peer-to-peer (Li et al., Algorithm 1): each node broadcasts [p_i^pub(i), Acc_i] to its peers.
Here the aggregator stands in for the broadcast: it keeps each organization's posteriors of round r and,
in round r + 1, sends each organization those of its teachers (every peer, or a seeded random subset of
``peers_per_round``) with ``source_organization`` set. It never aggregates and computes nothing from the
posteriors: the arrays it relays are the very arrays it received. It checks them, though: the seed set's
id, indices inside the seed set and inside the sender's own domain part, rows that are distributions,
a confidence in [0, 1]. The seed set's id, size and each organization's part come from the run's
``seed_set`` (the aggregator config), the same description the Join check uses.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from hetfed.aggregator.algorithms.base import RunInfo, SeedSetInfo, ServerHalf
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import Payload, Received, SeedPosteriors
from hetfed.wire.phases import Phase
from hetfed.wire.specs import fedh2l
from hetfed.wire.specs.fedh2l import FedH2LConfig


@fedh2l.SPEC.server_half
class FedH2LServer(ServerHalf[FedH2LConfig]):
    """Relays each organization's latest posteriors to its teachers' students; one instance per run."""

    broadcast = False

    def __init__(self, config: FedH2LConfig, run: RunInfo) -> None:
        super().__init__(config, run)
        self.seed_set = run.seed_set or SeedSetInfo("")
        # Posteriors of the last closed training round (what this round relays), and of the open round.
        self._relay: dict[str, SeedPosteriors] = {}
        self._incoming: dict[str, SeedPosteriors] = {}
        narrow = config.wire_dtype != "float32"
        self._row_tolerance = 2e-2 if narrow else 1e-3

    def teachers(self, round_: int, organization: str) -> list[str]:
        """The peers whose posteriors ``organization`` learns from in ``round_``: all, or a seeded subset."""
        peers = sorted(o for o in self._relay if o != organization)
        k = self.config.peers_per_round
        if 0 < k < len(peers):
            rng = np.random.default_rng([self.run.seed, round_, zlib.crc32(organization.encode())])
            peers = [peers[i] for i in sorted(rng.choice(len(peers), size=k, replace=False))]
        return peers

    def payloads_for(self, phase: Phase, round_: int, organization: str) -> list[Payload]:
        """The teachers' posteriors of the previous round, unchanged but for ``source_organization``."""
        if phase is Phase.SETUP:
            return []
        return [dataclasses.replace(self._relay[t], source_organization=t) for t in self.teachers(round_, organization)]

    def validate(self, phase: Phase, organization: str, update: Received) -> None:
        """Reject posteriors that name another seed set, stray outside the sender's part or are no distributions."""
        sp = update.maybe(SeedPosteriors)
        if sp is None:
            return
        seeds = self.seed_set

        def bad(reason: str, message: str) -> WireError:
            return WireError(reason, f"seed_posteriors from {organization!r}: {message}")

        if seeds.id and sp.seed_set_id != seeds.id:
            raise bad("seed_set_mismatch", f"seed set {sp.seed_set_id[:64]!r}, the run uses {seeds.id!r}")
        if not sp.seed_set_id:
            raise bad("invalid_value", "no seed_set_id")
        if sp.source_organization not in ("", organization):
            raise bad("invalid_value", f"claims to come from {sp.source_organization[:64]!r}")
        idx, probs = sp.indices, sp.probabilities
        if idx.dtype.kind not in "iu" or idx.ndim != 1 or idx.size == 0:
            raise bad("invalid_value", f"indices must be a non-empty int64 vector, got {idx.dtype}{list(idx.shape)}")
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or (seeds.size and hi >= seeds.size):
            raise bad("invalid_value", f"indices span [{lo}, {hi}], outside the seed set of {seeds.size}")
        own = seeds.parts.get(organization)
        if own is not None and (lo < own[0] or hi >= own[1]):
            raise bad("invalid_value", f"indices span [{lo}, {hi}], outside its own domain part "
                                       f"[{own[0]}, {own[1]})")
        if np.unique(idx).size != idx.size:
            raise bad("invalid_value", "indices repeat")
        if probs.dtype.kind != "f" or probs.ndim != 2 or probs.shape[0] != idx.size or probs.shape[1] < 2:
            raise bad("shape_mismatch", f"probabilities must be [{idx.size}, K >= 2], got {list(probs.shape)}")
        classes = self._num_classes()
        if classes is not None and probs.shape[1] != classes:
            raise bad("shape_mismatch", f"{probs.shape[1]} classes, the run's posteriors have {classes}")
        rows = probs.astype(np.float64).sum(axis=1)
        if probs.min() < 0 or probs.max() > 1 or np.abs(rows - 1).max() > self._row_tolerance:
            raise bad("invalid_value", "probability rows must lie in [0, 1] and sum to 1 "
                                       f"(worst row sums to {rows[np.abs(rows - 1).argmax()]:.6f})")
        if not 0.0 <= sp.teaching_confidence <= 1.0:
            raise bad("invalid_value", f"teaching_confidence {sp.teaching_confidence} is not in [0, 1]")

    def _num_classes(self) -> int | None:
        for sp in (*self._relay.values(), *self._incoming.values()):
            return int(sp.probabilities.shape[1])
        return None

    def accumulate(self, phase: Phase, organization: str, update: Received) -> None:
        """Keep the organization's posteriors as they arrived (no arithmetic on them)."""
        sp = update.maybe(SeedPosteriors)
        if phase is Phase.TRAIN and sp is not None:
            self._incoming[organization] = sp

    def close_round(self, phase: Phase, round_: int) -> None:
        """The round's posteriors become what the next round relays."""
        if phase is Phase.TRAIN:
            self._relay, self._incoming = dict(sorted(self._incoming.items())), {}
        else:
            self._incoming = {}

    def state(self) -> dict[str, np.ndarray]:
        """The posteriors to relay in the open round, by organization (sorted: the arrival order is no part of
        the state)."""
        out: dict[str, np.ndarray] = {}
        for org, sp in sorted(self._relay.items()):
            out[f"{org}/seed_set_id"] = np.frombuffer(sp.seed_set_id.encode(), dtype=np.uint8)
            out[f"{org}/indices"] = sp.indices
            out[f"{org}/probabilities"] = sp.probabilities
            out[f"{org}/teaching_confidence"] = np.array(sp.teaching_confidence, dtype=np.float64)
        return out

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore from ``state()``."""
        orgs = sorted({k.rpartition("/")[0] for k in arrays})
        self._relay = {
            org: SeedPosteriors(
                bytes(arrays[f"{org}/seed_set_id"]).decode(),
                arrays[f"{org}/indices"],
                arrays[f"{org}/probabilities"],
                float(arrays[f"{org}/teaching_confidence"]),
            )
            for org in orgs
        }
        self._incoming = {}
