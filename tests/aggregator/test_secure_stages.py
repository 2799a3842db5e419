"""A FedAvg round under secure aggregation through a real aggregator (gRPC, in process), its clients driven by
hand with ``SecureClient``: stages 1, 2 and 4 over the SecureStage RPC, stage 3 on PushUpdate. The setup, keys
and shares reach each organization, a stage closes when everyone it addressed answered, messages are bound to
the caller, retries change nothing, the round waits for the unmasking and closes with FedAvg's weighted mean
within the quantization, and the traffic is counted per payload kind."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from hetfed import secagg
from hetfed.aggregator.run.secure import SecureParams
from hetfed.client.secure import SecureClient
from hetfed.wire.contract import DeclaredTensor
from hetfed.wire.payloads import (
    EvalMetrics,
    ModelWeights,
    Payload,
    PayloadKind,
    SecAggPeerKeys,
    SecAggPeerShares,
    SecAggSetup,
    SecAggUnmask,
)
from hetfed.wire.rpc import AggregatorClient, RemoteError, SecureStageReply
from hetfed.wire.specs import fedavg
from tests.conftest import run_config

ORGS = ("a", "b", "c")
EXAMPLES = {"a": 10, "b": 20, "c": 30}


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {o: rng.normal(0, 0.5, (2, 3)).astype(np.float32) for o in ORGS}


@dataclass
class Joined:
    """A secure run's round 1 with its organizations joined and given their setup (``joined``)."""

    agg: Any
    run: Any
    w: dict[str, np.ndarray]
    clients: dict[str, AggregatorClient]
    setup: SecAggSetup
    secure: dict[str, SecureClient]


@contextmanager
def joined(aggregator: Callable[..., Any], orgs: tuple[str, ...], seed: int, shape: tuple[int, ...], *,
           members: tuple[str, ...] = (), rounds: int = 1, min_clients: int = 3) -> Iterator[Joined]:
    """A secure run of ``members`` (``orgs`` when empty; a 1 s round deadline) with ``orgs`` joined, each declaring
    a seeded weight array of ``shape``, and each holding round 1's setup and its own ``SecureClient``. The
    clients are closed on leaving."""
    agg = aggregator(run_config(organizations=list(members or orgs), rounds=rounds, min_clients=min_clients,
                                round_deadline_seconds=1.0))
    run = agg.service.runs["r"]
    run.secure.params = SecureParams()
    rng = np.random.default_rng(seed)
    w = {o: rng.normal(0, 0.5, shape).astype(np.float32) for o in orgs}
    clients = {o: AggregatorClient(f"127.0.0.1:{agg.port}", None, o, "r") for o in orgs}
    try:
        for o, c in clients.items():
            c.join(declared=[DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, "w", w[o])])
        setup = payloads({o: c.secure_stage(1, None, 0) for o, c in clients.items()}, SecAggSetup)["a"]
        yield Joined(agg, run, w, clients, setup, {o: SecureClient(setup, o, secagg.SeededEntropy(o)) for o in orgs})
    finally:
        for c in clients.values():
            c.close()


def together(calls: dict[str, Callable[[], SecureStageReply]]) -> dict[str, SecureStageReply]:
    """Every organization's call at once (a stage closes only when all of them sent)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {o: pool.submit(call) for o, call in calls.items()}
        return {o: f.result(timeout=60) for o, f in futures.items()}


def sample(agg: Any, org: str, direction: str, kind: str) -> float:
    labels = {"run": "r", "algorithm": "fedavg", "organization": org, "direction": direction, "payload_kind": kind}
    return agg.service.metrics.registry.get_sample_value("hetfed_aggregator_bytes_total", labels) or 0.0


def payloads(replies: dict[str, SecureStageReply], cls: type) -> dict[str, Any]:
    out = {}
    for o, r in replies.items():
        assert isinstance(r.payload, cls), (o, r)
        out[o] = r.payload
    return out


def share_keys(clients: dict[str, AggregatorClient], secure: dict[str, SecureClient],
               orgs: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Stages 1 and 2 for ``orgs`` at once over the SecureStage RPC: each one's neighbours' keys, then the sealed
    shares addressed to it."""
    adverts = {o: secure[o].advertise() for o in orgs}
    keys = payloads(together({o: (lambda o=o: clients[o].secure_stage(1, adverts[o], 30)) for o in orgs}),
                    SecAggPeerKeys)
    shared = {o: secure[o].share(keys[o]) for o in orgs}
    shares = payloads(together({o: (lambda o=o: clients[o].secure_stage(1, shared[o], 30)) for o in orgs}),
                      SecAggPeerShares)
    return keys, shares


