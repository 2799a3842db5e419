"""Figures an organization withheld under its privacy settings, as every tool shows them: "withheld", never 0 and
never averaged in as 0 (results.json, hetfed run's table and progress lines, hetfed report, the run's accuracy and
the Prometheus gauges)."""

from __future__ import annotations

from typing import Any

from hetfed.aggregator.observe.metrics import AggregatorMetrics
from hetfed.aggregator.observe.observers import RunObserver
from hetfed.aggregator.observe.run_metrics import weighted_accuracy
from hetfed.cli import localrun as lr
from hetfed.cli.progress import _accuracy
from hetfed.cli.report import curve_from_summary, markdown_table
from hetfed.wire import codec
from hetfed.wire.messages import RoundSummary, RunStatus
from hetfed.wire.payloads import EvalMetrics
from hetfed.wire.phases import Phase

PUBLIC = {"evaluated_round": 1.0, "privacy_epsilon": 2.0}
WITHHELD_ALL = ("train_loss", "num_train_examples", "test_accuracy", "test_loss", "num_test_examples")


def _withheld(*more: str) -> EvalMetrics:
    return EvalMetrics(extra=dict(PUBLIC), withheld=(*WITHHELD_ALL, *more))


def _shown(acc: float, n: int) -> EvalMetrics:
    return EvalMetrics(train_loss=0.5, num_train_examples=100, test_accuracy=acc, test_loss=0.9,
                       num_test_examples=n, extra={"evaluated_round": 1.0})


def _status(*rounds: dict[str, EvalMetrics]) -> RunStatus:
    history = tuple(RoundSummary(i, len(r), 1.0, (), r) for i, r in enumerate(rounds, start=1))
    return RunStatus("fedavg", "fedavg", Phase.FINISHED, len(rounds), len(rounds) - 1, ("a", "b"), history=history)


def test_withheld_names_survive_the_wire() -> None:
    m = _withheld("global_test_accuracy")
    back = codec.payload_from_proto(codec.payload_to_proto(m))
    assert back == m and back.figure("test_accuracy") is None and back.figure("evaluated_round") == 1.0
    assert back.is_withheld("global_test_accuracy") and not back.is_withheld("evaluated_round")


def test_a_run_where_every_organization_withholds_shows_withheld() -> None:
    summary = lr.summarize_run(_status({"a": _withheld(), "b": _withheld()}, {"a": _withheld(), "b": _withheld()}))
    assert summary["final_test_accuracy"] == "withheld" and summary["final_withheld_by"] == ["a", "b"]
    first = summary["rounds"][0]
    assert (first["test_accuracy"], first["train_loss"], first["withheld_by"]) == ("withheld", "withheld", ["a", "b"])
    assert first["per_organization"]["a"] == {"test_accuracy": "withheld", "test_loss": "withheld",
                                              "train_loss": "withheld", "num_test_examples": "withheld",
                                              "num_train_examples": "withheld", **PUBLIC}
    row = lr.table_rows([{**summary, "wall_seconds": 3.0}])[0]
    assert row[1] == "withheld"
    assert weighted_accuracy({"a": _withheld(), "b": _withheld()}) is None
    assert _accuracy(_status({"a": _withheld(), "b": _withheld()})) == "acc withheld"
    curve = curve_from_summary(summary, "results.json")
    assert curve.final_accuracy is None and curve.withheld and curve.points == []
    assert "| withheld |" in markdown_table([curve])


def test_a_mean_leaves_out_the_organizations_that_withheld_and_says_so() -> None:
    reports = {"a": _shown(0.5, 100), "b": _withheld()}
    summary = lr.summarize_run(_status(reports))
    assert summary["final_test_accuracy"] == 0.5  # a's alone: b's 0 is not averaged in
    assert summary["rounds"][0]["train_loss"] == 0.5 and summary["final_withheld_by"] == ["b"]
    assert lr.table_rows([{**summary, "wall_seconds": 3.0}])[0][1] == "50.00% (1 withheld)"
    assert weighted_accuracy(reports) == 0.5
    assert _accuracy(_status(reports)) == "acc  50.0% (1 withheld)"


def test_an_algorithms_figure_withheld_by_one_organization_is_the_others_mean() -> None:
    a = EvalMetrics(test_accuracy=0.5, num_test_examples=10, extra={"acc": 0.25})
    b = EvalMetrics(test_accuracy=0.7, num_test_examples=10, extra={"acc": 0.75})
    orgs: dict[str, Any] = {"a": {"acc": 0.25}, "b": {"acc": "withheld"}}
    assert lr.mean_over(orgs, "acc") == 0.25
    assert lr.mean_over({"a": {"acc": "withheld"}}, "acc") == "withheld"
    assert lr.mean_over({"a": {}}, "acc") is None
    assert lr.summarize_run(_status({"a": a, "b": b}))["final_withheld_by"] == []


def _sample(metrics: AggregatorMetrics, family: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(family, {"run": "r", "algorithm": "fedavg", **labels})


def test_prometheus_drops_a_withheld_figure_and_marks_it() -> None:
    metrics = AggregatorMetrics()
    observer = RunObserver("r", "fedavg", metrics, ())
    observer.folded("a", _shown(0.5, 100))
    assert _sample(metrics, "hetfed_reported_test_accuracy", organization="a") == 0.5
    observer.folded("a", _withheld("global_test_accuracy"))
    assert _sample(metrics, "hetfed_reported_test_accuracy", organization="a") is None  # no sample, not 0
    assert _sample(metrics, "hetfed_reported_train_loss", organization="a") is None
    for name in (*WITHHELD_ALL, "global_test_accuracy"):
        assert _sample(metrics, "hetfed_reported_withheld", organization="a", name=name) == 1
    observer.folded("a", _shown(0.75, 100))
    assert _sample(metrics, "hetfed_reported_test_accuracy", organization="a") == 0.75
    assert _sample(metrics, "hetfed_reported_withheld", organization="a", name="test_accuracy") is None
