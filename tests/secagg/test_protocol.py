"""SecAgg+ rounds in process: the unmasked sum is the plain sum of the encoded inputs, exactly; dropouts after
masking are recovered down to the threshold and abandoned below it, with no client's two secrets revealed."""

from __future__ import annotations

import numpy as np
import pytest

from hetfed.secagg import AbandonedError, Encoding, Field, RoundConfig, SecAggError
from hetfed.secagg.server import prune
from tests.secagg.driver import make_config, names, plain_sum, random_inputs, run_round, start

# Every kind of payload a server sums: a weight matrix, a 0-d scalar, a one-element count, an empty tensor.
PAYLOADS = (Field("weights", (4, 3), 2.0), Field("bias", (), 0.5), Field("count", (1,), 1000.0),
            Field("unused", (0,), 1.0))


def _degrees(n: int) -> list[int]:
    """Every degree the Harary graph allows on n clients from 2 (1 for two clients) up to complete."""
    return [k for k in range(1 if n == 2 else 2, n) if n * k % 2 == 0]


@pytest.mark.parametrize("n", range(2, 11))
def test_unmasked_sum_is_the_plain_quantized_sum(n: int) -> None:
    for k in _degrees(n):
        config = make_config(n, degree=k, fields=PAYLOADS)
        r, agg = run_round(config, random_inputs(config, seed=n * 100 + k), seed=k)
        assert agg.survivors == names(n) and agg.dropped == ()
        expected = plain_sum(r, agg.survivors)
        np.testing.assert_array_equal(config.encoding.signed(agg.ring_sum), expected)
        decoded = config.encoding.decode_sum(expected.astype(np.uint64).astype(config.encoding.dtype), n)
        for name, value in agg.values.items():
            np.testing.assert_array_equal(value, decoded[name])
            assert value.shape == next(f.shape for f in PAYLOADS if f.name == name)


def test_the_masked_inputs_differ_from_the_encoded_ones() -> None:
    config = make_config(4, fields=PAYLOADS)
    r, _ = run_round(config, random_inputs(config, 0))
    for u in config.roster:
        assert np.count_nonzero(r.masked[u] != r.encoded[u]) >= config.encoding.length - 1


@pytest.mark.parametrize(("length", "value_bits"), [(1, 16), (1_000_003, 16), (5, 40)])
def test_lengths_and_ring_widths(length: int, value_bits: int) -> None:
    """One element, a million (an odd count, past the PRG's 4 MiB chunk) and a 64-bit ring."""
    config = make_config(5, degree=4, fields=(Field("w", (length,), 3.0),), value_bits=value_bits)
    assert config.encoding.ring_bits == (64 if value_bits > 30 else 32)
    r, agg = run_round(config, random_inputs(config, length), drop={"mask": {"org-03"}})
    np.testing.assert_array_equal(config.encoding.signed(agg.ring_sum), plain_sum(r, agg.survivors))


def test_a_ring_narrower_than_32_bits() -> None:
    fields = (Field("w", (257,), 1.0),)
    config = RoundConfig("run-a", 1, names(6), 5, 3, bytes(32), Encoding(fields, 12, 15, 6))
    r, agg = run_round(config, random_inputs(config, 3), drop={"mask": {"org-02"}})
    assert int(agg.ring_sum.max()) < 2**15
    np.testing.assert_array_equal(config.encoding.signed(agg.ring_sum), plain_sum(r, agg.survivors))


@pytest.mark.parametrize(("n", "k", "t", "dropped"), [
    (5, 4, 3, {"org-01"}),  # k - t = 1 dropout
    (8, 7, 4, {"org-01", "org-04", "org-06"}),  # k - t = 3 dropouts, exactly at the threshold
    (10, 4, 3, {"org-00"}),  # a sparse graph
    (10, 6, 4, {"org-02", "org-07"}),
])
def test_dropouts_after_masking_at_and_above_the_threshold_are_recovered(n: int, k: int, t: int,
                                                                         dropped: set[str]) -> None:
    config = make_config(n, degree=k, threshold=t, fields=PAYLOADS)
    r, agg = run_round(config, random_inputs(config, n), drop={"mask": dropped})
    assert set(agg.dropped) == dropped and set(agg.survivors) == set(names(n)) - dropped
    np.testing.assert_array_equal(config.encoding.signed(agg.ring_sum), plain_sum(r, agg.survivors))
    assert set(map(frozenset, r.server.revealed.values())) <= {frozenset({"seed"}), frozenset({"key"})}
    for u in dropped:
        assert r.server.revealed[u] == {"key"}


def test_survivors_silent_at_unmasking_are_tolerated_down_to_the_threshold() -> None:
    config = make_config(8, degree=7, threshold=4)
    r, agg = run_round(config, random_inputs(config, 2), drop={"mask": {"org-00"}, "unmask": {"org-05", "org-06"}})
    assert agg.dropped == ("org-00",) and len(agg.survivors) == 7
    np.testing.assert_array_equal(config.encoding.signed(agg.ring_sum), plain_sum(r, agg.survivors))


