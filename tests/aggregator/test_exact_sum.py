"""ExactSum and the aggregators built on it: exact against fractions, the same bits in every order of adds."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from hetfed.aggregator.algorithms.aggregators import CoordinateMedian, ExactSum, TrimmedMean, WeightedMean


def summed(terms: list[np.ndarray]) -> ExactSum:
    acc = ExactSum(terms[0].shape)
    for t in terms:
        acc.add(t)
    return acc


def kept(acc: ExactSum) -> list[Fraction]:
    """The exact value each element's kept levels hold."""
    return [sum((Fraction(float(v)) for v in column), Fraction(0)) for column in acc._levels.T]


def bits(acc: ExactSum) -> bytes:
    return acc._levels.tobytes() + acc._top.tobytes() + acc.total().tobytes()


def test_cancellation_leaves_the_exact_remainder_in_every_order() -> None:
    terms = [np.array([1e16, 2.0**60, 3.0]), np.array([1.0, 1.0, -3.0]), np.array([-1e16, -(2.0**60), 2.0**-30])]
    for order in itertools.permutations(terms):
        got = summed(list(order)).total()
        np.testing.assert_array_equal(got, [1.0, 1.0, 2.0**-30])
        assert got.tolist() == [math.fsum(c) for c in zip(*terms, strict=True)]
    # Plain float64 addition in that order loses the 1 entirely.
    assert (terms[0] + terms[1] + terms[2]).tolist()[:2] == [0.0, 0.0]


def test_terms_within_the_window_are_kept_exactly() -> None:
    # Float32 values times integer weights, scaled by 2^-10..2^10: every term is below 2^31 (top level 0) and
    # has no bit below 2^-64 (the lowest kept grid), so the levels hold the exact sum, and the total is it
    # rounded once.
    rng = np.random.default_rng(11)
    terms = [rng.standard_normal(300).astype(np.float32).astype(np.float64) * float(rng.integers(1, 100))
             * np.exp2(rng.integers(-10, 11, 300)) for _ in range(25)]
    acc = summed(terms)
    exact = [sum((Fraction(float(v)) for v in column), Fraction(0)) for column in zip(*terms, strict=True)]
    assert kept(acc) == exact
    assert acc.total().tolist() == [float(x) for x in exact]


def test_every_order_gives_the_same_bits_where_plain_addition_does_not() -> None:
    rng = np.random.default_rng(5)
    n = ExactSum.BLOCK + 999  # two blocks
    # Magnitudes from 2^-80 to 2^80, so adds move windows (some elements by more than K levels) and take both
    # the one-window path and the per-element path.
    terms = [rng.standard_normal(n) * np.exp2(rng.integers(-80, 81, n)) for _ in range(9)]
    want = bits(summed(terms))
    plain = set()
    for seed in range(12):
        order = np.random.default_rng(seed).permutation(len(terms))
        assert bits(summed([terms[i] for i in order])) == want
        plain.add(sum((terms[i] for i in order), np.zeros(n)).tobytes())
    assert len(plain) > 1  # the running float64 sum does depend on the order


def test_a_larger_term_moves_the_window_up_and_drops_what_falls_below_it() -> None:
    # 2^70 needs top 2 (levels 2, 1, 0: grid 1): the 1.0 stays, 2^-70 falls below the window.
    for order in itertools.permutations([np.array([1.0]), np.array([2.0**-70]), np.array([2.0**70])]):
        acc = summed(list(order))
        assert acc._top.tolist() == [2]
        assert acc._levels[:, 0].tolist() == [2.0**70, 0.0, 1.0]
    # A move by two levels keeps 3·2^-40 (grid 2^-64 at level -2): the total is exact.
    for order in itertools.permutations([np.array([3 * 2.0**-40]), np.array([2.0**10])]):
        acc = summed(list(order))
        assert acc._top.tolist() == [0] and acc.total().tolist() == [2.0**10 + 3 * 2.0**-40]
    # A move by more than K levels drops every earlier level.
    for order in itertools.permutations([np.array([1.0]), np.array([2.0**200])]):
        acc = summed(list(order))
        assert acc._top.tolist() == [6] and acc._levels[:, 0].tolist() == [2.0**200, 0.0, 0.0]


def test_zero_terms_leave_small_elements_their_precision() -> None:
    acc = summed([np.array([0.0, 5.0]), np.array([2.0**-500, 0.0]), np.array([-0.0, 0.0])])
    assert acc.total().tolist() == [2.0**-500, 5.0]


def test_terms_beyond_its_range_and_too_many_terms_are_refused() -> None:
    acc = ExactSum((2,))
    with pytest.raises(ValueError, match="cannot be summed"):
        acc.add(np.array([1.0, 1e300]))
    acc.count = ExactSum.MAX_TERMS
    with pytest.raises(OverflowError):
        acc.add(np.zeros(2))
    with pytest.raises(ValueError, match="shape"):
        ExactSum((2,)).add(np.zeros(3))


def test_the_aggregators_give_the_same_bits_in_every_order() -> None:
    rng = np.random.default_rng(9)
    shape = (ExactSum.BLOCK // 7 + 5, 7)
    updates = [({"w": (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4)).astype(np.float32),
                 "b": rng.standard_normal(3).astype(np.float32)}, float(rng.integers(1, 500)) / 7)
               for _ in range(7)]
    for make in (WeightedMean, lambda: TrimmedMean(2), CoordinateMedian):
        results = set()
        for seed in range(6):
            acc = make()
            for i in np.random.default_rng(seed).permutation(len(updates)):
                acc.add(*updates[i])
            results.add(b"".join(v.tobytes() for v in acc.mean().values()))
        assert len(results) == 1, make
    acc = WeightedMean()
    for arrays, w in updates:
        acc.add(arrays, w)
    assert acc.weight == float(sum(Fraction(w) for _, w in updates))
