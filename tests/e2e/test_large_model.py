"""benchmarks/large_model.py: its streamed updates are protobuf's own bytes, and its harness runs end to end.

The end-to-end test runs the benchmark's ``measure`` (one code path with the benchmark) at 8 MB, 2 synthetic
client processes and 2 rounds against a real aggregator process, and checks the aggregate it broadcast against
the mean of the generated updates, computed here in float64 from the same seeds.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import payloads_pb2 as ppb
from hetfed.wire import chunks, codec
from hetfed.wire.payloads import EvalMetrics, ModelWeights
from tests.conftest import REPO, load_benchmark

ROW_FIELDS = {"size_gb", "model_bytes", "tensors", "clients", "rounds", "rtt_ms", "mbit", "chunk_bytes", "window_bytes", "reassemblies",
              "update_bytes", "agg_peak_rss_gb", "agg_rss_anon_gb", "agg_rss_file_gb", "agg_rss_over_model",
              "client_peak_rss_gb", "client_peak_rss_each_gb", "stopped", "round_s", "round_max_s", "open_close_s",
              "agg_cpu_s", "clients_cpu_s", "pushed_wire_bytes", "pulled_wire_bytes", "same_broadcast",
              "client_push_s", "disk_s", "net_s", "floor_s", "ratio", "load_average", "commit"}


def test_model_shapes_total_the_declared_size_and_scale_gpt2_large() -> None:
    synth = load_benchmark("large_model").synth
    gpt2 = synth.model_shapes(4 * synth.GPT2_LARGE_PARAMETERS)
    assert gpt2["wte.weight"] == (50257, 1280) and gpt2["h.35.mlp.c_fc.weight"] == (1280, 5120)
    assert len(gpt2) == 36 * 12 + 4 and synth.model_bytes(gpt2) == 4 * synth.GPT2_LARGE_PARAMETERS
    for size in (8_000_000, 400_000_000, 3_200_000_000):
        shapes = synth.model_shapes(size)
        width = shapes["wpe.weight"][1]
        assert 0 <= size - synth.model_bytes(shapes) < 4 * width


def test_streamed_update_and_its_chunks_are_protobufs_own_bytes() -> None:
    bench = load_benchmark("large_model")
    shapes = bench.synth.model_shapes(2_000_000)
    pieces, total = bench.update_pieces(shapes, 7, 1, 2, "org-1")
    data = b"".join(bytes(p) for p in pieces)
    assert len(data) == total
    tensors = {k: bench.synth.update_tensor(shapes, k, 7, 1, 2) for k in shapes}
    ref = apb.Update(envelope=apb.Envelope(run_id=bench.RUN, round=2, organization_id="org-1",
                                           payload_kinds=[ppb.PAYLOAD_KIND_MODEL_WEIGHTS,
                                                          ppb.PAYLOAD_KIND_EVAL_METRICS]))
    codec.fill_payload(ref.payloads.add(), ModelWeights(tensors, num_examples=bench.EXAMPLES))
    codec.fill_payload(ref.payloads.add(), EvalMetrics(train_loss=0.5, num_train_examples=bench.EXAMPLES))
    assert data == ref.SerializeToString()
    envelope = apb.PushUpdateRequest(run_id=bench.RUN, round=2, organization_id="org-1").SerializeToString()
    sent: list[int] = []
    pieces, total = bench.update_pieces(shapes, 7, 1, 2, "org-1")
    framed = list(bench.push_messages(envelope, pieces, total, 100_000, chunks.FIRST_PUSH_CHUNK_BYTES, sent))
    assert framed == list(chunks.framed(envelope, chunks.PUSH_CHUNK_FIELD, data, 100_000,
                                        first_bytes=chunks.FIRST_PUSH_CHUNK_BYTES))
    assert sent == [len(m) for m in framed] and len(framed) == 1 + math.ceil((total - (16 << 10)) / 100_000)


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_field_scanner_keeps_all_but_the_payloads(piece: int) -> None:
    bench = load_benchmark("large_model")
    payload = ppb.Payload()
    codec.fill_payload(payload, ModelWeights({"w": np.arange(300, dtype=np.float32)}, num_examples=0))
    ins = apb.Instructions(envelope=apb.Envelope(run_id="r", round=3), action=apb.ACTION_TRAIN, round_seed=2**63 + 5,
                           payloads=[payload, payload], total_rounds=9)
    data = ins.SerializeToString()
    scanner = bench.FieldScanner(apb.Instructions.PAYLOADS_FIELD_NUMBER)
    for i in range(0, len(data), piece):
        scanner.feed(memoryview(data)[i:i + piece])
    small = apb.Instructions(envelope=ins.envelope, action=ins.action, round_seed=ins.round_seed, total_rounds=9)
    assert bytes(scanner.kept) == small.SerializeToString()
    assert scanner.skipped == 2 * payload.ByteSize()


@pytest.mark.e2e
def test_the_harness_runs_and_the_broadcast_is_the_mean_of_the_generated_updates(tmp_path: Path) -> None:
    bench = load_benchmark("large_model")
    dump = tmp_path / "dump"
    dump.mkdir()
    row = bench.measure(0.008, 2, 2, tmp_path, seed=3, dump=dump, timeout=300.0)
    assert set(row) == ROW_FIELDS, set(row) ^ ROW_FIELDS
    assert row["stopped"] == "" and row["same_broadcast"] is True
    assert row["commit"].startswith(subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=7", "HEAD"],
                                                   capture_output=True, text=True, check=True).stdout.strip())
    shapes = bench.synth.model_shapes(8_000_000)
    assert row["model_bytes"] == bench.synth.model_bytes(shapes) and row["tensors"] == len(shapes) == 436
    for key in ("round_s", "open_close_s", "agg_cpu_s", "clients_cpu_s", "disk_s", "net_s", "agg_peak_rss_gb",
                "client_peak_rss_gb", "agg_rss_anon_gb"):
        assert row[key] > 0, key
    assert row["floor_s"] == row["disk_s"] + row["net_s"] and row["ratio"] == row["round_s"] / row["floor_s"]
    n_chunks = 1 + math.ceil((row["update_bytes"] - (16 << 10)) / row["chunk_bytes"])
    assert row["update_bytes"] < row["pushed_wire_bytes"] < row["update_bytes"] + 100 * n_chunks
    assert row["model_bytes"] < row["pulled_wire_bytes"] < row["model_bytes"] + 100 * n_chunks + 64 * len(shapes)
    # Round 2's instructions carry round 1's aggregate: the mean of the two generated updates.
    for org in ("org-0", "org-1"):
        ins = apb.Instructions.FromString((dump / f"{org}-round-2.bin").read_bytes())
        assert ins.action == apb.ACTION_TRAIN and len(ins.payloads) == 1
        got = codec.payload_from_proto(ins.payloads[0])
        assert isinstance(got, ModelWeights) and list(got.tensors) == list(shapes)
        for name in shapes:
            mean = (bench.synth.update_tensor(shapes, name, 3, 0, 1).astype(np.float64)
                    + bench.synth.update_tensor(shapes, name, 3, 1, 1).astype(np.float64)) / 2
            expected = mean.astype(np.float32)
            assert np.all(np.abs(got.tensors[name] - expected) <= np.spacing(np.abs(expected))), name
            assert not np.array_equal(got.tensors[name], bench.synth.update_tensor(shapes, name, 3, 0, 1))
    assert (dump / "org-0-round-2.bin").read_bytes() == (dump / "org-1-round-2.bin").read_bytes()


@pytest.mark.e2e
def test_the_memory_guard_stops_a_federation_and_says_where(tmp_path: Path) -> None:
    bench = load_benchmark("large_model")
    # A cap under what an aggregator process holds when it starts: the first sample stops the federation.
    row = bench.measure(0.008, 2, 2, tmp_path, guard=(0.0, 0.01), timeout=120.0)
    assert row["stopped"].startswith("stopped at ") and " GB in round 1 " in row["stopped"], row["stopped"]
    assert "round_s" not in row and "floor_s" not in row
    assert row["agg_peak_rss_gb"] > 0.01
    assert "| stopped at " in bench.report(row)
