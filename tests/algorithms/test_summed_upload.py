"""Every algorithm that declares ``summed_upload`` is linear in it: its server half fed the round's uploads one by
one ends the round exactly where it ends fed their weighted sums once (``hetfed.wire.summation``), so a spec that
declares a kind its half does more than sum fails here. Halves that need each payload refuse secure sums."""

from __future__ import annotations

import numpy as np
import pytest

from hetfed.aggregator.algorithms import make_server_half
from hetfed.aggregator.algorithms.base import RunInfo, ServerHalf
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import (
    ClassCounts,
    ClassMeanEmbeddings,
    EvalMetrics,
    HeadWeights,
    ModelWeights,
    Payload,
    PayloadKind,
    Received,
)
from hetfed.wire.phases import Phase
from hetfed.wire.specs import REGISTERED, AlgorithmSpec, fedavg, fedproto
from hetfed.wire.summation import Summed, add, fields, sums

ORGS = ("org-a", "org-b", "org-c", "org-d")
K, D = 10, 32  # the shared-space configs' defaults: num_classes, latent_dim
SUMMING = [s for s in REGISTERED if s.summed_upload]


def _counts(rng: np.random.Generator) -> np.ndarray:
    c = rng.integers(1, 60, K).astype(np.int64)
    c[rng.integers(0, K)] = 0  # a class this organization lacks
    return c


def _upload(spec: AlgorithmSpec, rng: np.random.Generator, counts: np.ndarray, centre: float) -> list[Payload]:
    """One organization's training upload: every summed kind spec declares, near ``centre``, plus metrics."""
    out: list[Payload] = [EvalMetrics(train_loss=1.0)]
    n = int(counts.sum())
    for kind in spec.summed_upload:
        if kind is PayloadKind.MODEL_WEIGHTS:
            out.append(ModelWeights({"conv.weight": centre + rng.normal(0, 0.1, (4, 3, 3)).astype(np.float32),
                                     "fc.bias": centre + rng.normal(0, 0.1, 7).astype(np.float32)}, n))
        elif kind is PayloadKind.HEAD_WEIGHTS:
            out.append(HeadWeights(rng.normal(0, 0.3, (K, D)).astype(np.float32),
                                   rng.normal(0, 0.3, K).astype(np.float32), n))
        elif kind is PayloadKind.CLASS_MEAN_EMBEDDINGS:
            means = rng.uniform(0, 1, (K, D)).astype(np.float32)
            means[counts == 0] = 0
            out.append(ClassMeanEmbeddings(np.arange(K, dtype=np.int64), means, counts.copy(), counts > 0))
    return out


def _round(spec: AlgorithmSpec, seed: int, secure: bool, **overrides: object) -> ServerHalf:
    """A setup round (where the spec has one) and a training round over ORGS, the summed kinds fed one by one
    (plain) or as one secure sum."""
    rng = np.random.default_rng(seed)
    half = make_server_half(spec, spec.config(**overrides), RunInfo(seed, ORGS))
    counts = {org: _counts(rng) for org in ORGS}
    if PayloadKind.CLASS_COUNTS in spec.setup_upload:
        for org in ORGS:
            update = Received([ClassCounts(counts[org])])
            half.validate(Phase.SETUP, org, update)
            half.accumulate(Phase.SETUP, org, update)
        half.close_round(Phase.SETUP, 0)
    uploads = {org: _upload(spec, rng, counts[org], 0.5) for org in ORGS}
    assert not half.secure_aggregation_refusal()
    if not secure:
        for org in ORGS:
            update = Received(uploads[org])
            half.validate(Phase.TRAIN, org, update)
            half.accumulate(Phase.TRAIN, org, update)
    else:
        total: dict[str, np.ndarray] = {}
        for org in ORGS:
            for p in uploads[org]:
                if p.kind in spec.summed_upload:
                    add(total, p, half.summed_unit_weights)
            rest = [p for p in uploads[org] if p.kind not in spec.summed_upload]
            half.accumulate(Phase.TRAIN, org, Received(rest))
        half.accumulate_sum(Phase.TRAIN, sums(spec.summed_upload, total), ORGS)
    half.close_round(Phase.TRAIN, 1)
    return half


@pytest.mark.parametrize("spec", SUMMING, ids=lambda s: s.name)
def test_the_half_fed_the_sum_equals_the_half_fed_each_upload(spec: AlgorithmSpec) -> None:
    plain, secure = _round(spec, 11, False).state(), _round(spec, 11, True).state()
    assert plain and plain.keys() == secure.keys()
    for name in plain:
        a, b = plain[name], secure[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if a.dtype.kind == "f":
            # Equal to float64's rounding: p_i^k = n_i^k / N^k against n_i^k, divided out at the close.
            np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-15, err_msg=f"{spec.name}: {name}")
        else:
            np.testing.assert_array_equal(b, a, err_msg=f"{spec.name}: {name}")


def test_fedavg_under_secure_sums_is_exact_to_the_bit() -> None:
    """FedAvg's global model is Σ n_i w_i / Σ n_i rounded once to float32 either way."""
    plain, secure = _round(fedavg.SPEC, 3, False).state(), _round(fedavg.SPEC, 3, True).state()
    for name in plain:
        np.testing.assert_array_equal(secure[name], plain[name])


def test_uniform_weighting_sums_unit_weights() -> None:
    plain = _round(fedavg.SPEC, 5, False, weighting="uniform").state()
    secure = _round(fedavg.SPEC, 5, True, weighting="uniform").state()
    for name in plain:
        np.testing.assert_array_equal(secure[name], plain[name])


