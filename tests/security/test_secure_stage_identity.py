"""Under mTLS a secure aggregation stage message is bound to the caller's certificate: org-b, holding its own
valid certificate, cannot advertise keys, share keys or push a masked input in org-a's name (``identity_mismatch``,
counted), while org-a's own messages, and org-b's own, go through and the round unmasks to the weighted mean."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetfed import secagg
from hetfed.cli.certs import FederationCerts
from hetfed.client.secure import SecureClient
from hetfed.wire.config import to_mapping
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

from .conftest import RUN, RUN_ORGS, rejected

A, B = RUN_ORGS
EXAMPLES = {A: 10, B: 30}


def _together(calls: dict[str, Callable[[], SecureStageReply]], cls: type) -> dict[str, Any]:
    """Both organizations' stage calls at once (a stage closes when both sent); each one's reply payload."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {o: pool.submit(call) for o, call in calls.items()}
        out = {o: f.result(timeout=60).payload for o, f in futures.items()}
    assert all(isinstance(p, cls) for p in out.values()), out
    return out


def _refused(agg: Any, call: Callable[[], object]) -> None:
    """``call`` is refused with identity_mismatch, and the refusal counted once."""
    before = rejected(agg, "identity_mismatch")
    with pytest.raises(RemoteError) as err:
        call()
    assert err.value.reason == "identity_mismatch", err.value
    assert rejected(agg, "identity_mismatch") == before + 1


def _logged(state_dir: Path) -> dict[str, int]:
    """The size of each write-ahead log of the aggregator's state directory."""
    return {str(f.relative_to(state_dir)): f.stat().st_size for f in state_dir.rglob("*.wal")}


def test_a_stage_message_naming_another_organization_is_refused(aggregator: Callable[..., Any],
                                                                  certs: FederationCerts, tmp_path: Path) -> None:
    state_dir = tmp_path / "state"  # the aggregator fixture's
    agg = aggregator(run_config(id=RUN, organizations=list(RUN_ORGS), rounds=1, secure_aggregation=True),
                     tls=to_mapping(certs.aggregator_tls()))
    rng = np.random.default_rng(5)
    w = {o: rng.normal(0, 0.5, (2, 3)).astype(np.float32) for o in RUN_ORGS}
    # Each client dials with its own organization's certificate; the aggregator reads who it is from it.
    clients = {o: AggregatorClient(f"127.0.0.1:{agg.port}", certs.client_tls(o), o, RUN) for o in RUN_ORGS}
    try:
        for o, c in clients.items():
            c.join(declared=[DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, "w", w[o])])
        setup = clients[A].secure_stage(1, None, 0).payload
        assert isinstance(setup, SecAggSetup) and setup.config.roster == RUN_ORGS
        secure = {o: SecureClient(setup, o, secagg.SeededEntropy(o)) for o in RUN_ORGS}

        # Stage 1: org-b sends a key advert in org-a's name, its own keys or a copy of org-a's.
        forged = SecureClient(setup, A, secagg.SeededEntropy("org-b's forgery")).advertise()
        adverts = {o: secure[o].advertise() for o in RUN_ORGS}
        _refused(agg, lambda: clients[B].secure_stage(1, forged, 0))
        _refused(agg, lambda: clients[B].secure_stage(1, adverts[A], 0))
        keys = _together({o: (lambda o=o: clients[o].secure_stage(1, adverts[o], 30)) for o in RUN_ORGS},
                         SecAggPeerKeys)
        # The keys org-b receives are org-a's own, not the forgery's.
        assert [p.sender for p in keys[B].message.peers] == [A]
        assert keys[B].message.peers[0] == adverts[A].message

        # Stage 2: shared keys in org-a's name.
        shared = {o: secure[o].share(keys[o]) for o in RUN_ORGS}
        _refused(agg, lambda: clients[B].secure_stage(1, shared[A], 0))
        shares = _together({o: (lambda o=o: clients[o].secure_stage(1, shared[o], 30)) for o in RUN_ORGS},
                           SecAggPeerShares)

        # Stage 3: org-a's masked input pushed by org-b is refused; each one's own is accepted.
        uploads: dict[str, list[Payload]] = {o: [ModelWeights({"w": w[o]}, EXAMPLES[o])] for o in RUN_ORGS}
        masked = {o: secure[o].mask(shares[o], uploads[o], fedavg.SPEC.summed_upload, np.random.default_rng([9, i]))
                  for i, o in enumerate(RUN_ORGS)}
        logged = _logged(state_dir)
        assert logged
        _refused(agg, lambda: clients[B].push(1, [masked[A], EvalMetrics(0.5, EXAMPLES[B], 0.5)]))
        assert _logged(state_dir) == logged  # refused before the write-ahead log took it
        for o in RUN_ORGS:
            assert clients[o].push(1, [masked[o], EvalMetrics(0.5, EXAMPLES[o], 0.5)]).accepted

        # Stage 4: an unmask answer in org-a's name is refused too; the own answers close the round.
        requests = {o: clients[o].secure_stage(1, None, 0).payload for o in RUN_ORGS}
        assert all(isinstance(r, SecAggUnmask) for r in requests.values())
        answers = {o: secure[o].unmask(requests[o]) for o in RUN_ORGS}  # type: ignore[arg-type]
        _refused(agg, lambda: clients[B].secure_stage(1, answers[A], 0))
        for o in RUN_ORGS:
            assert clients[o].secure_stage(1, answers[o], 0).payload is None
        run = agg.service.runs[RUN]
        assert run.round == 2 and run.secure.round is not None and run.secure.round.result is not None
        assert run.secure.round.result.survivors == RUN_ORGS
        enc = setup.config.encoding
        step = max(f.bound for f in enc.fields) / enc.level
        total = sum(EXAMPLES.values())
        plain = sum(np.float64(EXAMPLES[o]) * w[o].astype(np.float64) for o in RUN_ORGS) / total
        assert np.abs(run.aggregation.half.state()["w"] - plain).max() <= len(RUN_ORGS) * step / total + 1e-6
    finally:
        for c in clients.values():
            c.close()
