"""benchmarks/round_overhead.py's round period: read off the aggregator's close lines, one run's train rounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import load_benchmark


def test_periods_run_from_close_to_close_of_one_runs_train_rounds(tmp_path: Path) -> None:
    log = tmp_path / "aggregator.log"
    log.write_text(
        "2026-12-01 21:40:21,217 INFO hetfed.aggregator: run overhead closed train round 1 with 4 clients in 1.68s\n"
        "2026-12-01 21:40:21,300 INFO hetfed.aggregator: run other closed train round 2 with 4 clients in 0.05s\n"
        "2026-12-01 21:40:21,326 INFO hetfed.aggregator: run overhead closed train round 2 with 4 clients in 0.09s\n"
        "2026-12-01 21:40:21,327 WARNING hetfed.aggregator: rejected (late) from ipv4:127.0.0.1:5: round 2 closed\n"
        "2026-12-01 21:40:22,001 INFO hetfed.aggregator: run overhead closed train round 3 with 4 clients in 0.60s\n"
        "2026-12-01 21:40:22,101 INFO hetfed.aggregator: run overhead closed evaluate round 4 with 4 clients in 0.1s\n"
    )
    periods = load_benchmark("round_overhead").close_periods(log, "overhead")
    assert sorted(periods) == [2, 3]
    assert periods[2] == pytest.approx(0.109, abs=1e-6)  # 21.326 - 21.217
    assert periods[3] == pytest.approx(0.675, abs=1e-6)  # 22.001 - 21.326
