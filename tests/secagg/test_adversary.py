"""What a curious or lying server, or a replayed message, gets from a round: masked inputs that look uniform,
refusals for foreign, replayed and double requests, and never both secrets of one client."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hetfed.secagg import (
    AbandonedError,
    Field,
    MaskedInput,
    PeerShares,
    SecAggError,
    SeededEntropy,
    UnmaskReply,
    UnmaskRequest,
    shamir,
)
from tests.secagg.driver import Round, make_config, random_inputs, rounding_rng, run_round, start

CHI2_BINS = 256


def chi_square(values: np.ndarray, bins: int) -> float:
    counts = np.bincount(values, minlength=bins)
    expected = values.size / bins
    return float(((counts - expected) ** 2 / expected).sum())


def uniform_enough(values: np.ndarray, bins: int) -> bool:
    """A chi-square test of ``values`` in [0, bins): the statistic within 6 standard deviations of its mean."""
    df = bins - 1
    return bool(chi_square(values, bins) < df + 6 * np.sqrt(2 * df))


def ks_uniform(u: np.ndarray) -> bool:
    """A Kolmogorov-Smirnov test of ``u`` against U[0, 1) at the 0.1% level (1.95 / sqrt(N))."""
    u = np.sort(u)
    n = u.size
    d = max(float(np.max(np.arange(1, n + 1) / n - u)), float(np.max(u - np.arange(n) / n)))
    return bool(d < 1.95 / np.sqrt(n))


def test_one_masked_input_read_alone_is_uniform() -> None:
    """A constant input (the least random there is): its masked vector passes both tests on 65,536 elements,
    the plain encoded vector fails them."""
    config = make_config(3, fields=(Field("w", (1 << 16,), 1.0),), stochastic=False)
    inputs = {u: {"w": np.full(1 << 16, 0.25)} for u in config.roster}
    r, _ = run_round(config, inputs, seed=11)
    masked, encoded = r.masked["org-00"], r.encoded["org-00"]
    for vector, uniform in ((masked, True), (encoded, False)):
        assert uniform_enough((vector >> 24).astype(np.int64), CHI2_BINS) is uniform
        assert uniform_enough((vector & 0xFF).astype(np.int64), CHI2_BINS) is uniform
        assert ks_uniform(vector / 2.0**32) is uniform


def test_one_coordinate_over_many_rounds_is_uniform() -> None:
    """The same input masked in 400 rounds: its first element's top 4 bits are uniform over the rounds."""
    config = make_config(3, fields=(Field("w", (1,), 1.0),), stochastic=False)
    inputs = {u: {"w": np.array([0.5])} for u in config.roster}
    firsts = np.array([int(run_round(config, inputs, seed=s)[0].masked["org-01"][0]) for s in range(400)])
    assert uniform_enough(firsts >> 28, 16) and ks_uniform(firsts / 2.0**32)
    plain = config.encoding.encode(inputs["org-01"])
    assert not uniform_enough(np.full(400, int(plain[0]) >> 28), 16)


def _through_share_keys(n: int = 5, round_no: int = 1,
                        threshold: int | None = None) -> tuple[Round, dict[str, PeerShares]]:
    config = make_config(n, round_no=round_no, threshold=threshold)
    r = start(config)
    for u in config.roster:
        r.server.receive_advert(r.clients[u].advertise())
    peer_keys = r.server.close_advertising()
    for u in config.roster:
        r.server.receive_shared_keys(r.clients[u].share_keys(peer_keys[u]))
    return r, r.server.close_sharing()


def _through_masking(n: int = 5, threshold: int | None = None) -> tuple[Round, dict[str, UnmaskRequest]]:
    r, peer_shares = _through_share_keys(n, threshold=threshold)
    inputs = random_inputs(r.config, 0)
    for u in r.config.roster:
        r.server.receive_masked(r.clients[u].mask(peer_shares[u], inputs[u], rounding_rng(0, u)))
    return r, r.server.close_masking()


