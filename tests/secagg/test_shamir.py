"""Shamir sharing of 32-byte secrets: any t shares rebuild it exactly, fewer reveal nothing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetfed.secagg import SecAggError, SeededEntropy, shamir
from tests.secagg.test_adversary import uniform_enough


@pytest.mark.parametrize(("t", "n"), [(1, 1), (1, 3), (2, 3), (3, 5), (5, 9), (16, 31)])
def test_any_t_shares_rebuild_the_secret(t: int, n: int) -> None:
    entropy = SeededEntropy(f"{t}/{n}")
    for secret in (bytes(32), b"\xff" * 32, entropy(32)):
        shares = shamir.split(secret, t, range(1, n + 1), entropy)
        subsets = [*itertools.islice(itertools.combinations(shares, t), 20), tuple(shares)]
        for subset in subsets:
            assert shamir.combine(subset, t, 32) == secret
        assert shamir.Share.from_bytes(shares[0].to_bytes()) == shares[0]


def test_fewer_than_t_shares_are_refused_and_a_bad_extra_share_detected() -> None:
    entropy = SeededEntropy(1)
    shares = shamir.split(entropy(32), 3, [2, 5, 7, 9], entropy)
    with pytest.raises(SecAggError, match="below_threshold"):
        shamir.combine(shares[:2], 3, 32)
    bad = [*shares[:3], shamir.Share(shares[3].index, (shares[3].value + 1) % shamir.PRIME)]
    with pytest.raises(SecAggError, match="inconsistent_shares"):
        shamir.combine(bad, 3, 32)
    with pytest.raises(SecAggError, match="inconsistent_shares"):
        shamir.combine([shares[0], shares[0], shares[1]], 3, 32)


@pytest.mark.parametrize("t", [2, 3])
def test_t_minus_one_shares_are_distributed_alike_whatever_the_secret(t: int) -> None:
    """3,000 sharings of an all-zero and of an all-ones secret: the low bytes of each of the first t - 1 shares
    (and of their differences) are uniform for both; with t = 1 the share is the secret and fails."""
    entropy = SeededEntropy(f"independence/{t}")
    for secret in (bytes(32), b"\xff" * 32):
        draws = np.array([[s.value & 0xFF for s in shamir.split(secret, t, range(1, t + 2), entropy)[: t - 1]]
                          for _ in range(3000)])
        for column in draws.T:
            assert uniform_enough(column, 256)
        if t == 3:
            assert uniform_enough((draws[:, 0] - draws[:, 1]) % 256, 256)
    alone = np.array([shamir.split(b"\xff" * 32, 1, [1], entropy)[0].value & 0xFF for _ in range(3000)])
    assert not uniform_enough(alone, 256)
