"""A secure round across an aggregator restart (in process, real gRPC; the clients driven by hand with
``SecureClient``, seeded). The stage log (``secure.log``) and the update log rebuild the open round's coordinator:
at every stage boundary and mid-stage, each organization gets, byte for byte, what it got before the restart,
and the round ends with the same model as the uninterrupted one. Where resuming could reveal more (the logs
disagree), the round's aggregate is abandoned before anything more is given out, and the round closes by itself
with the model unchanged; so does a round abandoned at stage 1."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetfed import secagg
from hetfed.aggregator.journal.stages import StageKind, scan_stages
from hetfed.aggregator.run.secure_stages import outbox_digest
from hetfed.client.secure import SecureClient
from hetfed.wire import codec
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
from hetfed.wire.rpc import AggregatorClient, RemoteError
from hetfed.wire.specs import fedavg
from tests.conftest import run_config, wait_until

ORGS = ("a", "b", "c")
EXAMPLES = {"a": 10, "b": 20, "c": 30, "d": 40}
W = {o: np.random.default_rng(21).normal(0, 0.5, (2, 3)).astype(np.float32) * (i + 1) for i, o in enumerate("abcd")}
# After how many of the twelve steps (three adverts, three shared keys, three pushes, three unmask replies) the
# aggregator restarts, and the stage it is then in.
CUTS = {"advertise, mid-stage": 1, "share_keys, at its start": 3, "share_keys, mid-stage": 4,
        "mask, at its start": 6, "mask, mid-stage": 7, "unmask, at its start": 9, "unmask, mid-stage": 10}


def _bytes(p: Payload | None) -> bytes:
    return b"" if p is None else codec.payload_to_bytes(p)


class Federation:
    """Three organizations' clients of one aggregator, which a test may restart on the same state directory."""

    def __init__(self, aggregator: Callable[..., Any], state_dir: Path, orgs: tuple[str, ...] = ORGS,
                 **cfg: Any) -> None:
        self.orgs = orgs
        self.start = functools.partial(aggregator, run_config(organizations=list(orgs), rounds=1,
                                                              secure_aggregation=True, **cfg), state_dir=str(state_dir))
        self.agg = self.start()
        self.clients = self._connect()
        for o, c in self.clients.items():
            c.join(declared=[DeclaredTensor.of(PayloadKind.MODEL_WEIGHTS, "w", W[o])])
        setup = self.ask("a")
        assert isinstance(setup, SecAggSetup)
        self.secure = {o: SecureClient(setup, o, secagg.SeededEntropy(o)) for o in orgs}
        self.got: dict[str, Payload | None] = {}  # what each organization was last given

    def _connect(self) -> dict[str, AggregatorClient]:
        return {o: AggregatorClient(f"127.0.0.1:{self.agg.port}", None, o, "r") for o in self.orgs}

    @property
    def run(self) -> Any:
        return self.agg.service.runs["r"]

    def ask(self, org: str) -> Payload | None:
        return self.clients[org].secure_stage(1, None, 0).payload

    def seen(self) -> dict[str, tuple[str, bytes, str]]:
        """What each organization is given now: the stage, the message's bytes, the abandonment."""
        out = {}
        for o, c in self.clients.items():
            r = c.secure_stage(1, None, 0)
            out[o] = (r.stage, _bytes(r.payload), r.abandoned)
        return out

    def restart(self) -> None:
        for c in self.clients.values():
            c.close()
        self.agg.stop(grace=0.5)
        self.agg = self.start()
        self.clients = self._connect()

    def step(self, i: int) -> None:
        """The i-th step of 4n (n adverts, n shared keys, n pushes, n unmask replies); each organization works
        from what it was last given."""
        n = len(self.orgs)
        o = self.orgs[i % n]
        c, s = self.clients[o], self.secure[o]
        if i < n:
            c.secure_stage(1, s.advertise(), 0)
        elif i < 2 * n:
            keys = self.ask(o)
            assert isinstance(keys, SecAggPeerKeys)
            self.got[o] = keys
            c.secure_stage(1, s.share(keys), 0)
        elif i < 3 * n:
            shares = self.ask(o)
            assert isinstance(shares, SecAggPeerShares)
            masked = s.mask(shares, [ModelWeights({"w": W[o]}, EXAMPLES[o])], fedavg.SPEC.summed_upload,
                            np.random.default_rng([5, i]))
            assert c.push(1, [masked, EvalMetrics(0.5, EXAMPLES[o], 0.5)]).accepted
        else:
            request = self.ask(o)
            assert isinstance(request, SecAggUnmask)
            c.secure_stage(1, s.unmask(request), 0)

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


def _model(aggregator: Callable[..., Any], state_dir: Path, cut: int | None) -> tuple[np.ndarray, list[str]]:
    fed = Federation(aggregator, state_dir)
    stages = []
    try:
        for i in range(12):
            if i == cut:
                before, digest = fed.seen(), outbox_digest(fed.run.secure.round)
                fed.restart()
                sr = fed.run.secure.round
                assert sr is not None and outbox_digest(sr) == digest
                assert fed.seen() == before  # byte for byte, nothing new revealed
                stages.append(sr.stage)
            fed.step(i)
        assert fed.run.round == 2 and fed.run.status().history[0].secure_abandoned == ""
        return fed.run.aggregation.half.state()["w"], stages
    finally:
        fed.close()


