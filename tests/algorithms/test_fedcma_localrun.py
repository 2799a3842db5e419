"""What ``hetfed run --algorithm fedcma`` configures: heterogeneous encoders by default, one d_e and K everywhere."""

from __future__ import annotations

from hetfed.cli.localrun import LocalRunOptions, aggregator_config, client_config
from hetfed.wire.specs import SPECS


def test_fedcma_mixes_cnn_and_mlp_encoders_by_default_with_one_latent_width() -> None:
    opts = LocalRunOptions(algorithms=("fedcma", "local"), clients=4)
    (run, local) = aggregator_config(opts, "state")["runs"]
    cfg = SPECS["fedcma"].parse(run.get("algorithm_config", {}))  # as the aggregator reads its file
    assert (cfg.latent_dim, cfg.num_classes) == (32, 10)
    clients = [client_config(opts, "fedcma", i, 1) for i in range(4)]
    assert [c["model"]["name"] for c in clients] == ["fedgen_cnn", "mlp", "fedgen_cnn", "mlp"]
    assert {c["model"]["latent_dim"] for c in clients} == {32}
    assert "output_dir" not in clients[0]
    # Other algorithms keep the plain defaults.
    assert client_config(opts, "local", 1, 1)["model"] == {"name": "lenet", "latent_dim": 0}
    assert "latent_dim" not in local.get("algorithm_config", {})  # a table at the defaults is left out


def test_explicit_models_and_latent_width_win() -> None:
    opts = LocalRunOptions(algorithms=("fedcma",), models=("lenet",), latent_dim=16,
                           extra_algorithm_config={"fedcma": {"num_classes": 10}})
    (run,) = aggregator_config(opts, "state")["runs"]
    assert run["algorithm_config"]["latent_dim"] == 16
    assert client_config(opts, "fedcma", 1, 1)["model"] == {"name": "lenet", "latent_dim": 16}


def test_gauss4_uses_its_own_split_a_2d_latent_and_writes_snapshots() -> None:
    opts = LocalRunOptions(algorithms=("fedcma",), dataset="gauss4")
    (run,) = aggregator_config(opts, "state")["runs"]
    assert (run["algorithm_config"]["latent_dim"], run["algorithm_config"]["num_classes"]) == (2, 4)
    c = client_config(opts, "fedcma", 3, 1)
    assert c["data"]["partition"] == "natural"
    assert c["model"] == {"name": "mlp", "latent_dim": 2}
    assert c["output_dir"] == "artifacts/fedcma/org-3"
    # Every algorithm on the toy gets a flat-input encoder and a 2-D latent space to draw.
    assert client_config(LocalRunOptions(algorithms=("local",), dataset="gauss4"), "local", 0, 1)["model"] == {
        "name": "mlp", "latent_dim": 2}
