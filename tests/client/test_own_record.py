"""The organization's own record (``own-figures.json``): its exact figures by round, rewritten atomically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetfed.client import own_record
from hetfed.client.own_record import OWN_FIGURES, OwnRecord, entry_at, read_own_record
from hetfed.wire.payloads import EvalMetrics


def _metrics(acc: float, n_train: int = 7) -> EvalMetrics:
    return EvalMetrics(train_loss=0.75, num_train_examples=n_train, test_accuracy=acc, test_loss=1.25,
                       num_test_examples=40, extra={"evaluated_round": 1.0, "privacy_epsilon": 0.5})


def _entry(round_: int, acc: float) -> dict[str, object]:
    return {"round": round_, "train_loss": 0.75, "test_accuracy": acc, "test_loss": 1.25, "num_test_examples": 40,
            "num_train_examples": 160, "extra": {"evaluated_round": 1.0, "privacy_epsilon": 0.5}}


def test_each_round_is_written_with_the_true_training_count(tmp_path: Path) -> None:
    record = OwnRecord(tmp_path / "out", "org-0", "fedavg")
    path = tmp_path / "out" / OWN_FIGURES
    assert json.loads(path.read_text()) == {"organization": "org-0", "run": "fedavg", "rounds": []}
    record.record(1, [_metrics(0.25)], 160)  # the report declared N̂ = 7; the record keeps the true 160
    record.record(2, [_metrics(0.5)], 160)
    assert json.loads(path.read_text()) == {"organization": "org-0", "run": "fedavg",
                                            "rounds": [_entry(1, 0.25), _entry(2, 0.5)]}
    record.record(2, [_metrics(0.625)], 160)  # a round done again replaces its figures
    assert read_own_record(path) == {"organization": "org-0", "run": "fedavg",
                                     "rounds": [_entry(1, 0.25), _entry(2, 0.625)]}
    assert [p.name for p in path.parent.iterdir()] == [OWN_FIGURES]  # no temporary file left behind
    record_read = read_own_record(path)
    assert record_read is not None
    assert entry_at(record_read, 2) == _entry(2, 0.625) and entry_at(record_read, 3) is None
    assert read_own_record(tmp_path / "none" / OWN_FIGURES) is None


def test_a_failed_rewrite_leaves_the_previous_record_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = OwnRecord(tmp_path, "org-0", "fedavg")
    record.record(1, [_metrics(0.25)], 160)
    before = (tmp_path / OWN_FIGURES).read_bytes()

    def crash(src: object, dst: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(own_record.os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        record.record(2, [_metrics(0.5)], 160)
    assert (tmp_path / OWN_FIGURES).read_bytes() == before


def test_a_resumed_client_keeps_its_rounds_and_a_fresh_start_replaces_them(tmp_path: Path) -> None:
    first = OwnRecord(tmp_path, "org-0", "fedavg")
    for r in (1, 2, 3):
        first.record(r, [_metrics(r / 8)], 160)
    # Resumed after round 2: rounds 1-2 stay, round 3 is to be done again.
    assert OwnRecord(tmp_path, "org-0", "fedavg", resumed_round=2).entries == [_entry(1, 0.125), _entry(2, 0.25)]
    # Another run's record in the same folder, or a fresh start, keeps nothing.
    assert OwnRecord(tmp_path, "org-0", "other", resumed_round=2).entries == []
    assert read_own_record(tmp_path / OWN_FIGURES) == {"organization": "org-0", "run": "other", "rounds": []}
    OwnRecord(tmp_path, "org-0", "fedavg").record(1, [_metrics(0.25)], 160)
    assert OwnRecord(tmp_path, "org-0", "fedavg").entries == []
    assert read_own_record(tmp_path / OWN_FIGURES) == {"organization": "org-0", "run": "fedavg", "rounds": []}