def test_too_many_dropouts_after_masking_abandon_before_any_share_is_asked() -> None:
    config = make_config(6, degree=5, threshold=4)
    with pytest.raises(AbandonedError, match="at mask") as err:
        run_round(config, random_inputs(config, 1), drop={"mask": {"org-01", "org-02"}})
    assert err.value.reason == "below_threshold"
    # again, to look at the server: nothing was asked for, so nothing was revealed
    r = start(config)
    with pytest.raises(AbandonedError):
        run_round(config, random_inputs(config, 1), drop={"mask": {"org-01", "org-02"}}, rnd=r)
    assert r.server.revealed == {} and r.server.stage == "abandoned"


def test_too_few_answers_at_unmasking_abandon_and_reveal_no_two_secrets() -> None:
    config = make_config(7, degree=6, threshold=4)
    r = start(config)
    with pytest.raises(AbandonedError, match="at unmask"):
        run_round(config, random_inputs(config, 4), drop={"mask": {"org-01"}, "unmask": {"org-03", "org-04"}},
                  rnd=r)
    assert r.server.revealed and all(len(kinds) == 1 for kinds in r.server.revealed.values())
    assert r.server.revealed["org-01"] == {"key"}
    with pytest.raises(Exception, match="unexpected_stage"):
        r.server.finish()


def test_a_client_dropping_before_masking_is_just_excluded() -> None:
    config = make_config(6, degree=5, threshold=3)
    r, agg = run_round(config, random_inputs(config, 5), drop={"advertise": {"org-00"}, "share_keys": {"org-04"}})
    assert set(agg.survivors) == {"org-01", "org-02", "org-03", "org-05"} and agg.dropped == ()
    assert r.server.excluded == {"org-00": "advertise", "org-04": "share_keys"}
    assert "org-00" not in r.server.revealed and "org-04" not in r.server.revealed
    np.testing.assert_array_equal(config.encoding.signed(agg.ring_sum), plain_sum(r, agg.survivors))


def test_a_client_left_with_too_few_neighbours_is_excluded_and_the_rest_go_on() -> None:
    graph = {"a": frozenset("bce"), "b": frozenset("ac"), "c": frozenset("ab"), "e": frozenset("a")}
    assert prune("abce", graph, 2) == frozenset("abc")
    # a chain that loses its end loses every link: each is left with fewer than t in turn
    chain = {"a": frozenset("b"), "b": frozenset("ac"), "c": frozenset("bd"), "d": frozenset("c")}
    assert prune("abcd", chain, 2) == frozenset()


def test_too_few_clients_before_masking_abandon_with_nothing_sent() -> None:
    config = make_config(6, degree=5, threshold=3)
    r = start(config)
    with pytest.raises(AbandonedError, match="at advertise"):
        run_round(config, random_inputs(config, 6), drop={"advertise": {"org-00", "org-01", "org-02"}}, rnd=r)
    assert set(r.server.excluded) == set(config.roster) and r.server.stage == "abandoned"
    assert all(c.stage == "share_keys" for u, c in r.clients.items() if u not in {"org-00", "org-01", "org-02"})


def test_a_client_refuses_its_own_input_out_of_range_and_the_round_goes_on_without_it() -> None:
    config = make_config(6, fields=(Field("w", (3,), 1.0, norm_bound=1.0),))
    inputs = {u: {"w": np.full(3, 0.1)} for u in config.roster}
    inputs["org-01"] = {"w": np.array([0.0, 1.5, 0.0])}  # beyond the bound
    inputs["org-03"] = {"w": np.array([0.9, 0.9, 0.0])}  # within the bound, beyond the norm
    r, agg = run_round(config, inputs, strict=True)
    assert r.refused == {"org-01", "org-03"} and agg.dropped == ("org-01", "org-03")
    np.testing.assert_array_equal(config.encoding.signed(agg.ring_sum), plain_sum(r, agg.survivors))
    np.testing.assert_allclose(agg.values["w"], np.full(3, 0.4), atol=4 / config.encoding.level)


@pytest.mark.parametrize(("degree", "threshold", "roster", "max_inputs", "what"), [
    (4, 2, 5, 5, "in \\(k/2, k\\]"),  # t = k/2: two halves of the neighbours could each rebuild a secret
    (4, 5, 5, 5, "in \\(k/2, k\\]"),
    (3, 2, 5, 5, "n k is odd"),
    (4, 3, 5, 4, "sums at most 4 inputs"),
])
def test_unsafe_or_impossible_configurations_are_refused(degree: int, threshold: int, roster: int,
                                                         max_inputs: int, what: str) -> None:
    enc = Encoding.for_inputs((Field("w", (1,), 1.0),), max_inputs)
    with pytest.raises(SecAggError, match=what) as err:
        RoundConfig("run-a", 1, names(roster), degree, threshold, bytes(32), enc)
    assert err.value.reason == "bad_parameters"
