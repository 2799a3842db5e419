"""Durable run state: accepted updates are written before they are acknowledged; checkpoints are atomic."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np


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


class RunStore:
    """One run's directory: ``checkpoint.npz`` and ``round-NNNNNN/<organization>.update`` files."""

    def __init__(self, root: str | Path, run_id: str) -> None:
        self.dir = Path(root) / run_id
        self.dir.mkdir(parents=True, exist_ok=True)

    def _round_dir(self, round_: int) -> Path:
        return self.dir / f"round-{round_:06d}"

    def write_update(self, round_: int, organization: str, data: bytes) -> None:
        """Persist an accepted update (fsync'd) before it is acknowledged."""
        d = self._round_dir(round_)
        d.mkdir(exist_ok=True)
        atomic_write(d / f"{organization}.update", data)

    def updates(self, round_: int) -> list[tuple[str, bytes]]:
        """Every stored update of a round, in organization order."""
        d = self._round_dir(round_)
        if not d.is_dir():
            return []
        return [(p.stem, p.read_bytes()) for p in sorted(d.glob("*.update"))]

    def drop_rounds_before(self, round_: int) -> None:
        """Delete stored updates of rounds before ``round_`` (their effect is in the checkpoint)."""
        for d in self.dir.glob("round-*"):
            if int(d.name.split("-")[1]) < round_:
                shutil.rmtree(d, ignore_errors=True)

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
