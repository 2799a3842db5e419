"""``hetfed report`` from results.json files: the curves, the table and the PNG's description."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from hetfed.cli import build_parser
from hetfed.cli.prom import PNG_KEY
from hetfed.cli.report import X_LABEL, Y_LABEL, curve_from_summary, load_results, markdown_table


def summary(run: str, algorithm: str, per_round: list[tuple[int, int, float | None]]) -> dict[str, Any]:
    """A results.json run entry: rounds of (bytes up, bytes down, accuracy), the last one the evaluation."""
    rounds = [{"round": i + 1, "bytes_up": {"model_weights": up - 10, "envelope": 10}, "bytes_down": {"envelope": down},
               "test_accuracy": acc} for i, (up, down, acc) in enumerate(per_round)]
    train = rounds[:-1]
    return {
        "run": run, "algorithm": algorithm, "rounds": rounds,
        "final_test_accuracy": per_round[-1][2],
        "bytes_up_total": sum(u for u, _d, _a in per_round), "bytes_down_total": sum(d for _u, d, _a in per_round),
        "bytes_per_train_round": sum(sum(r["bytes_up"].values()) + sum(r["bytes_down"].values()) for r in train)
        / len(train),
    }


def write(path: Path, *runs: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"options": {}, "runs": list(runs)}))
    return path


def test_curve_pairs_each_round_accuracy_with_the_bytes_moved_by_its_end() -> None:
    c = curve_from_summary(summary("a", "fedavg", [(100, 50, 0.5), (100, 50, None), (20, 30, 0.75)]), "x")
    assert c.points == [(150.0, 0.5), (350.0, 0.75)]
    assert (c.bytes_up, c.bytes_down, c.final_accuracy) == (220, 130, 0.75)


def test_table_ratio_to_the_fedavg_run_of_the_same_file(tmp_path: Path) -> None:
    one = write(tmp_path / "one" / "results.json", summary("fedavg", "fedavg", [(1000, 1000, 0.5), (10, 500, 0.9)]),
                summary("head", "fedavg_head", [(100, 100, 0.4), (10, 50, 0.8)]))
    two = write(tmp_path / "two" / "results.json", summary("fedavg", "fedavg", [(400, 400, 0.6), (10, 200, 0.7)]))
    table = markdown_table(load_results([one, two]))
    lines = table.splitlines()
    assert lines[0].startswith("| algorithm | final accuracy | bytes up | bytes down | bytes per round |")
    # Two fedavg runs with one run id: labelled by their directories; each compares with its own file's FedAvg.
    assert "| fedavg (fedavg, one) | 90.00% | 1.01 KB | 1.50 KB | 2.00 KB | 1x |" in lines
    assert "| fedavg (fedavg, two) | 70.00% | 410 B | 600 B | 800 B | 1x |" in lines
    assert "| fedavg_head | 80.00% | 110 B | 150 B | 200 B | 0.1x |" in lines


def test_table_without_fedavg_has_no_ratio(tmp_path: Path) -> None:
    path = write(tmp_path / "results.json", summary("l", "local", [(10, 10, 0.1), (1, 1, None)]))
    assert markdown_table(load_results([path])).splitlines()[-1] == "| local | - | 11 B | 11 B | 20 B | - |"


def test_report_command_writes_png_and_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "results.json", summary("fedavg", "fedavg", [(1000, 1000, 0.5), (1000, 1000, 0.7),
                                                                         (10, 500, 0.8)]),
                 summary("fedcma", "fedcma", [(100, 100, 0.6), (100, 100, 0.7), (10, 50, 0.75)]))
    png, md = tmp_path / "plot.png", tmp_path / "table.md"
    args = build_parser().parse_args(["report", str(path), "--out", str(png), "--markdown", str(md)])
    assert args.func(args) == 0
    assert "| fedcma | 75.00% |" in capsys.readouterr().out
    assert md.read_text().count("\n") == 4
    with Image.open(png) as im:
        assert im.size == (800, 500) and im.format == "PNG"
        meta = json.loads(im.text[PNG_KEY])
    assert meta["xlabel"] == X_LABEL and meta["ylabel"] == Y_LABEL and meta["xscale"] == "log"
    assert meta["lines"] == [{"label": "fedavg", "points": 3}, {"label": "fedcma", "points": 3}]


def test_report_refuses_what_is_not_a_results_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"rounds": []}')
    args = build_parser().parse_args(["report", str(bad), "--out", str(tmp_path / "p.png")])
    assert args.func(args) == 2
    assert "not a hetfed results.json" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()
    args = build_parser().parse_args(["report"])
    assert args.func(args) == 2