def test_stages_cross_the_rpc_bound_to_their_callers_and_unmask_to_the_sum(aggregator: Callable[..., Any]) -> None:
    agg = aggregator(run_config(organizations=list(ORGS), rounds=1))
    run = agg.service.runs["r"]
    run.secure.params = SecureParams()
    w = weights()
    clients = {o: AggregatorClient(f"127.0.0.1:{agg.port}", None, o, "r") for o in ORGS}
    try:
        for o, c in clients.items():
            c.join(declared=[DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, "w", w[o])])
            assert c.pull(-1, 5.0, None).round == 1
        # Stage 0: the setup, the same for everyone, with the whole roster and the declared shapes.
        setups = payloads({o: c.secure_stage(1, None, 0) for o, c in clients.items()}, SecAggSetup)
        setup = setups["a"]
        assert all(s == setup for s in setups.values())
        assert setup.config.roster == ORGS and setup.config.threshold == 2 and not setup.unit_weights
        assert {f.name: f.shape for f in setup.config.encoding.fields} == {"model_weights#weight": (),
                                                                          "model_weights/w": (2, 3)}
        secure = {o: SecureClient(setup, o, secagg.SeededEntropy(o)) for o in ORGS}

        # A stage message must be the caller's own.
        forged = SecureClient(setup, "b", secagg.SeededEntropy("forger")).advertise()
        with pytest.raises(RemoteError) as err:
            clients["a"].secure_stage(1, forged, 0)
        assert err.value.reason == "identity_mismatch"

        # Stage 1: nothing comes back before everyone advertised; then each gets its neighbours' keys.
        adverts = {o: secure[o].advertise() for o in ORGS}
        lone = clients["a"].secure_stage(1, adverts["a"], 0.2)
        assert lone.payload is None and lone.stage == "advertise"
        keys = payloads(together({o: (lambda o=o: clients[o].secure_stage(1, adverts[o], 30)) for o in ORGS}),
                        SecAggPeerKeys)
        assert {o: sorted(a.sender for a in k.message.peers) for o, k in keys.items()} == \
            {o: sorted(p for p in ORGS if p != o) for o in ORGS}

        # Stage 2: sealed shares routed to their receivers.
        shared = {o: secure[o].share(keys[o]) for o in ORGS}
        shares = payloads(together({o: (lambda o=o: clients[o].secure_stage(1, shared[o], 30)) for o in ORGS}),
                          SecAggPeerShares)
        assert {o: sorted(s.sender for s in p.message.shares) for o, p in shares.items()} == \
            {o: sorted(p for p in ORGS if p != o) for o in ORGS}

        # A retry of a message already taken changes nothing; another message for a closed stage is refused.
        again = clients["a"].secure_stage(1, adverts["a"], 0)
        assert again.stage == "mask" and again.abandoned == ""
        with pytest.raises(RemoteError) as err:
            clients["a"].secure_stage(1, SecureClient(setup, "a", secagg.SeededEntropy("x")).advertise(), 0)
        assert err.value.reason == "unexpected_stage"

        # Stage 3: the masked input rides on PushUpdate in place of the weights; the half never sees it.
        uploads: dict[str, Sequence[Payload]] = {o: [ModelWeights({"w": w[o]}, EXAMPLES[o])] for o in ORGS}
        masked = {o: secure[o].mask(shares[o], uploads[o], fedavg.SPEC.summed_upload, np.random.default_rng([3, i]))
                  for i, o in enumerate(ORGS)}
        with pytest.raises(RemoteError) as err:  # stage 3 does not ride on SecureStage
            clients["a"].secure_stage(1, masked["a"], 0)
        assert err.value.reason == "payload_kind_not_allowed"
        with pytest.raises(RemoteError) as err:  # the plain weights are refused in a secure round
            clients["a"].push(1, [*uploads["a"], EvalMetrics(0.5, EXAMPLES["a"], 0.5)])
        assert err.value.reason == "payload_kind_not_allowed"
        for o in ORGS:
            assert clients[o].push(1, [masked[o], EvalMetrics(0.5, EXAMPLES[o], 0.5)]).accepted
        sr = run.secure.round
        assert sr is not None and sr.stage == "unmask" and run.round == 1  # due, but not closed: unmasking
        # Each masked input went into the running sum; the stages keep only that it came, not a copy of it.
        assert {o: raw for (stage, o), raw in run.secure._sent.items() if stage == "mask"} == dict.fromkeys(ORGS, b"")

        # Stage 4: the unmask request comes over the RPC, the reply goes back over it; the last one closes.
        requests = payloads({o: c.secure_stage(1, None, 0) for o, c in clients.items()}, SecAggUnmask)
        for o, c in clients.items():
            done = c.secure_stage(1, secure[o].unmask(requests[o]), 0)
            assert done.payload is None
        assert sr.stage == "done" and sr.result is not None and sr.result.survivors == ORGS
        assert run.round == 2 and len(run.history) == 1  # the round closed with the unmasked sum

        # The new model is FedAvg's weighted mean, within the encoding's quantization.
        enc = setup.config.encoding
        step = max(f.bound for f in enc.fields) / enc.level
        plain = sum(np.float64(EXAMPLES[o]) * w[o].astype(np.float64) for o in ORGS) / 60.0
        model = run.aggregation.half.state()["w"]
        assert np.abs(model - plain).max() <= len(ORGS) * step / 60.0 + 1e-6

        # Counted per payload kind, both ways, on the aggregator's side.
        for o in ORGS:
            assert sample(agg, o, "down", "secagg_setup") > 0
            assert sample(agg, o, "up", "secagg_key_advert") > 0
            assert sample(agg, o, "down", "secagg_peer_keys") > 0
            assert sample(agg, o, "up", "secagg_shared_keys") > 0
            assert sample(agg, o, "down", "secagg_peer_shares") > 0
            assert sample(agg, o, "down", "secagg_unmask") > 0 and sample(agg, o, "up", "secagg_unmask") > 0
            assert sample(agg, o, "up", "secagg_masked_input") > 0  # on PushUpdate, not SecureStage
    finally:
        for c in clients.values():
            c.close()


