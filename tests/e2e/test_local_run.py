"""``hetfed run`` end to end: a real aggregator process and real client processes over loopback gRPC."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import child_pids, process_alive

GOLDEN = Path(__file__).parent / "golden"
pytestmark = pytest.mark.e2e


def hetfed_run(tmp_path: Path, *args: str, timeout: float = 300) -> dict[str, Any]:
    """Run ``hetfed run ARGS --output tmp`` as a user would; return its results.json by algorithm."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "hetfed.cli", "run", *args, "--output", str(out)],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bytes up" in proc.stdout  # the final table
    results = json.loads((out / "results.json").read_text())
    return {r["algorithm"]: r for r in results["runs"]}


def param_bytes(model: str, dataset: str, latent_dim: int | None = None) -> int:
    """Bytes of the floating state FedAvg ships for one model (float32)."""
    from hetfed.client.data import DataConfig, load_client_data
    from hetfed.client.models import build_model

    data = load_client_data(DataConfig(dataset=dataset, partition="iid", num_clients=1))
    m = build_model(model, data.input_shape, data.num_classes, latent_dim=latent_dim)
    return sum(v.numel() * 4 for v in m.state_dict().values() if v.is_floating_point())


def test_fedavg_iid_mnist_reaches_90_percent_and_bytes_match_the_model(tmp_path: Path) -> None:
    runs = hetfed_run(tmp_path, "--algorithm", "fedavg", "--clients", "4", "--dataset", "mnist5k",
                      "--partition", "iid")
    fedavg = runs["fedavg"]
    assert fedavg["final_test_accuracy"] >= 0.90
    model = param_bytes("lenet", "mnist5k")
    expected = 2 * 4 * model
    steady = [r for r in fedavg["rounds"] if 2 <= r["round"] <= 10]
    assert len(steady) == 9
    for r in steady:
        assert "model_weights" in r["bytes_up"] and "model_weights" in r["bytes_down"]
        weights = r["bytes_up"]["model_weights"] + r["bytes_down"]["model_weights"]
        total = sum(r["bytes_up"].values()) + sum(r["bytes_down"].values())
        assert expected <= weights <= total
        assert (total - expected) / expected < 0.02, (total, expected)


def test_dirichlet_fedavg_beats_local_on_held_out_data(tmp_path: Path) -> None:
    runs = hetfed_run(tmp_path, "--algorithm", "fedavg,local", "--clients", "4", "--dataset", "mnist5k",
                      "--partition", "dirichlet", "--alpha", "0.1")
    fedavg, local = runs["fedavg"], runs["local"]
    assert fedavg["final_global_test_accuracy"] > local["final_global_test_accuracy"] + 0.2
    assert local["bytes_per_train_round"] < 2000  # Local sends metrics only
    # hetfed run --output writes hetfed report's plot by default: accuracy against log bytes, one line each.
    from PIL import Image

    from hetfed.cli.prom import PNG_KEY
    from hetfed.cli.report import X_LABEL, Y_LABEL

    with Image.open(tmp_path / "out" / "report.png") as im:
        assert im.size == (800, 500)
        meta = json.loads(im.text[PNG_KEY])
    assert (meta["xlabel"], meta["ylabel"], meta["xscale"]) == (X_LABEL, Y_LABEL, "log")
    assert [(line["label"], line["points"]) for line in meta["lines"]] == [("fedavg", 11), ("local", 11)]
    assert "| local |" in (tmp_path / "out" / "report.md").read_text()


def test_head_only_fedavg_counts_only_the_head(tmp_path: Path) -> None:
    runs = hetfed_run(tmp_path, "--algorithm", "fedavg_head", "--clients", "3", "--rounds", "3",
                      "--dataset", "digits", "--model", "mlp", "--partition", "iid")
    head = 4 * (10 * 64 + 10)
    for r in runs["fedavg_head"]["rounds"]:
        kinds = set(r["bytes_up"]) | set(r["bytes_down"])
        assert "model_weights" not in kinds
        if 2 <= r["round"] <= 3:
            assert head * 3 <= r["bytes_up"]["head_weights"] < head * 3 * 1.02
            assert head * 3 <= r["bytes_down"]["head_weights"] < head * 3 * 1.02


