"""Fed-CMA's server half driven with three-element arrays: setup p weights and eq. 7, exact numbers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hetfed.aggregator.algorithms.base import RunInfo
from hetfed.aggregator.algorithms.fedcma import FedCMAServer, initial_head, p_weights
from hetfed.aggregator.journal.store import RunStore
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import codec
from hetfed.wire.config import ConfigError, from_mapping
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import (
    ClassCounts,
    ClassMeanEmbeddings,
    EvalMetrics,
    HeadWeights,
    ModelWeights,
    PayloadKind,
    Received,
)
from hetfed.wire.phases import Phase
from hetfed.wire.specs import SPECS
from hetfed.wire.specs.fedcma import FedCMAConfig
from tests.conftest import RawClient

CC, CME, HW = PayloadKind.CLASS_COUNTS, PayloadKind.CLASS_MEAN_EMBEDDINGS, PayloadKind.HEAD_WEIGHTS
# K = 3 classes, d_e = 1: every tensor below has three elements. λ1 = λ2 = 0.5, η = 1: both EMA steps are 0.5.
CFG = FedCMAConfig(latent_dim=1, num_classes=3, lambda1=0.5, lambda2=0.5, server_lr=1.0)
COUNTS = {"a": [2, 0, 2], "b": [2, 4, 0], "c": [0, 4, 6]}


def cme(means: list[float | None], counts: list[int]) -> ClassMeanEmbeddings:
    """Class means of three classes (None: the class is absent and its row is zero)."""
    present = np.array([m is not None for m in means])
    rows = np.array([[m if m is not None else 0.0] for m in means], np.float32)
    return ClassMeanEmbeddings(np.arange(3, dtype=np.int64), rows, np.array(counts, np.int64), present)


def head(weight: list[float], bias: list[float], n: int = 1) -> HeadWeights:
    """A head Linear(1, 3)."""
    return HeadWeights(np.array(weight, np.float32).reshape(3, 1), np.array(bias, np.float32), n)


def after_setup(seed: int = 0, cfg: FedCMAConfig = CFG) -> FedCMAServer:
    """A server half whose setup round saw the three organizations' counts, with v̄ set to zero."""
    half = FedCMAServer(cfg, RunInfo(seed, tuple(COUNTS)))
    assert half.payloads_for(Phase.SETUP, 0, "a") == []
    for org, counts in COUNTS.items():
        payloads = Received([ClassCounts(np.array(counts, np.int64))])
        half.validate(Phase.SETUP, org, payloads)
        half.accumulate(Phase.SETUP, org, payloads)
    half.close_round(Phase.SETUP, 0)
    half.head_weight = np.zeros((3, 1))
    half.head_bias = np.zeros(3)
    return half


def push(half: FedCMAServer, org: str, means: list[float | None], weight: list[float], bias: list[float]) -> None:
    counts = [min(2, c) if m is not None else 0 for m, c in zip(means, COUNTS[org], strict=True)]
    payloads = Received([cme(means, counts), head(weight, bias)])
    half.validate(Phase.TRAIN, org, payloads)
    half.accumulate(Phase.TRAIN, org, payloads)


def test_setup_p_weights_are_exact() -> None:
    p_ik, p_i = p_weights(np.array([COUNTS["a"], COUNTS["b"], COUNTS["c"]]))
    # n^k = [4, 8, 8], N = 20.
    np.testing.assert_array_equal(p_ik, [[0.5, 0.0, 0.25], [0.5, 0.5, 0.0], [0.0, 0.5, 0.75]])
    np.testing.assert_array_equal(p_i, [0.2, 0.3, 0.5])
    half = after_setup()
    assert half.organizations == ["a", "b", "c"]
    np.testing.assert_array_equal(half.p_class, p_ik)
    np.testing.assert_array_equal(half.p_org, p_i)


