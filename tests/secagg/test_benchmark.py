"""benchmarks/secagg_core.py runs a round to the end and counts each message's payload exactly."""

from __future__ import annotations

from tests.conftest import load_benchmark


def test_a_small_cell_runs_and_counts_bytes() -> None:
    bench = load_benchmark("secagg_core")
    cell = bench.Cell(4, 100, 1)
    cell.run()
    assert cell.server.stage == "done"
    # a masked input: run id "bench" (5), round (8), sender "org-0x" (6) and 100 uint32
    assert set(cell.sent["mask"]) == {5 + 8 + 6 + 400}
    # an advert: the header and two 32-byte keys
    assert set(cell.sent["advertise"]) == {5 + 8 + 6 + 64}
    assert len(cell.client_cpu["mask"]) == 3 and len(cell.client_cpu["unmask"]) == 3
    assert [row.split("|")[1].strip() for row in cell.rows()] == list(bench.STAGES)
