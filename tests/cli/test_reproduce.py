"""The generic reproduction runner: grids as data, exact claim statistics, pages rendered from measurements."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hetfed.cli import reproduce as rp
from hetfed.cli.localrun import FederationFailedError
from hetfed.cli.reproduce import command
from hetfed.wire.specs import SPECS


def test_every_declared_grid_loads_and_names_real_algorithms() -> None:
    names = rp.grids()
    assert {"fedcma", "fedh2l"} <= set(names)
    for name in names:
        grid = rp.load_grid(name)
        assert grid.seeds and grid.methods and grid.figures, name
        assert not set(grid.seeds) & set(grid.tuning_seeds), f"{name} reports seeds it was tuned on"
        for m in grid.methods:
            assert m.algorithm in SPECS, (name, m.algorithm)
        assert grid.results.startswith("docs/results/"), name


def test_every_federation_of_every_grid_passes_hetfed_runs_validation() -> None:
    from hetfed.cli.localrun import plan

    for name in rp.grids():
        grid = rp.load_grid(name)
        for cell in grid.cells() or [{}]:
            for m in grid.methods:
                p = plan(rp.federation_options(grid, m, cell, grid.seeds[0], artifacts=False))
                assert [r.spec.name for r in p.runs] == [m.algorithm], (name, m.id)


def test_a_grid_refuses_claims_on_unknown_methods() -> None:
    with pytest.raises(ValueError, match="unknown method 'nobody'"):
        rp.Grid(name="g", title="t", paper="p", results="r.md", seeds=(0,), rounds=1,
                methods=(rp.Method("a", "A", "local"),), figures=(rp.GridFigure("acc", "acc", "final_test_accuracy"),),
                claims=(rp.Claim("x", "a", "acc", ("nobody",), 1.0),))


def test_mean_ci_matches_students_t_by_hand() -> None:
    m, lo, hi = rp.mean_ci([1.0, 2.0, 3.0])
    # mean 2, sd 1, n 3: half-width t(0.975, 2)·1/√3 = 4.303/1.7320508 = 2.48434...
    assert m == 2.0 and hi - m == pytest.approx(4.303 / 3 ** 0.5, abs=1e-12) and m - lo == pytest.approx(hi - m)
    assert rp.mean_ci([5.0]) == (5.0, 5.0, 5.0)


def _grid() -> rp.Grid:
    return rp.Grid(
        name="toy", title="Toy", paper="Table 0", results="docs/results/toy.md", seeds=(0, 1, 2), rounds=1,
        methods=(rp.Method("base1", "Base 1", "local"), rp.Method("base2", "Base 2", "local"),
                 rp.Method("new", "New", "fedavg")),
        figures=(rp.GridFigure("acc", "acc", "final_test_accuracy"),),
        axes=(rp.Axis("alpha", (0.1, 0.5)),),
        claims=(rp.Claim("New beats the better baseline by 2", "new", "acc", ("base1", "base2"), 2.0,
                         where={"alpha": 0.1}),),
        paper_values=(rp.PaperValue("new", "acc", 91.0, {"alpha": 0.1}),),
    )


def _rows() -> list[dict]:
    acc = {  # method -> seed -> accuracy at alpha 0.1 (alpha 0.5 gets the same minus 0.1)
        "base1": [0.80, 0.70, 0.75],
        "base2": [0.81, 0.72, 0.76],  # the better baseline on average
        "new": [0.85, 0.73, 0.80],
    }
    return [{"method": m, "cell": {"alpha": a}, "seed": s, "wall_seconds": 1.0, "figures": {"acc": v - d}}
            for m, vals in acc.items() for s, v in enumerate(vals) for a, d in ((0.1, 0.0), (0.5, 0.1))]


def test_claims_are_paired_per_seed_against_the_better_baseline() -> None:
    (r,) = rp.check_claims(_grid(), _rows())
    assert r.baseline == "base2" and r.cell == {"alpha": 0.1}
    assert [round(d, 10) for _, d in sorted(r.differences.items())] == [4.0, 1.0, 4.0]
    assert r.mean == pytest.approx(3.0)
    assert r.upper - r.mean == pytest.approx(4.303 * 3 ** 0.5 / 3 ** 0.5, abs=1e-9)  # sd of (4, 1, 4) is √3
    assert r.clearing == 2 and r.verdict == "holds on average only (fragile)"


def test_one_seed_gives_no_verdict_even_when_it_clears_the_margin() -> None:
    rows = [r for r in _rows() if r["seed"] == 0]  # new − base2 = +4 points on seed 0, margin 2
    (r,) = rp.check_claims(_grid(), rows)
    assert r.mean == pytest.approx(4.0) and r.lower == r.upper == r.mean and r.clearing == 1
    assert r.verdict == "no verdict (one seed, no interval)"


def test_a_claim_averaged_over_cells_pairs_each_seeds_mean_difference() -> None:
    grid = _grid()
    averaged = rp.Claim("New beats base on average over alpha", "new", "acc", ("base1", "base2"), 2.0,
                        where={"alpha": [0.1, 0.5]}, average_cells=True)
    rows = _rows()
    for r in rows:  # make alpha 0.5 differ: New gains 2 more points there on every seed
        if r["method"] == "new" and r["cell"] == {"alpha": 0.5}:
            r["figures"]["acc"] += 0.02
    (r,) = rp.check_claims(dataclasses.replace(grid, claims=(averaged,)), rows)
    assert r.cell == {"alpha": "mean of 0.1, 0.5"} and r.baseline == "base2"
    # Per seed: alpha 0.1 gives (4, 1, 4), alpha 0.5 gives (6, 3, 6): the means are (5, 2, 5).
    assert [round(d, 10) for _, d in sorted(r.differences.items())] == [5.0, 2.0, 5.0]
    assert r.mean == pytest.approx(4.0) and r.clearing == 3


def test_a_data_axis_sets_a_data_field_and_the_mean_over_cells_is_tabulated() -> None:
    grid = rp.Grid(name="g", title="t", paper="p", results="r.md", seeds=(0, 1, 2), rounds=1,
                   data={"dataset": "mnist5k", "partition": "rotated_lodo"},
                   methods=(rp.Method("base1", "Base 1", "local"), rp.Method("base2", "Base 2", "local"),
                            rp.Method("new", "New", "fedavg")),
                   figures=(rp.GridFigure("acc", "acc", "final_test_accuracy"),),
                   axes=(rp.Axis("data.target_domain", (0, 5)),), mean_over_cells=True,
                   paper_values=(rp.PaperValue("new", "acc", 90.5, {"data.target_domain": "mean of 0, 5"}),))
    opts = rp.federation_options(grid, grid.methods[2], {"data.target_domain": 5}, 1, artifacts=False)
    assert opts.data == {"target_domain": 5} and opts.partition == "rotated_lodo" and opts.seed == 1
    rows = [{**r, "cell": {"data.target_domain": 0 if r["cell"]["alpha"] == 0.1 else 5}} for r in _rows()]
    text = rp.render(grid, {"command": "c", "date": "d", "machine": "m", "wall_seconds": 1.0, "load": [0.0, 0.0],
                            "rows": rows, "bytes_references": {}})
    assert "### data.target_domain = mean of 0, 5" in text
    # New: (85, 73, 80) and (75, 63, 70) per seed, means 80, 68, 75 -> 74.33 ± 6.03, beside the paper's number.
    assert "| New | 74.33 ± 6.03 [90.5] |" in text


def test_the_page_is_rendered_from_the_measurements_and_keeps_hand_written_text(tmp_path: Path) -> None:
    data = {"command": "hetfed bench toy", "date": "2026-01-01", "machine": "2 CPU cores", "wall_seconds": 60.0,
            "load": [0.5, 0.7], "rows": _rows(), "bytes_references": {}}
    text = rp.render(_grid(), data)
    assert "| New | 79.33 ± 6.03 [91] |" in text  # mean ± std of 85, 73, 80 and the paper's number
    assert "### alpha = 0.5" in text and "**holds on average only (fragile)**" in text
    page = tmp_path / "toy.md"
    rp.write_page(page, "Toy", text)
    page.write_text("# Toy\n\nIntro by hand.\n\n" + page.read_text().split("\n", 2)[2] + "\n## Notes\n\nKept.\n")
    rp.write_page(page, "Toy", "NEW TABLES")
    body = page.read_text()
    assert "Intro by hand." in body and "## Notes\n\nKept." in body and "NEW TABLES" in body
    assert "79.33" not in body


def test_the_command_on_a_page_drops_where_its_files_went() -> None:
    """--workdir, --json and --page name the machine's paths, not what ran; every other word is kept."""
    command = ("hetfed bench fedcma --rounds 20 --workdir /work/x/wd --cell alpha=0.02,0.03 --json=/work/x/o.json "
               "--page '/work/x y/o.md' --resume --methods 'a b'")
    assert rp.portable_command(command) == "hetfed bench fedcma --rounds 20 --cell alpha=0.02,0.03 --resume --methods 'a b'"
    data = {"command": command, "date": "2026-01-01", "machine": "2 CPU cores", "wall_seconds": 60.0,
            "load": [0.5, 0.7], "rows": _rows(), "bytes_references": {}}
    text = rp.render(_grid(), data)
    assert "Command: `hetfed bench fedcma --rounds 20 --cell alpha=0.02,0.03 --resume --methods 'a b'`" in text
    assert "/work/" not in text