def test_a_share_replayed_to_another_receiver_or_round_fails_authentication() -> None:
    r, peer_shares = _through_share_keys()
    to_1 = peer_shares["org-01"]
    stolen = next(s for s in to_1.shares if s.sender == "org-00")
    # the server readdresses org-00's share for org-01 to org-02
    to_2 = peer_shares["org-02"]
    forged = dataclasses.replace(to_2, shares=tuple(
        dataclasses.replace(stolen, receiver="org-02") if s.sender == "org-00" else s for s in to_2.shares))
    with pytest.raises(SecAggError) as err:
        r.clients["org-02"].mask(forged, random_inputs(r.config, 0)["org-02"], rounding_rng(0, "org-02"))
    assert err.value.reason == "share_authentication_failed"
    # the same sealed shares replayed into the next round of the same clients
    r2, _ = _through_share_keys(round_no=2)
    replayed = PeerShares("run-a", 2, "org-01", to_1.shares)
    with pytest.raises(SecAggError) as err:
        r2.clients["org-01"].mask(replayed, random_inputs(r.config, 0)["org-01"], rounding_rng(0, "org-01"))
    assert err.value.reason == "share_authentication_failed"
    # and the message itself, with its round 1 header, is refused before anything is opened
    with pytest.raises(SecAggError, match="foreign_message"):
        r2.clients["org-01"].mask(to_1, random_inputs(r.config, 0)["org-01"], rounding_rng(0, "org-01"))


def test_a_request_for_both_shares_of_a_peer_is_refused_and_ends_the_clients_round() -> None:
    r, requests = _through_masking()
    honest = requests["org-00"]
    greedy = dataclasses.replace(honest, dropped=(honest.survivors[0],))
    with pytest.raises(SecAggError) as err:
        r.clients["org-00"].unmask(greedy)
    assert err.value.reason == "both_shares_requested"
    with pytest.raises(SecAggError, match="unexpected_stage"):
        r.clients["org-00"].unmask(honest)


def test_a_second_request_is_refused_so_no_peer_is_revealed_both_ways() -> None:
    r, requests = _through_masking()
    first = requests["org-00"]
    r.clients["org-00"].unmask(first)
    flipped = UnmaskRequest("run-a", 1, "org-00", first.survivors[1:], first.survivors[:1])
    with pytest.raises(SecAggError, match="unexpected_stage"):
        r.clients["org-00"].unmask(flipped)


def test_a_server_splitting_a_clients_neighbours_gets_neither_secret() -> None:
    """A lying server tells two of org-02's four neighbours that it survived and the other two that it
    dropped: with t = 3 > k/2 it holds two seed shares and two key shares, and rebuilds neither."""
    r, requests = _through_masking()
    victim = "org-02"
    holders = sorted(u for u in r.config.roster if victim in r.config.graph[u])
    seed_shares, key_shares = [], []
    for i, u in enumerate(holders):
        req = requests[u]
        others = tuple(v for v in req.survivors if v != victim)
        lie = (UnmaskRequest("run-a", 1, u, (*others, victim), ()) if i < 2 else
               UnmaskRequest("run-a", 1, u, others, (victim,)))
        try:
            reply = r.clients[u].unmask(lie)
        except AbandonedError:
            continue
        seed_shares += [shamir.Share.from_bytes(s.share) for s in reply.seed_shares if s.owner == victim]
        key_shares += [shamir.Share.from_bytes(s.share) for s in reply.key_shares if s.owner == victim]
    assert len(seed_shares) == 2 and len(key_shares) == 2
    for got, size in ((seed_shares, 32), (key_shares, 32)):
        with pytest.raises(SecAggError, match="below_threshold"):
            shamir.combine(got, r.config.threshold, size)


def test_a_request_with_too_few_survivors_or_strangers_is_refused() -> None:
    r, requests = _through_masking()
    req = requests["org-00"]
    with pytest.raises(AbandonedError):
        r.clients["org-00"].unmask(dataclasses.replace(req, survivors=req.survivors[:2],
                                                       dropped=req.survivors[2:]))
    r, requests = _through_masking()
    req = requests["org-01"]
    with pytest.raises(SecAggError, match="neighbours_mismatch"):
        r.clients["org-01"].unmask(dataclasses.replace(req, survivors=(*req.survivors, "org-99")))


def test_the_server_refuses_foreign_replayed_and_late_messages() -> None:
    config = make_config(4)
    r = start(config)
    advert = r.clients["org-00"].advertise()
    r.server.receive_advert(advert)
    with pytest.raises(SecAggError, match="duplicate"):
        r.server.receive_advert(advert)
    with pytest.raises(SecAggError, match="foreign_message"):
        r.server.receive_advert(dataclasses.replace(r.clients["org-01"].advertise(), round=2))
    with pytest.raises(SecAggError, match="foreign_message"):
        r.server.receive_advert(dataclasses.replace(advert, sender="org-77"))
    r2, _ = _through_masking(4)
    enc = r2.config.encoding
    late = MaskedInput("run-a", 1, "org-00", np.zeros(enc.length, enc.dtype))
    with pytest.raises(SecAggError, match="unexpected_stage"):
        r2.server.receive_masked(late)


def _replies(r: Round, requests: dict[str, UnmaskRequest]) -> dict[str, UnmaskReply]:
    return {u: r.clients[u].unmask(req) for u, req in requests.items()}


