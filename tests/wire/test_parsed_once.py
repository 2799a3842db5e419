"""Each process parses an algorithm's settings once: the spec's ``parse`` is counted on the way from
``hetfed run --set`` to the aggregator's file, from the file to the run, and from the Join reply to the client."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from hetfed.aggregator.config import load_aggregator_config
from hetfed.aggregator.serving.server import RunningAggregator
from hetfed.cli import build_parser, run_options
from hetfed.cli.localrun import aggregator_config, plan
from hetfed.wire import messages
from hetfed.wire.config import ConfigError, to_mapping
from hetfed.wire.rpc import AggregatorClient
from hetfed.wire.specs import SPECS
from hetfed.wire.specs.base import AlgorithmSpec


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Where each call of ``AlgorithmSpec.parse`` was made from (its ``where``), in order."""
    seen: list[str] = []
    parse = AlgorithmSpec.parse

    def counted(self: AlgorithmSpec[Any], data: Mapping[str, Any], where: str = "config") -> Any:
        seen.append(where)
        return parse(self, data, where)

    monkeypatch.setattr(AlgorithmSpec, "parse", counted)
    return seen


def test_the_aggregator_parses_once_and_the_client_parses_the_join_reply_once(
        parses: list[str], aggregator: Callable[..., RunningAggregator]) -> None:
    # The aggregator process: its file is loaded (a mapping here, the same loader), the run built, Joins answered.
    agg = aggregator({"id": "r", "algorithm": "fedprox", "organizations": ["a", "b"], "rounds": 2,
                      "algorithm_config": {"mu": 0.1, "lr": 0.2}})
    assert parses == ["aggregator.runs[0].algorithm_config"]
    held = agg.service.runs["r"].cfg.algorithm_config
    assert (held.mu, held.lr) == (0.1, 0.2)  # type: ignore[attr-defined]
    # The client process: the runtime reads the first reply's config; a second Join's reply is not read for it.
    with AggregatorClient(f"127.0.0.1:{agg.port}", None, "a", "r") as client:
        joined = client.join()
        again = client.join()
        assert parses == ["aggregator.runs[0].algorithm_config"]  # answering Joins parses nothing
        config = joined.config
        assert config is joined.config  # kept: reading it twice parses once
    assert parses == ["aggregator.runs[0].algorithm_config", "runs[r].algorithm_config"]
    assert config == held and type(config) is type(held)
    assert again.config_json == joined.config_json


def test_hetfed_runs_plan_parses_each_set_once_and_its_aggregator_once_more(parses: list[str], tmp_path: Path) -> None:
    args = build_parser().parse_args(["run", "--algorithm", "fedprox,fedavg", "--set", "fedprox.mu=0.1"])
    p = plan(run_options(args))
    assert parses == ["fedprox config", "fedavg config"]  # the command's process: once per run
    fedprox = p.runs[0].run.algorithm_config
    assert fedprox.mu == 0.1 and fedprox is p.runs[0].train  # type: ignore[attr-defined]
    path = tmp_path / "aggregator.json"
    path.write_text(json.dumps(aggregator_config(p, str(tmp_path / "state"))))  # written from the typed configs
    assert len(parses) == 2
    loaded = load_aggregator_config(path)  # the aggregator's process
    # FedProx's table is parsed once; FedAvg runs at its declared defaults, so its file carries no table and the
    # loader builds the spec's defaults without parsing anything.
    assert "algorithm_config" not in json.loads(path.read_text())["runs"][1]
    assert parses[2:] == ["aggregator.json.runs[0].algorithm_config"]
    assert [r.algorithm_config for r in loaded.runs] == [r.train for r in p.runs]


def test_the_join_reply_carries_every_field_of_the_typed_config() -> None:
    spec = SPECS["ditto_cos"]
    config = spec.config(lam=SPECS["ditto"].config().lam)  # a field back at the type's default, off the preset's
    text = messages.encode_config(config)
    assert json.loads(text) == to_mapping(config)
    reply = messages.JoinReply("r", "ditto_cos", text, 1, 3, 7, ("a",))
    decoded = messages.join_reply_from_proto(messages.join_reply_to_proto(reply)).config
    assert decoded == config and type(decoded) is type(config)


@pytest.mark.parametrize(("algorithm", "text", "message"), [
    ("fedavg", '{"lrr": 0.1}', "runs[r].algorithm_config: unknown field 'lrr' (did you mean 'lr'?)"),
    ("fedavg", '{"lr": "x"}', "runs[r].algorithm_config.lr: expected a number, got 'x'"),
    ("fedavg", '{"lr": ', "runs[r].algorithm_config: Expecting value: line 1 column 8 (char 7)"),
    ("fedavgg", "{}", "runs[r].algorithm_config: unknown algorithm 'fedavgg' (did you mean 'fedavg'?); available: "),
])
def test_a_config_the_client_cannot_read_is_one_line_naming_the_run(algorithm: str, text: str, message: str) -> None:
    reply = messages.JoinReply("r", algorithm, text, 1, 3, 7, ("a",))
    with pytest.raises(ConfigError) as err:
        _ = reply.config
    assert str(err.value).startswith(message)