def test_first_round_carries_zero_means_marked_absent_and_the_seeded_head() -> None:
    half = FedCMAServer(CFG, RunInfo(7, tuple(COUNTS)))
    for org, counts in COUNTS.items():
        half.accumulate(Phase.SETUP, org, Received([ClassCounts(np.array(counts, np.int64))]))
    half.close_round(Phase.SETUP, 0)
    means, v = half.payloads_for(Phase.TRAIN, 1, "b")
    assert isinstance(means, ClassMeanEmbeddings) and isinstance(v, HeadWeights)
    np.testing.assert_array_equal(means.means, np.zeros((3, 1), np.float32))
    np.testing.assert_array_equal(means.presence, [False, False, False])
    np.testing.assert_array_equal(means.counts, [4, 8, 8])  # Σ_j n_j^k: clients derive p_i^k and p_i from it
    np.testing.assert_array_equal(means.labels, [0, 1, 2])
    w0, b0 = initial_head(3, 1, 7)
    np.testing.assert_array_equal(v.weight, w0.astype(np.float32))
    np.testing.assert_array_equal(v.bias, b0.astype(np.float32))
    assert np.abs(w0).max() <= 1.0 and np.abs(b0).max() <= 1.0  # U(-1/√d_e, 1/√d_e) with d_e = 1
    # The same seed gives the same v̄⁰ in every process; another seed another one.
    np.testing.assert_array_equal(initial_head(3, 1, 7)[0], w0)
    assert not np.array_equal(initial_head(3, 1, 8)[0], w0)
    assert half.broadcast  # one payload list for every organization (the engine caches it per round)


def test_eq7_with_every_organization_reporting() -> None:
    half = after_setup()
    push(half, "a", [0.25, None, 0.5], [1.0, 0.0, -1.0], [1.0, 0.0, 0.0])
    push(half, "b", [0.75, 0.5, None], [0.0, 2.0, 0.0], [0.0, 1.0, 0.0])
    push(half, "c", [None, 0.25, 1.0], [2.0, 0.0, 2.0], [0.0, 0.0, 1.0])
    half.close_round(Phase.TRAIN, 1)
    means, v = half.payloads_for(Phase.TRAIN, 2, "a")
    # ē^k = 0.5·0 + 0.5·Σ_i p_i^k e_i^k:  k=0: 0.5·0.25 + 0.5·0.75 = 0.5;  k=1: 0.5·0.5 + 0.5·0.25 = 0.375;
    # k=2: 0.25·0.5 + 0.75·1.0 = 0.875.
    np.testing.assert_array_equal(half.means, [[0.25], [0.1875], [0.4375]])
    np.testing.assert_array_equal(means.means, np.array([[0.25], [0.1875], [0.4375]], np.float32))
    np.testing.assert_array_equal(means.presence, [True, True, True])
    # v̄ = 0.5·0 + 0.5·(0.2·v_a + 0.3·v_b + 0.5·v_c).
    np.testing.assert_allclose(half.head_weight, [[0.5 * (0.2 + 1.0)], [0.5 * 0.6], [0.5 * (-0.2 + 1.0)]],
                               rtol=0, atol=1e-15)
    np.testing.assert_allclose(half.head_bias, [0.1, 0.15, 0.25], rtol=0, atol=1e-15)
    assert v.weight.dtype == np.float32 and v.weight.shape == (3, 1)


def test_eq7_renormalises_over_the_organizations_that_report_a_class() -> None:
    half = after_setup()
    half.means = np.array([[0.25], [0.5], [0.75]])
    half.present[:] = True
    # c is a straggler this round; a holds class 0 but does not report it (e.g. its batch was empty).
    push(half, "a", [None, None, 0.5], [1.0, 1.0, 1.0], [2.0, 0.0, 0.0])
    push(half, "b", [0.75, 0.25, None], [3.0, 1.0, 1.0], [0.0, 2.0, 0.0])
    half.close_round(Phase.TRAIN, 2)
    # k=0: only b reports -> its p^0 = 0.5 renormalises to 1:  0.5·0.25 + 0.5·0.75 = 0.5.
    # k=1: only b (p^1 = 0.5 -> 1):  0.5·0.5 + 0.5·0.25 = 0.375.   k=2: only a (0.25 -> 1): 0.5·0.75 + 0.5·0.5.
    # Without renormalisation k=0 would be pulled toward 0 (0.5·0.25 + 0.5·0.375 = 0.3125).
    np.testing.assert_array_equal(half.means, [[0.5], [0.375], [0.625]])
    # v̄: p_a = 0.2, p_b = 0.3 renormalise to 0.4, 0.6:  0.5·(0.4·v_a + 0.6·v_b).
    np.testing.assert_allclose(half.head_weight, [[0.5 * (0.4 + 1.8)], [0.5], [0.5]], rtol=0, atol=1e-15)
    np.testing.assert_allclose(half.head_bias, [0.4, 0.6, 0.0], rtol=0, atol=1e-15)