def test_a_tampered_seed_share_gives_a_refused_sum_not_a_wrong_one() -> None:
    """With exactly t = 3 answers per secret no extra share can expose the bad one: the self mask is not
    removed and the sum falls far outside n times the bound, so it is refused."""
    r, requests = _through_masking(4, threshold=3)
    for u, reply in _replies(r, requests).items():
        if u == "org-01":
            first, *rest = reply.seed_shares
            share = shamir.Share.from_bytes(first.share)
            moved = shamir.Share(share.index, (share.value + 1) % shamir.PRIME).to_bytes()
            reply = dataclasses.replace(reply, seed_shares=(dataclasses.replace(first, share=moved), *rest))
        r.server.receive_unmask(reply)
    with pytest.raises(SecAggError, match="sum_out_of_range"):
        r.server.finish()
    assert r.server.stage == "abandoned"


def _after_a_dropout(n: int) -> tuple[Round, dict[str, UnmaskRequest]]:
    """A round of ``n`` through masking, with org-00 gone after sharing its keys."""
    r, peer_shares = _through_share_keys(n)
    inputs = random_inputs(r.config, 0)
    for u in r.config.roster[1:]:
        r.server.receive_masked(r.clients[u].mask(peer_shares[u], inputs[u], rounding_rng(0, u)))
    return r, r.server.close_masking()


@pytest.mark.parametrize("forged", ["one share", "another key"])
def test_a_dropped_clients_key_rebuilt_from_bad_shares_is_refused(forged: str) -> None:
    """One share moved is off the others' polynomial; shares of another key (consistent with each other)
    rebuild a key that is not the one org-00 advertised. Either way the sum is refused."""
    r, requests = _after_a_dropout(5)
    replies = _replies(r, requests)
    other = shamir.split(b"\x01" * 32, r.config.threshold, [r.config.index(u) for u in sorted(replies)],
                         SeededEntropy("forger"))
    for u, reply in sorted(replies.items()):
        (share,) = reply.key_shares
        if forged == "another key":
            bad = other[sorted(replies).index(u)]
        else:
            got = shamir.Share.from_bytes(share.share)
            bad = shamir.Share(got.index, (got.value + (u == "org-02")) % shamir.PRIME)
        r.server.receive_unmask(dataclasses.replace(reply, key_shares=(dataclasses.replace(share, share=bad.to_bytes()),)))
    with pytest.raises(SecAggError, match="inconsistent_shares"):
        r.server.finish()


def test_a_masked_input_of_the_wrong_type_or_size_is_refused() -> None:
    r, _ = _through_share_keys(4)
    enc = r.config.encoding
    for vector in (np.zeros(enc.length, np.int64), np.zeros(enc.length + 1, enc.dtype), [0] * enc.length):
        with pytest.raises(SecAggError, match="malformed"):
            r.server.receive_masked(MaskedInput("run-a", 1, "org-00", vector))  # type: ignore[arg-type]


def test_peer_keys_from_strangers_reused_or_too_few_are_refused() -> None:
    config = make_config(8, degree=4)
    stranger = next(u for u in config.roster if u != "org-00" and u not in config.graph["org-00"])
    for case in ("stranger", "reused", "too few"):
        r = start(config)
        adverts = {u: r.clients[u].advertise() for u in config.roster}
        for a in adverts.values():
            r.server.receive_advert(a)
        msg = r.server.close_advertising()["org-00"]
        if case == "stranger":
            msg = dataclasses.replace(msg, peers=(*msg.peers[1:], adverts[stranger]))
        elif case == "reused":
            first, second, *rest = msg.peers
            msg = dataclasses.replace(msg, peers=(first, dataclasses.replace(second, mask_public=first.mask_public),
                                                  *rest))
        else:
            msg = dataclasses.replace(msg, peers=msg.peers[:2])
        with pytest.raises(SecAggError) as err:
            r.clients["org-00"].share_keys(msg)
        assert err.value.reason == {"stranger": "neighbours_mismatch", "reused": "bad_keys",
                                    "too few": "below_threshold"}[case]


def test_the_server_refuses_shares_not_sealed_for_exactly_the_neighbours() -> None:
    r = start(make_config(5))
    for u in r.config.roster:
        r.server.receive_advert(r.clients[u].advertise())
    peer_keys = r.server.close_advertising()
    shared = r.clients["org-00"].share_keys(peer_keys["org-00"])
    for shares in (shared.shares[1:], (*shared.shares, shared.shares[0])):
        with pytest.raises(SecAggError, match="neighbours_mismatch"):
            r.server.receive_shared_keys(dataclasses.replace(shared, shares=shares))
    r.server.receive_shared_keys(shared)
