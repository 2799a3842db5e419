"""A user's mistake gets one clear line and exit status 2, before any process starts; help comes from the
registries."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BAD = [
    (["--algorithm", "nonexistent"], "unknown algorithm 'nonexistent'"),
    (["--algorithm", "fedavg,fedavgg"], "unknown algorithm 'fedavgg' (did you mean 'fedavg'?)"),
    (["--dataset", "mnist"], "unknown dataset 'mnist' (did you mean 'mnist5k'?)"),
    (["--clients", "0"], "--clients must be greater than 0, got 0"),
    (["--clients", "many"], "--clients must be a number, got 'many'"),
    (["--partition", "rotated", "--dataset", "digits"], "dataset 'digits' has no partition 'rotated'"),
    (["--algorithm", "fedh2l", "--dataset", "gauss4"], "fedh2l needs the 'rotated' partition, which dataset 'gauss4'"),
    (["--algorithm", "fedh2l", "--partition", "iid"], "fedh2l needs a seed set every organization holds; partition "
                                                       "'iid' of 'mnist5k' has none (use --partition rotated)"),
    (["--model", "resnet"], "unknown model 'resnet'"),
    (["--algorithm", "fedprox", "--set", "fedprox.mu=-1"], "mu must be >= 0, got -1"),
    (["--algorithm", "fedprox", "--set", "fedprox.muu=1"], "unknown field 'muu' (did you mean 'mu'?)"),
    (["--set", "fedcma.lambda1=1"], "--set names algorithm 'fedcma', which is not among fedavg, local"),
    (["--models", "lenet,resnet"], "unknown model 'resnet'"),
    (["--data", "target_domian=1"], "unknown data field 'target_domian' (did you mean 'target_domain'?)"),
    (["--data", "num_clients=3"], "--data num_clients: set it with --clients"),
    (["--algorithm", "fedsr", "--data", "target_domain=6"], "data.target_domain must be <= data.num_clients (5)"),
    (["--algorithm", "fedsr", "--set", "probabilistic=false"], "alpha_cmi = 0.0005 needs probabilistic = true"),
    (["--dataset", "synthetic", "--data", "synthetic_alpha=-1"], "data.synthetic_alpha must be >= 0, got -1"),
    (["--data", "seed=3"], "--data seed: set it with --seed"),
    (["--algorithm", "ditto", "--set", "ditto.mu=1"], "mu = 1.0 needs a measure (cosine, mkmmd or mmdd)"),
    (["--algorithm", "ditto_mkmmd", "--set", "refit_every=0"], "refit_every must be -1 (every step, on its batch)"),
    (["--set", "privacy.epsilon_budgt=3"], "--set privacy: unknown field 'epsilon_budgt' (did you mean 'epsilon_budget'?)"),
    (["--set", "privacy.epsilon_budget=0"], "--set privacy: epsilon_budget must be a number > 0"),
    (["--set", "privacy.epsilon_budget=3", "--set", "privacy.target_epsilon=5"],
     "--set privacy: target_epsilon (5.0) exceeds epsilon_budget (3.0)"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_invocation_prints_one_line_and_exits_2(tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "hetfed.cli", "run", *args, "--output", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert message in lines[0] and "Traceback" not in proc.stderr
    assert lines[0].startswith("hetfed run: error: ")
    # Nothing started: no aggregator or client ever wrote a log or a config.
    assert not out.exists() or not any(out.iterdir())


def test_help_lists_every_registered_choice() -> None:
    from hetfed.client.data import DATASETS, PARTITIONS
    from hetfed.client.model_registry import MODELS
    from hetfed.wire.specs import SPECS

    # A wide terminal and no PATH, but the PYTHONPATH that picks this checkout's packages.
    env = {"COLUMNS": "400", "PATH": "", **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}}
    proc = subprocess.run([sys.executable, "-m", "hetfed.cli", "run", "--help"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for name in [*SPECS, *PARTITIONS, *MODELS, *(n for n, e in DATASETS.items() if e.builtin)]:
        assert f"{name}:" in text, name


def test_an_unknown_benchmark_is_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "hetfed.cli", "bench", "nope"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "unknown benchmark 'nope'; available: ditto, ditto_draws, ditto_paper, fedcma, fedcma_fedgen, fedcma_hetero, fedh2l" in proc.stderr


def test_bare_hetfed_prints_the_help_and_starts_nothing(tmp_path: Path) -> None:
    """No subcommand: the top-level usage on stdout, exit 0, and no federation (it would take minutes)."""
    proc = subprocess.run([sys.executable, "-m", "hetfed.cli"], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: hetfed ")
    assert "{aggregator,client," in proc.stdout and "hetfed run" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("make", "message"), [
    ("file", "exists and is not a directory"),
    ("under_file", "cannot create the directory: {file} is a file"),
], ids=["a-file", "under-a-file"])
def test_a_bad_output_path_is_one_line(tmp_path: Path, make: str, message: str) -> None:
    """--output naming a file, or a directory that cannot be made under one: one line, exit 2, nothing started."""
    file = tmp_path / "results.txt"
    file.write_text("kept\n")
    out = file if make == "file" else file / "sub"
    proc = subprocess.run([sys.executable, "-m", "hetfed.cli", "run", "--output", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [f"hetfed run: error: --output {out}: {message.format(file=file)}"]
    assert file.read_text() == "kept\n" and sorted(p.name for p in tmp_path.iterdir()) == ["results.txt"]
