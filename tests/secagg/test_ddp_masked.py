"""Distributed DP's encoded vectors through secure aggregation: an organization's ring vector (``Plan.encode``)
masked as an exact field (``ddp.exact_field``) unmasks to the plain ring sum of the encoded vectors, exactly, and
decodes (``Plan.decode``) to the same floats, with dropouts after masking too."""

from __future__ import annotations

import numpy as np
import pytest

from hetfed.secagg import Encoding, Field, RoundConfig, SecAggError, ddp
from hetfed.secagg.ring import reduce
from tests.secagg.driver import names, run_round


def _plan(n: int, ring_bits: int) -> ddp.Plan:
    return ddp.choose(epsilon=2.0, delta=1e-6, rounds=5, dim=37, clip=40.0, clients=n, honest=n // 2 + 1,
                      ring_bits=ring_bits, sensitivity=1.5)


def _round(n: int, plan: ddp.Plan, value_bits: int = 40) -> RoundConfig:
    fields = (ddp.exact_field("ddp", plan.size, value_bits), Field("head", (3,), 10.0))
    return RoundConfig("run-d", 2, names(n), n - 1, (n - 1) // 2 + 1, bytes(range(32)),
                       Encoding.for_inputs(fields, n, value_bits))


@pytest.mark.parametrize(("n", "ring_bits", "dropped"), [(3, 16, set()), (4, 32, set()), (5, 39, {"org-02"}),
                                                         (7, 32, {"org-00", "org-06"})])
def test_the_unmasked_exact_field_is_the_plain_ring_sum_of_the_encoded_vectors(n: int, ring_bits: int,
                                                                               dropped: set[str]) -> None:
    plan = _plan(n, ring_bits)
    config = _round(n, plan)
    rotation = 12345
    gen = np.random.default_rng(7)
    encoded = {u: plan.encode(gen.normal(0.0, 20.0, plan.dim), rotation, np.random.default_rng([n, i]))
               for i, u in enumerate(config.roster)}
    inputs = {u: {"ddp": plan.field_values(encoded[u]), "head": np.zeros(3)} for u in config.roster}
    _, agg = run_round(config, inputs, drop={"mask": dropped})
    assert set(agg.survivors) == set(config.roster) - dropped
    plain = np.zeros(plan.size, plan.dtype)
    for u in agg.survivors:
        plain = reduce(plain + encoded[u], plan.ring_bits)
    ring = plan.ring_sum(agg.values["ddp"])
    np.testing.assert_array_equal(ring, plain)
    inputs_ = len(agg.survivors)
    np.testing.assert_array_equal(plan.decode(ring, rotation, inputs_), plan.decode(plain, rotation, inputs_))


def test_the_exact_field_passes_every_ring_element_unchanged() -> None:
    """The field's scale is exactly 1: the extreme elements of the largest ring it can carry encode as
    themselves (strict mode accepts them)."""
    field = ddp.exact_field("x", 4, 40)
    enc = Encoding.for_inputs((field,), 1, 40)
    values = np.array([-(2.0**38), 2.0**38 - 1, 0.0, -1.0])
    np.testing.assert_array_equal(enc.signed(enc.encode({"x": values}, np.random.default_rng(0), strict=True)),
                                  values.astype(np.int64))


def test_ring_sum_refuses_what_is_not_an_exact_integer_vector() -> None:
    plan = _plan(3, 32)
    with pytest.raises(SecAggError, match="exact integers"):
        plan.ring_sum(np.full(plan.size, 0.5))
    with pytest.raises(SecAggError, match="exact integers"):
        plan.ring_sum(np.zeros(plan.size - 1))
    with pytest.raises(SecAggError, match="value_bits"):
        ddp.exact_field("x", 4, 2)
