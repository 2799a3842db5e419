"""The round's configuration and the stage messages, as plain dataclasses (bytes, strings, numpy arrays), so
that a wire layer maps each to one Protobuf message field for field.

Every message names its run, its round and its sender or receiver; sessions refuse one that names another
(``foreign_message``). Lists are tuples sorted by name, so a message has one form.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hetfed.secagg.errors import SecAggError
from hetfed.secagg.graph import neighbours
from hetfed.secagg.ring import Encoding

GRAPH_SEED_BYTES = 32


def default_degree(clients: int) -> int:
    """The complete graph, k = n - 1 (the original SecAgg): each client's cost grows with n, which stays small
    for the tens of organizations of a cross-silo federation (benchmarks/secagg_core.py); a sparser k is the
    caller's choice."""
    return clients - 1


def default_threshold(degree: int) -> int:
    """A strict majority of a client's neighbours: floor(k/2) + 1 (docs in hetfed.secagg)."""
    return degree // 2 + 1


@dataclass(frozen=True)
class RoundConfig:
    """What the server publishes before a round: the run and round, the clients picked (``roster``), the
    graph's degree k and seed, the Shamir threshold t and how inputs are encoded."""

    run_id: str
    round: int
    roster: tuple[str, ...]
    degree: int
    threshold: int
    graph_seed: bytes
    encoding: Encoding
    graph: dict[str, frozenset[str]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.graph_seed) != GRAPH_SEED_BYTES:
            raise SecAggError("bad_parameters", f"the graph seed has {GRAPH_SEED_BYTES} bytes")
        if not self.degree / 2 < self.threshold <= self.degree:
            raise SecAggError("bad_parameters", (
                f"threshold {self.threshold} with degree {self.degree}: it must be in (k/2, k] so that no two "
                "disjoint sets of neighbours can each rebuild a secret"))
        if self.encoding.max_inputs < len(self.roster):
            raise SecAggError("bad_parameters", (
                f"the encoding sums at most {self.encoding.max_inputs} inputs, the roster has {len(self.roster)}"))
        object.__setattr__(self, "roster", tuple(sorted(self.roster)))
        object.__setattr__(self, "graph", neighbours(self.roster, self.degree, self.graph_seed))

    def index(self, name: str) -> int:
        """The Shamir evaluation point of ``name``: its place in the sorted roster, from 1."""
        return self.roster.index(name) + 1

    def check(self, run_id: str, round_no: int, name: str, expected: str, what: str) -> None:
        """Refuse (``foreign_message``) a message of another run or round, or from or to another party."""
        if (run_id, round_no) != (self.run_id, self.round):
            raise SecAggError("foreign_message", (
                f"{what} of run {run_id!r} round {round_no}; this is run {self.run_id!r} round {self.round}"))
        if name != expected:
            raise SecAggError("foreign_message", f"{what} names {name!r}, expected {expected!r}")


@dataclass(frozen=True)
class KeyAdvert:
    """Stage 1, client to server: the client's two public keys for this round."""

    run_id: str
    round: int
    sender: str
    share_public: bytes
    mask_public: bytes


@dataclass(frozen=True)
class PeerKeys:
    """Stage 1, server to client: the adverts of the client's neighbours that advertised."""

    run_id: str
    round: int
    receiver: str
    peers: tuple[KeyAdvert, ...]


@dataclass(frozen=True)
class EncryptedShare:
    """One client's Shamir shares (of its self-mask seed and its mask key) sealed for one neighbour."""

    sender: str
    receiver: str
    ciphertext: bytes


@dataclass(frozen=True)
class SharedKeys:
    """Stage 2, client to server: a sealed share for each neighbour in its PeerKeys."""

    run_id: str
    round: int
    sender: str
    shares: tuple[EncryptedShare, ...]


@dataclass(frozen=True)
class PeerShares:
    """Stage 2, server to client: the sealed shares addressed to it by its neighbours still in the round."""

    run_id: str
    round: int
    receiver: str
    shares: tuple[EncryptedShare, ...]


@dataclass(frozen=True)
class MaskedInput:
    """Stage 3, client to server: the encoded input plus its self mask and pairwise masks, mod 2^b."""

    run_id: str
    round: int
    sender: str
    vector: np.ndarray = field(compare=False)


@dataclass(frozen=True)
class UnmaskRequest:
    """Stage 4, server to client: which of its neighbours sent a masked input (``survivors``: reveal their
    self-mask seed shares) and which did not (``dropped``: reveal their mask key shares)."""

    run_id: str
    round: int
    receiver: str
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]


@dataclass(frozen=True)
class RevealedShare:
    """One share a client holds of ``owner``'s secret (``Share.to_bytes``)."""

    owner: str
    share: bytes


@dataclass(frozen=True)
class UnmaskReply:
    """Stage 4, client to server: the seed shares of the survivors and the key shares of the dropped."""

    run_id: str
    round: int
    sender: str
    seed_shares: tuple[RevealedShare, ...]
    key_shares: tuple[RevealedShare, ...]


@dataclass(frozen=True)
class Aggregate:
    """The unmasked result: the exact ring sum of the survivors' encoded inputs and its decoded floats."""

    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    ring_sum: np.ndarray = field(compare=False)
    values: dict[str, np.ndarray] = field(compare=False)
