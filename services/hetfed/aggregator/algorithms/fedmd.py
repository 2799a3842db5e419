"""FedMD's server half (numpy only): the consensus, the mean of every organization's logits on the round's public
subset.

Each training round r every organization sends f_k(x) for the examples x of the public subset S_r (drawn from
round r's seed, the same for all: ``hetfed.wire.specs.fedmd.public_subset``). At the close the consensus is

    f̃(x) = (1/N)·Σ_k f_k(x),  x ∈ S_r

over the N organizations that sent it (the reference code divides by the number of parties), summed in float64
over the organizations in sorted order, so the result does not depend on arrival order. Round r + 1 (and the
final evaluate round) sends the consensus on S_r to every organization.
"""

from __future__ import annotations

import numpy as np

from hetfed.aggregator.algorithms.base import RunInfo, SeedSetInfo, ServerHalf, round_seed
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import Payload, Received, SeedPosteriors
from hetfed.wire.phases import Phase
from hetfed.wire.specs import fedmd
from hetfed.wire.specs.fedmd import FedMDConfig, public_subset


def consensus(logits: list[np.ndarray]) -> np.ndarray:
    """(1/N)·Σ_k logits_k in float64, summed in the order given."""
    total = np.zeros(np.shape(logits[0]), dtype=np.float64)
    for scores in logits:
        total = total + np.asarray(scores, dtype=np.float64)
    return total / len(logits)


@fedmd.SPEC.server_half
class FedMDServer(ServerHalf[FedMDConfig]):
    """FedMD's server: the mean of the organizations' logits on the round's public subset."""

    def __init__(self, config: FedMDConfig, run: RunInfo) -> None:
        super().__init__(config, run)
        self.seed_set = run.seed_set or SeedSetInfo("")
        self.indices = np.zeros(0, dtype=np.int64)  # S of the last closed training round
        self.consensus = np.zeros((0, 0))
        self.open_round = 1
        self._round: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def expected_indices(self) -> np.ndarray | None:
        """S of the open round, when the seed set's size is known (the run's seed_set)."""
        if not self.seed_set.size:
            return None
        return public_subset(round_seed(self.run.seed, self.open_round), self.seed_set.size,
                             self.config.public_subset)

    def payloads_for(self, phase: Phase, round_: int, organization: str) -> list[Payload]:
        """The consensus on the last closed round's subset (nothing before the first close)."""
        self.open_round = round_
        if phase not in (Phase.TRAIN, Phase.EVALUATE) or self.indices.size == 0:
            return []
        return [SeedPosteriors(self.seed_set.id, self.indices.copy(), self.consensus.astype(np.float32), 0.0)]

    def validate(self, phase: Phase, organization: str, update: Received) -> None:
        """The run's seed set, the open round's subset (or, with no known size, the same indices as the round's
        other uploads), finite logits [|S|, K] with the K of the round's other uploads."""
        if phase is not Phase.TRAIN:
            return
        sp = update.get(SeedPosteriors)

        def bad(reason: str, message: str) -> WireError:
            return WireError(reason, f"seed_posteriors from {organization!r}: {message}")

        if not sp.seed_set_id or (self.seed_set.id and sp.seed_set_id != self.seed_set.id):
            raise bad("seed_set_mismatch", f"seed set {sp.seed_set_id[:64]!r}, the run uses {self.seed_set.id!r}")
        idx, scores = sp.indices, sp.probabilities
        if idx.dtype.kind not in "iu" or idx.ndim != 1 or idx.size == 0:
            raise bad("invalid_value", f"indices must be a non-empty int64 vector, got {idx.dtype}{list(idx.shape)}")
        expected = self.expected_indices()
        if expected is None and self._round:
            expected = next(iter(self._round.values()))[0]
        if expected is not None and not np.array_equal(idx, expected):
            raise bad("invalid_value", f"indices are not round {self.open_round}'s public subset "
                                       f"({expected.size} examples drawn from the round seed)")
        if scores.dtype.kind != "f" or scores.ndim != 2 or scores.shape[0] != idx.size or scores.shape[1] < 2:
            raise bad("shape_mismatch", f"logits must be [{idx.size}, K >= 2], got {list(scores.shape)}")
        if self._round:
            k = next(iter(self._round.values()))[1].shape[1]
            if scores.shape[1] != k:
                raise bad("shape_mismatch", f"{scores.shape[1]} classes, this round's logits have {k}")
        if not np.isfinite(np.asarray(scores, dtype=np.float64)).all():
            raise bad("invalid_value", "logits must be finite")

    def accumulate(self, phase: Phase, organization: str, update: Received) -> None:
        """Keep the organization's logits until the round closes."""
        if phase is not Phase.TRAIN:
            return
        sp = update.get(SeedPosteriors)
        self._round[organization] = (np.asarray(sp.indices, dtype=np.int64).copy(),
                                     np.asarray(sp.probabilities, dtype=np.float64).copy())

    def close_round(self, phase: Phase, round_: int) -> None:
        """The consensus over the organizations in sorted order."""
        if phase is Phase.TRAIN and self._round:
            ordered = [self._round[o] for o in sorted(self._round)]
            self.indices = ordered[0][0]
            self.consensus = consensus([scores for _, scores in ordered])
        self._round = {}
        self.open_round = round_ + 1

    def state(self) -> dict[str, np.ndarray]:
        """The consensus, its subset and the open round."""
        return {"indices": self.indices.copy(), "consensus": self.consensus.copy(),
                "open_round": np.array(self.open_round, dtype=np.int64)}

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore from ``state()``."""
        if not arrays:
            return
        self.indices = np.asarray(arrays["indices"], dtype=np.int64).copy()
        self.consensus = np.asarray(arrays["consensus"], dtype=np.float64).copy()
        self.open_round = int(arrays["open_round"])
        self._round = {}
