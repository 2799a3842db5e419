"""Fed-CMA under `[privacy]` and secure aggregation with distributed DP, end to end over real processes
(`hetfed run --secure-aggregation --set privacy.epsilon_budget=3 --set fedcma_paper.ddp_epsilon=1.5`), beside the
same seeded run under `[privacy]` alone (the local Gaussian class sums). At the same budget the distributed run
reaches at least the local run's accuracy (each organization adds half the noise of its class sums, t = 2 of 3);
no class means, counts or head cross the wire in a training round; each organization's ledger holds one distributed
release per round with t of n and the ring, and the ε it reports is the accountant's composition of its ledger."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hetfed.client.privacy.ledger import FILE_NAME, DistributedRelease, Release, epsilon_with_distributed

pytestmark = pytest.mark.e2e
CLIENTS, ROUNDS, BUDGET = 3, 3, 3.0
STAGES_UP = {"secagg_key_advert", "secagg_shared_keys", "secagg_masked_input", "secagg_unmask"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], Path]]:
    """The two seeded federations, run side by side (each its own aggregator and clients)."""
    base = [sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "fedcma_paper", "--dataset", "mnist5k",
            "--clients", str(CLIENTS), "--rounds", str(ROUNDS), "--set", f"privacy.epsilon_budget={BUDGET}"]
    extra = {"local": [], "distributed": ["--secure-aggregation", "--set", "fedcma_paper.ddp_epsilon=1.5"]}
    where = {name: tmp_path_factory.mktemp(name) / "out" for name in extra}
    procs = {name: subprocess.Popen([*base, *extra[name], "--output", str(where[name])], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for name in extra}
    out = {}
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, log
        (summary,) = json.loads((where[name] / "results.json").read_text())["runs"]
        out[name] = (summary, where[name])
    return out


def test_the_distributed_run_reaches_at_least_the_local_runs_accuracy(runs: dict[str, Any]) -> None:
    """Seed 0, measured: 0.280 against 0.271 (own-test accuracy, each organization's own record)."""
    local, distributed = runs["local"][0], runs["distributed"][0]
    assert local["privacy"]["epsilon_max"] <= BUDGET and distributed["privacy"]["epsilon_max"] <= BUDGET
    assert distributed["own_final_test_accuracy"] >= local["own_final_test_accuracy"]


def test_no_class_means_counts_or_head_go_up_in_a_training_round(runs: dict[str, Any]) -> None:
    setup, *train, _ = runs["distributed"][0]["rounds"]
    assert set(setup["bytes_up"]) == {"class_counts", "envelope"}  # the setup counts, released (Gaussian)
    assert len(train) == ROUNDS
    for r in train:  # a survivor's unmask reply that lands after the round's deadline counts in no round
        assert "secagg_masked_input" in r["bytes_up"]
        assert set(r["bytes_up"]) <= STAGES_UP | {"eval_metrics", "envelope"}


def test_each_ledger_holds_one_distributed_release_per_round_and_reports_its_composition(
        runs: dict[str, Any]) -> None:
    summary, out = runs["distributed"]
    ledgers = sorted((out / "client-state").glob(f"*/*/{FILE_NAME}"))
    assert len(ledgers) == CLIENTS
    for path in ledgers:
        raw = json.loads(path.read_text())
        (kept,) = [DistributedRelease(**d) for d in raw["distributed"]]
        assert (kept.count, kept.honest, kept.clients, kept.ring_bits) == (ROUNDS, 2, CLIENTS, 32)
        releases = [Release(q, s, c) for q, s, c in raw["releases"]]
        eps = epsilon_with_distributed(releases, [kept], raw["identity"]["delta"])
        assert eps == pytest.approx(raw["epsilon"], rel=1e-12) and eps <= BUDGET
        organization = path.parent.parent.name
        assert summary["privacy"]["organizations"][organization]["epsilon"] == pytest.approx(eps, rel=1e-12)
        assert sorted(int(r) for r in raw["rounds"]) == list(range(ROUNDS + 2))  # setup, rounds, evaluation


def test_fedavg_under_privacy_and_secure_aggregation_keeps_its_local_noise(tmp_path: Path) -> None:
    """FedAvg has no distributed plan: under `[privacy]` and secure aggregation its weights carry DP-SGD's full
    local noise, its ledger holds no distributed release, and the run goes through with the weights masked."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "fedavg", "--dataset", "mnist5k",
                           "--clients", "3", "--rounds", "1", "--secure-aggregation", "--set",
                           f"privacy.epsilon_budget={BUDGET}", "--output", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (summary,) = json.loads((out / "results.json").read_text())["runs"]
    assert 0 < summary["privacy"]["epsilon_max"] <= BUDGET
    (train,) = summary["rounds"][:-1]  # no setup round: round 1 and the evaluation
    assert "secagg_masked_input" in train["bytes_up"] and "model_weights" not in train["bytes_up"]
    for path in (out / "client-state").glob(f"*/*/{FILE_NAME}"):
        raw = json.loads(path.read_text())
        assert raw["distributed"] == [] and raw["epsilon"] <= BUDGET
