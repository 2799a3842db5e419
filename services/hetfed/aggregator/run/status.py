"""What Status reports of a run, from plain values."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hetfed.aggregator.config import RunConfig
from hetfed.aggregator.journal.history import RoundRecord
from hetfed.aggregator.run.org_ledger import OrganizationLedger
from hetfed.aggregator.run.state import RunState
from hetfed.wire.messages import Refusal, RoundSummary, RunStatus
from hetfed.wire.phases import Phase


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
