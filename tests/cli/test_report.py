"""``hetfed report``'s table: the ratio column compares bytes per round with the declared bytes reference."""

from __future__ import annotations

from hetfed.cli.experiments import bytes_reference
from hetfed.cli.report import RunCurve, fmt_bytes, markdown_table


def test_the_ratio_column_compares_with_the_reference_from_the_same_file() -> None:
    ref, label = bytes_reference()
    curves = [RunCurve("a", ref, "x/results.json", bytes_per_train_round=1000.0),
              RunCurve("b", "local", "x/results.json", bytes_per_train_round=250.0),
              RunCurve("c", ref, "y/results.json", bytes_per_train_round=4000.0),
              RunCurve("d", "local", "y/results.json", bytes_per_train_round=1000.0)]
    lines = markdown_table(curves).splitlines()
    assert lines[0].endswith(f"| ratio to {label} |")
    assert [line.rsplit("|", 2)[1].strip() for line in lines[2:6]] == ["1x", "0.25x", "1x", "0.25x"]


def test_a_table_without_the_reference_shows_no_ratio() -> None:
    lines = markdown_table([RunCurve("b", "local", "r.json", bytes_per_train_round=250.0)]).splitlines()
    assert lines[2].endswith("| - |")


def test_bytes_are_decimal_units() -> None:
    assert [fmt_bytes(n) for n in (999, 1000, 1_234_567, 5e9, 5e12)] == [
        "999 B", "1.00 KB", "1.23 MB", "5.00 GB", "5000.00 GB"]
