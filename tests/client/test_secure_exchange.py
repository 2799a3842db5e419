"""The client's side of a secure round over the SecureStage RPC (``SecureExchange``) against a real aggregator
(gRPC, in process): four organizations, each in its own thread, mask their FedAvg weights, push, and answer the
unmask request; one drops after masking. The round closes at its deadline with the survivors' weighted mean,
within the encoding's quantization."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from hetfed import secagg
from hetfed.aggregator.run.secure import SecureParams
from hetfed.client.secure import SecureExchange
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from hetfed.wire.rpc import AggregatorClient
from hetfed.wire.specs import fedavg
from tests.conftest import run_config, wait_until

ORGS = ("a", "b", "c", "d")  # complete graph: k = 3, t = 2
EXAMPLES = {"a": 10, "b": 20, "c": 30, "d": 40}


def joined(aggregator: Callable[..., Any], seed: int) -> tuple[Any, dict[str, np.ndarray], dict[str, AggregatorClient]]:
    """A secure one-round run of ORGS (quorum 3, 1 s deadline), every organization joined with a seeded weight
    vector of its own: the run, the weights and each organization's client."""
    agg = aggregator(run_config(organizations=list(ORGS), rounds=1, min_clients=3, round_deadline_seconds=1.0))
    run = agg.service.runs["r"]
    run.secure.params = SecureParams()
    rng = np.random.default_rng(seed)
    w = {o: rng.normal(0, 0.5, (4,)).astype(np.float32) for o in ORGS}
    clients = {o: AggregatorClient(f"127.0.0.1:{agg.port}", None, o, "r") for o in ORGS}
    for o, c in clients.items():
        c.join(declared=[DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, "w", w[o])])
    return run, w, clients


def exchange_all(clients: dict[str, AggregatorClient], w: dict[str, np.ndarray], tag: int,
                 drop: frozenset[str] = frozenset()) -> dict[str, tuple[list[Any] | None, str, bool]]:
    """Every organization's ``SecureExchange`` of round 1, each in its own thread (its stochastic rounding from
    ``tag`` and its index): per organization its upload (None: refused or left out), why it refused its own
    update ("" if it did not) and whether it answered an unmask request. One in ``drop`` drops after masking: it
    never pushes, never answers. The clients are closed after."""

    def organization(i: int, o: str) -> tuple[list[Any] | None, str, bool]:
        ex = SecureExchange(clients[o], o, 1, 30.0, secagg.SeededEntropy(o))
        upload = ex.masked_upload([ModelWeights({"w": w[o]}, EXAMPLES[o]), EvalMetrics(0.5, EXAMPLES[o], 0.5)],
                                  fedavg.SPEC.summed_upload, np.random.default_rng([tag, i]))
        if upload is None or o in drop:
            return upload, ex.refused, False
        clients[o].push(1, upload)
        return upload, ex.refused, ex.unmask()

    try:
        with ThreadPoolExecutor(len(ORGS)) as pool:
            return dict(zip(ORGS, pool.map(organization, range(len(ORGS)), ORGS), strict=True))
    finally:
        for c in clients.values():
            c.close()


def assert_the_survivors_weighted_mean(run: Any, w: dict[str, np.ndarray], survivors: tuple[str, ...]) -> None:
    """The round closed with the survivors' sum unmasked into the half: their weighted mean, within 3 steps of
    the encoding over the sum of their weights."""
    sr = run.secure.round
    assert sr is not None and sr.result is not None and sr.result.survivors == survivors
    assert run.round == 2
    enc = sr.config.encoding
    step = max(f.bound for f in enc.fields) / enc.level
    total = sum(EXAMPLES[o] for o in survivors)
    plain = sum(np.float64(EXAMPLES[o]) * w[o].astype(np.float64) for o in survivors) / total
    assert np.abs(run.aggregation.half.state()["w"] - plain).max() <= 3 * step / total + 1e-6


