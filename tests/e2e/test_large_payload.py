"""Large ModelWeights through a real in-process aggregator over loopback gRPC: push, close, pull the average back.

The work is benchmarks/large_payload.py's ``run_large_payload``: one code path for the benchmark and the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import load_benchmark


def check(size_mb: float, tmp_path: Path, chunk_bytes: int = 1 << 20) -> dict:
    bench = load_benchmark("large_payload")
    r = bench.run_large_payload(size_mb, tmp_path, chunk_bytes=chunk_bytes, timeout=600.0, verbose=False)
    assert r["equal"] is True
    assert abs(r["payload_bytes"] - size_mb * 1e6) <= 8 * 1024  # whole rows of 1024 float32
    assert r["chunks"] == -(-r["update_bytes"] // chunk_bytes)
    # The Update is the tensors plus a little framing; what comes back down is the same size.
    assert 0 < r["update_bytes"] - r["payload_bytes"] < 64 * r["tensors"] + 4096
    assert abs(r["pulled_wire_bytes"] - r["update_bytes"]) < 64 * r["chunks"] + 4096
    # What the aggregator counted up is what the push serialized (requests' ByteSize).
    assert r["update_bytes"] <= r["counted_up_bytes"] < r["update_bytes"] + 200 * r["chunks"]
    return r


@pytest.mark.e2e
def test_20mb_model_round_trips_through_the_aggregator(tmp_path: Path) -> None:
    r = check(20, tmp_path)
    assert r["chunks"] >= 19  # several chunks of 1 MiB
    assert r["tensors"] >= 8


@pytest.mark.e2e
def test_small_chunks_and_an_uneven_last_chunk(tmp_path: Path) -> None:
    r = check(3.3, tmp_path, chunk_bytes=100_000)
    assert r["chunks"] >= 33
    assert r["update_bytes"] % 100_000 != 0


@pytest.mark.e2e
@pytest.mark.slow
def test_500mb_model_round_trips_through_the_aggregator(tmp_path: Path) -> None:
    r = check(500, tmp_path)
    assert r["chunks"] >= 477
