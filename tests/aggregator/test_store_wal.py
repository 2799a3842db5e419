"""The run store: a checksummed, keyed write-ahead log, a history committed by the checkpoint, and recovery
from every torn or damaged file it can recover from (a clear StateError where it cannot)."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import struct
import threading
import zlib
from pathlib import Path

import blake3
import numpy as np
import pytest

from hetfed.aggregator.journal.store import RunStore, StateError, StorageError, WalTicket, holder_of, scan_wal
from tests.conftest import GatedDisk
from tests.faults import DiskFault, FaultyDisk

HEADER = 24  # the log's file header
REC = 70  # a record's header


def opened(root: Path, disk: FaultyDisk | None = None) -> RunStore:
    s = RunStore(root, "r", disk)
    s.recover()
    return s


def new_run(root: Path, disk: FaultyDisk | None = None) -> RunStore:
    """A new run's store with its first checkpoint, as the engine makes it."""
    s = RunStore(root, "r", disk)
    assert s.recover() is None
    s.save_checkpoint({"phase": "train", "round": 1}, {"w": np.zeros(2)})
    return s


def wal(root: Path) -> Path:
    return root / "r" / "updates.wal"


def flip(path: Path, offset: int) -> None:
    blob = bytearray(path.read_bytes())
    blob[offset] ^= 0x01
    path.write_bytes(bytes(blob))


def test_updates_are_logged_per_round_and_dropped_after_the_checkpoint(tmp_path: Path) -> None:
    s = new_run(tmp_path)
    s.write_update(1, "b", b"bee")
    s.write_update(1, "a", b"ay")
    assert s.updates(1) == [("a", b"ay"), ("b", b"bee")]
    assert s.updates(2) == []
    assert wal(tmp_path).stat().st_size == HEADER + 2 * REC + len("bbee") + len("aay")
    s.drop_rounds_before(2)
    assert s.updates(1) == [] and wal(tmp_path).stat().st_size == HEADER
    s.write_update(2, "a", b"x" * 5000)
    s.close()
    again = opened(tmp_path)  # a restart reads what was acknowledged
    assert again.updates(2) == [("a", b"x" * 5000)]


