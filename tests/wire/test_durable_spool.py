"""Partial pushes made durable: a push cut mid-stream survives an aggregator restart and resumes from the last
chunk the aggregator fsync'd with its record, not from chunk 0.

The record and the start-up load are tested on the files an aggregator left (tampered with); real aggregator
processes are killed (SIGKILL, and at the crash point between a spool file's fsync and its record's rename)
and restarted on the same state directory.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter

from hetfed.aggregator.journal.crashpoints import EXIT_CODE
from hetfed.aggregator.journal.store import RunStore
from hetfed.aggregator.serving import spool_record
from hetfed.aggregator.serving.server import RunningAggregator
from hetfed.aggregator.serving.spool import Spool
from hetfed.aggregator.serving.spool_record import Record, RecordError
from hetfed.cli.certs import make_federation_certs
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import chunks, codec, messages
from hetfed.wire import digest as content
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from hetfed.wire.rpc import SERVICE_NAME, AggregatorClient, RemoteError
from hetfed.wire.transport import make_channel
from tests.conftest import RawClient, load_benchmark, run_config, wait_until
from tests.wire.test_resume import (
    Relay,
    encoded,
    held_bytes,
    leave_partial,
    md,
    messages_of,
    named,
    progress,
    send,
)

faults = load_benchmark("faults")
Start = Callable[..., RunningAggregator]
W = np.arange(2_000_000, dtype=np.float32) / 2_000_000  # the 8 MB update of test_resume: 9 chunks


def spool_of(agg: RunningAggregator | Path) -> Path:
    state = agg if isinstance(agg, Path) else Path(agg.service.config.server.state_dir)
    return state / ".spool" / "r"


def only(folder: Path, suffix: str) -> Path:
    found = list(folder.glob(f"*{suffix}"))
    assert len(found) == 1, found
    return found[0]


def reload(state: Path, round_open: bool = True) -> tuple[Spool, CollectorRegistry]:
    """A spool started on ``state``, as a restarted aggregator's is (a run ``r`` hosted, its round open or not)."""
    registry = CollectorRegistry()
    dropped = Counter("dropped", "partial pushes dropped", ["reason"], registry=registry)
    spool = Spool(state / ".spool", ["r"], 600.0, 1 << 30, 1 << 30, dropped, lambda *_: round_open)
    return spool, registry


