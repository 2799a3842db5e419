"""What Status reports of a run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetfed.wire.messages import Refusal, RunStatus
from hetfed.wire.phases import Phase

if TYPE_CHECKING:
    from hetfed.aggregator.engine import Run


def run_status(run: Run) -> RunStatus:
    """The run's state and per-round history (call with the run's lock held)."""
    # Closed rounds never change: each one's summary is built once (runs of thousands of rounds
    # are polled several times a second), the open round's every time.
    run._summaries.extend(rec.summary() for rec in run.history[len(run._summaries):])
    history = [*run._summaries, *(() if run.phase is Phase.FINISHED else
                                   (run.current.summary(clients=len(run.pushed)),))]
    listed = [*((o, r.reason, r.message) for o, r in sorted(run.refused.items())),
              *((o, r, m) for o, (r, m) in run._strangers.items())]
    return RunStatus(
        run_id=run.cfg.id, algorithm=run.cfg.algorithm, phase=run.phase, round=run.round,
        total_rounds=run.cfg.rounds, organizations=tuple(run.cfg.organizations),
        pushed_this_round=tuple(sorted(run.pushed)), history=tuple(history),
        organization_status=run.ledger.statuses(run.cfg.organizations, set(run.joined)),
        refused=tuple(Refusal(o, r, m) for o, r, m in listed))
