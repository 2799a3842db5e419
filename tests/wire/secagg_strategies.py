"""Hypothesis strategies for secure aggregation's stage payloads (hetfed.wire.payloads.SecAgg*): valid round
configurations (a Harary degree and threshold the core accepts), keys, sealed shares and ring vectors."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hetfed import secagg
from hetfed.wire.payloads import (
    PayloadKind,
    SecAggKeyAdvert,
    SecAggMaskedInput,
    SecAggPeerKeys,
    SecAggPeerShares,
    SecAggSetup,
    SecAggSharedKeys,
    SecAggUnmask,
)

names = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8)
run_ids = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=10)
rounds = st.integers(min_value=0, max_value=2**62)
keys32 = st.binary(min_size=32, max_size=32)


@st.composite
def round_configs(draw: Any) -> secagg.RoundConfig:
    roster = draw(st.lists(names, min_size=2, max_size=7, unique=True))
    n = len(roster)
    degree = draw(st.sampled_from([k for k in range(1, n) if n * k % 2 == 0 and (k > 1 or n == 2)]))
    threshold = draw(st.integers(degree // 2 + 1, degree))
    fields = tuple(secagg.Field(f"f{i}", shape, bound, norm)
                   for i, (shape, bound, norm) in enumerate(draw(st.lists(st.tuples(
                       hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
                       st.floats(1e-6, 1e9), st.none() | st.floats(1e-3, 1e9)), max_size=3))))
    value_bits = draw(st.integers(2, 53 - n.bit_length()))
    enc = secagg.Encoding.for_inputs(fields, n + draw(st.integers(0, 3)), value_bits, draw(st.booleans()))
    return secagg.RoundConfig(draw(run_ids), draw(rounds), tuple(roster), degree, threshold,
                              draw(keys32), enc)


adverts = st.builds(secagg.KeyAdvert, run_ids, rounds, names, keys32, keys32)
sealed = st.lists(st.builds(secagg.EncryptedShare, names, names, st.binary(max_size=200)), max_size=4).map(tuple)
revealed = st.lists(st.builds(secagg.RevealedShare, names, st.binary(max_size=80)), max_size=4).map(tuple)
vectors = st.sampled_from([np.uint32, np.uint64]).flatmap(
    lambda dt: hnp.arrays(dt, st.integers(0, 9), elements=st.integers(0, int(np.iinfo(dt).max))))

SECAGG_PAYLOADS: dict[PayloadKind, st.SearchStrategy[Any]] = {
    PayloadKind.SECAGG_SETUP: st.builds(SecAggSetup, round_configs(), st.booleans()),
    PayloadKind.SECAGG_KEY_ADVERT: st.builds(SecAggKeyAdvert, adverts),
    PayloadKind.SECAGG_PEER_KEYS: st.builds(SecAggPeerKeys, st.builds(
        secagg.PeerKeys, run_ids, rounds, names, st.lists(adverts, max_size=3).map(tuple))),
    PayloadKind.SECAGG_SHARED_KEYS: st.builds(SecAggSharedKeys, st.builds(secagg.SharedKeys, run_ids, rounds, names,
                                                                          sealed)),
    PayloadKind.SECAGG_PEER_SHARES: st.builds(SecAggPeerShares, st.builds(secagg.PeerShares, run_ids, rounds, names,
                                                                          sealed)),
    PayloadKind.SECAGG_MASKED_INPUT: st.builds(SecAggMaskedInput, st.builds(secagg.MaskedInput, run_ids, rounds,
                                                                            names, vectors)),
    PayloadKind.SECAGG_UNMASK: st.builds(SecAggUnmask, st.builds(
        secagg.UnmaskRequest, run_ids, rounds, names, st.lists(names, max_size=3).map(tuple),
        st.lists(names, max_size=3).map(tuple)) | st.builds(secagg.UnmaskReply, run_ids, rounds, names, revealed,
                                                            revealed)),
}
