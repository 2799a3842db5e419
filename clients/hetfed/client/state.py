"""A client's private state on disk: what its organization keeps across restarts of its process.

After each round the runtime writes the client half's ``private_state()`` with the round it finished to
``<state_dir>/<run>/client-state.pt`` atomically (a temporary file, fsync, rename, fsync of the directory),
and at start it loads the file back into a half built the same way. The file is read with
``torch.load(weights_only=True)``: tensors, numbers, strings and containers only, never arbitrary objects;
numpy arrays are stored as tensors and turned back into arrays.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = 1
FILE_NAME = "client-state.pt"
_NUMPY = "__numpy__"


class StateMismatchError(RuntimeError):
    """The state directory holds state this client cannot resume from (another run, algorithm or seed)."""


@dataclass(frozen=True)
class SavedState:
    """What a client resumes from: the round it finished and its half's private state."""

    round: int
    state: dict[str, Any]
    digest: str


def fsync_directory(path: Path) -> None:
    """Make the names in directory ``path`` durable (after a rename into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pack(value: Any) -> Any:
    """``value`` with every numpy array replaced by a tagged tensor copy (so weights_only loading reads it)."""
    if isinstance(value, np.ndarray):
        return {_NUMPY: torch.from_numpy(np.ascontiguousarray(value).copy())}
    if isinstance(value, Mapping):
        return {k: pack(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(pack(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    return value


def unpack(value: Any) -> Any:
    """Inverse of ``pack``."""
    if isinstance(value, Mapping):
        if set(value) == {_NUMPY}:
            return value[_NUMPY].numpy()
        return {k: unpack(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(unpack(v) for v in value)
    return value


def digest(value: Any) -> str:
    """A SHA-256 over every tensor, array and plain value in ``value``, by key order (bit-exact)."""
    h = hashlib.sha256()

    def walk(v: Any, path: str) -> None:
        if isinstance(v, Mapping):
            for k in sorted(v, key=str):
                walk(v[k], f"{path}/{k}")
        elif isinstance(v, list | tuple):
            for i, item in enumerate(v):
                walk(item, f"{path}[{i}]")
        elif isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"{path}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(v, np.ndarray):
            walk(torch.from_numpy(np.ascontiguousarray(v)), path)
        else:
            h.update(f"{path}={v!r}".encode())

    walk(value, "")
    return h.hexdigest()[:16]


class StateFile:
    """The state file of one organization in one run."""

    def __init__(self, state_dir: str | Path, run: str, identity: Mapping[str, Any]) -> None:
        self.dir = Path(state_dir) / run
        self.path = self.dir / FILE_NAME
        # What must match for a saved state to be resumed: the run, organization, algorithm and seed.
        self.identity = dict(identity)

    def load(self) -> SavedState | None:
        """The saved state, or None when there is none; StateMismatchError when it belongs to something else."""
        if not self.path.exists():
            return None
        try:
            raw = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise StateMismatchError(f"{self.path} cannot be read ({type(exc).__name__}: {exc}); move it away to "
                                "start this organization afresh") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise StateMismatchError(f"{self.path} is not a hetfed client state of format {FORMAT}")
        saved = raw.get("identity", {})
        differ = [f"{k} {saved.get(k)!r} (now {v!r})" for k, v in self.identity.items() if saved.get(k) != v]
        if differ:
            raise StateMismatchError(f"{self.path} holds the state of another run: {', '.join(differ)}; move it away "
                                "to start this organization afresh")
        state = unpack(raw["state"])
        return SavedState(int(raw["round"]), state, digest(state))

    def evaluated(self) -> bool:
        """Whether the saved state is that after the run's evaluate round (False without a readable file)."""
        try:
            raw = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception:
            return False
        saved = raw.get("identity", {}) if isinstance(raw, dict) else {}
        return bool(isinstance(raw, dict) and raw.get("evaluated")
                    and all(saved.get(k) == v for k, v in self.identity.items()))

    def save(self, round_: int, state: Mapping[str, Any], evaluated: bool = False) -> str:
        """Write the state atomically (temporary file, fsync, rename, directory fsync); returns its digest.
        ``evaluated``: this is the state after the run's evaluate round (the organization completed the run)."""
        packed = pack(state)
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            torch.save({"format": FORMAT, "identity": self.identity, "round": int(round_), "evaluated": evaluated,
                        "state": packed}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_directory(self.dir)
        return digest(unpack(packed))
