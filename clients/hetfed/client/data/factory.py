"""An organization's own data from its data factory: ``data.factory = "package.module:function"``.

The factory takes one :class:`DataContext` and returns a mapping:

- ``train``, ``test``: map-style datasets, ``ds[i] -> (x, label)`` (required);
- ``num_classes``: the label space 0..num_classes-1 (required);
- ``eval``: further held-out sets by name, reported as ``<name>_accuracy`` (``global_test`` and ``cross_test``
  fill the ClientData fields of those names);
- ``seed_set`` (a :class:`SeedSet`, for FedH2L) and ``domain`` (int);
- ``name``: how the client shows the data.

Labels come from a dataset's ``targets`` when it has them, else from one pass over the dataset; group ids (a
patient, a device: ``privacy.unit = "group"``) from its ``groups`` when it has them. Everything is
checked once, at load, with one-line :class:`DataFactoryError` messages. This module imports torch only when
a factory is loaded, so validating a config stays light.
"""

from __future__ import annotations

import functools
import importlib
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from hetfed.client.data.config import DataConfig
from hetfed.client.data.core import ClientData, Examples, StreamedDataset, as_groups
from hetfed.client.data.seedset import SeedSet

REQUIRED_KEYS = ("train", "test", "num_classes")
OPTIONAL_KEYS = ("eval", "seed_set", "domain", "name")
# Names of the organization's own sets, refused for an eval set (an eval set's name becomes a metric name);
# eval sets named "global_test" or "cross_test" fill ClientData's fields of those names.
_RESERVED_EVAL = frozenset({"train", "test"})
_EVAL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_LABEL_BATCH = 256


class DataFactoryError(ValueError):
    """An organization's own data (its data factory or its image folder) cannot be used; one line says why."""


@dataclass(frozen=True)
class DataContext:
    """What a data factory is told: the organization's data path, its place in the federation, the data seed
    and its free-form ``data.options``."""

    path: str | None
    client_index: int
    num_clients: int
    seed: int
    options: dict[str, str] = field(default_factory=dict)


def describe_exception(exc: BaseException) -> str:
    """An exception as one line: its type and its message with whitespace collapsed."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def resolve_factory(reference: str) -> Callable[[DataContext], Any]:
    """The function ``"package.module:function"`` names; a DataFactoryError when it cannot be imported."""
    module_name, sep, name = reference.partition(":")
    if not sep or not module_name or not name:
        raise DataFactoryError(f"data.factory must be \"package.module:function\", got {reference!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name and module_name.startswith(exc.name):
            hint = "; install it in the client image or put it on PYTHONPATH"
        raise DataFactoryError(f"data.factory {reference!r}: cannot import module {module_name!r} "
                               f"({describe_exception(exc)}){hint}") from exc
    fn = getattr(module, name, None)
    if fn is None:
        raise DataFactoryError(f"data.factory {reference!r}: module {module_name!r} has no attribute {name!r}")
    if not callable(fn):
        raise DataFactoryError(f"data.factory {reference!r}: {name!r} is a {type(fn).__name__}, not a function")
    return fn  # type: ignore[no-any-return]


def load_factory(cfg: DataConfig) -> ClientData:
    """The organization's data from its factory (called once per config and process), checked."""
    data = _from_factory(cfg.factory, cfg.path, cfg.client_index, cfg.num_clients, cfg.seed,
                         tuple(sorted(cfg.options.items())), cfg.num_workers)
    if cfg.seed_set_path:  # every organization mounts the same file; it replaces the factory's seed set
        public = SeedSet.load(cfg.seed_set_path)
        _check_seed_set(cfg.factory, public, data.input_shape, f"data.seed_set_path {cfg.seed_set_path!r}")
        data = replace(data, public=public)
    return data


def load_factory_seed_set(cfg: DataConfig) -> SeedSet | None:
    """The shared seed set: the mounted ``seed_set_path`` when set, else the factory's (None if it gives none)."""
    return load_factory(cfg).public


@functools.lru_cache(maxsize=4)
def _from_factory(reference: str, path: str | None, client_index: int, num_clients: int, seed: int,
                  options: tuple[tuple[str, str], ...], num_workers: int) -> ClientData:
    fn = resolve_factory(reference)
    context = DataContext(path, client_index, num_clients, seed, dict(options))
    try:
        result = fn(context)
    except Exception as exc:
        raise DataFactoryError(f"data.factory {reference!r} raised {describe_exception(exc)}") from exc
    return _client_data(reference, result, num_workers)