def test_four_exchanges_with_one_dropout_after_masking_give_the_survivors_mean(aggregator: Callable[..., Any]) -> None:
    run, w, clients = joined(aggregator, seed=9)
    done = exchange_all(clients, w, 5, drop=frozenset({"d"}))
    upload = done["a"][0]
    assert upload is not None and [p.kind.value for p in upload] == ["secagg_masked_input", "eval_metrics"]
    assert [done[o][2] for o in ORGS] == [True, True, True, False]
    assert_the_survivors_weighted_mean(run, w, ("a", "b", "c"))


def test_an_organization_that_comes_after_stage_1_sits_the_round_out(aggregator: Callable[..., Any]) -> None:
    run, w, clients = joined(aggregator, seed=12)

    def organization(i: int, o: str) -> bool:
        if o == "d":  # comes once stage 1 has closed without it (at its deadline, with the quorum of 3)
            wait_until(lambda: run.secure.round is not None and run.secure.round.stage != "advertise", timeout=30)
        ex = SecureExchange(clients[o], o, 1, 30.0, secagg.SeededEntropy(o))
        upload = ex.masked_upload([ModelWeights({"w": w[o]}, EXAMPLES[o]), EvalMetrics(0.5, EXAMPLES[o], 0.5)],
                                  fedavg.SPEC.summed_upload, np.random.default_rng([6, i]))
        if upload is None:
            return False
        clients[o].push(1, upload)
        return ex.unmask()

    try:
        with ThreadPoolExecutor(len(ORGS)) as pool:
            done = dict(zip(ORGS, pool.map(organization, range(len(ORGS)), ORGS), strict=True))
    finally:
        for c in clients.values():
            c.close()
    assert done == {"a": True, "b": True, "c": True, "d": False}
    sr = run.secure.round
    assert sr is not None and sr.result is not None and sr.result.survivors == ("a", "b", "c")
    assert run.round == 2


def test_an_organization_sits_out_a_round_abandoned_at_stage_1(aggregator: Callable[..., Any]) -> None:
    # Only a comes (quorum 1): at stage 1's deadline nobody has t = 2 live neighbours, the round's aggregate is
    # abandoned and the round closes by itself, the model unchanged. a's exchange gives nothing to push and
    # raises nothing: its client goes on to the next round instead of leaving the run.
    agg = aggregator(run_config(organizations=list(ORGS), rounds=2, min_clients=1, round_deadline_seconds=1.0))
    run = agg.service.runs["r"]
    run.secure.params = SecureParams()
    w = np.ones(4, np.float32)
    with AggregatorClient(f"127.0.0.1:{agg.port}", None, "a", "r") as client:
        client.join(declared=[DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, "w", w)])
        ex = SecureExchange(client, "a", 1, 30.0, secagg.SeededEntropy("a"))
        upload = ex.masked_upload([ModelWeights({"w": w}, 10), EvalMetrics(0.5, 10, 0.5)],
                                  fedavg.SPEC.summed_upload, np.random.default_rng(1))
        assert upload is None and not ex.unmask()
        assert run.round == 2 and run.aggregation.half.state() == {}
        assert run.status().history[0].secure_abandoned.startswith("below_threshold: abandoned at advertise")
        assert client.pull(1, 5.0, None).round == 2  # the next round's instructions


def test_an_organization_whose_own_value_is_beyond_its_bound_sends_nothing_and_the_round_goes_on(
        aggregator: Callable[..., Any]) -> None:
    # d's weight 150 is beyond the encoding's bound of 100 (SecureParams.value_bound): its own client refuses it
    # after sharing its keys, pushes nothing, and is a dropout after masking; the round closes at its deadline
    # with a, b and c's weighted mean.
    run, w, clients = joined(aggregator, seed=11)
    w["d"] = np.full(4, 150.0, np.float32)
    done = exchange_all(clients, w, 6)
    assert done["d"][0] is None and "implausible_update" in done["d"][1] and "beyond its declared bound" in done["d"][1]
    assert [done[o][1] for o in "abc"] == ["", "", ""] and [done[o][2] for o in "abc"] == [True, True, True]
    assert run.secure.round.result.dropped == ("d",)
    assert_the_survivors_weighted_mean(run, w, ("a", "b", "c"))
