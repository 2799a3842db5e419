"""Shamir secret sharing of short secrets (up to 64 bytes) over the prime field of p = 2^521 - 1.

``split`` draws a random polynomial f of degree t - 1 with f(0) = secret and gives party i the share f(x_i);
any t shares give f(0) by Lagrange interpolation, and any t - 1 shares are uniformly distributed whatever the
secret is (for every candidate secret exactly one polynomial fits them). Shares beyond t are checked to lie on
the same polynomial, so a corrupted share is detected when there are more than t.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetfed.secagg.errors import SecAggError

PRIME = 2**521 - 1  # a Mersenne prime, above every 64-byte secret
VALUE_BYTES = 66
INDEX_BYTES = 4
SHARE_BYTES = INDEX_BYTES + VALUE_BYTES
MAX_SECRET_BYTES = 64
# Random bytes drawn per coefficient: 80 bytes reduced mod p are uniform up to a 2^-119 statistical distance.
_COEFFICIENT_BYTES = 80


@dataclass(frozen=True)
class Share:
    """f(index) of one polynomial; index >= 1 (f(0) is the secret)."""

    index: int
    value: int

    def to_bytes(self) -> bytes:
        return self.index.to_bytes(INDEX_BYTES, "big") + self.value.to_bytes(VALUE_BYTES, "big")

    @classmethod
    def from_bytes(cls, data: bytes) -> Share:
        if len(data) != SHARE_BYTES:
            raise SecAggError("malformed", f"a share has {SHARE_BYTES} bytes, not {len(data)}")
        index = int.from_bytes(data[:INDEX_BYTES], "big")
        value = int.from_bytes(data[INDEX_BYTES:], "big")
        if index < 1 or value >= PRIME:
            raise SecAggError("malformed", "a share's index is 0 or its value is outside the field")
        return cls(index, value)


def split(secret: bytes, threshold: int, indices: Sequence[int], entropy: Callable[[int], bytes]) -> list[Share]:
    """Shares of ``secret`` at ``indices`` (distinct, >= 1), any ``threshold`` of which rebuild it."""
    if len(secret) > MAX_SECRET_BYTES:
        raise SecAggError("bad_parameters", f"a shared secret has at most {MAX_SECRET_BYTES} bytes")
    if not 1 <= threshold <= len(indices):
        raise SecAggError("bad_parameters", f"threshold {threshold} with {len(indices)} shares")
    if len(set(indices)) != len(indices) or min(indices) < 1 or max(indices) >= PRIME:
        raise SecAggError("bad_parameters", "share indices must be distinct and >= 1")
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [int.from_bytes(entropy(_COEFFICIENT_BYTES), "big") % PRIME for _ in range(threshold - 1)]
    shares = []
    for x in indices:
        y = 0
        for c in reversed(coefficients):
            y = (y * x + c) % PRIME
        shares.append(Share(x, y))
    return shares


def _interpolate(points: Sequence[Share], at: int) -> int:
    """The value at ``at`` of the polynomial of degree len(points) - 1 through ``points``."""
    total = 0
    for i, p in enumerate(points):
        num, den = 1, 1
        for j, q in enumerate(points):
            if i != j:
                num = num * (at - q.index) % PRIME
                den = den * (p.index - q.index) % PRIME
        total = (total + p.value * num * pow(den, -1, PRIME)) % PRIME
    return total


def combine(shares: Sequence[Share], threshold: int, secret_bytes: int) -> bytes:
    """The secret of ``secret_bytes`` bytes from at least ``threshold`` shares; ``inconsistent_shares`` when the
    shares beyond the first ``threshold`` do not lie on their polynomial or the secret does not fit."""
    if len({s.index for s in shares}) != len(shares):
        raise SecAggError("inconsistent_shares", "two shares have one index")
    if len(shares) < threshold:
        raise SecAggError("below_threshold", f"{len(shares)} shares, {threshold} needed")
    base = list(shares[:threshold])
    for extra in shares[threshold:]:
        if _interpolate(base, extra.index) != extra.value:
            raise SecAggError("inconsistent_shares", f"share {extra.index} is not on the others' polynomial")
    secret = _interpolate(base, 0)
    if secret >= 1 << (8 * secret_bytes):
        raise SecAggError("inconsistent_shares", f"the rebuilt secret does not fit {secret_bytes} bytes")
    return secret.to_bytes(secret_bytes, "big")
