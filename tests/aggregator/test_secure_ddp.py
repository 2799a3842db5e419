"""Distributed DP in one secure round, through the real stage messages (Protobuf bytes), the aggregator's
``SecureRound`` and every organization's ``SecureClient``: Fed-CMA's class sums and counts go through the
distributed Skellam mechanism of the run's plan (``FedCMAConfig.distributed_sum``). What it proves: the sums the
server half receives are exactly ``Plan.decode`` of the plain ring sum of the organizations' encodings; the head
keeps the secure sum's own encoding; a sum of fewer inputs than the plan's honest organizations is refused and
the half untouched; the run's config refuses a plan without secure aggregation in one line."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hetfed import secagg
from hetfed.aggregator.config import RunConfig
from hetfed.aggregator.run.secure import SecureParams, SecureRound
from hetfed.client.secure import SecureClient, summed_fields
from hetfed.secagg.ring import reduce
from hetfed.wire.config import ConfigError
from hetfed.wire.distributed import DistributedSum, rotation_seed
from hetfed.wire.payloads import PayloadKind
from hetfed.wire.specs import fedcma
from hetfed.wire.summation import WEIGHT, shapes
from tests.aggregator.test_secure_round import (
    ORGS,
    SEED,
    D,
    K,
    class_counts,
    rounding,
    setup_half,
    uploads,
    wire,
)

CME = PayloadKind.CLASS_MEAN_EMBEDDINGS


def _config(**over: object) -> fedcma.FedCMAConfig:
    return dataclasses.replace(fedcma.SPEC.config(), latent_dim=D, num_classes=K, bounded_latent=True,
                               ddp_epsilon=2.0, **over)


def _secret(org: str) -> np.random.Generator:
    return np.random.default_rng([SEED, 0xDD9, ORGS.index(org)])


def _round(ddp: DistributedSum, drop_at_mask: frozenset[str] = frozenset()) -> tuple[SecureRound, list, dict]:
    """Round 1 with every organization's upload; what the half's ``accumulate_sum`` got, and the uploads."""
    counts = class_counts()
    ups = uploads(fedcma.SPEC, counts)
    half = setup_half(fedcma.SPEC, counts)
    got: list = []
    half.accumulate_sum = lambda phase, sums, orgs: got.append((sums, orgs))  # type: ignore[method-assign]
    schema = {n: s for p in ups[ORGS[0]] for n, s in shapes(p).items()}
    sr = SecureRound(fedcma.SPEC, half, "run-s", 1, ORGS, SEED, schema, SecureParams(), ddp)
    setup = wire(sr.setup())
    clients = {org: SecureClient(setup, org, secagg.SeededEntropy(org)) for org in ORGS}  # type: ignore[arg-type]
    for org, c in clients.items():
        sr.receive(org, wire(c.advertise()))
    for org, keys in sr.close_stage().items():
        sr.receive(org, wire(clients[org].share(wire(keys))))  # type: ignore[arg-type]
    rot = rotation_seed(SEED, 1)
    for org, shares in sr.close_stage().items():
        masked = clients[org].mask(wire(shares), ups[org], fedcma.SPEC.summed_upload, rounding(org),  # type: ignore[arg-type]
                                   distributed=(ddp, rot, _secret(org)))
        if org not in drop_at_mask:
            sr.receive(org, wire(masked))
    for org, request in sr.close_stage().items():
        sr.receive(org, wire(clients[org].unmask(wire(request))))  # type: ignore[arg-type]
    sr.finish()
    return sr, got, ups


def test_the_half_gets_exactly_the_decoded_plain_ring_sum_of_the_encodings() -> None:
    ddp = _config().distributed_sum(len(ORGS), 4)
    assert ddp is not None and ddp.plan.honest == 3 and ddp.plan.clients == 5
    sr, got, ups = _round(ddp)
    assert not sr.abandoned and len(got) == 1
    sums, survivors = got[0]
    assert survivors == ORGS
    rot, plan = rotation_seed(SEED, 1), ddp.plan
    plain = np.zeros(plan.size, plan.dtype)
    for org in ORGS:
        values = summed_fields(ups[org], fedcma.SPEC.summed_upload, False)
        plain = reduce(plain + plan.encode(ddp.vector(values), rot, _secret(org)), plan.ring_bits)
    flat = plan.decode(plain, rot, len(ORGS))
    # The weighted form's arrays in name order: "<kind>#weight" sorts before "<kind>/means".
    assert [n for n, _ in ddp.shapes] == [CME.value + WEIGHT, f"{CME.value}/means"]
    weight = np.maximum(np.rint(flat[:K]), 0.0)
    means = flat[K:].reshape(K, D).copy()
    means[weight == 0] = 0.0
    np.testing.assert_array_equal(sums[CME].weight, weight)
    np.testing.assert_array_equal(sums[CME].values["means"], means)
    # The noise is there, and of the plan's size: the decoded sums differ from the exact ones by about the
    # central standard deviation (5 shares of local variance μ/t each, in float units).
    exact = sum(summed_fields(ups[o], fedcma.SPEC.summed_upload, False)[f"{CME.value}/means"] for o in ORGS)
    err = sums[CME].values["means"] - exact
    spread = np.sqrt(len(ORGS) * plan.local_variance) / plan.scale
    assert 0.8 * spread < float(err.std()) < 1.2 * spread
    # The head keeps the secure sum's own fixed-point encoding: within its quantization step of the plain sum.
    head = sum(summed_fields(ups[o], fedcma.SPEC.summed_upload, False)[f"{PayloadKind.HEAD_WEIGHTS.value}/weight"]
               for o in ORGS)
    np.testing.assert_allclose(sums[PayloadKind.HEAD_WEIGHTS].values["weight"], head, atol=1e-2)
    assert ddp.name in {f.name for f in sr.config.encoding.fields}
    assert f"{CME.value}/means" not in {f.name for f in sr.config.encoding.fields}
    assert CME.value + WEIGHT not in {f.name for f in sr.config.encoding.fields}


def test_a_sum_of_fewer_inputs_than_the_honest_count_is_refused_and_the_half_untouched() -> None:
    """t = 5 honest of 5, secure aggregation's threshold 3: one dropout leaves a sum SecAgg unmasks and distributed
    DP refuses (it holds fewer honest shares than the accountant counted)."""
    ddp = _config(ddp_honest=5).distributed_sum(len(ORGS), 4)
    assert ddp is not None and ddp.plan.honest == 5
    sr, got, _ = _round(ddp, drop_at_mask=frozenset({"org-b"}))
    assert got == [] and sr.result is None
    assert "below_threshold" in sr.abandoned and "honest" in sr.abandoned


def test_a_plan_without_secure_aggregation_or_beyond_the_ring_is_refused_in_one_line() -> None:
    base = {"id": "r", "algorithm": "fedcma", "organizations": ORGS, "rounds": 4, "algorithm_config": _config()}
    with pytest.raises(ConfigError, match="needs secure_aggregation = true"):
        RunConfig(**base)  # type: ignore[arg-type]
    assert RunConfig(**base, secure_aggregation=True).distributed_sum is not None  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ring bits cannot hold"):
        RunConfig(**{**base, "algorithm_config": _config(ddp_ring_bits=8)}, secure_aggregation=True)  # type: ignore[arg-type]
    # Distributed DP counts the honest shares of every input: a sparse graph, whose cuts give partial sums, is refused.
    n = len(ORGS)
    sparse = next(k for k in range(n - 2, 0, -1) if n * k % 2 == 0)
    with pytest.raises(ConfigError, match="assumes the complete graph"):
        RunConfig(**base, secure_aggregation=True, secure_degree=sparse)  # type: ignore[arg-type]
    assert RunConfig(**base, secure_aggregation=True, secure_degree=n - 1).distributed_sum is not None  # type: ignore[arg-type]


def test_noisy_class_weights_above_the_setup_counts_are_capped_and_the_means_kept() -> None:
    """Under distributed DP the summed class weights carry the noise: Fed-CMA's half caps them at the survivors'
    setup counts, scaling each class's sum with its weight, where the plain secure sum refuses them."""
    from hetfed.aggregator.algorithms import make_server_half
    from hetfed.aggregator.algorithms.base import RunInfo
    from hetfed.wire.payloads import ClassCounts, Received
    from hetfed.wire.phases import Phase
    from hetfed.wire.summation import Summed

    counts = class_counts()
    half = make_server_half(fedcma.SPEC, _config(), RunInfo(SEED, ORGS))
    for org in ORGS:
        half.accumulate(Phase.SETUP, org, Received([ClassCounts(counts[org])]))
    half.close_round(Phase.SETUP, 0)
    setup = sum(counts[o] for o in ORGS).astype(np.float64)
    weight = setup + np.where(np.arange(K) % 2 == 0, 7.0, -3.0)  # noise above the setup counts in even classes
    weight = np.maximum(weight, 0.0)
    means = np.random.default_rng(1).uniform(0.1, 0.9, (K, D))
    sums = {CME: Summed(CME, {"means": means * weight[:, None]}, weight),
            PayloadKind.HEAD_WEIGHTS: Summed(PayloadKind.HEAD_WEIGHTS, {"weight": np.zeros((K, D)),
                                                                        "bias": np.zeros(K)}, np.array(100.0))}
    half.accumulate_sum(Phase.TRAIN, sums, ORGS)
    np.testing.assert_array_equal(half._e_weight.total(), np.minimum(weight, setup))  # type: ignore[attr-defined]
    np.testing.assert_allclose(half._e_sum.total() / half._e_weight.total()[:, None], means, rtol=1e-12)  # type: ignore[attr-defined]
    plain = make_server_half(fedcma.SPEC, dataclasses.replace(_config(), ddp_epsilon=0.0), RunInfo(SEED, ORGS))
    for org in ORGS:
        plain.accumulate(Phase.SETUP, org, Received([ClassCounts(counts[org])]))
    plain.close_round(Phase.SETUP, 0)
    with pytest.raises(Exception, match="exceed the survivors' setup counts"):
        plain.accumulate_sum(Phase.TRAIN, sums, ORGS)