def test_a_class_nobody_reports_keeps_its_mean_and_stays_absent() -> None:
    half = after_setup()
    push(half, "a", [0.5, None, None], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    push(half, "b", [0.5, None, None], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    half.close_round(Phase.TRAIN, 1)
    np.testing.assert_array_equal(half.means, [[0.25], [0.0], [0.0]])
    np.testing.assert_array_equal(half.present, [True, False, False])
    # A round without pushes of means (the evaluate phase) changes nothing.
    half.close_round(Phase.EVALUATE, 2)
    np.testing.assert_array_equal(half.means, [[0.25], [0.0], [0.0]])


def test_state_survives_a_checkpoint_round_trip(tmp_path: object) -> None:
    half = after_setup(seed=3)
    push(half, "a", [0.25, None, 0.5], [1.0, 0.0, -1.0], [1.0, 0.0, 0.0])
    half.close_round(Phase.TRAIN, 1)
    store = RunStore(str(tmp_path), "r")
    store.save_checkpoint({"x": 1}, half.state())
    _, arrays = store.read_checkpoint()
    other = FedCMAServer(CFG, RunInfo(99, tuple(COUNTS)))
    other.load_state(arrays)
    assert isinstance(other, FedCMAServer)
    assert other.organizations == ["a", "b", "c"]
    np.testing.assert_array_equal(other.p_class, half.p_class)
    for mine, theirs in zip(half.payloads_for(Phase.TRAIN, 2, "a"), other.payloads_for(Phase.TRAIN, 2, "a"), strict=True):
        for x, y in zip(vars(mine).values(), vars(theirs).values(), strict=True):
            np.testing.assert_array_equal(x, y)


def reason(half: FedCMAServer, phase: str, org: str, payloads: dict) -> str:
    with pytest.raises(WireError) as err:
        half.validate(Phase(phase), org, Received(payloads.values()))
    return err.value.reason


def test_validate_rejects_shapes_counts_and_unbounded_means() -> None:
    half = after_setup()
    good_head = head([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    wide = ClassMeanEmbeddings(np.arange(3), np.zeros((3, 2), np.float32), np.array([1, 0, 1]),
                               np.array([True, False, True]))
    assert reason(half, "train", "a", {CME: wide, HW: good_head}) == "shape_mismatch"
    bad_head = HeadWeights(np.zeros((3, 2), np.float32), np.zeros(3, np.float32))
    assert reason(half, "train", "a", {CME: cme([0.5, None, 0.5], [1, 0, 1]), HW: bad_head}) == "shape_mismatch"
    # presence must equal counts > 0
    lying = ClassMeanEmbeddings(np.arange(3), np.zeros((3, 1), np.float32), np.array([1, 0, 1]),
                                np.array([True, True, True]))
    assert reason(half, "train", "a", {CME: lying, HW: good_head}) == "invalid_value"
    # a reports class 1, which it does not hold (n_a^1 = 0)
    assert reason(half, "train", "a", {CME: cme([0.5, 0.5, 0.5], [1, 1, 1]), HW: good_head}) == "invalid_value"
    # latents are sigmoid-bounded
    assert reason(half, "train", "a", {CME: cme([1.5, None, 0.5], [1, 0, 1]), HW: good_head}) == "invalid_value"
    # an organization without setup counts has no p weights
    assert reason(half, "train", "z", {CME: cme([0.5, None, 0.5], [1, 0, 1]), HW: good_head}) == "missing_payload"
    # setup counts: K int64 entries, non-negative
    assert reason(half, "setup", "a", {CC: ClassCounts(np.array([1, 2], np.int64))}) == "shape_mismatch"
    assert reason(half, "setup", "a", {CC: ClassCounts(np.array([1.0, 2.0, 3.0]))}) == "shape_mismatch"
    assert reason(half, "setup", "a", {CC: ClassCounts(np.array([1, -2, 3], np.int64))}) == "invalid_value"
    half.validate(Phase.TRAIN, "a", Received([cme([0.5, None, 0.5], [1, 0, 1]), good_head]))


def test_an_unbounded_latent_takes_means_outside_the_unit_cube() -> None:
    """bounded_latent = false (FedGen's network, no sigmoid): means outside [0, 1] are the encoder's own (NaN and
    infinities are refused before the half sees them, by the contract: tests/wire)."""
    half = after_setup(cfg=dataclasses.replace(CFG, bounded_latent=False))
    good_head = head([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    wide_range = Received([cme([-3.5, None, 12.25], [1, 0, 1]), good_head])
    half.validate(Phase.TRAIN, "a", wide_range)
    half.accumulate(Phase.TRAIN, "a", wide_range)
    bounded = after_setup()
    assert reason(bounded, "train", "a", {CME: cme([-3.5, None, 12.25], [1, 0, 1]), HW: good_head}) == "invalid_value"


def test_whether_encoders_end_in_a_sigmoid_is_the_configs_where_it_has_the_field() -> None:
    spec = SPECS["fedcma"]
    # The authors' settings keep the encoder's own last activation; the paper form adds the sigmoid.
    assert spec.latent_bounded() and not spec.latent_bounded(spec.config())
    assert spec.latent_bounded(spec.config(bounded_latent=True))
    assert SPECS["fedcma_paper"].latent_bounded(SPECS["fedcma_paper"].config())
    assert not SPECS["fedavg"].latent_bounded(SPECS["fedavg"].config())  # no such field: the spec's own (False)
    with pytest.raises(ValueError, match="bounded_latent must be true or false"):
        spec.config(bounded_latent="no")


def test_config_requires_0_lt_lambda_eta_le_1() -> None:
    assert FedCMAConfig().lambda1 * FedCMAConfig().server_lr == pytest.approx(0.45)
    with pytest.raises(ConfigError, match=r"lambda1·server_lr must lie in \(0, 1\]"):
        from_mapping(FedCMAConfig, {"lambda1": 2.0, "server_lr": 0.9})
    with pytest.raises(ConfigError, match="lambda2"):
        from_mapping(FedCMAConfig, {"lambda2": 0.0})
    with pytest.raises(ConfigError, match="alignment"):
        from_mapping(FedCMAConfig, {"alignment": "batch"})
    assert from_mapping(FedCMAConfig, {"lambda1": 2.0, "lambda2": 2.0, "server_lr": 0.5}).server_lr == 0.5


def test_separate_head_step_follows_the_reference_codes_two_etas() -> None:
    """head_server_lr sets v̄'s step alone: λ1·η_head = 4·0.25 = 1 replaces v̄ by Σ p_i v_i, ē keeps λ2·η."""
    cfg = from_mapping(FedCMAConfig, {"latent_dim": 1, "num_classes": 3, "lambda1": 4.0, "lambda2": 0.5,
                                      "server_lr": 0.5, "head_server_lr": 0.25})
    assert cfg.head_eta == 0.25
    half = FedCMAServer(cfg, RunInfo(0, tuple(COUNTS)))
    assert (half.head_step, half.mean_step) == (1.0, 0.25)
    for org, counts in COUNTS.items():
        half.accumulate(Phase.SETUP, org, Received([ClassCounts(np.array(counts, np.int64))]))
    half.close_round(Phase.SETUP, 0)
    half.head_weight, half.head_bias = np.full((3, 1), 9.0), np.full(3, 9.0)  # forgotten entirely by a step of 1
    push(half, "a", [0.25, None, 0.5], [1.0, 0.0, -1.0], [1.0, 0.0, 0.0])
    push(half, "b", [0.75, 0.5, None], [0.0, 2.0, 0.0], [0.0, 1.0, 0.0])
    push(half, "c", [None, 0.25, 1.0], [2.0, 0.0, 2.0], [0.0, 0.0, 1.0])
    half.close_round(Phase.TRAIN, 1)
    # v̄ = 0.2·v_a + 0.3·v_b + 0.5·v_c exactly; ē = 0.25·target (targets 0.5, 0.375, 0.875 as above).
    np.testing.assert_allclose(half.head_weight, [[1.2], [0.6], [0.8]], rtol=0, atol=1e-15)
    np.testing.assert_allclose(half.head_bias, [0.2, 0.3, 0.5], rtol=0, atol=1e-15)
    np.testing.assert_array_equal(half.means, [[0.125], [0.09375], [0.21875]])
    # Unset, the head's η is server_lr (eq. 7's single η).
    assert FedCMAServer(CFG, RunInfo(0, tuple(COUNTS))).head_step == 0.5
    with pytest.raises(ConfigError, match=r"lambda1·head_server_lr must lie in \(0, 1\] \(eq. 7\), got 5.0·0.3 = 1.5"):
        from_mapping(FedCMAConfig, {"lambda1": 5.0, "head_server_lr": 0.3})
    with pytest.raises(ConfigError, match="head_server_lr"):
        from_mapping(FedCMAConfig, {"head_server_lr": "fast"})


def test_fedcma_defaults_to_its_authors_run_script() -> None:
    """fedcma: code/script_cifar.sh:99 through main_full.py's anneal_cons_alpha (η·λ per term), no sigmoid, and
    FedGen's 20 steps of batch 32: the settings under which the claims of docs/results/fedcma.md hold."""
    spec = SPECS["fedcma"]
    cfg = spec.config()
    assert (cfg.lambda1, cfg.lambda2) == (5.0, 1.0)
    assert cfg.lambda1 * cfg.head_eta == 1.0 and cfg.lambda2 * cfg.server_lr == 0.18
    assert (cfg.alignment, cfg.head_consensus, cfg.keep_optimizer_state) == ("reference", "reference", True)
    assert (cfg.lr, cfg.momentum, cfg.weight_decay, cfg.local_steps, cfg.batch_size) == (0.01, 0.9, 5e-4, 20, 32)
    assert cfg.bounded_latent is False
    assert spec.config(lambda2=0.5).lambda2 == 0.5  # a run's own fields still win
    # A hand-written aggregator file that names only the algorithm gets the same settings.
    assert spec.parse({}) == cfg


def test_the_paper_preset_is_the_paper_form_whatever_the_authors_settings() -> None:
    """fedcma_paper: eqs. 5-7 with λ1 = λ2 = 0.5, η = 0.9, sigmoid encoders, FedGen's plain SGD."""
    spec = SPECS["fedcma_paper"]
    assert spec.family == "fedcma" and spec.half("server") is SPECS["fedcma"].half("server") is FedCMAServer
    cfg = spec.config()
    assert (cfg.lambda1, cfg.lambda2, cfg.server_lr, cfg.head_server_lr) == (0.5, 0.5, 0.9, None)
    assert (cfg.alignment, cfg.head_consensus, cfg.bounded_latent) == ("paper", "paper", True)
    assert (cfg.lr, cfg.momentum, cfg.weight_decay, cfg.local_steps, cfg.batch_size) == (0.01, 0.0, 0.0, 20, 32)
    # Every field but the training schedule is the config type's own default: the equations.
    own = FedCMAConfig(local_steps=20, momentum=0.0)
    assert cfg == own


def test_the_spec_is_model_private_and_never_accepts_model_weights() -> None:
    spec = SPECS["fedcma"]
    assert spec.model_private and spec.bounded_latent
    assert spec.setup_upload == {CC}
    assert spec.upload == {CME, HW, PayloadKind.EVAL_METRICS}
    assert spec.download == {CME, HW}
    assert ModelWeights.kind not in spec.upload | spec.download | spec.setup_upload


def test_a_restarted_aggregator_resumes_with_the_same_p_weights_and_stored_updates(
    aggregator: Callable[..., Any], raw_client: Callable[..., RawClient]
) -> None:
    """Kill the aggregator after a's round-1 push: the restart keeps n_i^k, v̄⁰ and a's update; eq. 7 is exact."""
    run = {"id": "r", "algorithm": "fedcma_paper", "organizations": ["a", "b"], "rounds": 2, "seed": 5,
           "algorithm_config": {"latent_dim": 1, "num_classes": 3, "lambda1": 0.5, "lambda2": 0.5, "server_lr": 1.0}}
    first = aggregator(run)
    a, b = raw_client(first.port, "a"), raw_client(first.port, "b")
    a.join()
    b.join()
    a.push(0, [ClassCounts(np.array([2, 0, 2], np.int64))])
    b.push(0, [ClassCounts(np.array([2, 4, 0], np.int64))])
    v_a, v_b = head([1.0, 0.0, -1.0], [1.0, 0.0, 0.0], 4), head([0.0, 2.0, 0.0], [0.0, 1.0, 0.0], 6)
    metrics = EvalMetrics(test_accuracy=0.5, num_test_examples=2)
    assert a.push(1, [cme([0.25, None, 0.5], [2, 0, 2]), v_a, metrics]).accepted
    first.stop(grace=0.1)

    second = aggregator(run)
    a2, b2 = raw_client(second.port, "a"), raw_client(second.port, "b")
    assert b2.push(1, [cme([0.75, 0.5, None], [2, 2, 0]), v_b, metrics]).accepted
    ins = a2.pull(completed=1)  # the engine's instructions, read as raw protos
    assert ins.action == apb.ACTION_TRAIN and ins.envelope.round == 2
    means, v = (codec.payload_from_proto(p) for p in ins.payloads)
    assert isinstance(means, ClassMeanEmbeddings) and isinstance(v, HeadWeights)
    # n^k = [4, 4, 2]: p_a^k = [0.5, 0, 1], p_b^k = [0.5, 1, 0]; every target is 0.5, halved by the EMA.
    np.testing.assert_array_equal(means.means, [[0.25], [0.25], [0.25]])
    np.testing.assert_array_equal(means.counts, [4, 4, 2])
    # v̄ = 0.5·v̄⁰ + 0.5·(0.4·v_a + 0.6·v_b), v̄⁰ drawn from the run seed.
    w0, b0 = initial_head(3, 1, 5)
    want_w = 0.5 * w0 + 0.5 * (0.4 * v_a.weight + 0.6 * v_b.weight)
    want_b = 0.5 * b0 + 0.5 * (0.4 * v_a.bias + 0.6 * v_b.bias)
    np.testing.assert_allclose(v.weight, want_w.astype(np.float32), rtol=0, atol=1e-7)
    np.testing.assert_allclose(v.bias, want_b.astype(np.float32), rtol=0, atol=1e-7)


def test_noisy_released_counts_weigh_the_means_and_what_the_client_must_floor_and_cap() -> None:
    """Under DP an organization sends its class counts plus Gaussian noise, rounded and floored at 0, and its round
    counts capped at what it released (docs/privacy.md). The server takes them as they come: p weights from the
    noisy counts, and a class released as 0 weighs nothing in ē. A negative count, or a round count above the
    released one, is refused: which is why the client floors and caps, as post-processing of the release."""
    noisy = {"a": [3, 0, 1], "b": [1, 5, 0], "c": [0, 3, 7]}  # true counts: COUNTS
    half = FedCMAServer(CFG, RunInfo(0, tuple(noisy)))
    for org, counts in noisy.items():
        half.accumulate(Phase.SETUP, org, Received([ClassCounts(np.array(counts, np.int64))]))
    half.close_round(Phase.SETUP, 0)
    # n^k = [4, 8, 8] again, but split otherwise: p^0 = [0.75, 0.25, 0], p^1 = [0, 0.625, 0.375], p^2 = [0.125, 0, 0.875].
    np.testing.assert_array_equal(half.p_class, [[0.75, 0.0, 0.125], [0.25, 0.625, 0.0], [0.0, 0.375, 0.875]])
    for org, means, counts in (("a", [0.5, None, 0.25], [3, 0, 1]), ("b", [0.25, 0.75, None], [1, 5, 0]),
                               ("c", [None, 0.5, 1.0], [0, 3, 7])):
        payloads = Received([cme(means, counts), head([0.0] * 3, [0.0] * 3)])
        half.validate(Phase.TRAIN, org, payloads)
        half.accumulate(Phase.TRAIN, org, payloads)
    half.close_round(Phase.TRAIN, 1)
    # ē^k = 0.5·Σ_i p_i^k e_i^k: k=0: 0.75·0.5 + 0.25·0.25 = 0.4375; k=1: 0.625·0.75 + 0.375·0.5 = 0.65625;
    # k=2: 0.125·0.25 + 0.875·1.0 = 0.90625.
    np.testing.assert_array_equal(half.means, [[0.21875], [0.328125], [0.453125]])
    for bad in ([-1, 0, 1],):  # a noisy count below zero, as the release may draw it before the floor
        assert reason(FedCMAServer(CFG, RunInfo(0, ("a",))), "setup", "a",
                      {CC: ClassCounts(np.array(bad, np.int64))}) == "invalid_value"
    # A round count above the organization's released count: refused (the client caps it).
    over = Received([cme([0.5, None, 0.25], [4, 0, 1]), head([0.0] * 3, [0.0] * 3)])
    with pytest.raises(WireError, match="counts must lie in"):
        half.validate(Phase.TRAIN, "a", over)
