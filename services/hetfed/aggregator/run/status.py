"""What Status reports of a run, from plain values, and the ``StatusBoard`` that keeps what only Status needs."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from hetfed.aggregator.config import RunConfig
from hetfed.aggregator.journal.history import RoundRecord
from hetfed.aggregator.run.org_ledger import OrganizationLedger
from hetfed.aggregator.run.state import RunState
from hetfed.wire.messages import Refusal, RoundSummary, RunStatus
from hetfed.wire.phases import Phase

# Non-members refused lately that Status lists (their names are the caller's choice: bounded).
MAX_LISTED_STRANGERS = 16


def run_status(cfg: RunConfig, state: RunState, closed: Sequence[RoundSummary], current: RoundRecord,
               ledger: OrganizationLedger, strangers: Mapping[str, tuple[str, str]]) -> RunStatus:
    """The run's state and per-round history: ``closed`` summarises the closed rounds, ``current`` is the open
    round's record, ``strangers`` the non-members refused lately (reason, message)."""
    history = [*closed, *(() if state.phase is Phase.FINISHED else (current.summary(clients=len(state.pushed)),))]
    listed = [*((o, r.reason, r.message) for o, r in sorted(state.refused.items())),
              *((o, r, m) for o, (r, m) in strangers.items())]
    return RunStatus(
        run_id=cfg.id, algorithm=cfg.algorithm, phase=state.phase, round=state.round,
        total_rounds=cfg.rounds, organizations=tuple(cfg.organizations),
        pushed_this_round=tuple(sorted(state.pushed)), history=tuple(history),
        organization_status=ledger.statuses(cfg.organizations, set(state.joined)),
        refused=tuple(Refusal(o, r, m) for o, r, m in listed))


class StatusBoard:
    """What Status shows beyond the run's state: each closed round's summary, built once (runs of thousands of
    rounds are polled several times a second), and the non-members refused lately. Call under the run's lock."""

    def __init__(self) -> None:
        self._summaries: list[RoundSummary] = []  # of history[:len]
        self._strangers: OrderedDict[str, tuple[str, str]] = OrderedDict()

    def stranger(self, organization: str, reason: str, message: str) -> None:
        """A non-member was refused; the oldest beyond ``MAX_LISTED_STRANGERS`` are forgotten."""
        self._strangers[organization] = (reason, message)
        self._strangers.move_to_end(organization)
        while len(self._strangers) > MAX_LISTED_STRANGERS:
            self._strangers.popitem(last=False)

    def status(self, cfg: RunConfig, state: RunState, history: Sequence[RoundRecord], current: RoundRecord,
               ledger: OrganizationLedger) -> RunStatus:
        """The run's Status: the closed rounds' summaries, the open round's built now."""
        self._summaries.extend(rec.summary() for rec in history[len(self._summaries):])
        return run_status(cfg, state, self._summaries, current, ledger, self._strangers)
