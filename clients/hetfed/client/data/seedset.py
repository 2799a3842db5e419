"""The shared public seed set D_pub (FedH2L): its arrays, its id and its SHA-256 fingerprint (numpy only).

Every organization of a run holds the same seed set before training. In a local run each one derives
it from the same data config; in a deployment every organization mounts the same ``.npz`` file
(:meth:`SeedSet.save` / :meth:`SeedSet.load`). The aggregator knows only the id and the SHA-256 and
refuses a client whose fingerprint differs. Images are stored as uint8 so the fingerprint does not
depend on floating-point details of the machine that built the file.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

_FORMAT = b"hetfed-seed-set-v1"


def fingerprint(x: np.ndarray, y: np.ndarray, domain: np.ndarray) -> str:
    """SHA-256 over the canonical bytes (dtype, shape, little-endian data) of the three arrays."""
    h = hashlib.sha256(_FORMAT)
    for name, a in (("x", x), ("y", y), ("domain", domain)):
        a = np.ascontiguousarray(a)
        h.update(f"{name}:{a.dtype.newbyteorder('<').str}:{list(a.shape)};".encode())
        h.update(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
    return h.hexdigest()


@dataclass(frozen=True, eq=False)
class SeedSet:
    """Labelled public examples in the common label space, grouped by the domain each came from.

    ``x`` is uint8 (N, C, H, W), ``y`` int64 labels, ``domain`` int64: the domain (organization) whose
    α fraction each example was taken from. A node teaches on its own domain's part.
    """

    id: str
    x: np.ndarray
    y: np.ndarray
    domain: np.ndarray
    sha256: str = field(init=False)

    def __post_init__(self) -> None:
        x = np.ascontiguousarray(self.x)
        if x.dtype != np.uint8 or x.ndim < 2:
            raise ValueError(f"seed set x must be uint8 with shape (N, ...), got {x.dtype} {x.shape}")
        y = np.ascontiguousarray(self.y, dtype=np.int64)
        d = np.ascontiguousarray(self.domain, dtype=np.int64)
        if y.shape != (x.shape[0],) or d.shape != y.shape:
            raise ValueError(f"seed set y and domain must have shape ({x.shape[0]},), got {y.shape} and {d.shape}")
        if not self.id:
            raise ValueError("a seed set needs an id")
        for name, a in (("x", x), ("y", y), ("domain", d)):
            a.flags.writeable = False
            object.__setattr__(self, name, a)
        object.__setattr__(self, "sha256", fingerprint(x, y, d))

    def __len__(self) -> int:
        """Number of public examples."""
        return int(self.y.shape[0])

    def features(self) -> np.ndarray:
        """The images as float32 in [0, 1]."""
        return self.x.astype(np.float32) / np.float32(255.0)

    def part(self, domain: int) -> np.ndarray:
        """Indices of the examples taken from ``domain`` (the part that domain's node teaches on)."""
        return np.flatnonzero(self.domain == domain).astype(np.int64)

    def ranges(self) -> dict[int, tuple[int, int]]:
        """Each domain's part as a contiguous [start, stop) range (a seed set is stored grouped by domain)."""
        out: dict[int, tuple[int, int]] = {}
        for d in np.unique(self.domain):
            idx = self.part(int(d))
            if idx[-1] - idx[0] + 1 != idx.size:
                raise ValueError(f"seed set {self.id!r}: domain {int(d)}'s examples are not contiguous")
            out[int(d)] = (int(idx[0]), int(idx[-1]) + 1)
        return out

    def save(self, path: str | Path) -> None:
        """Write the seed set to an ``.npz`` file that every organization mounts."""
        np.savez(Path(path), id=np.array(self.id), x=self.x, y=self.y, domain=self.domain)

    @classmethod
    def load(cls, path: str | Path) -> SeedSet:
        """Read a seed set written by :meth:`save`; its SHA-256 is recomputed from the arrays."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"seed set file {str(p)!r} not found")
        with np.load(p, allow_pickle=False) as z:
            missing = [k for k in ("id", "x", "y", "domain") if k not in z.files]
            if missing:
                raise ValueError(f"{p}: not a seed set file (missing arrays {missing})")
            return cls(str(z["id"]), z["x"], z["y"], z["domain"])
