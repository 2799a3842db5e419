"""`hetfed bench htfl`: the grid loads, names only registered algorithms and models, and every federation is planned
with HtFLlib's split and training settings (docs/results/htfl.md lists their sources)."""

from __future__ import annotations

import subprocess
import sys

from hetfed.cli import reproduce as rp
from hetfed.cli.localrun import plan
from hetfed.client.model_registry import MODELS
from hetfed.wire.specs import SPECS

# The model-heterogeneous algorithms the grid compares, and the baselines beside them.
EXPECTED = {"local": "local", "lg_fedavg": "fedavg_head", "fedproto": "fedproto", "fml": "fml",
            "fedgen": "fedgen_head", "fedcma": "fedcma"}
ARCHITECTURES = ("rmnist_cnn_k5", "lenet", "cnn", "mlp")


def test_htfl_is_listed_by_hetfed_bench() -> None:
    out = subprocess.run([sys.executable, "-m", "hetfed.cli", "bench", "--list"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert any(line.split()[:1] == ["htfl"] for line in out.splitlines()), out


def test_htfl_names_only_registered_algorithms_and_models() -> None:
    grid = rp.load_grid("htfl")
    assert {m.id: m.algorithm for m in grid.methods} == EXPECTED
    for m in grid.methods:
        assert m.algorithm in SPECS, m.algorithm
        assert m.models == ARCHITECTURES and set(m.models) <= set(MODELS), m.id
    assert grid.results == "docs/results/htfl.md" and len(grid.seeds) >= 3
    assert [a.name for a in grid.axes] == ["dataset"] and grid.axes[0].values == ("fmnist", "mnist5k")


def test_htfl_reports_htfllibs_metric_and_bytes() -> None:
    figures = {f.key: f for f in rp.load_grid("htfl").figures}
    # HtFLlib: correct predictions over all test examples (pooled), the best round of each run.
    assert (figures["best"].source, figures["best"].best_rounds) == ("pooled:test_accuracy", 1)
    assert (figures["final"].source, figures["final"].best_rounds) == ("pooled:test_accuracy", 0)
    assert figures["bytes"].source == "bytes_per_round" and not figures["bytes"].percent


def test_every_htfl_federation_is_planned_with_htfllibs_settings() -> None:
    grid = rp.load_grid("htfl")
    for cell in grid.cells():
        for m in grid.methods:
            p = plan(rp.federation_options(grid, m, cell, grid.seeds[0], artifacts=False))
            (run,) = p.runs
            assert run.spec.name == m.algorithm and run.rounds == 200 and run.latent_dim == 512, m.id
            # 20 organizations on a Dirichlet(0.1) split, organization i on architecture i mod 4 (HtFLlib's
            # BaseHeadSplit: args.models[cid % len(args.models)]).
            assert p.clients == 20 and len(run.clients) == 20
            assert [c.model.name for c in run.clients] == [ARCHITECTURES[i % 4] for i in range(20)], m.id
            assert {(d.dataset, d.partition, d.alpha, d.num_clients) for d in p.data} == {
                (cell["dataset"], "dirichlet", 0.1, 20)}
            # SGD at lr 0.01 without momentum or weight decay, batch 10, one local epoch.
            train = run.train
            assert (train.optimizer, train.lr, train.momentum, train.weight_decay) == ("sgd", 0.01, 0.0, 0.0), m.id
            assert (train.batch_size, train.local_epochs, train.local_steps) == (10, 1, 0), m.id
            assert train.lr_decay == 1.0, m.id
    configs = {m.id: m.config for m in grid.methods}
    assert configs["fml"]["meme_model"] == ARCHITECTURES[0]  # HtFLlib's serverfml.py:18, BaseHeadSplit(args, 0)
    assert (configs["fml"]["alpha"], configs["fml"]["beta"]) == (0.5, 0.5)
    assert configs["fedproto"]["proto_weight"] == 10.0
    assert {k: configs["fedgen"][k] for k in ("gen_alpha", "gen_beta", "noise_dim", "hidden_dim", "generator_lr",
                                              "generator_steps", "diversity_weight")} == {
        "gen_alpha": 1.0, "gen_beta": 0.0, "noise_dim": 32, "hidden_dim": 512, "generator_lr": 0.1,
        "generator_steps": 100, "diversity_weight": 0.0}
