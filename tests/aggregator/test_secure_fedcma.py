"""One Fed-CMA round under secure aggregation through a real aggregator (gRPC, in process), its three clients driven
by hand with ``SecureClient``: the setup counts go up in plain, the class means and heads only masked. The round
closes with eq. 7's new ē and v̄ within the encoding's quantization of the float64 values computed by hand and of
the plain half fed each upload; what the aggregator learns of the weights is Σ_i n_i^k and Σ_i N_i. A class mean
beyond the encoding's value bound is refused by its own client before anything is masked; class weights beyond
the survivors' setup counts are refused on the sum."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from hetfed import secagg
from hetfed.aggregator.algorithms.base import RunInfo
from hetfed.aggregator.algorithms.fedcma import FedCMAServer
from hetfed.aggregator.run.secure import SecureRound
from hetfed.client.secure import SecureClient
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import (
    ClassCounts,
    ClassMeanEmbeddings,
    EvalMetrics,
    HeadWeights,
    Payload,
    Received,
    SecAggPeerKeys,
    SecAggPeerShares,
    SecAggSetup,
    SecAggUnmask,
)
from hetfed.wire.phases import Phase
from hetfed.wire.rpc import AggregatorClient, RemoteError, SecureStageReply
from hetfed.wire.specs import fedcma
from hetfed.wire.specs.fedcma import FedCMAConfig
from tests.conftest import run_config

ORGS = ("a", "b", "c")  # complete graph: k = 2, t = 2
# K = 3 classes, d_e = 2. Step on ē: λ2·η = 0.5; step on v̄: λ1·η = 1 (v̄ becomes the weighted mean of the heads).
CONFIG = {"latent_dim": 2, "num_classes": 3, "lambda1": 1.0, "lambda2": 0.5, "server_lr": 1.0, "head_server_lr": 1.0}
COUNTS = {"a": [2, 0, 2], "b": [2, 4, 0], "c": [0, 4, 6]}  # n^k = [4, 8, 8]; N_i = 4, 6, 10; N = 20
MEANS = {"a": [[0.2, 0.4], [0.0, 0.0], [0.6, 0.8]],
         "b": [[0.4, 0.0], [0.5, 0.25], [0.0, 0.0]],
         "c": [[0.0, 0.0], [0.9, 0.75], [0.1, 0.3]]}
HEADS = {"a": ([[1.0, 0.0], [0.0, -1.0], [2.0, 1.0]], [0.0, 0.0, 0.0]),
         "b": ([[2.0, 2.0], [2.0, 2.0], [2.0, 2.0]], [1.0, 1.0, 1.0]),
         "c": ([[0.5, -1.0], [3.0, 0.0], [-1.0, 0.5]], [-1.0, 0.0, 2.0])}
# By hand. Σ_i n_i^k e_i^k / n^k: class 0 (2·[.2, .4] + 2·[.4, 0]) / 4 = [.3, .2]; class 1 (4·[.5, .25] + 4·[.9, .75])
# / 8 = [.7, .5]; class 2 (2·[.6, .8] + 6·[.1, .3]) / 8 = [.225, .425]; ē = 0 + 0.5·(that).
NEW_MEANS = [[0.15, 0.1], [0.35, 0.25], [0.1125, 0.2125]]
# (4·v_a + 6·v_b + 10·v_c) / 20.
NEW_HEAD = ([[1.05, 0.1], [2.1, 0.4], [0.5, 1.05]], [-0.2, 0.3, 1.3])


def upload(org: str, means: list[list[float]] | None = None) -> list[Payload]:
    """What the Fed-CMA client half sends: its means counted with its setup counts, its head with N_i."""
    counts = np.array(COUNTS[org], np.int64)
    rows = np.array(MEANS[org] if means is None else means, np.float32)
    weight, bias = HEADS[org]
    return [ClassMeanEmbeddings(np.arange(3, dtype=np.int64), rows, counts, counts > 0),
            HeadWeights(np.array(weight, np.float32), np.array(bias, np.float32), int(counts.sum()))]


def together(calls: dict[str, Callable[[], SecureStageReply]]) -> dict[str, SecureStageReply]:
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {o: pool.submit(call) for o, call in calls.items()}
        return {o: f.result(timeout=60) for o, f in futures.items()}


def payloads(replies: dict[str, SecureStageReply], cls: type) -> dict[str, Any]:
    out = {}
    for o, r in replies.items():
        assert isinstance(r.payload, cls), (o, r)
        out[o] = r.payload
    return out


def plain_half() -> FedCMAServer:
    """The server half of a plain run fed the same setup counts and uploads one by one, closed."""
    half = FedCMAServer(FedCMAConfig(**CONFIG), RunInfo(0, ORGS))  # type: ignore[arg-type]
    for org in ORGS:
        half.accumulate(Phase.SETUP, org, Received([ClassCounts(np.array(COUNTS[org], np.int64))]))
    half.close_round(Phase.SETUP, 0)
    for org in ORGS:
        half.validate(Phase.TRAIN, org, Received(upload(org)))
        half.accumulate(Phase.TRAIN, org, Received(upload(org)))
    half.close_round(Phase.TRAIN, 1)
    return half


def test_a_fedcma_round_unmasks_to_eq_7s_new_means_and_head(aggregator: Callable[..., Any]) -> None:
    agg = aggregator(run_config(algorithm="fedcma", algorithm_config=CONFIG, organizations=list(ORGS), rounds=1,
                                secure_aggregation=True))
    run = agg.service.runs["r"]
    clients = {o: AggregatorClient(f"127.0.0.1:{agg.port}", None, o, "r") for o in ORGS}
    try:
        # The setup round: each organization's class counts go up in plain (the aggregator keeps them).
        for o, c in clients.items():
            c.join()
            assert c.pull(-1, 5.0, fedcma.SPEC).round == 0
            assert c.push(0, [ClassCounts(np.array(COUNTS[o], np.int64))]).accepted
        assert all(c.pull(0, 5.0, fedcma.SPEC).round == 1 for c in clients.values())

        # The round's setup: the summed form's fields from K and d_e of the run's config (nobody declared them).
        setup = payloads({o: c.secure_stage(1, None, 0) for o, c in clients.items()}, SecAggSetup)["a"]
        assert {f.name: f.shape for f in setup.config.encoding.fields} == {
            "class_mean_embeddings#weight": (3,), "class_mean_embeddings/means": (3, 2),
            "head_weights#weight": (), "head_weights/bias": (3,), "head_weights/weight": (3, 2)}
        assert not setup.unit_weights and setup.config.roster == ORGS
        secure = {o: SecureClient(setup, o, secagg.SeededEntropy(o)) for o in ORGS}
        adverts = {o: secure[o].advertise() for o in ORGS}
        keys = payloads(together({o: (lambda o=o: clients[o].secure_stage(1, adverts[o], 30)) for o in ORGS}),
                        SecAggPeerKeys)
        shared = {o: secure[o].share(keys[o]) for o in ORGS}
        shares = payloads(together({o: (lambda o=o: clients[o].secure_stage(1, shared[o], 30)) for o in ORGS}),
                          SecAggPeerShares)

        # A mean beyond the value bound (100; possible only with bounded_latent = false) is refused by its own
        # client: nothing is masked, and the same client then masks its real upload.
        with pytest.raises(WireError) as err:
            secure["a"].mask(shares["a"], upload("a", [[150.0, 0.0], [0.0, 0.0], [0.6, 0.8]]), fedcma.SPEC.summed_upload,
                             np.random.default_rng(0))
        assert err.value.reason == "implausible_update" and "declared bound 100" in str(err.value)

        # Plain class means and heads are refused in a secure round; the masked input is taken instead.
        metrics = {o: EvalMetrics(0.5, sum(COUNTS[o]), 0.5) for o in ORGS}
        with pytest.raises(RemoteError) as remote:
            clients["a"].push(1, [*upload("a"), metrics["a"]])
        assert remote.value.reason == "payload_kind_not_allowed"
        for i, o in enumerate(ORGS):
            masked = secure[o].mask(shares[o], upload(o), fedcma.SPEC.summed_upload, np.random.default_rng([1, i]))
            assert clients[o].push(1, [masked, metrics[o]]).accepted
        requests = payloads({o: c.secure_stage(1, None, 0) for o, c in clients.items()}, SecAggUnmask)
        for o, c in clients.items():
            c.secure_stage(1, secure[o].unmask(requests[o]), 0)
        sr = run.secure.round
        assert sr is not None and sr.result is not None and sr.result.survivors == ORGS
        assert run.round == 2

        # Each survivor's stochastic rounding moves a summed element by under one step of its field.
        enc = setup.config.encoding
        step = {f.name: f.bound / enc.level for f in enc.fields}
        n = len(ORGS)
        # What the aggregator learns of the weights: the class totals n^k it has from the setup, and N.
        weights = sr.result.values
        assert np.abs(weights["class_mean_embeddings#weight"] - [4, 8, 8]).max() <= n * step[
            "class_mean_embeddings#weight"]
        assert abs(float(weights["head_weights#weight"]) - 20) <= n * step["head_weights#weight"]

        # ē and v̄ against the float64 values by hand: the mean Σwx / Σw moves by under n·(step_wx + |x|·step_w)
        # / Σw, scaled by the server's step (0.5 on ē), plus float32's rounding of the uploads.
        state = run.aggregation.half.state()
        n_k = np.array([4.0, 8.0, 8.0])
        tol_means = 0.5 * n * (step["class_mean_embeddings/means"] + step["class_mean_embeddings#weight"]) / n_k
        assert np.all(np.abs(state["means"] - NEW_MEANS) <= tol_means[:, None] + 1e-7)
        assert state["present"].tolist() == [True, True, True]
        tol_head = n * (step["head_weights/weight"] + 3 * step["head_weights#weight"]) / 20 + 1e-7
        assert np.abs(state["head_weight"] - NEW_HEAD[0]).max() <= tol_head
        assert np.abs(state["head_bias"] - NEW_HEAD[1]).max() <= tol_head
        assert max(tol_means.max(), tol_head) < 1e-4  # the default encoding: 40 bits for |x| <= 100, w <= 10^6

        # The plain round (the half fed each upload one by one) gives the same, within the same step.
        plain = plain_half().state()
        np.testing.assert_allclose(plain["means"], NEW_MEANS, rtol=0, atol=1e-7)
        np.testing.assert_allclose(plain["head_weight"], NEW_HEAD[0], rtol=0, atol=1e-7)
        assert np.all(np.abs(state["means"] - plain["means"]) <= tol_means[:, None] + 1e-7)
        assert np.abs(state["head_weight"] - plain["head_weight"]).max() <= tol_head
        assert np.abs(state["head_bias"] - plain["head_bias"]).max() <= tol_head
        np.testing.assert_array_equal(state["counts"], plain["counts"])  # the setup counts: the same
    finally:
        for c in clients.values():
            c.close()


def test_class_weights_beyond_the_setup_counts_are_refused_and_the_half_untouched() -> None:
    """The plain round refuses an upload counted beyond its setup counts; under secure aggregation the aggregator
    sees only the sum, so it refuses a sum whose class weights exceed the survivors' setup counts (a lie the
    others' honest weights cannot hide: weights are never negative). The round's aggregate is abandoned."""
    half = FedCMAServer(FedCMAConfig(**CONFIG), RunInfo(0, ORGS))  # type: ignore[arg-type]
    for org in ORGS:
        half.accumulate(Phase.SETUP, org, Received([ClassCounts(np.array(COUNTS[org], np.int64))]))
    half.close_round(Phase.SETUP, 0)
    before = half.state()
    sr = SecureRound(fedcma.SPEC, half, "r", 1, ORGS, 0, half.summed_shapes())
    clients = {o: SecureClient(sr.setup(), o, secagg.SeededEntropy(o)) for o in ORGS}
    for o, c in clients.items():
        sr.receive(o, c.advertise())
    for o, keys in sr.close_stage().items():
        sr.receive(o, clients[o].share(keys))  # type: ignore[arg-type]
    for i, (o, shares) in enumerate(sr.close_stage().items()):
        sent = upload(o)
        if o == "a":  # weighs its class 0 by 3, not its setup count 2
            cme = sent[0]
            assert isinstance(cme, ClassMeanEmbeddings)
            sent[0] = dataclasses.replace(cme, counts=np.array([3, 0, 2], np.int64))
        sr.receive(o, clients[o].mask(shares, sent, fedcma.SPEC.summed_upload, np.random.default_rng([2, i])))  # type: ignore[arg-type]
    for o, request in sr.close_stage().items():
        sr.receive(o, clients[o].unmask(request))  # type: ignore[arg-type]
    assert sr.finish() is None and sr.result is None
    assert sr.abandoned.startswith("implausible_update") and "setup counts" in sr.abandoned
    half.close_round(Phase.TRAIN, 1)
    after = half.state()
    assert all(np.array_equal(after[name], before[name]) for name in before)  # ē and v̄ untouched
