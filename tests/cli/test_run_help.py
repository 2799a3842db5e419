"""``hetfed run --help`` states no default that a run does not use.

Options with a fixed default state the parser's own value. Options the registries resolve (rounds, clients,
the training knobs, models, latent width, partition) point to the defaults table, and every cell of that
table must equal what the aggregator and the clients of a run of that algorithm are configured with.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from hetfed.aggregator.config import aggregator_config_from_mapping
from hetfed.cli import build_parser, main, run_options
from hetfed.cli.localrun import aggregator_config, client_config, plan, run_id_of
from hetfed.client.data import DATASETS
from hetfed.wire.config import ConfigError
from hetfed.wire.specs import SPECS

BUILTIN = [n for n, e in DATASETS.items() if e.builtin]
# Options whose default the plan resolves per algorithm and dataset: their parser default must stay None.
RESOLVED = {"rounds", "clients", "local_epochs", "lr", "momentum", "batch_size", "latent_dim", "model", "partition"}


def help_of(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """What ``hetfed run ARGS --help`` prints."""
    with pytest.raises(SystemExit) as stop:
        main(["run", *args, "--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


def defaults_table(text: str) -> dict[str, dict[str, str]]:
    """The help's defaults table: algorithm -> column -> cell."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["algorithm", "rounds"])
    header = re.split(r"\s{2,}", lines[start].strip())
    rows = {}
    for line in lines[start + 1:]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        assert len(cells) == len(header), line
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    return rows


def what_a_run_uses(algorithm: str, dataset: str, tmp_path: Path) -> dict[str, object]:
    """The configs ``hetfed run --algorithm A --dataset D`` hands its aggregator and clients, read back."""
    args = build_parser().parse_args(["run", "--algorithm", algorithm, "--dataset", dataset])
    p = plan(run_options(args))
    (run,) = aggregator_config_from_mapping(aggregator_config(p, str(tmp_path))).runs
    clients = [client_config(p, run_id_of(algorithm), i, 1) for i in range(len(run.organizations))]
    tc = run.algorithm_config
    return {"rounds": run.rounds, "epochs": tc.local_epochs, "steps": tc.local_steps, "lr": tc.lr,
            "momentum": tc.momentum, "batch": tc.batch_size, "clients": len(run.organizations),
            "partition": {c["data"]["partition"] for c in clients}, "models": [c["model"]["name"] for c in clients],
            "d_e": {c["model"]["latent_dim"] for c in clients}}


@pytest.mark.parametrize("dataset", BUILTIN)
def test_the_defaults_table_is_what_a_run_uses(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                               dataset: str) -> None:
    text = help_of(capsys, "--dataset", dataset)
    rows = defaults_table(text)
    for algorithm in SPECS:
        if algorithm not in rows:  # the help says why a run of it is refused; so must the run
            with pytest.raises(ConfigError) as refused:
                what_a_run_uses(algorithm, dataset, tmp_path)
            assert f"  {algorithm}: {refused.value}" in text
            continue
        row, used = rows[algorithm], what_a_run_uses(algorithm, dataset, tmp_path)
        n, unit = row["local work"].split()
        if unit.startswith("step"):
            assert int(n) == used["steps"], (algorithm, row)
        else:
            assert unit.startswith("epoch") and int(n) == used["epochs"] and used["steps"] == 0, (algorithm, row)
        assert int(row["rounds"]) == used["rounds"], (algorithm, row)
        assert float(row["lr"]) == used["lr"], (algorithm, row)
        assert float(row["momentum"]) == used["momentum"], (algorithm, row)
        assert int(row["batch"]) == used["batch"], (algorithm, row)
        assert int(row["clients"]) == used["clients"], (algorithm, row)
        assert {row["partition"]} == used["partition"], (algorithm, row)
        listed = row["models"].split(",")
        assert used["models"] == [listed[i % len(listed)] for i in range(used["clients"])], (algorithm, row)
        assert {0 if row["d_e"] == "-" else int(row["d_e"])} == used["d_e"], (algorithm, row)


def test_the_table_shows_what_differs_by_algorithm(capsys: pytest.CaptureFixture[str]) -> None:
    """SimFed's training defaults are not FedAvg's: one line of help cannot state both."""
    rows = defaults_table(help_of(capsys))
    assert (rows["simfed"]["local work"], rows["simfed"]["lr"], rows["simfed"]["batch"]) == ("5 epochs", "0.05", "128")
    assert (rows["fedavg"]["local work"], rows["fedavg"]["lr"], rows["fedavg"]["batch"]) == ("2 epochs", "0.01", "32")


def stated_value_matches(value: str, default: object) -> bool:
    """Whether a help's "(default VALUE)" is the parser's default (numbers compared as numbers)."""
    if isinstance(default, list):
        return value == ",".join(map(str, default))
    if isinstance(default, int | float) and not isinstance(default, bool):
        return float(value) == float(default)
    return value == str(default)


def test_every_stated_default_is_the_parser_default() -> None:
    """A fixed "(default X)" is the value the parser fills in, in every subcommand. An option the plan resolves
    names whose default applies (the table lists the values) and states no value of its own."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    checked = 0
    for command, parser in sub.choices.items():
        for action in parser._actions:
            if not action.help or action.dest in ("help", argparse.SUPPRESS):
                continue
            text = action.help % {"default": action.default, "prog": parser.prog}
            stated = re.findall(r"\(default(:?) ?([^:;)]*)", text)  # "(default: whose)" or "(default VALUE"
            where = f"{command} --{action.dest}: {text!r}"
            if command == "run" and action.dest in RESOLVED:
                assert action.default is None, where
                assert stated and all(colon and not re.search(r"\d", words) for colon, words in stated), where
                continue
            for colon, value in stated:
                if colon:  # resolved when the command runs: the parser must leave it unset
                    assert action.default is None, where
                else:
                    assert stated_value_matches(value, action.default), where
                    checked += 1
    assert checked >= 12  # run's algorithm, dataset, alpha, seed, ..., certs --days, report --since, ...