def _client_data(ref: str, result: object, num_workers: int) -> ClientData:
    if not isinstance(result, Mapping):
        raise DataFactoryError(f"data.factory {ref!r} returned {type(result).__name__}, expected a mapping with "
                               f"keys {', '.join(map(repr, REQUIRED_KEYS))}")
    unknown = sorted(str(k) for k in result if k not in REQUIRED_KEYS + OPTIONAL_KEYS)
    if unknown:
        raise DataFactoryError(f"data.factory {ref!r} returned unknown key(s) {', '.join(map(repr, unknown))} "
                               f"(allowed: {', '.join(REQUIRED_KEYS + OPTIONAL_KEYS)})")
    missing = [k for k in REQUIRED_KEYS if k not in result]
    if missing:
        raise DataFactoryError(f"data.factory {ref!r} returned no {', '.join(map(repr, missing))} "
                               f"(it must return {', '.join(map(repr, REQUIRED_KEYS))})")
    num_classes = result["num_classes"]
    if isinstance(num_classes, bool) or not isinstance(num_classes, int | np.integer) or num_classes < 1:
        raise DataFactoryError(f"data.factory {ref!r}: num_classes must be a positive integer, got {num_classes!r}")
    k = int(num_classes)
    train = _streamed(ref, "train set", result["train"], k, num_workers, None)
    shape = train.input_shape
    test = _streamed(ref, "test set", result["test"], k, num_workers, shape)
    evals = result.get("eval") or {}
    if not isinstance(evals, Mapping):
        raise DataFactoryError(f"data.factory {ref!r}: eval must map names to datasets, got {type(evals).__name__}")
    extra: dict[str, Examples] = {}
    for name, ds in evals.items():
        if not isinstance(name, str) or not _EVAL_NAME.fullmatch(name) or name in _RESERVED_EVAL:
            raise DataFactoryError(f"data.factory {ref!r}: eval set name {name!r} must be letters, digits and _ "
                                   f"(starting with a letter) and none of {', '.join(sorted(_RESERVED_EVAL))}")
        extra[name] = _streamed(ref, f"eval set {name!r}", ds, k, num_workers, shape)
    public = result.get("seed_set")
    if public is not None:
        if not isinstance(public, SeedSet):
            raise DataFactoryError(f"data.factory {ref!r}: seed_set must be a hetfed.client.data.SeedSet, "
                                   f"got {type(public).__name__}")
        _check_seed_set(ref, public, shape, "its seed_set")
    domain = result.get("domain", -1)
    if isinstance(domain, bool) or not isinstance(domain, int | np.integer) or domain < -1:
        raise DataFactoryError(f"data.factory {ref!r}: domain must be an integer >= 0 (or -1: none), got {domain!r}")
    name = result.get("name", f"torch[{ref}]")
    if not isinstance(name, str) or not name:
        raise DataFactoryError(f"data.factory {ref!r}: name must be a non-empty string, got {name!r}")
    global_test, cross_test = extra.pop("global_test", None), extra.pop("cross_test", None)
    return ClientData(train=train, test=test, global_test=global_test, num_classes=k, input_shape=shape, name=name,
                      cross_test=cross_test, public=public, domain=int(domain), extra_eval=extra)


def _check_seed_set(ref: str, public: SeedSet, shape: tuple[int, ...], what: str) -> None:
    if tuple(public.x.shape[1:]) != shape:
        raise DataFactoryError(f"data.factory {ref!r}: {what} holds examples of shape {tuple(public.x.shape[1:])} "
                               f"but the train set's are {shape}")


def _streamed(ref: str, what: str, ds: object, num_classes: int, num_workers: int,
              shape: tuple[int, ...] | None) -> StreamedDataset:
    """``ds`` checked (map-style, not empty, same input shape, labels in range) as the client streams it."""
    from torch.utils.data import IterableDataset

    where = f"data.factory {ref!r}: the {what}"
    if isinstance(ds, IterableDataset) or not (hasattr(type(ds), "__getitem__") and hasattr(type(ds), "__len__")):
        raise DataFactoryError(f"{where} is a {type(ds).__name__}, not a map-style Dataset (ds[i] -> (x, label) "
                               "with len(ds))")
    n = len(ds)  # type: ignore[arg-type]
    if n == 0:
        raise DataFactoryError(f"{where} is empty")
    first = _example(where, ds, 0)
    _label(where, 0, first[1])
    x_shape = tuple(int(s) for s in first[0].shape)
    if not x_shape or 0 in x_shape:
        raise DataFactoryError(f"{where}: example 0's input has shape {x_shape}; it needs at least one dimension "
                               "and no empty one")
    if shape is not None and x_shape != shape:
        raise DataFactoryError(f"{where}: example 0 has shape {x_shape} but the train set's have {shape}")
    labels = _labels(where, ds, n, num_workers)
    bad = (labels < 0) | (labels >= num_classes)
    if bad.any():
        values, counts = np.unique(labels[bad], return_counts=True)
        listed = ", ".join(f"{v} ({c} example{'s' if c > 1 else ''})" for v, c in zip(values, counts, strict=True))
        raise DataFactoryError(f"{where} has {int(bad.sum())} label(s) outside 0..{num_classes - 1}: {listed}")
    groups = getattr(ds, "groups", None)
    if groups is not None:  # one group id per example (a patient, a device): privacy.unit = "group"
        try:
            groups = as_groups(groups, n, "groups")
        except ValueError as exc:
            raise DataFactoryError(f"{where}: {exc}") from None
    examples = FactoryExamples(ds, x_shape, where)
    return StreamedDataset(examples, labels, x_shape, name=f"{ref} {what}", groups=groups)


