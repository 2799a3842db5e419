"""A local run reads the organizations' own records (``own-figures.json``) on its machine: results.json's
``own_final_test_accuracy`` and ``own_final``, and the privacy grid's accuracy figure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hetfed.cli import localrun as lr
from hetfed.cli import reproduce as rp
from hetfed.client.catalog import OWN_FIGURES
from hetfed.wire.messages import RoundSummary, RunStatus
from hetfed.wire.payloads import EvalMetrics
from hetfed.wire.phases import Phase

ORGS = ("org-0", "org-1", "org-2")
WITHHELD_ALL = ("train_loss", "num_train_examples", "test_accuracy", "test_loss", "num_test_examples")


def _status(rounds: int = 2) -> RunStatus:
    """A DP run as the aggregator saw it: every figure withheld."""
    report = EvalMetrics(extra={"evaluated_round": 1.0, "privacy_epsilon": 2.0}, withheld=WITHHELD_ALL)
    history = tuple(RoundSummary(i, len(ORGS), 1.0, (), dict.fromkeys(ORGS, report)) for i in range(1, rounds + 1))
    return RunStatus("fedavg", "fedavg", Phase.FINISHED, rounds, rounds - 1, ORGS, history=history)


def _clients(privacy: dict[str, Any], artifacts: bool = True) -> tuple[Any, ...]:
    opts = lr.LocalRunOptions(algorithms=("fedavg",), clients=3, dataset="synthetic", privacy=privacy,
                              artifacts=artifacts)
    return lr.plan(opts).runs[0].clients


def _entry(round_: int, acc: float, n_test: int) -> dict[str, Any]:
    return {"round": round_, "train_loss": 0.5, "test_accuracy": acc, "test_loss": 1.0, "num_test_examples": n_test,
            "num_train_examples": 160, "extra": {"evaluated_round": 1.0}}


def _write(workdir: Path, org: str, *entries: dict[str, Any]) -> None:
    folder = workdir / lr.artifacts_dir("fedavg", org)
    folder.mkdir(parents=True)
    (folder / OWN_FIGURES).write_text(json.dumps({"organization": org, "run": "fedavg", "rounds": list(entries)}))


def test_the_own_final_accuracy_is_weighted_by_test_examples_at_the_final_round(tmp_path: Path) -> None:
    # Round 1's figures differ: only the final round's count.
    _write(tmp_path, "org-0", _entry(1, 0.125, 30), _entry(2, 0.5, 30))
    _write(tmp_path, "org-1", _entry(1, 0.125, 10), _entry(2, 0.75, 10))
    _write(tmp_path, "org-2", _entry(1, 0.125, 60), _entry(2, 0.25, 60))
    summary = lr.summarize_run(_status())
    own = lr.own_final(summary, _clients({"noise_multiplier": 1.0}), tmp_path)
    assert own == {"own_final_test_accuracy": (0.5 * 30 + 0.75 * 10 + 0.25 * 60) / 100,
                   "own_final": {"org-0": _entry(2, 0.5, 30), "org-1": _entry(2, 0.75, 10),
                                 "org-2": _entry(2, 0.25, 60)}}
    assert own["own_final_test_accuracy"] == 0.375
    # The aggregator's view and hetfed run's table stay "withheld".
    assert summary["final_test_accuracy"] == "withheld"
    assert lr.table_rows([{**summary, **own, "wall_seconds": 1.0}])[0][1] == "withheld"
    # The grid reads the new key as it reads any key of the summary.
    fig = rp.GridFigure("acc", "acc", "own_final_test_accuracy")
    assert rp.figure_value(fig, {**summary, **own}, tmp_path, 0) == 0.375


def test_an_organization_without_an_own_record_makes_the_mean_none(tmp_path: Path) -> None:
    _write(tmp_path, "org-0", _entry(2, 0.5, 30))
    _write(tmp_path, "org-2", _entry(1, 0.25, 60))  # no report of the final round
    own = lr.own_final(lr.summarize_run(_status()), _clients({"noise_multiplier": 1.0}), tmp_path)
    assert own == {"own_final_test_accuracy": None,
                   "own_final": {"org-0": _entry(2, 0.5, 30), "org-1": lr.NO_OWN_RECORD, "org-2": lr.NO_OWN_RECORD}}
    # Clients without an output_dir keep no record at all.
    plain_dirs = _clients({"noise_multiplier": 1.0}, artifacts=False)
    assert [c.output_dir for c in plain_dirs] == [None, None, None]
    assert lr.own_final(lr.summarize_run(_status()), plain_dirs, tmp_path) == {
        "own_final_test_accuracy": None, "own_final": dict.fromkeys(ORGS, lr.NO_OWN_RECORD)}
    fig = rp.GridFigure("acc", "acc", "own_final_test_accuracy")
    assert rp.figure_value(fig, {**lr.summarize_run(_status()), **own}, tmp_path, 0) is None


def test_without_privacy_the_own_figure_is_the_reported_one(tmp_path: Path) -> None:
    report = EvalMetrics(train_loss=0.5, num_train_examples=100, test_accuracy=0.625, test_loss=0.9,
                         num_test_examples=40)
    status = RunStatus("fedavg", "fedavg", Phase.FINISHED, 1, 0, ("org-0",),
                       history=(RoundSummary(1, 1, 1.0, (), {"org-0": report}),))
    summary = lr.summarize_run(status)
    assert lr.own_final(summary, _clients({}), tmp_path) == {"own_final_test_accuracy": 0.625}


def test_the_privacy_grid_reads_the_own_records_and_its_dp_cells_keep_artifacts() -> None:
    grid = rp.load_grid("privacy")
    (acc,) = [f for f in grid.figures if f.key == "acc"]
    assert (acc.source, acc.label) == ("own_final_test_accuracy", "own-test acc (each organization's own record)")
    fedavg = grid.method("fedavg")
    assert rp.federation_options(grid, fedavg, {"epsilon": 3}, 0, artifacts=False).artifacts is True
    assert rp.federation_options(grid, fedavg, {"epsilon": 0}, 0, artifacts=False).artifacts is False
    p = lr.plan(rp.federation_options(grid, fedavg, {"epsilon": 3}, 0, artifacts=False))
    assert [c.output_dir for c in p.runs[0].clients] == [lr.artifacts_dir("fedavg", f"org-{i}") for i in range(4)]
