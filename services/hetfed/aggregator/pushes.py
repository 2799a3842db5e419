"""A push's durability protocol: logged under the run's lock, made durable outside it, then folded in.

Concurrent pushes share one fsync (group commit); polls, Status and other pushes' checks go on meanwhile.
An update is not folded, and not acknowledged, until it is on disk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetfed.aggregator import run_state as rs
from hetfed.aggregator.algorithms.base import ServerHalf
from hetfed.aggregator.crashpoints import crash_point
from hetfed.aggregator.store import StorageError
from hetfed.aggregator.wal import WalTicket
from hetfed.wire import messages
from hetfed.wire.errors import WireError
from hetfed.wire.messages import ParsedUpdate, PushReply
from hetfed.wire.payloads import Received
from hetfed.wire.phases import Phase
from hetfed.wire.privacy import PrivacyDeclaration
from hetfed.wire.traffic import Direction, TrafficBreakdown, with_envelope

if TYPE_CHECKING:
    from hetfed.aggregator.engine import Run


def log_update(run: Run, organization: str, round_: int, update: ParsedUpdate, digest: bytes,
                        received: Received, phase: Phase, half: ServerHalf) -> WalTicket | PushReply:  # type: ignore[type-arg]
    """Append the checked update to the log under the lock (not yet durable)."""
    with run._lock:
        run._await_commit_locked()  # the last close's checkpoint first: the log then holds this round only
        if run._duplicate_locked(organization, round_, digest):
            return PushReply(accepted=True, duplicate=True, round=round_)
        if organization in run._committing:
            raise WireError("too_many_streams", f"an update of {organization!r} for round {run.round} is being "
                                                "made durable; try again in a moment")
        if run.half is not half or run._stale:  # a failed close changed the half while this was decoded
            run._fresh_locked()
            run.half.validate(phase, organization, received)
        try:
            ticket = run.store.append_update(round_, organization, update.data, digest)
        except StorageError as exc:
            run._storage_failed(exc)
        update.release()  # written: the log has the bytes, the decoded arrays are what is folded
        run._committing.add(organization)
        return ticket

def sync_and_fold(run: Run, organization: str, round_: int, digest: bytes, received: Received, ticket: WalTicket,
                   up: TrafficBreakdown, privacy: PrivacyDeclaration | None = None) -> PushReply:
    """Make the record durable outside the lock (concurrent pushes share one fsync), then fold it in (with the
    privacy it declared, for the organization's ledger). Not folded, not acknowledged until it is on disk."""
    try:
        durable = run.store.sync(ticket)
    except StorageError as exc:
        with run._lock:
            run._committing.discard(organization)
            run.store.repair()  # every record past the last durable point is cut: none was acknowledged
        run._storage_failed(StorageError(run.store.failed_update(organization, round_, exc)))
    with run._lock:
        run._committing.discard(organization)
        rs.check_round(run.state, run.rules, round_)  # the round closed while it was synced: it was cut
        if not durable:
            run._storage_failed(StorageError(run.store.failed_update(
                organization, round_, "it was cut back with the records of a failed fsync")))
        if run._duplicate_locked(organization, round_, digest):  # folded by a rebuild from the log meanwhile
            return PushReply(accepted=True, duplicate=True, round=round_)
        run._fresh_locked()
        run._apply_locked(rs.accept(run.state, run.rules, organization, round_, digest), received, privacy)
        reply = PushReply(accepted=True, duplicate=False, round=round_)
        # Counted before the round can close, so both belong to this round's record.
        run.record_traffic(organization, round_, Direction.UP, up)
        run.record_traffic(organization, round_, Direction.DOWN, with_envelope(TrafficBreakdown(), messages.push_reply_size(reply)))
        # The update is durable: it is acknowledged even when the close it completes must be retried.
        run._try_close_locked()
        crash_point("push.acknowledged")
        return reply
