"""Fed-CMA under secure aggregation end to end: `hetfed run --algorithm fedcma --secure-aggregation` over real
processes reaches the plain run's accuracy within the quantization's error, no organization's class means or head
cross the wire (its setup counts still do, in plain), and a client process killed after masking is recovered."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetfed.wire.traffic import Direction
from tests.conftest import run_config
from tests.e2e.runs import digits_clients

pytestmark = pytest.mark.e2e
CLIENTS, ROUNDS = 3, 2
STAGES_UP = {"secagg_key_advert", "secagg_shared_keys", "secagg_masked_input", "secagg_unmask"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The same seeded run, plain and under secure aggregation (both at once: each has its own ports)."""
    started = {}
    for name, extra in (("plain", ()), ("secure", ("--secure-aggregation",))):
        where = tmp_path_factory.mktemp(name) / "out"
        proc = subprocess.Popen(
            [sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "fedcma", "--dataset", "mnist5k",
             "--clients", str(CLIENTS), "--rounds", str(ROUNDS), "--output", str(where), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started[name] = (proc, where)
    out: dict[str, dict[str, Any]] = {}
    try:
        for name, (proc, where) in started.items():
            log, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0, log
            (out[name],) = json.loads((where / "results.json").read_text())["runs"]
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def test_the_secure_run_reaches_the_plain_runs_accuracy(runs: dict[str, dict[str, Any]]) -> None:
    """ē and v̄ differ from the plain run's by at most survivors × the encoding's step over the summed weights
    (about 10^-6 here: tests/aggregator/test_secure_fedcma.py), far below any test example's margin, so the
    accuracies agree to a few test examples; measured equal (seed 0: 0.365 and 0.3275 with v̄, both runs)."""
    plain, secure = runs["plain"], runs["secure"]
    assert [r["clients"] for r in secure["rounds"]] == [CLIENTS] * (ROUNDS + 2)  # setup, 2 rounds, evaluate
    assert secure["final_test_accuracy"] > 0.25  # chance is 0.1
    assert abs(secure["final_test_accuracy"] - plain["final_test_accuracy"]) <= 0.02
    # The encoders scored with the global head v̄ that the secure sums built.
    assert abs(secure["final_figures"]["global_head"] - plain["final_figures"]["global_head"]) <= 0.02


def test_no_class_means_or_head_go_up(runs: dict[str, dict[str, Any]]) -> None:
    setup, *train, evaluate = runs["secure"]["rounds"]
    assert set(setup["bytes_up"]) == {"class_counts", "envelope"}  # the setup counts still go up in plain
    for r in train:
        assert set(r["bytes_up"]) == STAGES_UP | {"eval_metrics", "envelope"}
        assert {"secagg_setup", "secagg_peer_keys", "secagg_peer_shares", "secagg_unmask"} <= set(r["bytes_down"])
    assert set(evaluate["bytes_up"]) == {"eval_metrics", "envelope"}
    plain_train = runs["plain"]["rounds"][1:-1]
    assert all({"class_mean_embeddings", "head_weights"} <= set(r["bytes_up"]) for r in plain_train)


def test_a_fedcma_client_killed_after_masking_is_recovered(aggregator: Callable[..., Any], tmp_path: Path) -> None:
    """Four real client processes (k = 3, t = 2); d is killed (SIGKILL) after it shared its keys and masked its
    class means and head, before the masked input left. At the deadline the round unmasks the other three's sums
    with d's rebuilt key: ē and v̄ move to the survivors' weighted means, and the run finishes without d."""
    orgs = ("a", "b", "c", "d")
    config = {"latent_dim": 8, "local_steps": 5}
    agg = aggregator(run_config(algorithm="fedcma", algorithm_config=config, organizations=list(orgs), rounds=1,
                                min_clients=3, round_deadline_seconds=8, secure_aggregation=True))
    with digits_clients(tmp_path, f"127.0.0.1:{agg.port}", orgs, "mlp", crash={"d": "secure.masked"}) as procs:
        codes = {org: p.wait(timeout=240) for org, p in procs.items()}
    logs = {org: (tmp_path / f"{org}.log").read_text() for org in orgs}
    assert codes == {"a": 0, "b": 0, "c": 0, "d": -signal.SIGKILL}, logs
    run = agg.service.runs["r"]
    status = run.status()
    assert status.phase.value == "finished"
    setup, train = status.history[:2]
    assert setup.round == 0 and set(setup.bytes(Direction.UP)) == {"class_counts", "envelope"}
    assert train.round == 1 and train.clients == 3 and train.secure_abandoned == ""
    sr = run.secure.round
    assert sr is not None and sr.result is not None and sr.result.survivors == ("a", "b", "c")
    state = run.aggregation.half.state()
    assert state["present"].all() and np.abs(state["means"]).sum() > 0  # ē set from the survivors' sums
    up = train.bytes(Direction.UP)
    assert "secagg_masked_input" in up and not {"class_mean_embeddings", "head_weights"} & set(up)
