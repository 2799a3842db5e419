"""The checkpoint (``checkpoint.npz``): the run's state (JSON) and its server half's arrays, replaced atomically.

It is the commit point of a round's close, a join and a refusal. ``CheckpointMeta`` is its typed metadata: the
run's state (``RunState.to_json``), the algorithm that wrote it, the per-organization ledger, and how many
history lines it counts with a copy of the last one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hetfed.aggregator.journal.disk import Disk, StateError, atomic_write

# Keys of the metadata that are not the run's state.
_OWN_KEYS = ("algorithm", "organizations", "history_len", "last_record")


@dataclass(frozen=True)
class CheckpointMeta:
    """A checkpoint's metadata, typed. ``state``: the run's state as ``RunState.to_json`` gives it."""

    state: Mapping[str, Any]
    algorithm: str | None = None
    organizations: Mapping[str, Any] | None = None  # the ledger (``OrganizationLedger.to_json``)
    history_len: int = 0
    last_record: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The flat JSON object the file stores."""
        return {**self.state, "algorithm": self.algorithm, "organizations": self.organizations,
                "history_len": self.history_len, "last_record": self.last_record}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CheckpointMeta:
        """Inverse of ``to_json``."""
        return cls({k: v for k, v in d.items() if k not in _OWN_KEYS}, d.get("algorithm"), d.get("organizations"),
                   int(d.get("history_len", 0)), d.get("last_record"))


class CheckpointFile:
    """Reads and atomically replaces one checkpoint file."""

    def __init__(self, path: Path, disk: Disk) -> None:
        self.path = path
        self.disk = disk

    def read(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The checkpoint's metadata and arrays; StateError names the file when it cannot be read."""
        path = self.path
        try:
            with np.load(path) as z:
                if "meta" not in z.files:
                    raise StateError(f"{path} has no metadata record: it is not a hetfed checkpoint")
                meta = json.loads(bytes(z["meta"]).decode())
                arrays = {k[2:]: z[k] for k in z.files if k.startswith("a/")}
        except StateError:
            raise
        except Exception as exc:  # a truncated or damaged zip fails in many ways; every one is a clear refusal
            raise StateError(
                f"{path} cannot be read ({type(exc).__name__}: {exc}). It is the run's only copy of its server "
                "state: restore it from a backup; the aggregator will not start the run over it") from None
        if not isinstance(meta, dict):
            raise StateError(f"{path} holds metadata of type {type(meta).__name__}, not an object")
        return meta, arrays

    def write(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        """Replace the file by ``meta`` and ``arrays``; StorageError leaves the old one. The zip is streamed into
        the file (numpy writes an array in pieces of 16 MiB): no copy of the arrays is made in memory."""
        payload = {f"a/{k}": v for k, v in arrays.items()}
        payload["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        atomic_write(self.disk, self.path, lambda out: np.savez(out, **payload),  # type: ignore[arg-type]
                     checkpoint=True)
