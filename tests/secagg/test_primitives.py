"""The key agreement and its binding, the sealed shares, the mask PRG and the neighbourhood graph."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetfed.secagg import SecAggError, SeededEntropy, graph, keys, prg


def test_agreement_is_symmetric_and_bound_to_run_round_and_names() -> None:
    e = SeededEntropy(0)
    a, b = keys.KeyPair.generate(e), keys.KeyPair.generate(e)
    k = keys.agree(a.private, b.public, keys.MASK_PURPOSE, "run", 1, "alice", "bob")
    assert k == keys.agree(b.private, a.public, keys.MASK_PURPOSE, "run", 1, "bob", "alice")
    others = {keys.agree(a.private, b.public, keys.MASK_PURPOSE, "run", 2, "alice", "bob"),
              keys.agree(a.private, b.public, keys.MASK_PURPOSE, "run2", 1, "alice", "bob"),
              keys.agree(a.private, b.public, keys.MASK_PURPOSE, "run", 1, "alice", "carol"),
              keys.agree(a.private, b.public, keys.SHARE_PURPOSE, "run", 1, "alice", "bob")}
    assert k not in others and len(others) == 4
    with pytest.raises(SecAggError, match="bad_keys"):
        keys.agree(a.private, bytes(32), keys.MASK_PURPOSE, "run", 1, "a", "b")  # a low-order point


def test_a_sealed_share_opens_only_under_its_binding() -> None:
    e = SeededEntropy(1)
    key = e(32)
    ad = keys.binding(b"share", "run", 1, "alice", "bob")
    sealed = keys.seal(key, b"shares", ad, e)
    assert keys.open_sealed(key, sealed, ad) == b"shares"
    for run, round_no, sender, receiver in (("run", 2, "alice", "bob"), ("run", 1, "alice", "carol"),
                                            ("run", 1, "bob", "alice"), ("other", 1, "alice", "bob")):
        other = keys.binding(b"share", run, round_no, sender, receiver)
        with pytest.raises(SecAggError, match="share_authentication_failed"):
            keys.open_sealed(key, sealed, other)
    with pytest.raises(SecAggError, match="share_authentication_failed"):
        keys.open_sealed(key, sealed[:-1] + bytes([sealed[-1] ^ 1]), ad)


def test_prg_is_deterministic_uniform_and_reduced() -> None:
    seed = bytes(range(32))
    a = prg.expand(seed, 300_000, 32)
    np.testing.assert_array_equal(a, prg.expand(seed, 300_000, 32))
    np.testing.assert_array_equal(a[:7], prg.expand(seed, 7, 32))  # a prefix of the same stream
    assert np.count_nonzero(a == prg.expand(bytes(32), 300_000, 32)) < 5
    counts = np.bincount((a >> 24).astype(np.int64), minlength=256)
    assert ((counts - a.size / 256) ** 2 / (a.size / 256)).sum() < 255 + 6 * np.sqrt(510)
    assert int(prg.expand(seed, 10_000, 20).max()) < 2**20
    assert prg.expand(seed, 3, 64).dtype == np.uint64 and prg.expand(seed, 0, 32).shape == (0,)
    with pytest.raises(ValueError, match="32 bytes"):
        prg.expand(b"short", 3, 32)


@pytest.mark.parametrize(("n", "k"), [(2, 1), (5, 2), (5, 4), (8, 3), (10, 4), (12, 5), (9, 8)])
def test_the_graph_is_k_regular_symmetric_and_the_same_for_any_roster_order(n: int, k: int) -> None:
    roster = [f"o{i}" for i in range(n)]
    g = graph.neighbours(roster, k, b"seed")
    assert all(len(v) == k and u not in v for u, v in g.items())
    assert all(u in g[v] for u in g for v in g[u])
    assert g == graph.neighbours(list(reversed(roster)), k, b"seed")
    if k == n - 1:
        assert all(v == set(roster) - {u} for u, v in g.items())


def test_the_graph_is_connected_after_removing_fewer_than_k_clients() -> None:
    roster = [f"o{i}" for i in range(10)]
    g = graph.neighbours(roster, 4, b"seed")
    for removed in itertools.combinations(roster, 3):
        left = set(roster) - set(removed)
        seen, todo = set(), [min(left)]
        while todo:
            u = todo.pop()
            if u not in seen:
                seen.add(u)
                todo += [v for v in g[u] & left if v not in seen]
        assert seen == left


def test_impossible_graphs_are_refused() -> None:
    for roster, k in ((["a", "b", "c"], 1), (["a", "b"], 2), (["a"], 0), (["a", "a", "b"], 1)):
        with pytest.raises(SecAggError, match="bad_parameters"):
            graph.neighbours(roster, k, b"s")