def test_a_wrong_weighting_would_be_caught() -> None:
    """The test above can fail: summing example-weighted models into a uniform-weighting half differs."""
    rng = np.random.default_rng(5)
    half = make_server_half(fedavg.SPEC, fedavg.SPEC.config(weighting="uniform"), RunInfo(5, ORGS))
    plain = _round(fedavg.SPEC, 5, False, weighting="uniform").state()
    total: dict[str, np.ndarray] = {}
    for _ in ORGS:
        counts = _counts(rng)
        add(total, _upload(fedavg.SPEC, rng, counts, 0.5)[1], unit=False)
    half.accumulate_sum(Phase.TRAIN, sums(fedavg.SPEC.summed_upload, total), ORGS)
    half.close_round(Phase.TRAIN, 1)
    assert not np.array_equal(half.state()["fc.bias"], plain["fc.bias"])


@pytest.mark.parametrize(("overrides", "word"), [({"aggregation": "trimmed_mean"}, "trimmed_mean"),
                                                 ({"aggregation": "median"}, "median"),
                                                 ({"update_norm_policy": "clip"}, "clip")])
def test_fedavg_refuses_secure_sums_where_it_needs_each_update(overrides: dict, word: str) -> None:
    half = make_server_half(fedavg.SPEC, fedavg.SPEC.config(**overrides), RunInfo(0, ORGS))
    assert word in half.secure_aggregation_refusal()


@pytest.mark.parametrize("spec", [s for s in REGISTERED if not s.summed_upload], ids=lambda s: s.name)
def test_a_spec_without_summed_uploads_is_refused(spec: AlgorithmSpec) -> None:
    assert "cannot run with secure_aggregation = true" in spec.secure_aggregation_refusal()
    assert spec.name in spec.secure_aggregation_refusal()
    assert spec.unsummed_because in spec.secure_aggregation_refusal()


_MW, _HW, _CME = PayloadKind.MODEL_WEIGHTS, PayloadKind.HEAD_WEIGHTS, PayloadKind.CLASS_MEAN_EMBEDDINGS
# The audit of every registered algorithm: the kinds its server half only sums. The FedAvg family's halves are
# FedAvg's weighted mean (``FedAvgServer``), of whole models, bodies, global, meme or meta-models.
AUDITED = {
    **dict.fromkeys(["fedavg", "fedprox", "fedsr", "fedl2r", "fedcmi", "fedavg_body", "fedper", "fedrep", "ditto",
                     "ditto_cos", "ditto_mkmmd", "ditto_mmdd", "fedadg", "fml", "perfedavg", "perfedavg_hf"],
                    frozenset({_MW})),
    "fedavg_head": frozenset({_HW}),
    "fedcma": frozenset({_CME, _HW}), "fedcma_paper": frozenset({_CME, _HW}),
}


def test_every_registered_algorithm_is_audited_for_secure_aggregation() -> None:
    """A new algorithm, or a spec derived from FedAvg's that inherits its summed upload, lands here: it either
    sums what this table says, or says why it cannot in its refusal (``unsummed_because``)."""
    assert {s.name: s.summed_upload for s in REGISTERED if s.summed_upload} == AUDITED
    for spec in REGISTERED:
        assert bool(spec.summed_upload) != bool(spec.unsummed_because), spec.name


def test_a_half_that_does_not_sum_refuses_sums() -> None:
    half = make_server_half(fedproto.SPEC, fedproto.SPEC.config(), RunInfo(0, ORGS))
    assert half.secure_aggregation_refusal()
    with pytest.raises(NotImplementedError):
        half.accumulate_sum(Phase.TRAIN, {}, ORGS)


def test_weighted_forms_by_hand() -> None:
    mw = fields(ModelWeights({"w": np.array([1.0, -2.0], np.float32)}, 3))
    assert set(mw) == {"model_weights/w", "model_weights#weight"}
    np.testing.assert_array_equal(mw["model_weights/w"], [3.0, -6.0])
    assert mw["model_weights#weight"] == 3.0
    cme = ClassMeanEmbeddings(np.arange(3), np.array([[0.5, 1.0], [0.25, 0.0], [9.0, 9.0]], np.float32),
                              np.array([2, 4, 0]), np.array([True, True, False]))
    got = fields(cme)
    np.testing.assert_array_equal(got["class_mean_embeddings/means"], [[1.0, 2.0], [1.0, 0.0], [0.0, 0.0]])
    np.testing.assert_array_equal(got["class_mean_embeddings#weight"], [2.0, 4.0, 0.0])
    np.testing.assert_array_equal(fields(cme, unit=True)["class_mean_embeddings#weight"], [1.0, 1.0, 0.0])
    back = sums([PayloadKind.CLASS_MEAN_EMBEDDINGS], got)[PayloadKind.CLASS_MEAN_EMBEDDINGS]
    assert isinstance(back, Summed) and set(back.values) == {"means"}
    with pytest.raises(WireError, match="num_examples > 0"):
        fields(ModelWeights({"w": np.zeros(1)}, 0))
    with pytest.raises(WireError, match="no declared kind"):
        sums([PayloadKind.HEAD_WEIGHTS], {**got, "head_weights#weight": np.array(1.0)})


def test_a_spec_cannot_declare_a_kind_without_a_summed_form() -> None:
    with pytest.raises(ValueError, match="no summed form"):
        fedproto.SPEC.derive(name="x", upload=fedproto.SPEC.upload | {PayloadKind.SEED_POSTERIORS},
                             summed_upload=frozenset({PayloadKind.SEED_POSTERIORS}))
    with pytest.raises(ValueError, match="allowed uploads"):
        fedavg.SPEC.derive(name="y", summed_upload=frozenset({PayloadKind.HEAD_WEIGHTS}))