def test_baselines_match_golden_metrics(tmp_path: Path) -> None:
    """A short deterministic run of every baseline against golden figures (bytes exact, accuracy ± 3 points)."""
    runs = hetfed_run(tmp_path, "--algorithm", "local,fedavg,fedprox,fedavg_head", "--clients", "3",
                      "--rounds", "3", "--dataset", "digits", "--model", "mlp", "--partition", "dirichlet",
                      "--alpha", "0.5", "--seed", "1", "--set", "fedprox.mu=0.1")
    got = {
        algo: {
            "final_test_accuracy": r["final_test_accuracy"],
            "final_global_test_accuracy": r["final_global_test_accuracy"],
            "bytes_up": [r2["bytes_up"] for r2 in r["rounds"]],
            "bytes_down": [r2["bytes_down"] for r2 in r["rounds"]],
        }
        for algo, r in runs.items()
    }
    golden_file = GOLDEN / "baselines_digits.json"
    if os.environ.get("HETFED_UPDATE_GOLDEN"):
        golden_file.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    golden = json.loads(golden_file.read_text())
    assert set(got) == set(golden)
    for algo, want in golden.items():
        for key in ("final_test_accuracy", "final_global_test_accuracy"):
            assert got[algo][key] == pytest.approx(want[key], abs=0.03), (algo, key)
        for key in ("bytes_up", "bytes_down"):
            for rg, rw in zip(got[algo][key], want[key], strict=True):
                for kind, n in rw.items():
                    # Payload bytes are exact; the envelope varies by a few bytes with varint-encoded values.
                    assert rg[kind] == pytest.approx(n, abs=0 if kind != "envelope" else 16), (algo, key, kind)


def test_a_second_run_into_the_same_output_directory_starts_fresh(tmp_path: Path) -> None:
    """``--output DIR`` twice: the second run does not resume the first one's finished state."""
    args = ("--algorithm", "local", "--clients", "2", "--rounds", "1", "--dataset", "digits", "--model", "mlp",
            "--no-report")
    first = hetfed_run(tmp_path, *args)["local"]
    second = hetfed_run(tmp_path, *args)["local"]
    assert [r["round"] for r in second["rounds"]] == [1, 2]  # one training round and the evaluate round, again
    assert second["final_test_accuracy"] == first["final_test_accuracy"]  # and deterministic


def test_a_client_whose_training_diverges_stops_in_one_line_and_sends_nothing(tmp_path: Path) -> None:
    """At lr 1e6 the MLP's weights overflow within round 1: each client exits 2 naming the round, the mean loss
    and the rate, with no traceback; ``hetfed run`` prints that as its error and exits 1; nothing reached the
    aggregator, so round 1 never closed."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "fedavg", "--clients", "2",
                           "--rounds", "2", "--dataset", "digits", "--model", "mlp", "--lr", "1e6", "--no-report",
                           "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("hetfed run: error: client-fedavg-org-"), proc.stderr
    assert "Traceback" not in proc.stderr
    failed = proc.stderr.splitlines()[0].removeprefix("hetfed run: error: ").removesuffix(" failed:")
    log = (out / f"{failed}.log").read_text()
    (line,) = [ln for ln in log.splitlines() if ln.startswith("hetfed client:")]
    assert re.fullmatch(r"hetfed client: org-[01]: local training diverged in round 1: the mean training loss is "
                        r"(nan|inf) over \d+ steps at lr 1e\+06; its model is no longer finite and nothing was sent\. "
                        r"A lower learning rate \(lr\), or a cap on the gradient's norm \(max_grad_norm\), may "
                        r"avoid it", line), line
    assert "Traceback" not in log and line in proc.stderr
    # Before exiting it told the aggregator it leaves, naming the event (a leave notice), so rounds stop waiting
    # for it; this run closes no round since every organization diverged. The loss is a figure of private data:
    # the organization's log keeps it, the notice does not carry it.
    assert re.search(r"org-[01]: the aggregator took the leave notice: organization_left: organization 'org-[01]' "
                     r"leaves run 'fedavg': its local training diverged in round 1; the run goes on without it",
                     log), log
    aggregator_log = (out / "aggregator.log").read_text()
    assert re.search(r"organization 'org-[01]' refused for good \(organization_left\)", aggregator_log)
    assert "training loss" not in aggregator_log and "lr 1e+06" not in aggregator_log
    assert (out / "state" / "fedavg" / "history.jsonl").read_text() == ""  # the run's journal: no round closed


def _descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (Linux /proc children lists)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in child_pids(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_sigterm_stops_the_federation_it_started(tmp_path: Path) -> None:
    """`timeout`, a scheduler or kill send SIGTERM: the aggregator and every client go with `hetfed run`."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "fedavg", "--clients", "2",
                             "--rounds", "100000", "--dataset", "digits", "--model", "mlp", "--output", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not all((out / f"client-fedavg-org-{i}.log").exists()
                      and "joined run" in (out / f"client-fedavg-org-{i}.log").read_text() for i in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, "the federation did not start"
            time.sleep(0.1)
        started = _descendants(proc.pid)
        assert len(started) >= 4  # the aggregator, the fork server and two clients at least
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while any(process_alive(p) for p in started):
            assert time.monotonic() < deadline, f"left running: {[p for p in started if process_alive(p)]}"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
