"""benchmarks/grpc_round_floor.py: the bare round runs over real processes and reads its figures as Flower's harness."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import load_benchmark


def test_a_two_client_floor_federation_runs_every_round(tmp_path: Path) -> None:
    load_benchmark("flower_round")  # the workload it imports (beside it on sys.path when run as a script)
    floor = load_benchmark("grpc_round_floor")
    row = floor.measure(2, 3, tmp_path, timeout=240.0)
    assert row["rounds"] == 3 and row["clients"] == 2
    # 1,000,120 float32 parameters, down to and up from each of 2 clients.
    assert row["payload_mb_per_round"] == pytest.approx(2 * 2 * 1_000_120 * 4 / 1e6)
    assert row["server_loaded_torch"] is False
    assert row["round_median_s"] > 0 and row["round_p90_s"] > 0
    assert 0 < row["server_cpu_s_per_round"] < row["cpu_s_per_round"]
    assert row["server_peak_rss_mb"] > 0 and row["client_peak_rss_mb"] > 0
