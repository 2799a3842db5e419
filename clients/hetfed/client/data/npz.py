"""An organization's own data: a directory of ``.npz`` files (``train.npz`` with ``x``, ``y`` and optionally
``domain``; optionally ``test.npz``), read without pickle and checked with messages that name the file."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from hetfed.client.data.config import DataConfig
from hetfed.client.data.core import HOLDOUT_FRACTION, STREAM_HOLDOUT, ArrayDataset, ClientData
from hetfed.client.data.partitions import domain_partition, stratified_holdout


def load_npz_dir(path: str | Path) -> tuple[ArrayDataset, ArrayDataset | None]:
    """Read ``train.npz`` (and ``test.npz`` if present) from an organization's data directory."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(
            f"data.path {str(root)!r} is not a directory; it should hold train.npz (arrays 'x', 'y', optional "
            "'domain') and optionally test.npz"
        )
    train = _read_npz(root / "train.npz")
    test_file = root / "test.npz"
    test = _read_npz(test_file) if test_file.exists() else None
    if test is not None and test.input_shape != train.input_shape:
        raise ValueError(
            f"{test_file}: array 'x' has examples of shape {test.input_shape} but {root / 'train.npz'} has "
            f"{train.input_shape}"
        )
    return train, test


def load_npz(cfg: DataConfig) -> ClientData:
    assert cfg.path is not None  # guaranteed by DataConfig
    root = Path(cfg.path)
    train, test = load_npz_dir(root)
    labels = [train.y] if test is None else [train.y, test.y]
    num_classes = int(max(int(v.max()) for v in labels)) + 1
    i = cfg.client_index
    if cfg.partition == "domain":
        for file, ds in ((root / "train.npz", train), (root / "test.npz", test)):
            if ds is not None and ds.domain is None:
                raise ValueError(f"{file}: partition 'domain' needs an array 'domain' (int, one per example)")
        assert train.domain is not None
        train = train.subset(domain_partition(train.domain, cfg.num_clients)[i])
        if test is not None:
            assert test.domain is not None
            test = test.subset(domain_partition(test.domain, cfg.num_clients)[i])
        name = f"npz[{root.name}, domain {i}]"
        domain = i
    else:
        name = f"npz[{root.name}]"
        domain = declared_domain(train)
    if test is None:
        keep, hold = stratified_holdout(train.y, HOLDOUT_FRACTION, (cfg.seed, STREAM_HOLDOUT, i))
        train, test = train.subset(keep), train.subset(hold)
    return ClientData(
        train=train,
        test=test,
        global_test=None,
        num_classes=num_classes,
        input_shape=train.input_shape,
        name=name,
        domain=domain,
    )


def declared_domain(train: ArrayDataset) -> int:
    """The organization's domain when its train.npz declares one: a ``domain`` array holding a single value
    (-1 when there is no such array or it mixes domains)."""
    if train.domain is None or train.domain.size == 0:
        return -1
    values = np.unique(train.domain)
    return int(values[0]) if values.size == 1 else -1


def _read_npz(file: Path) -> ArrayDataset:
    if not file.is_file():
        raise FileNotFoundError(
            f"{file}: not found; an npz data directory needs train.npz with arrays 'x' and 'y' (optional 'domain')"
        )
    try:
        loaded = np.load(file, allow_pickle=False)
    except (OSError, zipfile.BadZipFile, ValueError, EOFError) as exc:
        raise ValueError(f"{file}: not a readable .npz archive ({exc})") from exc
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ValueError(
            f"{file}: holds a single array, not named arrays 'x' and 'y' (save it with np.savez)"
        )
    arrays: dict[str, np.ndarray] = {}
    with loaded as archive:
        found = list(archive.files)
        missing = [k for k in ("x", "y") if k not in found]
        if missing:
            raise ValueError(
                f"{file}: missing array {', '.join(repr(k) for k in missing)} (found: {', '.join(found) or 'none'})"
            )
        for key in ("x", "y", "domain", "group"):
            if key in found:
                try:
                    arrays[key] = archive[key]
                except (OSError, zipfile.BadZipFile, ValueError, EOFError) as exc:
                    raise ValueError(f"{file}: array {key!r} cannot be read ({exc})") from exc
    x, y = arrays["x"], arrays["y"]
    if x.ndim not in (2, 3, 4) or x.shape[0] == 0:
        raise ValueError(
            f"{file}: array 'x' must be (N, features), (N, H, W) or (N, C, H, W) with N >= 1, got shape {x.shape}"
        )
    if x.dtype.kind not in "uif":
        raise ValueError(f"{file}: array 'x' must be numeric, got dtype {x.dtype}")
    n = x.shape[0]
    xf = x.astype(np.float32) / np.float32(255.0) if x.dtype == np.uint8 else x.astype(np.float32)
    if x.ndim == 3:
        xf = xf[:, None, :, :]
    if not np.all(np.isfinite(xf)):
        raise ValueError(f"{file}: array 'x' contains NaN or infinite values")
    labels = _npz_int_array(file, "y", y, n)
    domain = _npz_int_array(file, "domain", arrays["domain"], n) if "domain" in arrays else None
    groups = _npz_int_array(file, "group", arrays["group"], n) if "group" in arrays else None
    return ArrayDataset(xf, labels, domain, groups)


def _npz_int_array(file: Path, key: str, a: np.ndarray, n: int) -> np.ndarray:
    if a.shape != (n,):
        raise ValueError(f"{file}: array {key!r} must have shape ({n},) to match 'x', got {a.shape}")
    if a.dtype.kind in "f":
        if not np.all(np.isfinite(a)) or not np.all(a == np.round(a)):
            raise ValueError(f"{file}: array {key!r} must hold whole numbers, got non-integer values")
    elif a.dtype.kind not in "iu":
        raise ValueError(f"{file}: array {key!r} must be integer, got dtype {a.dtype}")
    out = a.astype(np.int64)
    if out.min() < 0:
        raise ValueError(f"{file}: array {key!r} must be >= 0, found {out.min()}")
    return out