@pytest.mark.e2e
def test_a_small_grid_runs_real_federations_and_reports(tmp_path: Path) -> None:
    grid = rp.Grid(
        name="tiny", title="Tiny", paper="-", results=str(tmp_path / "tiny.md"), seeds=(0,), rounds=3,
        data={"dataset": "digits", "partition": "iid", "clients": 2},
        methods=(rp.Method("local", "Local", "local", models=("mlp",)),
                 rp.Method("fedavg", "FedAvg", "fedavg", models=("mlp",), config={"local_steps": 2})),
        figures=(rp.GridFigure("acc", "acc", "final_test_accuracy"),
                 rp.GridFigure("pooled", "pooled", "pooled:test_accuracy"),
                 rp.GridFigure("bytes", "bytes / round", "bytes_per_round", percent=False)),
        claims=(rp.Claim("FedAvg is no worse than Local by 100 points", "fedavg", "acc", ("local",), -100.0),),
        throughput=True,
    )
    rows = [rp.run_federation(grid, m, {}, 0, tmp_path / "runs") for m in grid.methods]
    for row in rows:
        assert 0.0 <= row["figures"]["acc"] <= 1.0
        assert row["figures"]["pooled"] == pytest.approx(row["figures"]["acc"])  # both weight by test examples
        assert row["throughput"]["rounds_per_second"] > 0
    assert rows[1]["figures"]["bytes"] > 10 * rows[0]["figures"]["bytes"]  # FedAvg ships the model
    (claim,) = rp.check_claims(grid, rows)
    assert claim.clearing == 1 and claim.verdict == "no verdict (one seed, no interval)"  # one seed: no interval
    data = {"command": "test", "date": "today", "machine": "here", "wall_seconds": 1.0, "load": [0.0, 0.0],
            "rows": rows, "bytes_references": {}}
    json.dumps(data)  # the measurements are plain JSON
    assert "| FedAvg |" in rp.render(grid, data)


