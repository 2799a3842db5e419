"""Patient-level privacy end to end (docs/privacy.md#patient-level-privacy): a real aggregator and two real client
processes whose npz data carry a group id per example train FedAvg under ``privacy.unit = "group"``; the ledger
counts the group count's release and every step at the group sampling rate q = B/Ĝ (batch_size in groups) with
δ = 1/Ĝ², and every upload declares that δ."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hetfed.cli.localrun import LocalFederation, LocalRunOptions, aggregator_config, client_config
from hetfed.client.privacy.ledger import FILE_NAME, Release, epsilon_of
from hetfed.wire.messages import RunStatus
from tests.conftest import wait_until

pytestmark = pytest.mark.e2e

N, G, BATCH, STEPS, ROUNDS, SIGMA = 120, 30, 3, 3, 2, 1.2


def write_npz(path: Path, seed: int) -> None:
    """120 examples of 60 features and 10 classes, 30 patients of 4 examples (train.npz's ``group``)."""
    rng = np.random.default_rng(seed)
    path.mkdir()
    np.savez(path / "train.npz", x=rng.normal(size=(N, 60)).astype(np.float32), y=np.arange(N) % 10,
             group=np.repeat(np.arange(G), N // G))
    np.savez(path / "test.npz", x=rng.normal(size=(20, 60)).astype(np.float32), y=np.arange(20) % 10)


def finished(fed: LocalFederation) -> RunStatus | None:
    """The run's status once it finished; fails at once when a client exited with an error."""
    for name, proc in fed.clients.items():
        if proc.poll() not in (None, 0):
            pytest.fail(f"{name} exited with {proc.poll()}:\n{fed.log_tail(name)}")
    status = next(s for s in fed.status() if s.run_id == "fedavg")
    return status if status.finished else None


def test_fedavg_under_group_privacy_accounts_at_the_group_rate(tmp_path: Path) -> None:
    opts = LocalRunOptions(algorithms=("fedavg",), clients=2, rounds=ROUNDS, dataset="synthetic",
                           data={"synthetic_samples": 200}, train={"batch_size": BATCH}, quiet=True,
                           privacy={"noise_multiplier": SIGMA, "unit": "group", "max_examples_per_group": 4},
                           extra_algorithm_config={"fedavg": {"local_steps": STEPS}})
    fed = LocalFederation(tmp_path)
    try:
        fed.start_aggregator(aggregator_config(opts, str(tmp_path / "state")))
        for i in range(2):
            write_npz(tmp_path / f"data-{i}", i)
            cfg = client_config(opts, "fedavg", i, fed.port)
            cfg["data"] = {"dataset": "npz", "partition": "natural", "path": str(tmp_path / f"data-{i}")}
            cfg["state_dir"] = str(tmp_path / f"org-{i}-state")
            fed.start_client(f"org-{i}", cfg)
        status = wait_until(lambda: finished(fed), timeout=180, what="the run to finish")
        fed.wait_clients(timeout=60)
        codes = {n: p.poll() for n, p in fed.clients.items()}
    finally:
        fed.stop()
    assert codes == {"org-0": 0, "org-1": 0}, status
    for i in range(2):
        ledger = json.loads((tmp_path / f"org-{i}-state" / "fedavg" / FILE_NAME).read_text())
        g_hat = ledger["released"]["groups"]  # the released group count; no example count is released
        assert set(ledger["released"]) == {"groups"} and ledger["identity"]["unit"] == "group"
        q = BATCH / g_hat  # 3 patients per batch in expectation
        want = epsilon_of([Release(1.0, 20.0), Release(q, SIGMA, STEPS * ROUNDS)], 1 / g_hat**2)
        assert ledger["identity"]["delta"] == 1 / g_hat**2
        assert sorted(ledger["releases"]) == sorted([[1.0, 20.0, 1], [q, SIGMA, STEPS * ROUNDS]])
        assert ledger["epsilon"] == pytest.approx(want, rel=1e-12)
        org = next(o for o in status.organization_status if o.organization == f"org-{i}")
        assert org.privacy_epsilon == pytest.approx(want, rel=1e-12)
