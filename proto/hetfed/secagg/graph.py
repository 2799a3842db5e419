"""The neighbourhood graph of SecAgg+: a Harary graph H(k, n) over the round's roster in an order drawn from
a seed the server publishes, so that every client can compute its own neighbours and check the server's.

Position i is joined to i ± 1, ..., i ± floor(k/2) (mod n) and, for odd k, to i + n/2; n k must be even. With
k = n - 1 the graph is complete and the protocol is the original SecAgg's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from hetfed.secagg.errors import SecAggError


def order(roster: Sequence[str], seed: bytes) -> list[str]:
    """The roster in the seed's order: sorted by SHA-256(seed, name), identical on every machine."""
    prefix = len(seed).to_bytes(4, "big") + seed
    return sorted(roster, key=lambda name: hashlib.sha256(prefix + name.encode()).digest())


def neighbours(roster: Sequence[str], degree: int, seed: bytes) -> dict[str, frozenset[str]]:
    """Each member's neighbours in the Harary graph of ``degree`` over ``roster``."""
    n = len(roster)
    if len(set(roster)) != n:
        raise SecAggError("bad_parameters", "the roster names a client twice")
    if n < 2 or not 1 <= degree <= n - 1:
        raise SecAggError("bad_parameters", f"degree {degree} with {n} clients: it must be in [1, n - 1]")
    if n * degree % 2:
        raise SecAggError("bad_parameters", f"no {degree}-regular graph on {n} clients (n k is odd)")
    ring = order(roster, seed)
    offsets = {o for h in range(1, degree // 2 + 1) for o in (h, -h)}
    if degree % 2:
        offsets.add(n // 2)
    return {name: frozenset(ring[(i + o) % n] for o in offsets) for i, name in enumerate(ring)}
