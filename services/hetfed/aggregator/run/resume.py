"""Resuming a run at start-up, as plain values: its checkpoint's state and ledger, its committed history, and the
open round's logged updates checked again. The run (``hetfed.aggregator.run.conductor``) adopts what they return."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetfed.aggregator.algorithms.aggregators import drop_pages
from hetfed.aggregator.config import RunConfig
from hetfed.aggregator.journal.checkpoint import CheckpointMeta
from hetfed.aggregator.journal.history import RoundRecord
from hetfed.aggregator.journal.store import Recovered, RunConflictError, StateError
from hetfed.aggregator.run.org_ledger import OrganizationLedger
from hetfed.aggregator.run.state import Rules, RunState
from hetfed.wire import contract
from hetfed.wire import digest as content
from hetfed.wire.errors import WireError, clip
from hetfed.wire.messages import ParsedUpdate
from hetfed.wire.payloads import Received
from hetfed.wire.phases import Phase
from hetfed.wire.privacy import PrivacyDeclaration

log = logging.getLogger("hetfed.aggregator")


@dataclass(frozen=True)
class Restored:
    """What a run's checkpoint and history say: its state, history, ledger and server-half arrays."""

    state: RunState
    history: list[RoundRecord]
    ledger: OrganizationLedger
    arrays: dict[str, np.ndarray]


@dataclass(frozen=True)
class Logged:
    """An update of the open round read back from the log and checked again."""

    organization: str
    received: Received
    digest: bytes
    privacy: PrivacyDeclaration | None


def restored(loaded: Recovered, cfg: RunConfig, rules: Rules, checkpoint: Path, history: Path) -> Restored:
    """Parse what the journal recovered; ``RunConflictError`` when another algorithm wrote it, ``StateError``
    naming the file when it is invalid."""
    meta = CheckpointMeta.from_json(loaded.meta)
    if meta.algorithm is not None and meta.algorithm != cfg.algorithm:
        raise RunConflictError(f"run {cfg.id!r}: its state in {checkpoint.parent} was written by algorithm "
                               f"{meta.algorithm!r}, the config now names {cfg.algorithm!r}; give the run a "
                               "new id, or remove that directory to start it over")
    try:
        records = [RoundRecord.from_json(r) for r in loaded.history]
    except (KeyError, ValueError, TypeError) as exc:
        raise StateError(f"run {cfg.id!r}: {history} holds an invalid record "
                         f"({type(exc).__name__}: {exc})") from None
    try:
        state = RunState.from_json(meta.state, rules, len(records))
        ledger = OrganizationLedger.from_json(dict(meta.organizations or {}))
    except (KeyError, ValueError, TypeError) as exc:
        raise StateError(f"run {cfg.id!r}: {checkpoint} holds invalid metadata ({type(exc).__name__}: {exc})") \
            from None
    return Restored(state, records, ledger, loaded.arrays)


def load_arrays(load: Callable[[dict[str, np.ndarray]], None], arrays: dict[str, np.ndarray],
                cfg: RunConfig, checkpoint: Path) -> None:
    """Load a checkpoint's arrays into the server half; ``RunConflictError`` when they do not fit it."""
    try:
        load(arrays)
    except Exception as exc:
        raise RunConflictError(f"run {cfg.id!r}: the arrays in {checkpoint} do not fit algorithm "
                               f"{cfg.algorithm!r} as configured ({type(exc).__name__}: {exc}); give the "
                               "run a new id, or remove its state directory to start it over") from None


def parse_logged(org: str, data: bytes | memoryview, cfg: RunConfig, phase: Phase, round_: int,
                 schema: contract.Schema, max_tensor_elements: int, scan: bool = True,
                 ) -> tuple[ParsedUpdate, Received]:
    """A logged update parsed and checked again (its arrays view ``data``; ``scan``: see
    ``contract.check_update``); ``WireError`` when it no longer passes. The pages of a mapped log that the
    checks read are given back at once."""
    if org not in cfg.organizations:
        raise WireError("unknown_organization", f"{clip(org, 64)!r} is not part of the run")
    parsed = ParsedUpdate(data)
    try:
        # A secure run's training update carries its masked input in place of the summed kinds.
        secure = cfg.secure_aggregation and phase is Phase.TRAIN
        return parsed, parsed.check(cfg.spec, phase, schema, max_tensor_elements, cfg.id, round_, org, scan, secure)
    finally:
        drop_pages(np.frombuffer(data, np.uint8))


def logged_updates(logged: Iterable[tuple[str, bytes | memoryview]], cfg: RunConfig, phase: Phase, round_: int,
                   schema: contract.Schema, max_tensor_elements: int) -> list[Logged]:
    """The open round's logged updates, checked again, with the privacy each declared; one that no longer passes
    is skipped (and logged)."""
    out = []
    for org, data in logged:
        try:
            parsed, update = parse_logged(org, data, cfg, phase, round_, schema, max_tensor_elements)
        except WireError as err:
            log.error("run %s: the logged update of %r for round %d is skipped (%s); the organization is asked "
                      "for it again", cfg.id, clip(org, 64), round_, err)
            continue
        out.append(Logged(org, update, content.digest(data), parsed.privacy))
    return out
