"""What a run's readers see without its lock: the parts of its state (``RunState``, replaced whole, never
changed in place, so a read sees one state) and the lock-free admission checks. ``hetfed.aggregator.run.conductor.Run``
is one; the service, the metrics collector and tests read these."""

from __future__ import annotations

from hetfed.aggregator.run.open_round import OpenRound
from hetfed.aggregator.run.state import Rules, RunState, check_member, check_round


class RunView:
    """The lock-free reads of a run (module docstring)."""

    state: RunState
    rules: Rules
    open_round: OpenRound

    phase = property(lambda self: self.state.phase)
    round = property(lambda self: self.state.round)
    schema = property(lambda self: self.state.schema)
    joined = property(lambda self: self.state.joined)
    declared = property(lambda self: self.state.declared)
    examples = property(lambda self: self.state.examples)
    pushed = property(lambda self: self.state.pushed)
    refused = property(lambda self: self.state.refused)
    current = property(lambda self: self.open_round.record)  # the open round's record

    def check_member(self, organization: str) -> None:
        """Refuse an organization that is not in the run, has not joined, or owes its declaration."""
        check_member(self.state, self.rules, organization)

    def admit_push(self, organization: str, round_: int) -> None:
        """Refuse a push from a non-member or for another round before its chunks are read."""
        check_member(self.state, self.rules, organization)
        check_round(self.state, self.rules, round_)
