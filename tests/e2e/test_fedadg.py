"""FedADG end to end: ``hetfed run`` starts a real aggregator and real client processes over loopback gRPC on
Rotated MNIST, leave one domain out (FedSR's setting, where its paper compares with FedADG). The held-out target
domain is classified far above chance after two rounds, and every byte of model weights each way is exactly the
extractor, the classifier and the generator: FedAvg's upload of the same network is smaller by the generator's
encoded tensors alone, so no discriminator value goes up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetfed.cli.localrun import LocalFederation, LocalRunOptions, aggregator_config, client_config
from hetfed.client.algorithms import ClientContext
from hetfed.client.algorithms.fedadg import FedADGClient
from hetfed.client.algorithms.fedavg import model_weights
from hetfed.client.data import DataConfig, load_client_data
from hetfed.wire import codec
from hetfed.wire.specs import get_spec
from hetfed.wire.traffic import embedded_size
from tests.e2e.test_local_run import hetfed_run

pytestmark = pytest.mark.e2e
CLIENTS, ROUNDS, TARGET, Z, K = 2, 2, 2, 64, 10
# One classifier epoch and one adversarial epoch of batch 64 a round; G and D of the default sizes.
SETTINGS = ("local_epochs=1", "classifier_epochs=1", "batch_size=64")


def _sizes() -> tuple[int, int]:
    """(FedADG's, FedAvg's) encoded ModelWeights of one organization: rmnist_cnn with z = 64, 900 examples."""
    spec = get_spec("fedadg")
    config = spec.config()
    data = load_client_data(DataConfig(dataset="mnist5k", partition="rotated_lodo", num_clients=CLIENTS,
                                       target_domain=TARGET))
    model = FedADGClient.make_model("rmnist_cnn", data.input_shape, K, seed=0, latent_dim=Z, bounded_latent=False,
                                    config=config)
    half = FedADGClient(ClientContext("org-0", model, data, torch.device("cpu"), config, 0))
    fedadg, fedavg = half.upload(), model_weights(model, len(data.train))
    assert fedadg.num_examples == fedavg.num_examples == 900
    assert set(fedadg.tensors) - set(fedavg.tensors) == {f"generator.net.fc{i}.{p}" for i in (1, 2)
                                                         for p in ("weight", "bias")}
    return embedded_size(codec.payload_to_proto(fedadg).ByteSize()), embedded_size(
        codec.payload_to_proto(fedavg).ByteSize())


def test_fedadg_generalises_to_the_target_and_sends_f_c_and_g_alone(tmp_path: Path) -> None:
    runs = hetfed_run(tmp_path, "--algorithm", "fedadg,fedavg", "--dataset", "mnist5k", "--clients", str(CLIENTS),
                      "--rounds", str(ROUNDS), "--model", "rmnist_cnn", "--latent-dim", str(Z),
                      "--data", f"target_domain={TARGET}", *(a for s in SETTINGS for a in ("--set", f"fedadg.{s}")))
    fedadg = runs["fedadg"]
    assert [r["round"] for r in fedadg["rounds"]] == list(range(1, ROUNDS + 2))
    assert all(r["clients"] == CLIENTS for r in fedadg["rounds"])  # every upload accepted
    # The held-out domain (M30) is never trained on; chance is 10%.
    assert fedadg["final_figures"]["target"] > 0.5
    assert fedadg["final_figures"]["source_val"] > 0.8
    ours, theirs = _sizes()
    # G's Linear(64 + 10, 256) and Linear(256, 64): 35,648 float32 values, plus four names, shapes and framing.
    assert 4 * ((Z + K) * 256 + 256 + 256 * Z + Z) == 142_592 < ours - theirs < 142_592 + 400
    for r in fedadg["rounds"]:
        up, down = r["bytes_up"], r["bytes_down"]
        if r["round"] <= ROUNDS:
            assert set(up) == {"model_weights", "eval_metrics", "envelope"}
            assert up["model_weights"] == CLIENTS * ours
        else:
            assert set(up) == {"eval_metrics", "envelope"}  # the final evaluation sends metrics alone
        if r["round"] > 1:  # the global F, C and G; round 1 starts from the run seed
            assert set(down) == {"model_weights", "envelope"}
    fedavg = runs["fedavg"]
    assert [a["bytes_up"].get("model_weights", 0) - b["bytes_up"].get("model_weights", 0)
            for a, b in zip(fedadg["rounds"], fedavg["rounds"], strict=True)] == \
        [CLIENTS * (ours - theirs)] * ROUNDS + [0]


def test_a_client_under_privacy_is_refused_at_join_in_one_line(tmp_path: Path) -> None:
    """FedADG has no DP mechanism (G and D train outside DP-SGD, G is sent): an organization with [privacy]
    joins, learns the algorithm and stops, exit 2, before any training or push."""
    opts = LocalRunOptions(algorithms=("fedadg",), clients=1, rounds=1, data={"target_domain": 1},
                           privacy={"noise_multiplier": 1.0, "delta": 1e-5}, quiet=True)
    fed = LocalFederation(tmp_path, fork_clients=False)
    try:
        fed.start_aggregator(aggregator_config(opts, str(tmp_path / "state")))
        path = tmp_path / "org-0.json"
        path.write_text(json.dumps({**client_config(opts, "fedadg", 0, fed.port),
                                    "state_dir": str(tmp_path / "org-0-state")}))
        proc = subprocess.run([sys.executable, "-m", "hetfed.cli", "client", "--config", str(path)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        (status,) = fed.status()
    finally:
        fed.stop()
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "hetfed client: org-0: [privacy] is set, but hetfed has no DP mechanism for fedadg's uploads "
        "(docs/privacy.md lists the algorithms it serves)")
    assert "Traceback" not in proc.stderr
    # Joined (it learnt the algorithm there), never pushed: no round has a client.
    assert [o.last_round_pushed for o in status.organization_status] == [-1]
    assert status.round == 1 and all(h.clients == 0 for h in status.history)