def count(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("dropped_total", {"reason": reason}) or 0.0


@pytest.fixture
def left(aggregator: Start, raw_client: Callable[..., RawClient], tmp_path: Path) -> tuple[Path, bytes, list[bytes]]:
    """A state directory whose aggregator kept a's push cut after 3 chunks (stopped since)."""
    agg = aggregator(run_config())
    for org in ("a", "b"):
        raw_client(agg.port, org).join([(PayloadKind.MODEL_WEIGHTS, "w", W)])
    data = encoded("a")
    with grpc.insecure_channel(f"127.0.0.1:{agg.port}") as ch:
        msgs = leave_partial(ch, "a", data, 3, metadata=md("a"))
        assert progress(ch, "a", content.digest(data), len(data), metadata=md("a")) == (3, held_bytes(msgs, 3))
    agg.stop()
    return Path(agg.service.config.server.state_dir), data, msgs


# ------------------------------------------------------------------------------------------------ the record


def a_record(**changed: Any) -> Record:
    fields: dict[str, Any] = {"run_id": "r", "organization": "a", "round": 1, "digest": b"d" * 32, "count": 9,
                              "total_bytes": 100, "chunks": 3, "held_bytes": 40, "prefix_digest": b"p" * 32,
                              "wire_bytes": 70, "messages": 3}
    return Record(**{**fields, **changed})


def test_a_record_reads_back_and_a_torn_or_damaged_one_is_invalid() -> None:
    record = a_record()
    raw = record.to_json()
    assert Record.from_json(raw) == record
    flipped = raw.replace(b'\\"chunks\\": 3', b'\\"chunks\\": 4')
    assert flipped != raw
    for bad, why in ((raw[: len(raw) // 2], "not a partial push's record"), (b"", "not a partial push's record"),
                     (flipped, "its check does not match")):
        with pytest.raises(RecordError, match=why) as err:
            Record.from_json(bad)
        assert err.value.reason == "invalid"
    for fields, why in (({"chunks": 0}, "0 of 9 chunks, 40 of 100 bytes: not a partial push"),
                        ({"chunks": 9}, "9 of 9 chunks, 40 of 100 bytes: not a partial push"),
                        ({"held_bytes": 101}, "3 of 9 chunks, 101 of 100 bytes: not a partial push"),
                        ({"total_bytes": 8, "held_bytes": 4}, "3 of 9 chunks, 4 of 8 bytes: not a partial push"),
                        ({"digest": b"short"}, "a digest that is not BLAKE3's 32 bytes"),
                        ({"organization": ""}, "no run or organization")):
        with pytest.raises(RecordError) as bad_field:
            Record.from_json(a_record(**fields).to_json())
        assert str(bad_field.value) == why
    other = json.loads(raw)
    body = json.loads(other["record"])
    body["version"] = 2
    other["record"] = json.dumps(body, sort_keys=True)
    other["blake3"] = content.digest(other["record"].encode()).hex()
    with pytest.raises(RecordError, match="another format version"):
        Record.from_json(json.dumps(other).encode())


def test_the_durable_prefix_is_hashed_again_in_blocks(tmp_path: Path) -> None:
    data = np.random.default_rng(3).integers(0, 256, 64 << 20, np.uint8).tobytes()
    path = tmp_path / "f.part"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        tracemalloc.start()
        hashed = spool_record.rehash(fd, len(data) - 5, block=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert hashed.digest() == content.digest(data[:-5])
        assert peak < 2 << 20  # one block of 1 MiB, not the 64 MiB file
        with pytest.raises(RecordError, match="the file ends at 67108864 bytes, its record claims 67108865") as err:
            spool_record.rehash(fd, len(data) + 1, block=1 << 20)
        assert err.value.reason == "torn"
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------ the load


def test_a_restarted_aggregator_resumes_the_partial_push_it_made_durable(
        aggregator: Start, left: tuple[Path, bytes, list[bytes]]) -> None:
    state, data, msgs = left
    folder = spool_of(state)
    record = spool_record.read_record(only(folder, ".part"))
    assert (record.organization, record.round, record.digest) == ("a", 1, content.digest(data))
    assert (record.count, record.total_bytes, record.chunks, record.held_bytes) == (9, len(data), 3,
                                                                                   held_bytes(msgs, 3))
    # Bytes written after the record (never fsync'd: a kill's leftovers) are cut off at the start.
    with open(only(folder, ".part"), "ab") as f:
        f.write(b"x" * 1000)
    again = aggregator(run_config())
    assert again.service.spool.durable("r", "a") == (3, held_bytes(msgs, 3))
    assert only(folder, ".part").stat().st_size == held_bytes(msgs, 3)
    digest = content.digest(data)
    with grpc.insecure_channel(f"127.0.0.1:{again.port}") as ch:
        assert progress(ch, "a", digest, len(data), metadata=md("a")) == (3, held_bytes(msgs, 3))
        reply = send(ch, [named(msgs[3], digest), *msgs[4:]], md("a"))
    assert isinstance(reply, bytes) and apb.PushUpdateResponse.FromString(reply).accepted
    assert again.service.runs["r"].journal.store.updates(1) == [("a", data)]
    assert not list(folder.iterdir())


@pytest.mark.parametrize(("damage", "reason", "why"), [
    ("record_torn", "invalid", "not a partial push's record"),
    ("record_missing", "unsynced", "no record"),
    ("file_short", "torn", "holds 2113535 bytes, its record claims 2113536"),
    ("file_flipped", "torn", "do not hash to its record's digest"),
    ("file_missing", "torn", "its spool file is missing"),
])
def test_a_damaged_partial_push_is_deleted_and_counted_at_start(
        left: tuple[Path, bytes, list[bytes]], damage: str, reason: str, why: str,
        caplog: pytest.LogCaptureFixture) -> None:
    state, _, _ = left
    folder = spool_of(state)
    part = only(folder, ".part")
    rec = spool_record.record_path(part)
    if damage == "record_torn":
        rec.write_bytes(rec.read_bytes()[:40])
    elif damage == "record_missing":
        rec.unlink()
    elif damage == "file_short":
        os.truncate(part, part.stat().st_size - 1)
    elif damage == "file_flipped":
        raw = bytearray(part.read_bytes())
        raw[5000] ^= 1
        part.write_bytes(raw)
    else:
        part.unlink()
    (folder / "a-1-0000.json.tmp").write_bytes(b"{")  # a record being written when the process ended
    spool, dropped = reload(state)
    assert len(spool) == 0 and spool.durable("r", "a") == (0, 0)
    assert count(dropped, reason) == 1
    assert why in caplog.text and f"at start-up ({reason})" in caplog.text
    assert not list(folder.iterdir())


def test_a_partial_push_of_a_closed_round_is_deleted_at_start(left: tuple[Path, bytes, list[bytes]]) -> None:
    state, _, _ = left
    spool, dropped = reload(state, round_open=False)
    assert len(spool) == 0 and count(dropped, "round_closed") == 1
    assert not list(spool_of(state).iterdir())
    # Another aggregator's run on the same state directory is left alone.
    (state / ".spool" / "other").mkdir()
    (state / ".spool" / "other" / "x.part").write_bytes(b"1")
    reload(state)
    assert (state / ".spool" / "other" / "x.part").exists()


def test_a_push_received_into_its_file_is_made_durable_as_it_arrives(
        aggregator: Start, raw_client: Callable[..., RawClient], tmp_path: Path) -> None:
    agg = aggregator(run_config())
    for org in ("a", "b"):
        raw_client(agg.port, org).join([(PayloadKind.MODEL_WEIGHTS, "w", W)])
    agg.service.spool.memory_below = 0
    agg.service.spool.sync_bytes = 2 << 20
    data = encoded("a")
    digest = content.digest(data)
    msgs = messages_of("a", data)
    release = threading.Event()

    def stream() -> Any:
        yield named(msgs[0], digest)
        yield from msgs[1:6]
        release.wait(30)  # the aggregator dies here, mid-stream (its state copied as a kill leaves it)

    with grpc.insecure_channel(f"127.0.0.1:{agg.port}") as ch:
        call = ch.stream_unary(f"/{SERVICE_NAME}/PushUpdate").future(stream(), metadata=md("a"), timeout=30)
        # A sync each 2 MiB received: after 3 chunks (16 KiB + 2 MiB) and after 5; the 6th is not yet durable.
        wait_until(lambda: agg.service.spool.held("r", "a") == (6, held_bytes(msgs, 6)), timeout=20,
                   what="six chunks received")
        wait_until(lambda: agg.service.spool.durable("r", "a") == (5, held_bytes(msgs, 5)), timeout=20,
                   what="five chunks durable")
        shutil.copytree(agg.service.config.server.state_dir, tmp_path / "killed", ignore=shutil.ignore_patterns("lock"))
        release.set()
        call.cancel()
    assert only(spool_of(tmp_path / "killed"), ".part").stat().st_size == held_bytes(msgs, 6)
    again = aggregator(run_config(), state_dir=str(tmp_path / "killed"))
    with grpc.insecure_channel(f"127.0.0.1:{again.port}") as ch:
        assert progress(ch, "a", digest, len(data), metadata=md("a")) == (5, held_bytes(msgs, 5))
        reply = send(ch, [named(msgs[5], digest), *msgs[6:]], md("a"))
    assert isinstance(reply, bytes) and apb.PushUpdateResponse.FromString(reply).accepted
    assert again.service.runs["r"].journal.store.updates(1) == [("a", data)]


def test_a_graceful_stop_keeps_the_push_it_cut(aggregator: Start, raw_client: Callable[..., RawClient]) -> None:
    # A pod deleted (SIGTERM) while a push is received: the stop cuts the stream, and the push, held in memory
    # until then, is made durable before the process ends.
    agg = aggregator(run_config())
    for org in ("a", "b"):
        raw_client(agg.port, org).join([(PayloadKind.MODEL_WEIGHTS, "w", W)])
    data = encoded("a")
    digest = content.digest(data)
    msgs = messages_of("a", data)
    release = threading.Event()

    def stream() -> Any:
        yield named(msgs[0], digest)
        yield from msgs[1:6]
        release.wait(30)

    with grpc.insecure_channel(f"127.0.0.1:{agg.port}") as ch:
        call = ch.stream_unary(f"/{SERVICE_NAME}/PushUpdate").future(stream(), metadata=md("a"), timeout=30)
        wait_until(lambda: agg.service.spool.held("r", "a") == (6, held_bytes(msgs, 6)), timeout=20,
                   what="six chunks received")
        assert agg.service.spool.durable("r", "a") == (0, 0)  # in memory: nothing on disk yet
        agg.stop(grace=0.5)
        release.set()
        call.cancel()
    again = aggregator(run_config())
    with grpc.insecure_channel(f"127.0.0.1:{again.port}") as ch:
        assert progress(ch, "a", digest, len(data), metadata=md("a")) == (6, held_bytes(msgs, 6))
        reply = send(ch, [named(msgs[6], digest), *msgs[7:]], md("a"))
    assert isinstance(reply, bytes) and apb.PushUpdateResponse.FromString(reply).accepted
    assert again.service.runs["r"].journal.store.updates(1) == [("a", data)]


# ------------------------------------------------------------------------------------------------ real processes


def logged_updates(state: Path) -> list[tuple[str, bytes]]:
    """The open round's updates in a stopped aggregator's log."""
    store = RunStore(state, "r")
    try:
        store.recover()
        return list(store.updates(1))
    finally:
        store.close()


def join_tls(channel: grpc.Channel, org: str, w: np.ndarray) -> None:
    join = apb.JoinRequest(run_id="r", organization_id=org)
    join.declared_tensors.add(payload_kind=PayloadKind.MODEL_WEIGHTS.proto_enum, name="w",
                              dtype=codec._WIRE[codec.wire_dtype_of(w)][0], shape=w.shape)
    channel.unary_unary(f"/{SERVICE_NAME}/Join")(join.SerializeToString(), timeout=10)


@pytest.mark.e2e
def test_a_cut_push_resumes_after_the_aggregator_is_killed(tmp_path: Path) -> None:
    n = 17_000_000  # float32 elements: an update of 68 MB, received into its spool file from its first chunk
    big = (np.arange(n, dtype=np.float32) / n).astype(np.float32)
    certs = make_federation_certs(tmp_path / "certs", ["a", "b"])
    agg = faults.AggregatorProcess(tmp_path, [run_config()], tls=certs.aggregator_tls())
    assert agg.start() == ""
    update = messages.Update("r", 1, "a", [ModelWeights({"w": big}, 1),
                                           EvalMetrics(test_accuracy=0.5, num_test_examples=1)], None, "")
    data = bytes(messages.encode_update(update, None).data)
    digest = content.digest(data)
    relay = Relay(agg.port, len(data) // 2)
    kept: list[str] = []

    def restart_between_tries(what: str, call: Callable[[], Any]) -> Any:
        for attempt in range(4):
            try:
                return call()
            except RemoteError as err:
                if attempt == 3 or not err.retryable:
                    raise
                if not kept:  # the cut: once its chunks are durable, the aggregator is killed and restarted
                    wait_until(lambda: "kept for resumption" in agg.log_path().read_text(), timeout=60,
                               what="the cut push made durable")
                    agg.kill()
                    kept.append(agg.log_path().read_text())
                    assert agg.start() == ""
                    others(kept)
        raise AssertionError("unreachable")

    def others(_: list[str]) -> None:
        """Another organization cannot see or resume a's push after the restart (mTLS identities)."""
        with make_channel(agg.address, certs.client_tls("b")) as b:
            assert progress(b, "b", digest, len(data)) == (0, 0)
            with pytest.raises(grpc.RpcError) as claim:
                progress(b, "a", digest, len(data))
            assert claim.value.details().startswith("identity_mismatch")
            msgs = messages_of("b", data)
            err = send(b, [named(msgs[20], digest), *msgs[21:23]])
            assert isinstance(err, grpc.RpcError) and err.details().startswith("not_resumable")

    try:
        with make_channel(agg.address, certs.client_tls("a")) as a, make_channel(agg.address, certs.client_tls("b")) as b:
            join_tls(a, "a", big)
            join_tls(b, "b", big)
        with AggregatorClient(f"127.0.0.1:{relay.port}", certs.client_tls("a"), "a", "r",
                              retry=restart_between_tries) as client:
            reply = client.push(1, update.payloads)
    finally:
        relay.close()
        agg.stop()
    assert (reply.accepted, reply.duplicate) == (True, False)
    held = [line for line in agg.log_path().read_text().splitlines() if "from before the restart" in line]
    assert len(held) == 1, agg.log_tail(20)
    chunks_kept = int(held[0].split(": ")[-1].split()[0])
    cut_line = next(line for line in kept[0].splitlines() if "kept for resumption" in line)
    assert f"cut after {chunks_kept} chunks" in cut_line and f"{chunks_kept} chunks durable" in cut_line
    assert 20 < chunks_kept < 50  # about half of the 66 chunks: resumed there, not from chunk 0
    cut, rest = relay.carried[0], sum(relay.carried[1:])
    resent = len(data) - (chunks.FIRST_PUSH_CHUNK_BYTES + (chunks_kept - 1) * chunks.DEFAULT_CHUNK_BYTES)
    assert resent <= rest < resent + (2 << 20) < len(data) and cut >= len(data) // 2
    assert logged_updates(agg.state_dir) == [("a", data)]


@pytest.mark.e2e
def test_killed_between_a_spool_fsync_and_its_record_the_push_resumes_from_the_previous_record(
        tmp_path: Path, raw_client: Callable[..., RawClient]) -> None:
    agg = faults.AggregatorProcess(tmp_path, [run_config()])
    # Each record's rename waits 1 s (a slow disk): PushProgress answers only once the cut push is durable.
    assert agg.start(crash_at="spool.synced:2", delay_at="spool.synced:1") == ""
    for org in ("a", "b"):
        raw_client(agg.port, org).join([(PayloadKind.MODEL_WEIGHTS, "w", W)])
    data = encoded("a")
    digest = content.digest(data)
    with grpc.insecure_channel(agg.address) as ch:
        msgs = leave_partial(ch, "a", data, 3, metadata=md("a"))  # made durable: the first record
        assert progress(ch, "a", digest, len(data), metadata=md("a")) == (3, held_bytes(msgs, 3))
        assert spool_record.read_record(only(spool_of(agg.state_dir), ".part")).chunks == 3
        send(ch, [named(msgs[3], digest), *msgs[4:6]], md("a"))  # cut again at 6: its fsync, then the kill
    wait_until(lambda: agg.exited() is not None, timeout=30, what="the crash")
    assert agg.exited() == EXIT_CODE
    part = only(spool_of(agg.state_dir), ".part")
    assert part.stat().st_size == held_bytes(msgs, 6)
    assert spool_record.read_record(part).chunks == 3
    assert agg.start() == ""
    with grpc.insecure_channel(agg.address) as ch:
        assert progress(ch, "a", digest, len(data), metadata=md("a")) == (3, held_bytes(msgs, 3))
        reply = send(ch, [named(msgs[3], digest), *msgs[4:]], md("a"))
    assert isinstance(reply, bytes) and apb.PushUpdateResponse.FromString(reply).accepted
    agg.stop()
    assert logged_updates(agg.state_dir) == [("a", data)]
    assert not list(spool_of(agg.state_dir).iterdir())
