"""The run store: updates in a checksummed write-ahead log, an append-only history, crash leftovers handled."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetfed.aggregator.store import RunStore


def test_updates_are_logged_per_round_and_dropped_after_the_checkpoint(tmp_path: Path) -> None:
    s = RunStore(tmp_path, "r")
    s.write_update(1, "b", b"bee")
    s.write_update(1, "a", b"ay")
    assert s.updates(1) == [("a", b"ay"), ("b", b"bee")]
    assert s.updates(2) == []
    s.drop_rounds_before(2)
    assert s.updates(1) == [] and (tmp_path / "r" / "updates.wal").stat().st_size == 0
    s.write_update(2, "a", b"x" * 5000)
    s.close()
    again = RunStore(tmp_path, "r")  # a restart reads what was acknowledged
    assert again.updates(2) == [("a", b"x" * 5000)]


def test_a_torn_tail_is_cut_off_and_later_appends_survive(tmp_path: Path) -> None:
    s = RunStore(tmp_path, "r")
    s.write_update(3, "a", b"complete")
    s.close()
    wal = tmp_path / "r" / "updates.wal"
    good = wal.stat().st_size
    with open(wal, "ab") as f:
        f.write(b"HFU1" + b"\x00" * 20)  # a record the crash interrupted
    s = RunStore(tmp_path, "r")
    assert wal.stat().st_size == good
    s.write_update(3, "b", b"after")
    assert s.updates(3) == [("a", b"complete"), ("b", b"after")]
    # A flipped byte inside a record stops the log there (its checksum fails).
    s.close()
    blob = bytearray(wal.read_bytes())
    blob[-1] ^= 0xFF
    wal.write_bytes(bytes(blob))
    assert RunStore(tmp_path, "r").updates(3) == [("a", b"complete")]


def test_stale_records_of_closed_rounds_are_never_replayed(tmp_path: Path) -> None:
    s = RunStore(tmp_path, "r")
    s.write_update(4, "a", b"old")
    s.write_update(5, "a", b"new")  # not what the engine does, but the log keeps rounds apart
    s.drop_rounds_before(5)
    assert s.updates(4) == [] and s.updates(5) == [("a", b"new")]


def test_legacy_round_directories_are_still_read(tmp_path: Path) -> None:
    legacy = tmp_path / "r" / "round-000007"
    legacy.mkdir(parents=True)
    (legacy / "a.update").write_bytes(b"from before")
    s = RunStore(tmp_path, "r")
    assert s.updates(7) == [("a", b"from before")]
    s.drop_rounds_before(8)
    assert not legacy.exists()


def test_history_counts_only_what_a_checkpoint_counted(tmp_path: Path) -> None:
    s = RunStore(tmp_path, "r")
    for r in range(1, 4):
        s.append_history({"round": r})
    assert s.load_history(3) == [{"round": 1}, {"round": 2}, {"round": 3}]
    # A close whose checkpoint never landed: its record is cut off, and the next append follows the rest.
    assert s.load_history(2) == [{"round": 1}, {"round": 2}]
    s.append_history({"round": 3, "again": True})
    assert s.load_history(3)[-1] == {"round": 3, "again": True}
    with pytest.raises(ValueError, match="holds 3 rounds"):
        s.load_history(5)
    assert RunStore(tmp_path, "fresh").load_history(0) == []
