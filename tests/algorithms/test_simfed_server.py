"""SimFed's server math on three-element arrays with hand-computed numbers (numpy only)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from hetfed.aggregator.algorithms.simfed import (
    cosine_similarity_matrix,
    match,
    personalised_downloads,
    random_similarity_sets,
    ranked_similarity_sets,
    reflect,
    reflect_factorized,
    reflect_sparse,
    reflection_weights,
    similarity_sets,
)
from hetfed.wire.payloads import FactorizedLayer, FactorizedWeights

# Three organizations whose embeddings have cosines 0.96 (a, b), 0 (a, c) and 0.28 (b, c).
Z = [np.array([[1.0, 0.0]]), np.array([[0.96, 0.28]]), np.array([[0.0, 1.0]])]
SIGMA = np.array([[1.0, 0.96, 0.0], [0.96, 1.0, 0.28], [0.0, 0.28, 1.0]])
# α with exp(α·0.04) = 3: the pair (1, 0.96) gets the weights (3/4, 1/4).
ALPHA_3_TO_1 = math.log(3.0) / 0.04


def test_cosine_similarity_matrix_by_hand() -> None:
    np.testing.assert_allclose(cosine_similarity_matrix(Z), SIGMA, rtol=0, atol=1e-15)
    # [B, D] embeddings are flattened row-major: the cosine of the concatenations.
    a, b = np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([[1.0, 1.0], [0.0, 1.0]])
    sigma = cosine_similarity_matrix([a, 2.0 * b])
    assert sigma[0, 1] == pytest.approx(2.0 / (math.sqrt(2.0) * math.sqrt(3.0)), abs=1e-15)
    # An all-zero embedding matches only itself.
    s0 = cosine_similarity_matrix([np.zeros((1, 2)), np.ones((1, 2))])
    np.testing.assert_array_equal(s0, [[1.0, 0.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match="one shape"):
        cosine_similarity_matrix([np.ones((1, 2)), np.ones((1, 3))])
    with pytest.raises(ValueError, match="non-finite"):
        cosine_similarity_matrix([np.ones((1, 2)), np.array([[np.nan, 1.0]])])


def test_similarity_sets_hold_the_organization_and_those_above_tau() -> None:
    sets = similarity_sets(SIGMA, 0.9)
    assert [s.tolist() for s in sets] == [[0, 1], [0, 1], [2]]
    assert [s.tolist() for s in similarity_sets(SIGMA, 0.28)] == [[0, 1], [0, 1, 2], [1, 2]]
    assert [s.tolist() for s in similarity_sets(SIGMA, 1.5)] == [[0], [1], [2]]  # k is always in J_k


def test_a_minimum_set_size_adds_the_most_similar_organizations_top_m() -> None:
    # The authors' minimum_aggr (server.py): the top max(|{σ ≥ τ}|, m) by σ, the organization first.
    assert [s.tolist() for s in similarity_sets(SIGMA, 0.9, minimum=2)] == [[0, 1], [0, 1], [1, 2]]
    assert [s.tolist() for s in similarity_sets(SIGMA, 1.5, minimum=2)] == [[0, 1], [0, 1], [1, 2]]
    assert [s.tolist() for s in similarity_sets(SIGMA, 0.9, minimum=3)] == [[0, 1, 2]] * 3
    assert [s.tolist() for s in similarity_sets(SIGMA, 0.9, minimum=7)] == [[0, 1, 2]] * 3
    s4 = np.array([[1.0, 0.5, 0.2, 0.5], [0.5, 1.0, 0.9, 0.1], [0.2, 0.9, 1.0, 0.3], [0.5, 0.1, 0.3, 1.0]])
    # Ties (σ_01 = σ_03 = 0.5) go to the lower index.
    assert [s.tolist() for s in similarity_sets(s4, 0.95, minimum=2)] == [[0, 1], [1, 2], [1, 2], [0, 3]]
    assert [s.tolist() for s in similarity_sets(s4, 0.8, minimum=3)] == [[0, 1, 3], [0, 1, 2], [1, 2, 3], [0, 2, 3]]
    # More organizations above τ than m: the threshold set stands.
    assert [s.tolist() for s in similarity_sets(s4, 0.4, minimum=2)] == [[0, 1, 3], [0, 1, 2], [1, 2], [0, 3]]
    _, sets, weights = match(Z, 0.9, ALPHA_3_TO_1, minimum=2)
    assert [s.tolist() for s in sets] == [[0, 1], [0, 1], [1, 2]]
    np.testing.assert_allclose(weights[0], [0.75, 0.25], rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="minimum similarity-set size"):
        similarity_sets(SIGMA, 0.9, minimum=0)


def test_reflection_weights_and_eq8_by_hand() -> None:
    w = reflection_weights(SIGMA[0], np.array([0, 1]), ALPHA_3_TO_1)
    np.testing.assert_allclose(w, [0.75, 0.25], rtol=0, atol=1e-15)
    theta_a, theta_b = np.array([1.0, 2.0, 3.0]), np.array([5.0, 6.0, 7.0])
    # θ_a + 3/4·(θ_a − θ_a) + 1/4·(θ_b − θ_a) = [2, 3, 4]; θ_b + 1/4·(θ_a − θ_b) = [4, 5, 6].
    np.testing.assert_allclose(reflect(theta_a, [theta_a, theta_b], w), [2.0, 3.0, 4.0], rtol=0, atol=1e-14)
    w_b = reflection_weights(SIGMA[1], np.array([0, 1]), ALPHA_3_TO_1)
    np.testing.assert_allclose(w_b, [0.25, 0.75], rtol=0, atol=1e-15)
    np.testing.assert_allclose(reflect(theta_b, [theta_a, theta_b], w_b), [4.0, 5.0, 6.0], rtol=0, atol=1e-14)
    # J_c = {c}: θ_c comes back bit for bit.
    theta_c = np.array([0.1, 0.2, 0.3])
    assert reflect(theta_c, [theta_c], reflection_weights(SIGMA[2], np.array([2]), 30.0)).tolist() == [
        0.1,
        0.2,
        0.3,
    ]
    # Three members at α = 30: σ = (1, 1 − ln2/30, 1 − ln4/30) gives weights ∝ (1, 1/2, 1/4) = (4, 2, 1)/7.
    row = np.array([1.0, 1.0 - math.log(2.0) / 30.0, 1.0 - math.log(4.0) / 30.0])
    w3 = reflection_weights(row, np.array([0, 1, 2]), 30.0)
    np.testing.assert_allclose(w3, [4 / 7, 2 / 7, 1 / 7], rtol=0, atol=1e-15)
    # [1, 2, 3] + 2/7·[7, 7, 7] + 1/7·[14, 14, 14] = [5, 6, 7].
    got = reflect(
        np.array([1.0, 2.0, 3.0]),
        [np.array([1.0, 2.0, 3.0]), np.array([8.0, 9.0, 10.0]), np.array([15.0, 16.0, 17.0])],
        w3,
    )
    np.testing.assert_allclose(got, [5.0, 6.0, 7.0], rtol=0, atol=1e-14)
    # The paper's α = 30 on the (1, 0.96) pair: w = (1, e^{-1.2}) / (1 + e^{-1.2}).
    w30 = reflection_weights(SIGMA[0], np.array([0, 1]), 30.0)
    e = math.exp(-1.2)
    np.testing.assert_allclose(w30, [1 / (1 + e), e / (1 + e)], rtol=0, atol=1e-15)


def test_log_sum_exp_is_stable_at_alpha_30_and_beyond() -> None:
    near_one = np.array([1.0, 1.0 - 1e-12, 1.0 - 2e-12])
    w = reflection_weights(near_one, np.array([0, 1, 2]), 30.0)
    assert np.all(np.isfinite(w)) and w.sum() == pytest.approx(1.0, abs=1e-15)
    np.testing.assert_allclose(w, [1 / 3, 1 / 3, 1 / 3], rtol=0, atol=1e-10)
    # α = 1000: exp(α·σ) alone overflows float64; the ratio e^{-1} survives.
    with np.errstate(over="ignore", invalid="ignore"):
        naive = np.exp(1000.0 * np.array([1.0, 0.999]))
        assert not np.all(np.isfinite(naive / naive.sum()))
    w_big = reflection_weights(np.array([1.0, 0.999]), np.array([0, 1]), 1000.0)
    e = math.exp(-1.0)
    np.testing.assert_allclose(w_big, [1 / (1 + e), e / (1 + e)], rtol=0, atol=1e-15)
    # Huge α puts all weight on the most similar member, with no NaN.
    np.testing.assert_array_equal(
        reflection_weights(np.array([1.0, 0.5, -1.0]), np.array([0, 1, 2]), 1e6), [1, 0, 0]
    )
    with pytest.raises(ValueError, match="alpha"):
        reflection_weights(np.array([1.0]), np.array([0]), math.inf)


def test_sparse_masks_reflect_on_their_dense_scatter() -> None:
    a = (np.array([0, 2], np.int64), np.array([1.0, 2.0]))  # dense [1, 0, 2]
    b = (np.array([1, 2], np.int64), np.array([4.0, 6.0]))  # dense [0, 4, 6]
    idx, val = reflect_sparse(a, [a, b], np.array([0.75, 0.25]), 3)
    assert idx.tolist() == [0, 1, 2] and np.allclose(val, [0.75, 1.0, 3.0], rtol=0, atol=1e-15)
    idx, val = reflect_sparse(b, [a, b], np.array([0.25, 0.75]), 3)
    assert idx.tolist() == [0, 1, 2] and np.allclose(val, [0.25, 3.0, 5.0], rtol=0, atol=1e-15)
    idx, val = reflect_sparse(b, [a, b], np.array([0.25, 0.75]), 3, threshold=0.5)  # re-thresholded
    assert idx.tolist() == [1, 2]
    with pytest.raises(ValueError, match="distinct"):
        reflect_sparse((np.array([1, 1]), np.array([1.0, 2.0])), [a], np.array([1.0]), 3)
    with pytest.raises(ValueError, match="distinct"):
        reflect_sparse((np.array([3]), np.array([1.0])), [a], np.array([1.0]), 3)


def _payload(u: list[float], v: list[float], idx: list[int], val: list[float]) -> FactorizedWeights:
    layer = FactorizedLayer(
        "encoder.0",
        np.array(u, np.float32),
        np.array(v, np.float32),
        np.array(idx, np.int64),
        np.array(val, np.float32),
        (1, 3),
    )
    return FactorizedWeights((layer,), num_examples=10)


def test_round_one_has_no_reflection_then_each_organization_gets_its_own() -> None:
    uploads = [
        _payload([1.0, 2.0, 3.0], [1.0], [0, 2], [1.0, 2.0]),
        _payload([5.0, 6.0, 7.0], [5.0], [1, 2], [4.0, 6.0]),
        _payload([0.1, 0.2, 0.3], [0.5], [1], [0.7]),
    ]
    sigma, sets, weights = match(Z, 0.9, ALPHA_3_TO_1)
    np.testing.assert_allclose(sigma, SIGMA, atol=1e-15)
    assert personalised_downloads(1, uploads, sets, weights) is None
    down = personalised_downloads(2, uploads, sets, weights)
    assert down is not None and len(down) == 3
    a, b, c = (d.layers[0] for d in down)
    np.testing.assert_allclose(a.u, [2.0, 3.0, 4.0], atol=1e-6)
    np.testing.assert_allclose(a.v, [2.0], atol=1e-6)
    assert a.mask_indices.tolist() == [0, 1, 2] and np.allclose(a.mask_values, [0.75, 1.0, 3.0], atol=1e-6)
    np.testing.assert_allclose(b.u, [4.0, 5.0, 6.0], atol=1e-6)
    assert b.mask_indices.tolist() == [0, 1, 2] and np.allclose(b.mask_values, [0.25, 3.0, 5.0], atol=1e-6)
    own = uploads[2].layers[0]  # J_c = {c}: exactly its own factors back
    assert np.array_equal(c.u, own.u) and np.array_equal(c.v, own.v)
    assert np.array_equal(c.mask_indices, own.mask_indices) and np.array_equal(c.mask_values, own.mask_values)
    assert a.u.dtype == np.float32 and a.mask_indices.dtype == np.int64 and a.mask_values.dtype == np.float32
    with pytest.raises(ValueError, match="must hold 0"):
        personalised_downloads(2, uploads, [np.array([1]), sets[1], sets[2]], weights)
    first = uploads[0].layers[0]
    other = FactorizedWeights((dataclasses.replace(first, name="encoder.1"),))
    with pytest.raises(ValueError, match=r"expected 'encoder\.0'"):
        reflect_factorized(uploads[0], [uploads[0], other], np.array([0.5, 0.5]))


def test_random_matching_sets_are_seeded_and_hold_the_organization() -> None:
    sets = random_similarity_sets(5, 2, seed=(3, 1))
    assert all(k in s and s.size == 3 and np.unique(s).size == 3 for k, s in enumerate(sets))
    assert [s.tolist() for s in sets] == [s.tolist() for s in random_similarity_sets(5, 2, seed=(3, 1))]
    assert [s.tolist() for s in random_similarity_sets(2, 4, seed=0)] == [[0, 1], [0, 1]]


def test_ranked_sets_by_hand_ties_to_the_lower_index() -> None:
    sigma = np.array([[1.0, 0.5, 0.5, -0.2],
                      [0.5, 1.0, 0.9, 0.1],
                      [0.5, 0.9, 1.0, 0.3],
                      [-0.2, 0.1, 0.3, 1.0]])
    top = ranked_similarity_sets(sigma, 1, most_similar=True)
    bottom = ranked_similarity_sets(sigma, 2, most_similar=False)
    assert [s.tolist() for s in top] == [[0, 1], [1, 2], [1, 2], [2, 3]]  # row 0: 1 and 2 tie, 1 wins
    assert [s.tolist() for s in bottom] == [[0, 1, 3], [0, 1, 3], [0, 2, 3], [0, 1, 3]]
    assert [s.tolist() for s in ranked_similarity_sets(sigma, 0, most_similar=True)] == [[0], [1], [2], [3]]
    assert [s.tolist() for s in ranked_similarity_sets(sigma[:1, :1], 3, most_similar=False)] == [[0]]
    with pytest.raises(ValueError, match="partners must be >= 0"):
        ranked_similarity_sets(sigma, -1, most_similar=True)
