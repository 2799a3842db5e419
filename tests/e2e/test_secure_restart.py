"""A secure run survives the aggregator's death in each stage of a round: a real ``hetfed aggregator`` process
and three real ``hetfed client`` processes (FedAvg, digits, a one-layer model, four rounds). The aggregator dies
once per round, each time in another stage: SIGKILL in round 1's mask stage (the process held there by
``HETFED_DELAY_AT`` until the test sees the first masked push in the update log), then at a crash point
(``HETFED_CRASH_AT``: ``os._exit``, no cleanup) mid-advertise in round 2, mid-share_keys in round 3 and
mid-unmask in round 4. Each time it is started again on the same state directory and the clients (their keys in
memory) go on. The run ends with every round aggregated and the same final model as the uninterrupted run's,
bit for bit (the unmasked sum is exact, the clients' training is seeded)."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest

from hetfed.aggregator.journal.crashpoints import EXIT_CODE
from hetfed.v1 import aggregator_pb2 as apb
from tests.conftest import RawClient, load_benchmark, run_config, wait_until
from tests.e2e.runs import digits_clients

faults = load_benchmark("faults")
pytestmark = pytest.mark.e2e
ORGS, ROUNDS = ("a", "b", "c"), 4
WAL_HEADER = 24  # updates.wal's file header: magic, key, CRC
# Each process after the first dies at the n-th record it appends to the stage log. A round with three
# organizations appends three adverts, the advertise close, three shared keys, the share_keys close, the mask
# close and three unmask replies (the masked inputs ride on PushUpdate); a retried message is not appended.
CRASHES = (
    # Started in round 1's mask stage: its close and three replies (4), then round 2's first advert.
    "stages.appended:5",
    # Started in round 2's advertise stage, one advert logged: 2 + 1 + 3 + 1 + 1 + 3 = 11 in round 2, then round
    # 3's three adverts, its close and its first shared keys.
    "stages.appended:16",
    # Started in round 3's share_keys stage, one shared keys logged: 2 + 1 + 1 + 3 = 7 in round 3, then round 4's
    # three adverts, close, three shared keys, close, mask close and first unmask reply.
    "stages.appended:17",
)
RESUMED = ["1 resumed at mask", "2 resumed at advertise", "3 resumed at share_keys", "4 resumed at unmask"]


def _logged_an_update(state: Path) -> bool:
    wal = state / "r" / "updates.wal"
    return wal.exists() and wal.stat().st_size > WAL_HEADER


def _federation(tmp_path: Path, kill: bool) -> tuple[dict[str, np.ndarray], apb.RunStatus, list[str]]:
    """Run the federation, the aggregator killed in each stage (``kill``) or never; the final model, the run's
    Status and, per restart, the round and stage it resumed at."""
    tmp_path.mkdir()
    agg = faults.AggregatorProcess(tmp_path, [run_config(organizations=list(ORGS), rounds=ROUNDS, min_clients=3,
                                                         round_deadline_seconds=60, secure_aggregation=True)])
    assert agg.start(delay_at="push.acknowledged:30" if kill else "") == ""
    try:
        with digits_clients(tmp_path, agg.address, ORGS, "mlp1") as procs:
            if kill:
                wait_until(lambda: _logged_an_update(agg.state_dir), timeout=300, what="a masked push to be logged")
                agg.kill()
                assert agg.exited() == -signal.SIGKILL
                for crash_at in CRASHES:
                    assert agg.start(crash_at=crash_at) == ""
                    wait_until(lambda: agg.exited() is not None, timeout=300, what=f"the aggregator to die at {crash_at}")
                    assert agg.exited() == EXIT_CODE, agg.log_tail()
                assert agg.start() == ""
            codes = {org: p.wait(timeout=300) for org, p in procs.items()}
            logs = {org: (tmp_path / f"{org}.log").read_text()[-2000:] for org in ORGS}
            assert codes == dict.fromkeys(ORGS, 0), logs
            raw = RawClient(agg.port, "a")
            try:
                status = raw.stub.Status(apb.StatusRequest(run_id="r"), timeout=10).runs[0]
            finally:
                raw.close()
    finally:
        agg.kill()
    with np.load(tmp_path / "state" / "r" / "checkpoint.npz") as z:
        model = {k: z[k] for k in z.files if k != "meta"}  # the server half's arrays (meta: the run's state)
    resumed = [line.split("secure round ")[1].split(" from ")[0]
               for n in range(1, agg.starts + 1) for line in (tmp_path / f"aggregator-{n}.log").read_text().splitlines()
               if "secure round" in line and "resumed at " in line]
    return model, status, resumed


def test_the_aggregator_killed_in_each_stage_resumes_the_round(tmp_path: Path) -> None:
    uninterrupted, status, resumed = _federation(tmp_path / "once", kill=False)
    assert status.state == apb.RUN_STATE_FINISHED and resumed == []
    model, status, resumed = _federation(tmp_path / "killed", kill=True)
    assert resumed == RESUMED
    assert status.state == apb.RUN_STATE_FINISHED
    train = [(h.round, h.clients, h.secure_abandoned) for h in status.history if h.round <= ROUNDS]
    assert train == [(r, 3, "") for r in range(1, ROUNDS + 1)]
    assert model.keys() == uninterrupted.keys()
    for name in model:
        np.testing.assert_array_equal(model[name], uninterrupted[name], err_msg=name)
