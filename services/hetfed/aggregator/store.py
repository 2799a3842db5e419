"""Durable run state: accepted updates are written before they are acknowledged; checkpoints are atomic.

A run's directory holds ``checkpoint.npz`` (replaced atomically at every round close), ``updates.wal``
(the open round's accepted updates, each appended and fsync'd before it is acknowledged, each record
checksummed so a torn tail from a crash is detected and cut off) and ``history.jsonl`` (one line per
closed round, appended once; the checkpoint records how many lines are valid). Nothing grows per round
except the history, and no round writes more than a few small appends and one checkpoint: runs of
thousands of short rounds (FedH2L) stay cheap.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np

# updates.wal record: magic, round, organization length, data length, SHA-256 of organization + data.
_WAL_HEADER = struct.Struct("<4sqHQ32s")
_WAL_MAGIC = b"HFU1"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _wal_records(blob: bytes) -> tuple[list[tuple[int, str, bytes]], int]:
    """The valid records of a write-ahead log and the length of its valid prefix (a torn tail is cut off)."""
    out: list[tuple[int, str, bytes]] = []
    pos = 0
    while pos + _WAL_HEADER.size <= len(blob):
        magic, round_, org_len, data_len, digest = _WAL_HEADER.unpack_from(blob, pos)
        end = pos + _WAL_HEADER.size + org_len + data_len
        if magic != _WAL_MAGIC or end > len(blob):
            break
        body = blob[pos + _WAL_HEADER.size : end]
        if hashlib.sha256(body).digest() != digest:
            break
        out.append((round_, body[:org_len].decode(), body[org_len:]))
        pos = end
    return out, pos


class RunStore:
    """One run's directory: ``checkpoint.npz``, ``updates.wal`` and ``history.jsonl``."""

    def __init__(self, root: str | Path, run_id: str) -> None:
        self.dir = Path(root) / run_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self._wal_path = self.dir / "updates.wal"
        self._history_path = self.dir / "history.jsonl"
        if self._wal_path.exists():  # cut off a record torn by a crash, so appends follow valid records
            blob = self._wal_path.read_bytes()
            _, valid = _wal_records(blob)
            if valid < len(blob):
                with open(self._wal_path, "r+b") as f:
                    f.truncate(valid)
                    os.fsync(f.fileno())
        self._wal = open(self._wal_path, "ab")  # noqa: SIM115 - held for the run's lifetime
        self._wal_bytes = self._wal_path.stat().st_size
        _fsync_dir(self.dir)

    def write_update(self, round_: int, organization: str, data: bytes) -> None:
        """Persist an accepted update (appended and fsync'd) before it is acknowledged."""
        org = organization.encode()
        body_digest = hashlib.sha256(org)
        body_digest.update(data)
        self._wal.write(_WAL_HEADER.pack(_WAL_MAGIC, round_, len(org), len(data), body_digest.digest()))
        self._wal.write(org)
        self._wal.write(data)
        self._wal.flush()
        os.fsync(self._wal.fileno())
        self._wal_bytes += _WAL_HEADER.size + len(org) + len(data)

    def updates(self, round_: int) -> list[tuple[str, bytes]]:
        """Every stored update of a round, in organization order."""
        found: dict[str, bytes] = {}
        legacy = self.dir / f"round-{round_:06d}"  # the layout before the write-ahead log
        if legacy.is_dir():
            found.update((p.stem, p.read_bytes()) for p in legacy.glob("*.update"))
        records, _ = _wal_records(self._wal_path.read_bytes()) if self._wal_path.exists() else ([], 0)
        found.update((org, data) for r, org, data in records if r == round_)
        return sorted(found.items())

    def drop_rounds_before(self, round_: int) -> None:
        """Forget stored updates of rounds before ``round_`` (their effect is in the checkpoint)."""
        for d in self.dir.glob("round-*"):
            if int(d.name.split("-")[1]) < round_:
                shutil.rmtree(d, ignore_errors=True)
        if self._wal_bytes == 0:
            return
        records, _ = _wal_records(self._wal_path.read_bytes())
        if any(r >= round_ for r, _, _ in records):  # not reached by the engine, which drops after closing
            buf = io.BytesIO()
            for r, org, data in records:
                if r >= round_:
                    digest = hashlib.sha256(org.encode() + data).digest()
                    buf.write(_WAL_HEADER.pack(_WAL_MAGIC, r, len(org.encode()), len(data), digest))
                    buf.write(org.encode() + data)
            self._wal.close()
            atomic_write(self._wal_path, buf.getbuffer())
            self._wal = open(self._wal_path, "ab")  # noqa: SIM115
            self._wal_bytes = len(buf.getbuffer())
            return
        # No fsync: should a crash undo the truncation, the stale records name closed rounds, which no
        # restore replays (``updates`` selects the open round).
        self._wal.truncate(0)
        self._wal_bytes = 0

    def append_history(self, record: dict[str, Any]) -> None:
        """Append one closed round's record to ``history.jsonl`` (fsync'd before the checkpoint counts it)."""
        with open(self._history_path, "ab") as f:
            f.write(json.dumps(record).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())

    def load_history(self, count: int) -> list[dict[str, Any]]:
        """The first ``count`` history records; later ones (a close whose checkpoint was lost) are cut off."""
        if not self._history_path.exists():
            if count:
                raise ValueError(f"{self._history_path} is missing; the checkpoint counts {count} rounds")
            return []
        lines = self._history_path.read_bytes().split(b"\n")[:-1]  # complete (newline-terminated) lines only
        records = [json.loads(line) for line in lines[:count]]
        if len(records) < count:
            raise ValueError(f"{self._history_path} holds {len(records)} rounds; the checkpoint counts {count}")
        keep = sum(len(line) + 1 for line in lines[:count])
        if keep < self._history_path.stat().st_size:
            with open(self._history_path, "r+b") as f:
                f.truncate(keep)
                os.fsync(f.fileno())
        return records

    def close(self) -> None:
        """Close the write-ahead log."""
        self._wal.close()

    def save_checkpoint(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """Atomically replace the checkpoint with ``meta`` (JSON) and ``arrays``."""
        buf = io.BytesIO()
        payload = {f"a/{k}": v for k, v in arrays.items()}
        payload["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        np.savez(buf, **payload)  # type: ignore[arg-type]
        atomic_write(self.dir / "checkpoint.npz", buf.getbuffer())

    def load_checkpoint(self) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
        """The last checkpoint, or None for a new run."""
        path = self.dir / "checkpoint.npz"
        if not path.exists():
            return None
        with np.load(path) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            arrays = {k[2:]: z[k] for k in z.files if k.startswith("a/")}
        return meta, arrays