class FactoryExamples:
    """A factory's map-style dataset as the client reads it: ``(float32 tensor of input_shape, int label)``."""

    def __init__(self, dataset: Any, input_shape: tuple[int, ...], where: str) -> None:
        self.dataset = dataset
        self.input_shape = input_shape
        self.where = where

    def __len__(self) -> int:
        """Number of examples."""
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        """Example ``index`` as a float32 tensor and an int label (its shape checked)."""
        x, label = _example(self.where, self.dataset, index)
        if tuple(x.shape) != self.input_shape:
            raise DataFactoryError(f"{self.where}: example {index} has shape {tuple(x.shape)} but example 0 has "
                                   f"{self.input_shape}")
        return x, _label(self.where, index, label)


def _example(where: str, ds: Any, index: int) -> tuple[Any, Any]:
    import torch

    try:
        item = ds[index]
    except Exception as exc:
        raise DataFactoryError(f"{where}: reading example {index} raised {describe_exception(exc)}") from exc
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise DataFactoryError(f"{where}: example {index} is a {type(item).__name__}, expected a pair (x, label)")
    try:
        x = torch.as_tensor(item[0], dtype=torch.float32)
    except Exception as exc:
        raise DataFactoryError(f"{where}: example {index}'s input is not numeric ({describe_exception(exc)})") from exc
    return x, item[1]


def _label(where: str, index: int, label: Any) -> int:
    try:
        return operator.index(label)
    except TypeError:
        raise DataFactoryError(f"{where}: example {index}'s label {label!r} is not an integer") from None


def _labels(where: str, ds: Any, n: int, num_workers: int) -> np.ndarray:
    """Every label of ``ds``: its ``targets`` when it has them, else one pass through a DataLoader."""
    targets = getattr(ds, "targets", None)
    if targets is not None:
        if hasattr(targets, "detach"):
            targets = targets.detach().cpu().numpy()
        y = np.asarray(targets)
        if y.shape != (n,):
            raise DataFactoryError(f"{where}: targets has shape {y.shape} but the set holds {n} examples")
        if y.dtype.kind not in "iu":
            raise DataFactoryError(f"{where}: targets must be integers, got dtype {y.dtype}")
        return y.astype(np.int64)
    from torch.utils.data import DataLoader

    loader = DataLoader(ds, batch_size=_LABEL_BATCH, shuffle=False, num_workers=num_workers,
                        collate_fn=_labels_only)
    labels: list[int] = []
    try:
        for batch in loader:
            labels.extend(batch)
    except DataFactoryError as exc:
        raise DataFactoryError(f"{where}: {_last_line(exc)}") from exc
    except Exception as exc:
        raise DataFactoryError(f"{where}: reading its labels raised {_last_line(exc)}") from exc
    if len(labels) != n:
        raise DataFactoryError(f"{where}: len() says {n} examples but reading them gave {len(labels)}")
    return np.asarray(labels, dtype=np.int64)


def _last_line(exc: BaseException) -> str:
    """One line for an exception raised here or in a DataLoader worker (whose message carries a traceback)."""
    text = str(exc)
    if "Original Traceback" in text:  # from a worker: the traceback's last line is the original exception
        last = text.strip().splitlines()[-1].strip()
        return last.split("DataFactoryError: ", 1)[-1] if isinstance(exc, DataFactoryError) else last
    return " ".join(text.split()) if isinstance(exc, DataFactoryError) else describe_exception(exc)


def _labels_only(batch: list[Any]) -> list[int]:
    """A DataLoader collate function keeping only each example's label (an int)."""
    out: list[int] = []
    for item in batch:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise DataFactoryError(f"an example is a {type(item).__name__}, expected a pair (x, label)")
        try:
            out.append(operator.index(item[1]))
        except TypeError:
            raise DataFactoryError(f"label {item[1]!r} is not an integer") from None
    return out