def test_a_run_that_is_not_secure_refuses_stage_messages(aggregator: Callable[..., Any]) -> None:
    agg = aggregator(run_config())
    with AggregatorClient(f"127.0.0.1:{agg.port}", None, "a", "r") as client:
        client.join(declared=[DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, "w", np.zeros(3, np.float32))])
        with pytest.raises(RemoteError) as err:
            client.secure_stage(1, None, 0)
        assert err.value.reason == "payload_kind_not_allowed"


def test_a_client_that_drops_after_masking_is_recovered(aggregator: Callable[..., Any]) -> None:
    orgs = ("a", "b", "c", "d")  # complete graph: k = 3, t = 2; d shares its keys, then never pushes
    examples = {"a": 10, "b": 20, "c": 30, "d": 40}
    with joined(aggregator, orgs, 8, (2, 3)) as j:
        run, w, clients, setup, secure = j.run, j.w, j.clients, j.setup, j.secure
        assert setup.config.threshold == 2
        _, shares = share_keys(clients, secure, orgs)
        survivors = orgs[:3]
        for i, o in enumerate(survivors):
            masked = secure[o].mask(shares[o], [ModelWeights({"w": w[o]}, examples[o])], fedavg.SPEC.summed_upload,
                                    np.random.default_rng([4, i]))
            assert clients[o].push(1, [masked, EvalMetrics(0.5, examples[o], 0.5)]).accepted
        # At the deadline (3 of 4 pushed: the quorum) the mask stage closes; the requests name d as dropped.
        requests = payloads(together({o: (lambda o=o: clients[o].secure_stage(1, None, 30)) for o in survivors}),
                            SecAggUnmask)
        assert all(r.message.dropped == ("d",) for r in requests.values())
        for o in survivors:
            clients[o].secure_stage(1, secure[o].unmask(requests[o]), 0)
        sr = run.secure.round
        assert sr is not None and sr.result is not None and sr.result.survivors == survivors
        assert run.round == 2
        enc = setup.config.encoding
        step = max(f.bound for f in enc.fields) / enc.level
        total = sum(examples[o] for o in survivors)
        plain = sum(np.float64(examples[o]) * w[o].astype(np.float64) for o in survivors) / total
        assert np.abs(run.aggregation.half.state()["w"] - plain).max() <= len(survivors) * step / total + 1e-6