@pytest.mark.parametrize("cut", CUTS)
def test_a_restart_resumes_the_round_byte_for_byte(aggregator: Callable[..., Any], tmp_path: Path, cut: str) -> None:
    uninterrupted, _ = _model(aggregator, tmp_path / "once", None)
    resumed, stages = _model(aggregator, tmp_path / "restarted", CUTS[cut])
    assert stages == [cut.split(",")[0]]
    np.testing.assert_array_equal(resumed, uninterrupted)
    plain = sum(np.float64(EXAMPLES[o]) * W[o].astype(np.float64) for o in ORGS) / 60.0
    assert np.abs(resumed - plain).max() < 1e-3  # FedAvg's weighted mean, within the quantization


def test_a_close_cut_short_in_the_stage_log_is_made_again_alike(aggregator: Callable[..., Any],
                                                                 tmp_path: Path) -> None:
    # The advertise close's record is the log's last; cut short (the process died while appending it), it is cut
    # off at start-up, and the stage, whose every advert is logged, closes again with the same keys for each.
    fed = Federation(aggregator, tmp_path / "state")
    try:
        for i in range(3):
            fed.step(i)
        before = fed.seen()
        assert {stage for stage, _, _ in before.values()} == {"share_keys"}
        fed.agg.stop(grace=0.5)
        log = tmp_path / "state" / "r" / "secure.log"
        log.write_bytes(log.read_bytes()[:-5])
        fed.restart()
        assert fed.seen() == before
        assert [r.kind for r in scan_stages(log.read_bytes()).records][-1] is StageKind.CLOSE
        for i in range(3, 12):
            fed.step(i)
        assert fed.run.round == 2 and fed.run.status().history[0].secure_abandoned == ""
    finally:
        fed.close()


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _abandoned_alone(fed: Federation, why: str) -> None:
    """The round closed by itself, its aggregate abandoned for ``why``, the model unchanged (none yet)."""
    run = fed.run
    assert run.round == 2, run.status()
    summary = run.status().history[0]
    assert summary.round == 1 and why in summary.secure_abandoned, summary.secure_abandoned
    assert run.aggregation.half.state() == {}
    labels = {"run": "r"}
    assert fed.agg.service.metrics.registry.get_sample_value("hetfed_secure_rounds_abandoned_total", labels) == 1


def test_a_damaged_stage_log_abandons_the_round(aggregator: Callable[..., Any], tmp_path: Path) -> None:
    fed = Federation(aggregator, tmp_path / "state")
    try:
        for i in range(7):
            fed.step(i)
        log = tmp_path / "state" / "r" / "secure.log"
        scan = scan_stages(log.read_bytes())
        assert [r.kind for r in scan.records] == [StageKind.OPEN, *[StageKind.MESSAGE] * 3, StageKind.CLOSE,
                                                  *[StageKind.MESSAGE] * 3, StageKind.CLOSE]
        fed.agg.stop(grace=0.5)
        _flip(log, log.stat().st_size // 3)  # mid-file: a record before the end fails its digest
        fed.restart()
        _abandoned_alone(fed, "the stage log is damaged")
    finally:
        fed.close()


def test_a_masked_input_lost_after_the_mask_close_abandons_before_any_share(aggregator: Callable[..., Any],
                                                                           tmp_path: Path) -> None:
    # Four organizations (k = 3, t = 2). After the unmask requests went out (each asks for a's self-mask seed
    # share), a's masked input is lost from the update log. Resuming would close the mask stage without a and
    # ask b, c and d for a's mask key shares instead: with those and the seed shares of any who answered the
    # first request, both of a's secrets. The replayed close differs from the logged one: the round is abandoned.
    orgs = ("a", "b", "c", "d")
    fed = Federation(aggregator, tmp_path / "state", orgs)
    try:
        for i in range(12):
            fed.step(i)
        requests = {o: fed.ask(o) for o in orgs}
        assert all(isinstance(r, SecAggUnmask) and r.message.dropped == () for r in requests.values())
        fed.agg.stop(grace=0.5)
        wal = tmp_path / "state" / "r" / "updates.wal"
        blob = wal.read_bytes()
        _flip(wal, blob.index(b"a", blob.index(b"HFR3")) + 200)  # inside a's logged update
        fed.restart()
        _abandoned_alone(fed, "could not resume it: the replayed close")
        with pytest.raises(RemoteError) as err:  # nothing more is given out for round 1
            fed.clients["b"].secure_stage(1, None, 0)
        assert err.value.reason == "late"
    finally:
        fed.close()


def test_a_round_abandoned_at_stage_one_closes_by_itself(aggregator: Callable[..., Any], tmp_path: Path) -> None:
    fed = Federation(aggregator, tmp_path / "state", min_clients=1, round_deadline_seconds=1.0)
    try:
        fed.step(0)  # only a advertises: at the stage's deadline, nobody has t = 2 live neighbours
        wait_until(lambda: fed.run.round == 2, timeout=30, what="the abandoned round to close")
        _abandoned_alone(fed, "below_threshold: abandoned at advertise")
        with pytest.raises(RemoteError) as err:  # b's advert comes too late: the round is over
            fed.clients["b"].secure_stage(1, fed.secure["b"].advertise(), 0)
        assert err.value.reason == "late"
    finally:
        fed.close()
