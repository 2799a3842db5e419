"""Resuming a run at start-up: its checkpoint, committed history and the open round's logged updates."""

from __future__ import annotations

import hashlib
import logging
import time
from typing import TYPE_CHECKING

from hetfed.aggregator import run_state as rs
from hetfed.aggregator.checkpoint import CheckpointMeta
from hetfed.aggregator.history import RoundRecord
from hetfed.aggregator.org_ledger import OrganizationLedger
from hetfed.aggregator.store import RunConflictError, StateError, StorageError
from hetfed.wire.errors import WireError
from hetfed.wire.messages import ParsedUpdate
from hetfed.wire.payloads import Received
from hetfed.wire.phases import Phase
from hetfed.wire.privacy import PrivacyDeclaration
from hetfed.wire.rpc import clip

if TYPE_CHECKING:
    from hetfed.aggregator.engine import Run

log = logging.getLogger("hetfed.aggregator")


def restore(run: Run) -> None:
    """Read the run's durable state back (a new run writes its first checkpoint) and replay the open round's
    logged updates; StateError or RunConflictError when it cannot be resumed."""
    try:
        loaded = run.store.recover()
    except StateError as exc:
        raise StateError(f"run {run.cfg.id!r}: {exc}") from None
    if loaded is None:
        try:
            run.store.save_checkpoint(run._meta().to_json(), run.half.state())
        except StorageError as exc:
            raise StateError(f"run {run.cfg.id!r}: cannot write its first checkpoint: {exc}") from None
        return
    meta, where = CheckpointMeta.from_json(loaded.meta), run.store.checkpoint_path
    if meta.algorithm is not None and meta.algorithm != run.cfg.algorithm:
        raise RunConflictError(f"run {run.cfg.id!r}: its state in {run.store.dir} was written by algorithm "
                               f"{meta.algorithm!r}, the config now names {run.cfg.algorithm!r}; give the run a "
                               "new id, or remove that directory to start it over")
    try:
        run.history = [RoundRecord.from_json(r) for r in loaded.history]
    except (KeyError, ValueError, TypeError) as exc:
        raise StateError(f"run {run.cfg.id!r}: {run.store.history_path} holds an invalid record "
                         f"({type(exc).__name__}: {exc})") from None
    try:
        run.state = rs.RunState.from_json(meta.state, run.rules, len(run.history))
        run.ledger = OrganizationLedger.from_json(dict(meta.organizations or {}))
    except (KeyError, ValueError, TypeError) as exc:
        raise StateError(f"run {run.cfg.id!r}: {where} holds invalid metadata ({type(exc).__name__}: {exc})") \
            from None
    try:
        run.half.load_state(loaded.arrays)
    except Exception as exc:
        raise RunConflictError(f"run {run.cfg.id!r}: the arrays in {where} do not fit algorithm "
                               f"{run.cfg.algorithm!r} as configured ({type(exc).__name__}: {exc}); give the "
                               "run a new id, or remove its state directory to start it over") from None
    run.observer.restored(run.refused)
    run.current = RoundRecord(run.round, run.phase, time.monotonic())
    run._deadline_armed = bool(run.joined)
    if run.phase is Phase.FINISHED:
        run.store.drop_rounds_before(run.round + 1)
        log.info("run %s resumed finished after %d rounds", run.cfg.id, len(run.history))
        return
    replayed = logged_updates(run)
    for org, received, digest, privacy in replayed:  # their declarations bring the ledger's last ε up to date
        run._apply_locked(rs.accept(run.state, run.rules, org, run.round, digest), received, privacy)
    log.info("run %s resumed at %s round %d with %d stored updates", run.cfg.id, run.phase.value,
             run.round, len(replayed))
    run._try_close_locked()


def logged_updates(run: Run) -> list[tuple[str, Received, bytes, PrivacyDeclaration | None]]:
    """The open round's logged updates, checked again, with the privacy each declared; one that no longer passes
    is skipped (and logged)."""
    out = []
    for org, data in run.store.updates(run.round):
        try:
            if org not in run.cfg.organizations:
                raise WireError("unknown_organization", f"{clip(org, 64)!r} is not part of the run")
            parsed = ParsedUpdate(data)
            update = parsed.check(run.spec, run.phase, run.schema, run.limits.max_tensor_elements, run.cfg.id,
                                  run.round, org)
        except WireError as err:
            log.error("run %s: the logged update of %r for round %d is skipped (%s); the organization is asked "
                      "for it again", run.cfg.id, clip(org, 64), run.round, err)
            continue
        out.append((org, update, hashlib.sha256(data).digest(), parsed.privacy))
    return out


def rebuild(run: Run) -> None:
    """The server half rebuilt from the checkpoint and the open round's logged updates (after a close that
    failed to persist left it ahead of the disk)."""
    try:
        _, arrays = run.store.read_checkpoint()
        half = run._new_half()
        half.load_state(arrays)
        for org, received, _, _ in logged_updates(run):
            if org in run.pushed:
                half.accumulate(run.phase, org, run._weighted(org, received))
    except (StateError, OSError) as exc:
        raise WireError("storage_unavailable", f"run {run.cfg.id!r} cannot reload its state after a failed "
                                               f"write ({exc})") from None
    run.half, run._stale = half, False
    log.info("run %s: server state rebuilt from the checkpoint and %d logged updates", run.cfg.id,
             len(run.pushed))