def test_a_record_cut_short_by_a_crash_is_cut_off_and_later_appends_follow_the_good_ones(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    s = new_run(tmp_path)
    s.write_update(3, "a", b"complete")
    good = wal(tmp_path).stat().st_size
    s.write_update(3, "b", b"interrupted" * 10)
    s.close()
    with open(wal(tmp_path), "r+b") as f:
        f.truncate(good + REC + 1 + 30)  # the crash left the header, the organization and 30 of 110 bytes
    with caplog.at_level(logging.WARNING, "hetfed.aggregator"):
        s = opened(tmp_path)
    assert wal(tmp_path).stat().st_size == good
    assert "(round 3, organization 'b') is cut short: 30 of 110 bytes" in caplog.text
    s.write_update(3, "b", b"after")
    s.close()
    assert opened(tmp_path).updates(3) == [("a", b"complete"), ("b", b"after")]


def test_a_flipped_byte_in_an_update_discards_that_record_alone(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    s = new_run(tmp_path)
    for org in "abc":
        s.write_update(1, org, org.encode() * 100)
    s.close()
    flip(wal(tmp_path), HEADER + REC + 1 + 50)  # inside a's update
    with caplog.at_level(logging.ERROR, "hetfed.aggregator"):
        s = opened(tmp_path)
    assert s.updates(1) == [("b", b"b" * 100), ("c", b"c" * 100)]
    assert (f"the record at offset {HEADER} (round 1, organization 'a', 100 bytes) fails its BLAKE3 digest: "
            "discarded") in caplog.text
    assert "asked for it again" in caplog.text
    # The log was rewritten without the damage: the next start finds nothing wrong.
    s.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, "hetfed.aggregator"):
        assert opened(tmp_path).updates(1) == [("b", b"b" * 100), ("c", b"c" * 100)]
    assert caplog.text == ""


@pytest.mark.parametrize("field", ["magic", "round", "length", "mac"])
def test_a_flipped_byte_in_a_record_header_loses_no_later_record(tmp_path: Path, field: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    s = new_run(tmp_path)
    for org in "abc":
        s.write_update(1, org, org.encode() * 100)
    s.close()
    offset = {"magic": 0, "round": 4, "length": 14, "mac": 60}[field]
    flip(wal(tmp_path), HEADER + offset)  # a's header: its lengths can no longer be trusted
    with caplog.at_level(logging.ERROR, "hetfed.aggregator"):
        s = opened(tmp_path)
    assert s.updates(1) == [("b", b"b" * 100), ("c", b"c" * 100)]
    assert f"bytes {HEADER}..{HEADER + REC + 101} hold no valid record" in caplog.text


@pytest.mark.parametrize("magic", [b"HFR3", b"HFR2"])
def test_a_record_forged_inside_an_update_is_never_taken_for_a_real_one(tmp_path: Path, magic: bytes) -> None:
    """Resynchronising after a damaged header searches for the next record (of either format): an organization
    that embeds a well-formed record in its update (claiming another organization) must not be able to plant it."""
    s = new_run(tmp_path)
    forged_data = b"forged update"
    digest = (blake3.blake3 if magic == b"HFR3" else hashlib.sha256)(forged_data).digest()
    signed = struct.pack("<4sqHQ32s", magic, 1, 1, len(forged_data), digest)
    forged = signed + hashlib.blake2b(signed + b"b", key=b"\0" * 16, digest_size=16).digest() + b"b" + forged_data
    s.write_update(1, "a", b"x" * 10 + forged + b"y" * 10)
    s.write_update(1, "c", b"honest")
    s.close()
    flip(wal(tmp_path), HEADER + 4)  # a's header
    assert opened(tmp_path).updates(1) == [("c", b"honest")]


def _old_record(key: bytes, round_: int, org: bytes, data: bytes) -> bytes:
    """A record as hetfed wrote it before BLAKE3: magic HFR2 and the update's SHA-256, MAC'd with the file's key."""
    signed = struct.pack("<4sqHQ32s", b"HFR2", round_, len(org), len(data), hashlib.sha256(data).digest())
    return signed + hashlib.blake2b(signed + org, key=key, digest_size=16).digest() + org + data


def test_records_an_older_hetfed_wrote_are_read_and_checked_by_their_sha256(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An aggregator upgraded in the middle of a round resumes the updates its predecessor logged (SHA-256
    records), appends BLAKE3 ones after them, and still discards an old record whose bytes changed."""
    s = new_run(tmp_path)
    s.write_update(1, "a", b"new format")
    s.close()
    blob = wal(tmp_path).read_bytes()
    key = blob[4:20]
    old = _old_record(key, 1, b"b", b"b" * 40) + _old_record(key, 1, b"c", b"c" * 40)
    wal(tmp_path).write_bytes(blob[:HEADER] + old + blob[HEADER:])
    s = opened(tmp_path)
    assert s.updates(1) == [("a", b"new format"), ("b", b"b" * 40), ("c", b"c" * 40)]
    s.write_update(1, "d", b"after the upgrade")
    s.close()
    blob = wal(tmp_path).read_bytes()
    assert blob[HEADER:HEADER + 4] == b"HFR2" and blob.count(b"HFR3") == 2
    flip(wal(tmp_path), HEADER + REC + 1 + 20)  # inside b's old-format update
    with caplog.at_level(logging.ERROR, "hetfed.aggregator"):
        s = opened(tmp_path)
    assert s.updates(1) == [("a", b"new format"), ("c", b"c" * 40), ("d", b"after the upgrade")]
    assert f"the record at offset {HEADER} (round 1, organization 'b', 40 bytes) fails its SHA-256 digest" \
        in caplog.text


def test_scan_reports_the_damage_it_skips() -> None:
    key = b"k" * 16
    head = struct.pack("<4s16sI", b"HFW2", key, zlib.crc32(b"HFW2" + key))
    assert scan_wal(head + b"\0" * 5, key).tail == f"5 bytes at offset {HEADER} hold no complete record"
    assert scan_wal(head, key).records == []


def test_a_damaged_file_header_moves_the_log_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    s = new_run(tmp_path)
    s.write_update(1, "a", b"lost")
    s.close()
    flip(wal(tmp_path), 2)
    with caplog.at_level(logging.ERROR, "hetfed.aggregator"):
        s = opened(tmp_path)
    assert s.updates(1) == []
    assert "the file header is damaged" in caplog.text
    assert len(list((tmp_path / "r").glob("updates.wal.damaged-*"))) == 1
    s.write_update(1, "a", b"again")
    assert s.updates(1) == [("a", b"again")]


def test_stale_records_of_closed_rounds_are_never_replayed(tmp_path: Path) -> None:
    s = new_run(tmp_path)
    s.write_update(4, "a", b"old")
    s.write_update(5, "a", b"new")  # not what the engine does, but the log keeps rounds apart
    s.drop_rounds_before(5)
    assert s.updates(4) == [] and s.updates(5) == [("a", b"new")]
    s.drop_rounds_before(6)
    assert s.updates(5) == [] and wal(tmp_path).stat().st_size == HEADER


# ---------------------------------------------------------------------------------- failed appends


@pytest.mark.parametrize("op", ["pwrite", "fsync"])
def test_a_failed_append_leaves_the_log_as_it_was(tmp_path: Path, op: str) -> None:
    disk = FaultyDisk()
    s = new_run(tmp_path, disk)
    s.write_update(1, "a", b"acknowledged")
    before = wal(tmp_path).read_bytes()
    disk.add(DiskFault(op, "updates.wal", errno.ENOSPC if op == "pwrite" else errno.EIO))
    with pytest.raises(StorageError, match=r"could not log the update of 'b' for round 1 in .*updates.wal"):
        s.write_update(1, "b", b"x" * 1000)
    assert wal(tmp_path).read_bytes() == before  # no torn bytes ahead of later records
    s.write_update(1, "c", b"later")  # acknowledged after the failure
    s.close()
    assert opened(tmp_path).updates(1) == [("a", b"acknowledged"), ("c", b"later")]


def test_a_cut_back_that_fails_is_retried_before_the_next_append(tmp_path: Path) -> None:
    disk = FaultyDisk()
    s = new_run(tmp_path, disk)
    s.write_update(1, "a", b"acknowledged")
    disk.add(DiskFault("pwrite", "updates.wal", partial=0.9))
    disk.add(DiskFault("truncate", "updates.wal"))
    with pytest.raises(StorageError):
        s.write_update(1, "b", b"x" * 1000)
    assert wal(tmp_path).stat().st_size > HEADER + REC + 1 + len(b"acknowledged")  # the torn bytes are still there
    s.write_update(1, "c", b"later")
    s.close()
    assert opened(tmp_path).updates(1) == [("a", b"acknowledged"), ("c", b"later")]


# ---------------------------------------------------------------------------------- history and checkpoint


def records(n: int) -> list[dict[str, int]]:
    return [{"round": r} for r in range(1, n + 1)]


def closed(root: Path, n: int, disk: FaultyDisk | None = None) -> RunStore:
    s = new_run(root, disk)
    for rec in records(n):
        s.close_round(rec, {"phase": "train", "round": rec["round"] + 1}, {"w": np.full(2, rec["round"])})
    return s


def test_history_and_checkpoint_commit_together(tmp_path: Path) -> None:
    closed(tmp_path, 3).close()
    s = RunStore(tmp_path, "r")
    got = s.recover()
    assert got is not None
    assert got.history == records(3)
    assert got.meta["history_len"] == 3 and got.meta["round"] == 4
    np.testing.assert_array_equal(got.arrays["w"], [3, 3])


def test_a_line_the_checkpoint_does_not_count_is_cut_off(tmp_path: Path) -> None:
    closed(tmp_path, 2).close()
    with open(tmp_path / "r" / "history.jsonl", "ab") as f:
        f.write(b'{"round": 3}\n{"rou')  # a close whose checkpoint never landed, then a torn append
    got = RunStore(tmp_path, "r").recover()
    assert got is not None and got.history == records(2)
    lines = (tmp_path / "r" / "history.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1, 2]


@pytest.mark.parametrize("cut", [1, 5, 13])
def test_a_torn_last_committed_line_is_repaired_from_the_checkpoint(tmp_path: Path, cut: int,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    closed(tmp_path, 3).close()
    path = tmp_path / "r" / "history.jsonl"
    path.write_bytes(path.read_bytes()[:-cut])
    with caplog.at_level(logging.WARNING, "hetfed.aggregator"):
        got = RunStore(tmp_path, "r").recover()
    assert got is not None and got.history == records(3)
    assert [{k: v for k, v in json.loads(line).items() if k != "crc32"} for line in path.read_text().splitlines()] \
        == records(3)
    assert "line 3 of the 3 the checkpoint counts" in caplog.text and "rewritten from the checkpoint" in caplog.text


@pytest.mark.parametrize(("old", "new", "problem"), [(b'{"round": 1', b'{"round"; 1', "is not JSON"),
                                                      (b'{"round": 1', b'{"round": 7', "fails its CRC-32")])
def test_a_damaged_earlier_line_is_refused_with_the_file_and_line(tmp_path: Path, old: bytes, new: bytes,
                                                                 problem: str) -> None:
    closed(tmp_path, 3).close()
    path = tmp_path / "r" / "history.jsonl"
    path.write_bytes(path.read_bytes().replace(old, new))
    with pytest.raises(StateError, match=rf"history.jsonl: line 1 of the 3 the checkpoint counts {problem}"):
        RunStore(tmp_path, "r").recover()


def test_a_changed_value_in_the_last_line_is_repaired_from_the_checkpoint(tmp_path: Path) -> None:
    closed(tmp_path, 3).close()
    path = tmp_path / "r" / "history.jsonl"
    path.write_bytes(path.read_bytes().replace(b'{"round": 3', b'{"round": 8'))
    got = RunStore(tmp_path, "r").recover()
    assert got is not None and got.history == records(3)


def test_a_missing_checkpoint_beside_history_or_log_is_refused(tmp_path: Path) -> None:
    s = closed(tmp_path, 1)
    s.write_update(2, "a", b"acknowledged")
    s.close()
    (tmp_path / "r" / "checkpoint.npz").unlink()
    with pytest.raises(StateError, match=r"checkpoint.npz is missing, but history.jsonl holds closed rounds and "
                                         r"updates.wal holds \d+ bytes of updates"):
        RunStore(tmp_path, "r").recover()


def test_a_missing_checkpoint_with_nothing_else_is_a_new_run(tmp_path: Path) -> None:
    crashed = RunStore(tmp_path, "r")
    crashed.recover()  # a crash before the first checkpoint leaves an empty log
    crashed.close()  # (the process ends: its files and the directory's lock are released)
    assert RunStore(tmp_path, "r").recover() is None


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty", "no meta"])
def test_an_unreadable_checkpoint_is_refused_with_its_name(tmp_path: Path, damage: str) -> None:
    closed(tmp_path, 2).close()
    path = tmp_path / "r" / "checkpoint.npz"
    blob = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(blob[: len(blob) // 2])
    elif damage == "flipped":
        flip(path, blob.index(b"\x93NUMPY") + 20)  # inside the first array: its CRC-32 fails
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        np.savez(path, a=np.zeros(1))
    with pytest.raises(StateError, match=r"checkpoint.npz (cannot be read|has no metadata)"):
        RunStore(tmp_path, "r").recover()


def test_a_failed_history_append_commits_nothing_and_its_retry_adds_one_line(tmp_path: Path) -> None:
    disk = FaultyDisk()
    s = closed(tmp_path, 1, disk)
    disk.add(DiskFault("pwrite", "history.jsonl", times=3))
    for _ in range(3):  # the deadline ticker retries the close
        with pytest.raises(StorageError, match=r"could not append round 2's record to .*history.jsonl"):
            s.close_round({"round": 2}, {"phase": "train", "round": 3}, {"w": np.full(2, 2)})
    s.close_round({"round": 2}, {"phase": "train", "round": 3}, {"w": np.full(2, 2)})
    s.close()
    got = RunStore(tmp_path, "r").recover()
    assert got is not None and got.history == records(2) and got.meta["history_len"] == 2


def test_a_failed_checkpoint_keeps_the_old_one_and_the_retry_overwrites_the_line(tmp_path: Path) -> None:
    disk = FaultyDisk()
    s = closed(tmp_path, 1, disk)
    disk.add(DiskFault("pwrite", "checkpoint.npz"))
    with pytest.raises(StorageError, match=r"could not write .*checkpoint.npz"):
        s.close_round({"round": 2, "try": 1}, {"phase": "train", "round": 3}, {"w": np.full(2, 2)})
    assert not list((tmp_path / "r").glob(".checkpoint.npz.tmp*"))
    shutil.copytree(tmp_path / "r", tmp_path / "copy" / "r")  # what a restart would find, had the process died here
    interrupted = RunStore(tmp_path / "copy", "r").recover()
    assert interrupted is not None and interrupted.history == records(1) and interrupted.meta["round"] == 2
    s.close_round({"round": 2, "try": 2}, {"phase": "train", "round": 3}, {"w": np.full(2, 2)})
    s.close()
    got = RunStore(tmp_path, "r").recover()
    assert got is not None and got.history == [{"round": 1}, {"round": 2, "try": 2}]


def test_a_second_store_on_the_same_run_directory_is_refused_naming_the_holder(tmp_path: Path) -> None:
    first = RunStore(tmp_path, "r")
    assert first.recover() is None
    assert holder_of(tmp_path / "r") == f"pid {os.getpid()}"
    second = RunStore(tmp_path, "r")
    with pytest.raises(StateError, match=rf"{tmp_path / 'r'} is in use by another aggregator \(pid {os.getpid()}\)"):
        second.recover()
    first.close()
    assert holder_of(tmp_path / "r") is None
    third = RunStore(tmp_path, "r")
    third.recover()  # the lock went with the first store
    third.close()


# ---------------------------------------------------------------------------------- group commit


def _sync_in_thread(s: RunStore, ticket: WalTicket) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def go() -> None:
        try:
            out.append(s.sync(ticket))
        except StorageError as exc:
            out.append(exc)

    t = threading.Thread(target=go)
    t.start()
    return t, out


def test_concurrent_appends_share_one_fsync(tmp_path: Path) -> None:
    """Records written while an fsync runs wait for the next one, and share it: three records, two fsyncs."""
    disk = GatedDisk("updates.wal")
    s = new_run(tmp_path, disk)
    disk.arm()
    first = s.append_update(1, "a", b"one")
    ta, out_a = _sync_in_thread(s, first)
    assert disk.entered.wait(timeout=10)  # a's fsync is under way (and waits at the gate)
    tb, out_b = _sync_in_thread(s, s.append_update(1, "b", b"two"))
    tc, out_c = _sync_in_thread(s, s.append_update(1, "c", b"three"))
    disk.gate.set()
    for t in (ta, tb, tc):
        t.join(timeout=30)
    assert out_a == out_b == out_c == [True]
    assert disk.fsyncs == 2  # a's, then one for b and c together
    s.close()
    assert opened(tmp_path).updates(1) == [("a", b"one"), ("b", b"two"), ("c", b"three")]


def test_a_failed_group_fsync_fails_every_record_it_covered_and_the_log_is_cut_back(tmp_path: Path) -> None:
    """Both records written before the failed fsync are refused (none acknowledged); after the repair the log
    is as it was, and a later record is durable."""
    disk = GatedDisk("updates.wal")
    s = new_run(tmp_path, disk)
    s.write_update(1, "z", b"acknowledged before")
    before = wal(tmp_path).read_bytes()
    disk.arm(fail=True)
    a = s.append_update(1, "a", b"one")
    b = s.append_update(1, "b", b"two")
    ta, out_a = _sync_in_thread(s, a)
    tb, out_b = _sync_in_thread(s, b)
    assert disk.entered.wait(timeout=10)
    disk.gate.set()
    for t in (ta, tb):
        t.join(timeout=30)
    assert all(isinstance(o[0], StorageError) for o in (out_a, out_b)), (out_a, out_b)
    s.repair()
    assert wal(tmp_path).read_bytes() == before
    assert s.sync(a) is False  # its record is gone: the cut voided the ticket
    s.write_update(1, "c", b"later")
    s.close()
    assert opened(tmp_path).updates(1) == [("c", b"later"), ("z", b"acknowledged before")]


def test_a_ticket_of_a_round_cut_from_the_log_is_not_durable(tmp_path: Path) -> None:
    """The round closed (its records dropped) while a record waited for its fsync: sync says it is gone."""
    s = new_run(tmp_path)
    ticket = s.append_update(1, "a", b"one")
    s.drop_rounds_before(2)
    assert s.sync(ticket) is False
    assert s.sync(s.append_update(2, "a", b"two")) is True
