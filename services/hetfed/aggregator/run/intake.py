"""A pushed update's way in, from its claim to the disk: the ``Intake``.

A push that is not a duplicate claims its organization's place in the journal (no other update of it comes in
meanwhile), is checked outside the run's lock (``admission.check_push``), appended to the journal's log under the
lock, and made durable outside it, where concurrent pushes share one fsync. The run (``conductor.Run``) then settles
it under its lock and folds it in: nothing is folded, nor acknowledged, before it is on disk.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from hetfed.aggregator.config import RunConfig
from hetfed.aggregator.journal.journal import Journal
from hetfed.aggregator.run import admission
from hetfed.aggregator.run.admission import Limits
from hetfed.aggregator.run.aggregation import Aggregation, Half
from hetfed.aggregator.run.secure_stages import SecureStages
from hetfed.aggregator.run.state import Rules, RunState, check_round
from hetfed.wire.errors import WireError
from hetfed.wire.messages import ParsedUpdate
from hetfed.wire.payloads import Received
from hetfed.wire.privacy import PrivacyDeclaration


@dataclass(frozen=True)
class Claim:
    """A claimed push: the state and the server half its update is checked against, and the organization's last
    accepted privacy declaration (it changes only when an update of it is folded: none can be meanwhile)."""

    organization: str
    round: int
    state: RunState
    half: Half
    last: PrivacyDeclaration | None


class Intake:
    """Takes one run's updates in; ``lock`` is the run's lock, ``state`` reads the run's current state."""

    def __init__(self, cfg: RunConfig, limits: Limits, max_examples: int, rules: Rules, journal: Journal,
                 aggregation: Aggregation, lock: threading.RLock, state: Callable[[], RunState],
                 secure: SecureStages | None = None) -> None:
        self.cfg, self.limits, self.max_examples, self.rules = cfg, limits, max_examples, rules
        self.stages = secure  # a secure round's stages (its updates carry masked inputs)
        self.journal, self.aggregation, self._lock, self._state = journal, aggregation, lock, state

    def claim_locked(self, organization: str, round_: int, last: PrivacyDeclaration | None) -> Claim:
        """Claim the organization's place in the log; ``too_many_streams`` while another update of it comes in."""
        self.journal.claim_locked(organization, round_)
        try:
            state = self._state()
            return Claim(organization, round_, state, self.aggregation.current(state), last)
        except WireError:
            self.journal.settle_locked(organization)
            raise

    def secure(self, state: RunState) -> bool:
        """Whether the round of ``state`` aggregates securely (its updates carry masked inputs)."""
        return self.stages is not None and self.stages.active(state)

    def take(self, claim: Claim, update: ParsedUpdate, digest: bytes) -> tuple[Received, bool]:
        """Check the claimed update, log it and make it durable: the decoded update, for the run to settle
        (``settle_locked``, with the second value) and fold. The claim is given up when the update is refused on
        its way."""
        org, round_ = claim.organization, claim.round
        try:
            received = admission.check_push(self.cfg, self.limits, self.max_examples, claim.state, org, round_,
                                            update, claim.half, claim.last, self.secure(claim.state))
            with self._lock:
                # The last close's checkpoint first: the log holds this round. Awaiting it releases the lock,
                # so the state is read after it; the round may have closed meanwhile.
                self.journal.await_commit_locked(self._state().round - 1)
                state = self._state()
                check_round(state, self.rules, round_)
                if self.stages is not None and self.secure(state):  # one the round's coordinator would take
                    self.stages.admit(state, org)
                else:
                    self.aggregation.revalidate(state, org, received, claim.half)
                ticket = self.journal.log_locked(org, round_, update.data, digest)
        except BaseException:
            with self._lock:
                self.journal.settle_locked(org)
            raise
        update.release()  # written: the log has the bytes, the decoded arrays are what is folded
        return received, self.journal.sync(org, round_, ticket)

    def settle_locked(self, claim: Claim, durable: bool) -> None:
        """The claimed update is no longer on its way in; ``late`` when its round closed while it was synced (it
        was cut), ``storage_unavailable`` when a failed fsync of another record cut it back."""
        self.journal.settle_locked(claim.organization)
        check_round(self._state(), self.rules, claim.round)
        if not durable:
            self.journal.refuse_cut(claim.organization, claim.round)
