"""The kept push (hetfed.client.pending): what a restarted client resumes, and what it never sends."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hetfed.client.pending import DATA_NAME, RECORD_NAME, PendingPushFile, RoundKey
from hetfed.wire import digest as content
from hetfed.wire.payloads import EvalMetrics
from tests.conftest import run_config

IDENTITY = {"run": "r", "organization": "a", "algorithm": "fedavg", "seed": 3, "model": "mlp"}
KEY = RoundKey(round=2, action="TRAIN", round_seed=77, after=1)
DATA = bytes(range(256)) * 1000
STATE = {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, "momentum": np.array([1.5, -2.0]),
         "round": 2}
EXACT = [EvalMetrics(train_loss=0.25, num_train_examples=90, test_accuracy=0.5, test_loss=1.0, num_test_examples=10,
                     extra={"privacy_epsilon": 1.5}, withheld=("train_loss",))]


def kept(tmp_path: Path, identity: dict[str, object] = IDENTITY) -> PendingPushFile:
    return PendingPushFile(tmp_path, "r", identity)


def save(store: PendingPushFile, data: bytes = DATA, key: RoundKey = KEY) -> None:
    store.save(key, memoryview(data), content.digest(data), STATE, EXACT, {"test_accuracy": 0.5})


def test_a_kept_push_round_trips(tmp_path: Path) -> None:
    save(kept(tmp_path))
    got = kept(tmp_path).take(KEY)
    assert got is not None
    assert bytes(got.data) == DATA and got.digest == content.digest(DATA) and got.key == KEY
    assert isinstance(got.data, memoryview) and got.data.readonly  # a read-only memory map of the file
    assert torch.equal(got.state["model"]["w"], STATE["model"]["w"])  # type: ignore[index]
    np.testing.assert_array_equal(got.state["momentum"], STATE["momentum"])
    assert got.state["round"] == 2
    assert got.exact == EXACT and got.released == {"test_accuracy": 0.5}
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == sorted([DATA_NAME, RECORD_NAME])  # no temporary file left


def test_the_kept_push_is_removed(tmp_path: Path) -> None:
    store = kept(tmp_path)
    save(store)
    store.remove()
    assert list((tmp_path / "r").iterdir()) == []
    assert store.take(KEY) is None
    store.remove()  # nothing kept: nothing to do


@pytest.mark.parametrize(("key", "identity", "why"), [
    (RoundKey(3, "TRAIN", 77, 2), IDENTITY, "it is the push of round 2 (TRAIN, round seed 77, after round 1), and the "
                                            "aggregator asks for round 3 (TRAIN, round seed 77, after round 2)"),
    (RoundKey(2, "TRAIN", 78, 1), IDENTITY, "the aggregator asks for round 2 (TRAIN, round seed 78, after round 1)"),
    (RoundKey(2, "EVALUATE", 77, 1), IDENTITY, "asks for round 2 (EVALUATE,"),
    (RoundKey(2, "TRAIN", 77, 0), IDENTITY, "asks for round 2 (TRAIN, round seed 77, after round 0)"),
    (KEY, {**IDENTITY, "algorithm": "local"}, "it belongs to another run: algorithm 'fedavg' (now 'local')"),
    (KEY, {**IDENTITY, "seed": 4}, "it belongs to another run: seed 3 (now 4)"),
])
def test_a_kept_push_of_another_round_or_run_is_discarded_never_sent(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, key: RoundKey, identity: dict[str, object], why: str) -> None:
    save(kept(tmp_path))
    with caplog.at_level(logging.WARNING, "hetfed.client"):
        assert kept(tmp_path, identity).take(key) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"discarded the kept push in {tmp_path / 'r' / RECORD_NAME}: ") and why in line
    assert line.endswith("; it is not sent")
    assert list((tmp_path / "r").iterdir()) == []


def test_a_record_whose_update_is_cut_short_is_discarded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save(kept(tmp_path))
    with open(tmp_path / "r" / DATA_NAME, "r+b") as f:
        f.truncate(1000)
    with caplog.at_level(logging.WARNING, "hetfed.client"):
        assert kept(tmp_path).take(KEY) is None
    assert f"1000 bytes, the record says {len(DATA)}" in caplog.text
    assert list((tmp_path / "r").iterdir()) == []


def test_a_record_that_cannot_be_read_is_discarded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save(kept(tmp_path))
    (tmp_path / "r" / RECORD_NAME).write_bytes(b"not a record")
    with caplog.at_level(logging.WARNING, "hetfed.client"):
        assert kept(tmp_path).take(KEY) is None
    assert "it cannot be read" in caplog.text
    assert list((tmp_path / "r").iterdir()) == []


SAVE_AND_DIE = """
import sys
from pathlib import Path
from tests.client.test_pending_push import kept, save
save(kept(Path(sys.argv[1])), data=b"new" * 1000)
"""


def test_killed_between_the_update_and_its_record_nothing_is_kept(tmp_path: Path) -> None:
    """SIGKILL at ``pending.update_written`` while a new push is kept over an older one: the older record is gone
    before the new update is written, and the new update has no record, so nothing is resumed, and the update
    without its record is removed."""
    save(kept(tmp_path))
    proc = subprocess.run([sys.executable, "-c", SAVE_AND_DIE, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HETFED_CLIENT_CRASH_AT": "pending.update_written"})
    assert proc.returncode == -9, proc.stderr
    assert not (tmp_path / "r" / RECORD_NAME).exists()
    assert kept(tmp_path).take(KEY) is None
    assert list((tmp_path / "r").iterdir()) == []


def test_a_push_that_cannot_be_kept_is_sent_all_the_same(
        aggregator: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        tmp_path: Path) -> None:
    """A full disk under the state directory: the push is not kept (a restart would train the round again), and
    it goes all the same; the run finishes."""
    from hetfed.client.config import ClientConfig, ModelConfig, RetryConfig
    from hetfed.client.data import DataConfig
    from hetfed.client.runtime import ClientRuntime

    def full(*args: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PendingPushFile, "save", full)
    agg = aggregator(run_config(rounds=1))
    results: dict[str, Any] = {}

    def client(org: str, index: int) -> None:
        cfg = ClientConfig(organization=org, run="r", aggregator=f"127.0.0.1:{agg.port}", threads=1,
                           data=DataConfig(dataset="digits", partition="iid", num_clients=2, client_index=index),
                           model=ModelConfig(name="mlp"), state_dir=str(tmp_path / org), keep_push_from_bytes=0,
                           retry=RetryConfig(initial_backoff_seconds=0.05, max_backoff_seconds=0.5))
        try:
            results[org] = ClientRuntime(cfg).run()
        except Exception as exc:  # reported by the assertion below
            results[org] = exc

    with caplog.at_level(logging.WARNING, "hetfed.client"):
        threads = [threading.Thread(target=client, args=(org, i)) for i, org in enumerate("ab")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not [r for r in results.values() if isinstance(r, Exception)], results
    assert {org: [r for r, _ in reports] for org, reports in results.items()} == {"a": [1, 2], "b": [1, 2]}
    assert agg.service.runs["r"].status().finished
    assert f"a: the push of round 1 could not be kept in {tmp_path / 'a' / 'r'} ([Errno 28] No space left on " \
           "device); it is sent unkept" in caplog.text