def test_resume_keeps_measured_federations_and_runs_only_the_missing(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    grid = rp.load_grid("fedh2l")
    # Every federation of the selection is already measured, plus one of another method and seed: nothing runs,
    # and the page and measurements keep all of them.
    measured = [{"method": m, "cell": {}, "seed": s, "wall_seconds": 1.0, "rounds": 3,
                 "figures": {f.key: 0.5 for f in grid.figures}, "throughput": {}}
                for m, s in (("fedh2l", 0), ("ind", 0), ("agg", 7))]
    work = tmp_path / "work"
    work.mkdir()
    (work / "rows.json").write_text(json.dumps(measured))
    out = tmp_path / "page.md"
    code = rp.main("fedh2l", ["--seeds", "0", "--methods", "fedh2l,ind", "--workdir", str(work), "--no-bytes",
                              "--resume", "--page", str(out), "--json", str(tmp_path / "m.json")])
    assert code == 0
    assert "resuming: 3 federations already measured" in capsys.readouterr().out
    saved = json.loads((tmp_path / "m.json").read_text())
    assert [(r["method"], r["seed"]) for r in saved["rows"]] == [("fedh2l", 0), ("ind", 0), ("agg", 7)]
    assert "| FedH2L |" in out.read_text()


def test_jobs_run_federations_at_once_and_save_them_in_grid_order(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    both_running = threading.Barrier(2, timeout=30)  # broken (and the test failing) unless two run at once
    running, most = [0], [0]
    lock = threading.Lock()

    def fake(g: rp.Grid, method: rp.Method, cell: dict[str, Any], seed: int, root: Path,
             rounds: int | None = None) -> dict[str, Any]:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        both_running.wait()
        if seed == 0:  # the later seed's federation finishes first: the saved order must not depend on it
            time.sleep(0.05)
        with lock:
            running[0] -= 1
        return {"method": method.id, "cell": dict(cell), "seed": seed, "wall_seconds": 0.1, "rounds": 1,
                "figures": {f.key: 0.5 for f in g.figures}, "throughput": {}}

    monkeypatch.setattr(command, "run_federation", fake)
    out = tmp_path / "page.md"
    code = rp.main("fedh2l", ["--seeds", "0,1", "--methods", "fedh2l", "--workdir", str(tmp_path / "w"),
                              "--no-bytes", "--jobs", "2", "--page", str(out), "--json", str(tmp_path / "m.json")])
    assert code == 0 and most[0] == 2
    saved = json.loads((tmp_path / "m.json").read_text())
    assert [(r["method"], r["seed"]) for r in saved["rows"]] == [("fedh2l", 0), ("fedh2l", 1)]
    assert saved["jobs"] == 2 and "2 federations at once" in out.read_text()
    assert json.loads((tmp_path / "w" / "rows.json").read_text())  # saved as they finished, for --resume


def _failing_on_seed(bad: int) -> Any:
    """A stand-in for run_federation whose federations of seed ``bad`` fail as a client's crash does."""
    def fake(g: rp.Grid, method: rp.Method, cell: dict[str, Any], seed: int, root: Path,
             rounds: int | None = None) -> dict[str, Any]:
        if seed == bad:
            raise FederationFailedError("client-org-3 failed:\n  File ...\ntorch.OutOfMemoryError: CUDA out of memory.")
        return {"method": method.id, "cell": dict(cell), "seed": seed, "wall_seconds": 0.1, "rounds": 1,
                "figures": {f.key: 0.5 for f in g.figures}, "throughput": {}}
    return fake


def test_keep_going_reports_a_failed_federation_and_runs_the_others(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(command, "run_federation", _failing_on_seed(1))
    work = tmp_path / "w"
    code = rp.main("fedh2l", ["--seeds", "0,1,2", "--methods", "fedh2l,ind", "--workdir", str(work), "--no-bytes",
                              "--keep-going", "--page", str(tmp_path / "p.md"), "--json", str(tmp_path / "m.json")])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAILED fedh2l seed=1: torch.OutOfMemoryError: CUDA out of memory." in out
    assert "2 of 6 federations failed (run again with --resume to retry them):" in out
    expected = [("fedh2l", 0), ("ind", 0), ("fedh2l", 2), ("ind", 2)]
    assert [(r["method"], r["seed"]) for r in json.loads((tmp_path / "m.json").read_text())["rows"]] == expected
    assert sorted((r["method"], r["seed"]) for r in json.loads((work / "rows.json").read_text())) == sorted(expected)
    assert sorted(p.name for p in work.iterdir()) == ["rows.json"]  # saved by rename: no temporary file left


def test_without_keep_going_the_first_failure_stops_the_grid(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(command, "run_federation", _failing_on_seed(1))
    work = tmp_path / "w"
    with pytest.raises(FederationFailedError, match=r"^fedh2l seed=1: client-org-3 failed:\n"):  # names the federation
        rp.main("fedh2l", ["--seeds", "0,1,2", "--methods", "fedh2l", "--workdir", str(work), "--no-bytes",
                           "--page", str(tmp_path / "p.md"), "--json", str(tmp_path / "m.json")])
    assert [r["seed"] for r in json.loads((work / "rows.json").read_text())] == [0]  # seed 2 never started
    assert not (tmp_path / "m.json").exists()


def test_hetfed_bench_prints_a_failed_federation_as_its_error_without_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from hetfed.cli import build_parser

    monkeypatch.setattr(command, "run_federation", _failing_on_seed(0))
    args = build_parser().parse_args(["bench", "fedh2l", "--seeds", "0", "--methods", "fedh2l", "--workdir",
                                      str(tmp_path / "w"), "--no-bytes", "--page", str(tmp_path / "p.md"),
                                      "--json", str(tmp_path / "m.json")])
    code = args.func(args)  # what main calls, without its process-wide signal handler
    assert code == 1
    assert capsys.readouterr().err == ("hetfed bench: error: fedh2l seed=0: client-org-3 failed:\n  File ...\n"
                                       "torch.OutOfMemoryError: CUDA out of memory.\n")


def test_jobs_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        rp.main("fedh2l", ["--jobs", "0"])
    assert exc.value.code == 2 and "--jobs must be at least 1, got 0" in capsys.readouterr().err


def _summary(per_round: list[dict[str, tuple[float, int, int]]]) -> dict[str, Any]:
    """A run summary whose round r reports, per organization, (accuracy, test examples, evaluated round)."""
    rounds = [{"round": 0, "per_organization": {}}]
    for r, report in enumerate(per_round, start=1):
        rounds.append({"round": r, "per_organization": {
            org: {"test_accuracy": acc, "num_test_examples": n, "evaluated_round": float(ev)}
            for org, (acc, n, ev) in report.items()}})
    return {"rounds": rounds}


def test_best_rounds_is_the_mean_of_the_n_best_evaluated_rounds_pooled_or_averaged() -> None:
    summary = _summary([
        {"a": (0.5, 10, 0), "b": (1.0, 30, 0)},    # pooled (5 + 30) / 40 = 0.875, mean 0.75
        {"a": (0.0, 10, 1), "b": (0.5, 30, 1)},    # pooled 0.375, mean 0.25
        {"a": (1.0, 10, 2), "b": (0.75, 30, 2)},   # pooled 0.8125, mean 0.875
        {"a": (1.0, 10, 2), "b": (1.0, 30, 2)},    # the evaluate round re-scores round 2: it replaces it
    ])
    assert rp.per_round("pooled", "test_accuracy", summary) == {0: 0.875, 1: 0.375, 2: 1.0}
    assert rp.per_round("mean", "test_accuracy", summary) == {0: 0.75, 1: 0.25, 2: 1.0}
    pooled2 = rp.GridFigure("p", "p", "pooled:test_accuracy", best_rounds=2)
    mean2 = rp.GridFigure("m", "m", "mean:test_accuracy", best_rounds=2)
    final = rp.GridFigure("f", "f", "pooled:test_accuracy")
    assert rp.figure_value(pooled2, summary, Path("."), 0) == 0.9375  # (1.0 + 0.875) / 2
    assert rp.figure_value(mean2, summary, Path("."), 0) == 0.875     # (1.0 + 0.75) / 2
    assert rp.figure_value(final, summary, Path("."), 0) == 1.0
    assert rp.best_rounds_mean({0: 0.25}, 5) == 0.25 and rp.best_rounds_mean({}, 5) is None
    with pytest.raises(ValueError, match="best_rounds needs a 'mean:' or 'pooled:' source"):
        rp.GridFigure("x", "x", "final_test_accuracy", best_rounds=5)


def test_at_lowest_reads_the_figure_where_the_selector_is_lowest_the_later_round_on_ties() -> None:
    def summary(rows: list[tuple[float, float, int]]) -> dict[str, Any]:
        """Two organizations; round r reports (target accuracy, own loss of a, evaluated round); b's loss is 1."""
        rounds: list[dict[str, Any]] = [{"round": 0, "per_organization": {}}]
        for r, (acc, loss_a, ev) in enumerate(rows, start=1):
            rounds.append({"round": r, "per_organization": {
                org: {"target_test_accuracy": acc, "test_loss": loss, "num_test_examples": 10,
                      "evaluated_round": float(ev)} for org, loss in (("a", loss_a), ("b", 1.0))}})
        return {"rounds": rounds}

    target = rp.GridFigure("t", "t", "mean:target_test_accuracy", at_lowest="mean:test_loss")
    # Mean losses by evaluated round: 0 -> 1.5, 10 -> 0.75, 20 -> 1.0, 30 -> 0.75 (a tie with 10: 30 wins).
    rows = [(0.1, 2.0, 0), (0.6, 0.5, 10), (0.6, 0.5, 10), (0.7, 1.0, 20), (0.8, 0.5, 30), (0.9, 3.0, 40)]
    assert rp.figure_value(target, summary(rows), Path("."), 0) == 0.8
    assert rp.figure_value(target, summary(rows[:4]), Path("."), 0) == 0.6
    assert rp.at_lowest({1: 0.5, 2: 0.25}, {2: 3.0, 3: 1.0}) == 0.25  # only rounds both hold
    assert rp.at_lowest({1: 0.5}, {2: 1.0}) is None
    with pytest.raises(ValueError, match="at_lowest needs a 'mean:' or 'pooled:' source"):
        rp.GridFigure("x", "x", "final_test_accuracy", at_lowest="mean:test_loss")
    with pytest.raises(ValueError, match="at_lowest must be 'mean:<key>' or 'pooled:<key>'"):
        rp.GridFigure("x", "x", "mean:target_test_accuracy", at_lowest="test_loss")
    with pytest.raises(ValueError, match="give one"):
        rp.GridFigure("x", "x", "mean:target_test_accuracy", best_rounds=5, at_lowest="mean:test_loss")


def test_cell_filters_select_the_grid_cells_to_run() -> None:
    grid = rp.load_grid("fedcma")
    cells = rp.select_cells(grid, ["alpha=0.05"])
    assert cells == [{"dataset": "mnist5k", "alpha": 0.05}, {"dataset": "fmnist", "alpha": 0.05}]
    assert rp.select_cells(grid, ["alpha=0.02,0.1", "dataset=fmnist"]) == [
        {"dataset": "fmnist", "alpha": 0.02}, {"dataset": "fmnist", "alpha": 0.1}]
    with pytest.raises(ValueError, match=r"0\.5 not among"):
        rp.select_cells(grid, ["alpha=0.5"])
    with pytest.raises(ValueError, match="AXIS one of dataset, alpha"):
        rp.select_cells(grid, ["seed=1"])