def test_too_few_survivors_abandon_the_aggregate_shown_in_status_and_metrics(aggregator: Callable[..., Any]) -> None:
    orgs = ("a", "b", "c", "d")  # k = 3, t = 2: two dropouts after masking leave each survivor one live neighbour
    with joined(aggregator, orgs, 10, (3,), rounds=2, min_clients=2) as j:
        agg, run, w, clients, secure = j.agg, j.run, j.w, j.clients, j.secure
        _, shares = share_keys(clients, secure, orgs)
        for i, o in enumerate(("a", "b")):
            masked = secure[o].mask(shares[o], [ModelWeights({"w": w[o]}, 10)], fedavg.SPEC.summed_upload,
                                    np.random.default_rng([6, i]))
            assert clients[o].push(1, [masked, EvalMetrics(0.5, 10, 0.5)]).accepted
        # At the deadline the mask stage closes, finds too few survivors, and the round closes unmasked.
        with pytest.raises(RemoteError) as err:  # a survivor waiting for its unmask request learns the round closed
            clients["a"].secure_stage(1, None, 30)
        assert err.value.reason == "late"
        assert run.round == 2 and run.aggregation.half.state() == {}  # the half never got a sum
        summary = clients["a"].status()[0].history[0]
        assert summary.round == 1 and summary.secure_abandoned.startswith("below_threshold: abandoned at mask")
        labels = {"run": "r"}
        assert agg.service.metrics.registry.get_sample_value("hetfed_secure_rounds_abandoned_total", labels) == 1



def test_a_member_that_never_comes_is_left_out_at_the_stage_deadline(aggregator: Callable[..., Any]) -> None:
    orgs, absent = ("a", "b", "c"), "d"  # d is in the run but never joins: stage 1 closes without it at its deadline
    with joined(aggregator, orgs, 11, (3,), members=(*orgs, absent)) as j:
        run, w, clients, setup, secure = j.run, j.w, j.clients, j.setup, j.secure
        assert setup.config.roster == (*orgs, absent)
        keys, shares = share_keys(clients, secure, orgs)
        assert all(absent not in {a.sender for a in k.message.peers} for k in keys.values())
        for i, o in enumerate(orgs):
            masked = secure[o].mask(shares[o], [ModelWeights({"w": w[o]}, 10)], fedavg.SPEC.summed_upload,
                                    np.random.default_rng([7, i]))
            assert clients[o].push(1, [masked, EvalMetrics(0.5, 10, 0.5)]).accepted
        requests = payloads(together({o: (lambda o=o: clients[o].secure_stage(1, None, 30)) for o in orgs}),
                            SecAggUnmask)
        for o in orgs:
            clients[o].secure_stage(1, secure[o].unmask(requests[o]), 0)
        assert run.round == 2
        enc = setup.config.encoding
        step = max(f.bound for f in enc.fields) / enc.level
        plain = sum(w[o].astype(np.float64) for o in orgs) / 3
        assert np.abs(run.aggregation.half.state()["w"] - plain).max() <= 3 * step / 30 + 1e-6
