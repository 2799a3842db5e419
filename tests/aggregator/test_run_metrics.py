"""The per-run families: computed from the persisted round history, so an aggregator restart keeps them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hetfed.aggregator.journal.history import RoundRecord
from hetfed.aggregator.observe.run_metrics import rounds_missed, weighted_accuracy
from hetfed.aggregator.serving.server import RunningAggregator
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from hetfed.wire.phases import Phase
from tests.conftest import RawClient, run_config

W = np.array([1.0, 2.0, 3.0], np.float32)
DECL = [(PayloadKind.MODEL_WEIGHTS, "w", W)]
RUN = {"run": "r", "algorithm": "fedavg"}


def value(agg: RunningAggregator, name: str, **labels: str) -> float | None:
    return agg.service.metrics.registry.get_sample_value(name, {**RUN, **labels})


def run_bytes(agg: RunningAggregator) -> dict[tuple[str, str, str], float]:
    """hetfed_run_bytes_total by (phase, direction, payload_kind)."""
    out = {}
    for fam in agg.service.metrics.registry.collect():
        for s in fam.samples:
            if s.name == "hetfed_run_bytes_total" and s.labels["run"] == "r":
                out[(s.labels["phase"], s.labels["direction"], s.labels["payload_kind"])] = s.value
    return out


def history_bytes(status: apb.RunStatus) -> dict[tuple[str, str], int]:
    """Status history traffic by (direction, payload_kind), as results.json sums it."""
    out: dict[tuple[str, str], int] = {}
    for rec in status.history:
        for t in rec.traffic:
            out[(t.direction, t.payload_kind)] = out.get((t.direction, t.payload_kind), 0) + t.bytes
    return out


def by_kind(b: dict[tuple[str, str, str], float]) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for (_phase, direction, kind), n in b.items():
        out[(direction, kind)] = out.get((direction, kind), 0) + n
    return out


def test_run_families_survive_a_restart_and_match_the_history(
    aggregator: Callable[..., RunningAggregator], raw_client: Callable[..., RawClient]
) -> None:
    cfg = run_config(rounds=1, fedavg_model_bytes=12, round_deadline_seconds=300)
    agg = aggregator(cfg)
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a.join(DECL)
    b.join(DECL)
    a.push(1, [ModelWeights({"w": W}, 1), EvalMetrics(test_accuracy=0.5, num_test_examples=1)])
    b.push(1, [ModelWeights({"w": W}, 1), EvalMetrics(test_accuracy=1.0, num_test_examples=3)])

    before = run_bytes(agg)
    assert {k[0] for k in before} == {"train"}
    status = a.stub.Status(apb.StatusRequest(run_id="r"), timeout=5).runs[0]
    # The open evaluate round has had no traffic yet: the run's bytes are the closed round's.
    assert by_kind(before) == history_bytes(status)
    assert value(agg, "hetfed_run_rounds_closed_total", phase="train") == 1
    assert value(agg, "hetfed_run_rounds_closed_total", phase="evaluate") == 0
    assert value(agg, "hetfed_run_test_accuracy") == (0.5 * 1 + 1.0 * 3) / 4
    assert value(agg, "hetfed_run_fedavg_reference_bytes_total") == 2 * 2 * 12
    assert value(agg, "hetfed_run_finished") == 0
    assert value(agg, "hetfed_run_final_test_accuracy") is None
    assert value(agg, "hetfed_run_organizations") == 2
    assert value(agg, "hetfed_run_round_deadline_seconds") == 300
    assert 0 <= value(agg, "hetfed_run_round_age_seconds") < 300  # type: ignore[operator]
    assert value(agg, "hetfed_run_organization_rounds_missed", organization="b") == 0
    assert value(agg, "hetfed_run_last_round_bytes", direction="up") == sum(
        n for (d, _k), n in history_bytes(status).items() if d == "up")

    agg.stop(grace=0.5)
    agg = aggregator(cfg)  # same state directory
    assert run_bytes(agg) == before
    assert value(agg, "hetfed_run_test_accuracy") == 0.875
    assert value(agg, "hetfed_run_fedavg_reference_bytes_total") == 48
    # The process counters start from zero; the run's cumulative figures do not.
    assert value(agg, "hetfed_aggregator_bytes_total", organization="a", direction="up",
                 payload_kind="model_weights") is None

    a2, b2 = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a2.push(2, [EvalMetrics(test_accuracy=0.25, num_test_examples=1)])
    b2.push(2, [EvalMetrics(test_accuracy=0.75, num_test_examples=1)])
    status = a2.stub.Status(apb.StatusRequest(run_id="r"), timeout=5).runs[0]
    assert status.state == apb.RUN_STATE_FINISHED
    assert value(agg, "hetfed_run_finished") == 1
    assert value(agg, "hetfed_run_final_test_accuracy") == 0.5
    assert value(agg, "hetfed_run_round_age_seconds") == 0
    assert value(agg, "hetfed_run_rounds_closed_total", phase="train") == 1
    assert value(agg, "hetfed_run_rounds_closed_total", phase="evaluate") == 1
    after = run_bytes(agg)
    assert by_kind(after) == history_bytes(status)
    assert {k[0] for k in after} == {"train", "evaluate"}
    # The evaluate round is not a train round: FedAvg's reference stays at one round's worth.
    assert value(agg, "hetfed_run_fedavg_reference_bytes_total") == 48


def test_rounds_missed_counts_back_from_the_last_round() -> None:
    def rec(n: int, phase: str, orgs: str) -> RoundRecord:
        r = RoundRecord(n, Phase(phase), 0.0)
        r.reports = {o: EvalMetrics() for o in orgs}
        return r

    history = [rec(0, "setup", ""), rec(1, "train", "ab"), rec(2, "train", "a"), rec(3, "train", "a"),
               rec(4, "evaluate", "a")]
    assert rounds_missed(history, "a") == 0
    assert rounds_missed(history, "b") == 3
    assert rounds_missed(history, "c") == 4  # never seen: every non-setup round
    assert rounds_missed([], "a") == 0


def test_weighted_accuracy_weights_by_test_examples() -> None:
    reports: dict[str, Any] = {"a": EvalMetrics(test_accuracy=1.0, num_test_examples=1),
                               "b": EvalMetrics(test_accuracy=0.0, num_test_examples=3)}
    assert weighted_accuracy(reports) == 0.25
    assert weighted_accuracy({"a": EvalMetrics(test_accuracy=1.0, num_test_examples=0)}) is None
