"""Tests for hetfed.wire.config: strict loading names the field, its full path and the close match."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from hetfed.aggregator.config import AggregatorConfig, aggregator_config_from_mapping, load_aggregator_config
from hetfed.wire.config import ConfigError, check, dependent, from_mapping, load_file, to_mapping
from hetfed.wire.specs.fedavg import FedAvgConfig


@dataclass(frozen=True)
class Limits:
    """A nested table with a range check."""

    max_bytes: int = 1024
    ratio: float = 0.5

    def __post_init__(self) -> None:
        check(self.max_bytes > 0, f"max_bytes must be > 0, got {self.max_bytes}")


@dataclass(frozen=True)
class Peer:
    """An entry of a list of tables."""

    name: str
    port: int = 0


@dataclass(frozen=True)
class Example:
    """Every kind of field the loader supports."""

    name: str
    enabled: bool = True
    retries: int = 3
    timeout: float = 1.0
    mode: Literal["fast", "safe"] = "safe"
    tags: tuple[str, ...] = ()
    weights: dict[str, float] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    peers: tuple[Peer, ...] = ()
    backup: Peer | None = None
    anything: Any = None


def error_of(data: dict[str, Any], cls: type = Example) -> str:
    with pytest.raises(ConfigError) as err:
        from_mapping(cls, data)
    return str(err.value)


def test_valid_mapping_builds_frozen_typed_dataclasses() -> None:
    cfg = from_mapping(Example, {
        "name": "x", "enabled": False, "retries": 5, "timeout": 2, "mode": "fast", "tags": ["a", "b"],
        "weights": {"a": 1}, "limits": {"max_bytes": 7}, "peers": [{"name": "p", "port": 9}],
        "backup": {"name": "b"}, "anything": [1, {"k": None}],
    })
    assert cfg == Example("x", False, 5, 2.0, "fast", ("a", "b"), {"a": 1.0}, Limits(7, 0.5), (Peer("p", 9),),
                          Peer("b"), [1, {"k": None}])
    assert isinstance(cfg.timeout, float)  # an integer is accepted for a float and converted
    assert isinstance(cfg.weights["a"], float)
    assert from_mapping(Example, {"name": "x", "backup": None}).backup is None
    assert from_mapping(Example, to_mapping(cfg)) == cfg
    assert to_mapping(cfg)["tags"] == ["a", "b"]


def test_unknown_field_is_named_with_its_close_match() -> None:
    assert error_of({"name": "x", "retires": 1}) == "config: unknown field 'retires' (did you mean 'retries'?)"
    assert error_of({"name": "x", "limits": {"max_byte": 1}}) == (
        "config.limits: unknown field 'max_byte' (did you mean 'max_bytes'?)"
    )


def test_unknown_field_without_a_close_match_lists_the_valid_fields() -> None:
    msg = error_of({"name": "x", "limits": {"zzz": 1}})
    assert msg == "config.limits: unknown field 'zzz'; valid fields: max_bytes, ratio"


def test_nested_paths_index_lists_of_tables() -> None:
    msg = error_of({"name": "x", "peers": [{"name": "a"}, {"name": "b", "prot": 1}]})
    assert msg == "config.peers[1]: unknown field 'prot' (did you mean 'port'?)"
    assert error_of({"name": "x", "peers": [{"name": "a"}, {"name": "b", "port": "80"}]}) == (
        "config.peers[1].port: expected an integer, got '80'"
    )
    assert error_of({"name": "x", "tags": ["a", 3]}) == "config.tags[1]: expected a string, got 3"
    assert error_of({"name": "x", "weights": {"w": "heavy"}}) == "config.weights.w: expected a number, got 'heavy'"


@pytest.mark.parametrize(("data", "message"), [
    ({"name": 3}, "config.name: expected a string, got 3"),
    ({"name": "x", "enabled": 1}, "config.enabled: expected true or false, got 1"),
    ({"name": "x", "enabled": "yes"}, "config.enabled: expected true or false, got 'yes'"),
    ({"name": "x", "retries": True}, "config.retries: expected an integer, got True"),
    ({"name": "x", "retries": 2.0}, "config.retries: expected an integer, got 2.0"),
    ({"name": "x", "timeout": False}, "config.timeout: expected a number, got False"),
    ({"name": "x", "timeout": "1s"}, "config.timeout: expected a number, got '1s'"),
    ({"name": "x", "mode": "turbo"}, "config.mode: must be one of 'fast', 'safe', got 'turbo'"),
    ({"name": "x", "tags": "a"}, "config.tags: expected a list, got 'a'"),
    ({"name": "x", "weights": [1]}, "config.weights: expected a table, got [1]"),
    ({"name": "x", "limits": 5}, "config.limits: expected a table of fields, got int"),
    ({"name": "x", "peers": [["a"]]}, "config.peers[0]: expected a table of fields, got list"),
])
def test_wrong_types_name_the_field_and_the_value(data: dict[str, Any], message: str) -> None:
    assert error_of(data) == message


def test_missing_required_field() -> None:
    assert error_of({}) == "config: missing required field 'name'"
    assert error_of({"name": "x", "peers": [{"port": 1}]}) == "config.peers[0]: missing required field 'name'"


def test_range_checks_raise_config_error() -> None:
    with pytest.raises(ConfigError, match=r"max_bytes must be > 0, got 0"):
        from_mapping(Example, {"name": "x", "limits": {"max_bytes": 0}})
    with pytest.raises(ConfigError, match="boom"):
        check(False, "boom")
    check(True, "never")


def test_not_a_dataclass_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="not a dataclass"):
        from_mapping(dict, {})


def test_optional_table_keeps_the_inner_error() -> None:
    assert error_of({"name": "x", "backup": {"nmae": "b"}}) == (
        "config.backup: unknown field 'nmae' (did you mean 'name'?)"
    )


def test_nested_range_check_names_its_path() -> None:
    assert error_of({"name": "x", "limits": {"max_bytes": 0}}) == "config.limits: max_bytes must be > 0, got 0"


# ---------------------------------------------------------------- the real aggregator config


def run(**kw: Any) -> dict[str, Any]:
    return {"id": "r", "algorithm": "fedavg", "organizations": ["a", "b"], **kw}


def test_aggregator_config_paths() -> None:
    with pytest.raises(ConfigError) as err:
        aggregator_config_from_mapping({"runs": [run(), run(id="s", roundz=3)]})
    assert str(err.value) == "aggregator.runs[1]: unknown field 'roundz' (did you mean 'rounds'?)"
    with pytest.raises(ConfigError) as err:
        aggregator_config_from_mapping({"runs": [run()], "server": {"chunk_byte": 2048}})
    assert str(err.value) == "aggregator.server: unknown field 'chunk_byte' (did you mean 'chunk_bytes'?)"
    with pytest.raises(ConfigError) as err:
        aggregator_config_from_mapping({"runs": [run(organizations="a")]})
    assert str(err.value) == "aggregator.runs[0].organizations: expected a list, got 'a'"
    with pytest.raises(ConfigError) as err:
        aggregator_config_from_mapping({"runs": [run(algorithm_config={"lrr": 0.1})]})
    # The algorithm's spec parses the table where it sits, so its errors name the whole path.
    assert str(err.value) == "aggregator.runs[0].algorithm_config: unknown field 'lrr' (did you mean 'lr'?)"
    with pytest.raises(ConfigError) as err:
        aggregator_config_from_mapping({"runs": [run(algorithm_config={"lr": "fast"})]})
    assert str(err.value) == "aggregator.runs[0].algorithm_config.lr: expected a number, got 'fast'"
    with pytest.raises(ConfigError) as err:
        aggregator_config_from_mapping({"runs": [run(algorithm_config={"lr": -1})]})
    assert str(err.value) == "aggregator.runs[0].algorithm_config: lr must be > 0, got -1.0"
    with pytest.raises(ConfigError) as err:
        aggregator_config_from_mapping({"runs": [run(algorithm="fedprox", algorithm_config={"mu": "x"})]})
    assert str(err.value) == "aggregator.runs[0].algorithm_config.mu: expected a number, got 'x'"
    for table in ({}, {"algorithm_config": {"lr": 0.1}}):  # an unknown algorithm has no config to parse either way
        with pytest.raises(ConfigError) as err:
            aggregator_config_from_mapping({"runs": [run(algorithm="fedavgg", **table)]})
        assert str(err.value).startswith("aggregator.runs[0]: unknown algorithm 'fedavgg' (did you mean 'fedavg'?)")
    with pytest.raises(ConfigError) as err:
        aggregator_config_from_mapping({"runs": [{"id": "r", "organizations": ["a"]}]})
    assert str(err.value) == "aggregator.runs[0]: missing required field 'algorithm'"


TOML = """
[server]
listen = "127.0.0.1:0"
metrics_port = -1
chunk_bytes = 4096

[[runs]]
id = "r1"
algorithm = "fedavg"
organizations = ["a", "b"]
rounds = 3

[runs.algorithm_config]
lr = 0.1
"""


def test_toml_and_json_files_load_the_same_config(tmp_path: Path) -> None:
    toml_path = tmp_path / "agg.toml"
    toml_path.write_text(TOML)
    from_toml = load_aggregator_config(toml_path)
    assert from_toml.server.chunk_bytes == 4096
    assert from_toml.runs[0].rounds == 3
    assert from_toml.runs[0].algorithm_config == FedAvgConfig(lr=0.1)
    json_path = tmp_path / "agg.json"
    json_path.write_text(json.dumps(to_mapping(from_toml)))
    assert load_file(AggregatorConfig, json_path) == from_toml


def test_file_errors_are_rooted_at_the_file_name(tmp_path: Path) -> None:
    p = tmp_path / "agg.toml"
    p.write_text(TOML.replace("rounds = 3", "rounds = 3\nmin_client = 1"))
    with pytest.raises(ConfigError) as err:
        load_aggregator_config(p)
    assert str(err.value) == "agg.toml.runs[0]: unknown field 'min_client' (did you mean 'min_clients'?)"


@pytest.mark.parametrize(("name", "text", "language"), [
    ("bad.toml", "[server\nlisten = 1", "TOML"),
    ("bad.json", '{"runs": [}', "JSON"),
    ("bad.conf", '{"runs": []}', "TOML"),  # anything but .json is read as TOML
])
def test_unparsable_files(tmp_path: Path, name: str, text: str, language: str) -> None:
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ConfigError, match=f"^{re.escape(str(p))}: not valid {language}: .*line 1"):
        load_aggregator_config(p)


def test_missing_or_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"cannot read config file {tmp_path / 'nope.toml'}: ")):
        load_aggregator_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_aggregator_config(tmp_path)  # a directory


def test_a_file_whose_top_level_is_not_a_table(tmp_path: Path) -> None:
    p = tmp_path / "list.json"
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"list\.json"):
        load_aggregator_config(p)


def test_a_sparse_mapping_leaves_out_defaults_and_reads_back_equal() -> None:
    from hetfed.aggregator.config import AggregatorConfig, RunConfig, ServerConfig
    from hetfed.wire.config import from_mapping, to_sparse_mapping

    cfg = AggregatorConfig(runs=(RunConfig(id="a", algorithm="fedavg", organizations=("x", "y"), min_clients=1,
                                           algorithm_config=FedAvgConfig()),),
                           server=ServerConfig(state_dir="s"))
    sparse = to_sparse_mapping(cfg)
    assert sparse == {"runs": [{"id": "a", "algorithm": "fedavg", "organizations": ["x", "y"], "min_clients": 1}],
                      "server": {"state_dir": "s"}}
    assert from_mapping(AggregatorConfig, sparse) == cfg
    kept = to_sparse_mapping(cfg, ("runs.rounds", "server.listen"))
    assert kept["runs"][0]["rounds"] == 10 and kept["server"] == {"listen": "0.0.0.0:50051", "state_dir": "s"}
    assert to_sparse_mapping(AggregatorConfig(runs=cfg.runs))["runs"] == sparse["runs"]
    assert "server" not in to_sparse_mapping(AggregatorConfig(runs=cfg.runs))


def test_a_sparse_run_writes_what_differs_from_its_algorithms_defaults_presets_included() -> None:
    """A preset's config starts from the preset's values, not the config type's: a field set back to the type's
    default differs from the preset and is written; the preset's own values are left out, and read back."""
    from hetfed.aggregator.config import AggregatorConfig, RunConfig
    from hetfed.wire.config import to_sparse_mapping
    from hetfed.wire.specs import SPECS

    cos = SPECS["ditto_cos"]
    plain_lam = SPECS["ditto"].config().lam
    assert cos.config().lam != plain_lam  # the case this test is about: the preset moves lam
    config = cos.config(lam=plain_lam, local_epochs=3)
    cfg = AggregatorConfig(runs=(RunConfig(id="a", algorithm="ditto_cos", organizations=("x",),
                                           algorithm_config=config),))
    (run,) = to_sparse_mapping(cfg)["runs"]
    assert run["algorithm_config"] == {"lam": plain_lam, "local_epochs": 3}
    assert aggregator_config_from_mapping(to_sparse_mapping(cfg)) == cfg
    at_preset = AggregatorConfig(runs=(RunConfig(id="a", algorithm="ditto_cos", organizations=("x",),
                                                 algorithm_config=cos.config()),))
    assert "algorithm_config" not in to_sparse_mapping(at_preset)["runs"][0]
    assert aggregator_config_from_mapping(to_sparse_mapping(at_preset)) == at_preset


def test_a_run_holds_its_algorithms_typed_config_and_nothing_else() -> None:
    from hetfed.aggregator.config import RunConfig
    from hetfed.wire.specs import SPECS

    loaded = aggregator_config_from_mapping({"runs": [run(algorithm="ditto_cos", algorithm_config={"mu": 2})]})
    assert loaded.runs[0].algorithm_config == SPECS["ditto_cos"].config(mu=2.0)  # presets, then the table
    assert aggregator_config_from_mapping({"runs": [run()]}).runs[0].algorithm_config == FedAvgConfig()
    with pytest.raises(ConfigError) as err:
        RunConfig(id="r", algorithm="fedprox", organizations=("a",), algorithm_config=FedAvgConfig())
    assert str(err.value) == "algorithm_config must be a FedProxConfig (algorithm 'fedprox''s config), got FedAvgConfig"
    with pytest.raises(ConfigError) as err:
        RunConfig(id="r", algorithm="fedavg", organizations=("a",), algorithm_config={"lr": 0.1})  # type: ignore[arg-type]
    assert str(err.value) == "algorithm_config must be a FedAvgConfig (algorithm 'fedavg''s config), got dict"


@dataclass(frozen=True)
class Circle:
    radius: float = 1.0


@dataclass(frozen=True)
class Square:
    side: float = 1.0
    rounded: bool = False


SHAPES: dict[str, type] = {"circle": Circle, "square": Square}


def _shape(value: Any, siblings: Mapping[str, Any], where: str) -> Any:
    return from_mapping(SHAPES[siblings["kind"]], value, where)


@dataclass(frozen=True)
class Drawing:
    """A field whose type its sibling ``kind`` names, declared with ``dependent``."""

    name: str
    kind: Literal["circle", "square"] = "circle"
    shape: Any = field(kw_only=True, metadata=dependent(_shape, lambda siblings: SHAPES[siblings["kind"]]()))
    scale: float = 1.0


def test_a_dependent_field_is_built_after_its_siblings_by_its_own_parser() -> None:
    from hetfed.wire.config import to_sparse_mapping

    square = from_mapping(Drawing, {"shape": {"side": 2}, "kind": "square", "name": "d"})
    assert square == Drawing("d", "square", shape=Square(2.0))
    assert from_mapping(Drawing, {"name": "d"}) == Drawing("d", shape=Circle())  # left out: the default hook's
    assert error_of({"name": "d", "kind": "square", "shape": {"radius": 1}}, Drawing) == (
        "config.shape: unknown field 'radius'; valid fields: rounded, side")
    assert error_of({"name": "d", "kind": "oval", "shape": {}}, Drawing) == (
        "config.kind: must be one of 'circle', 'square', got 'oval'")  # the sibling is checked first
    assert to_sparse_mapping(square) == {"name": "d", "kind": "square", "shape": {"side": 2.0}}
    assert to_sparse_mapping(Drawing("d", "square", shape=Square())) == {"name": "d", "kind": "square"}
    assert from_mapping(Drawing, to_sparse_mapping(square)) == square
    assert from_mapping(Drawing, to_mapping(square)) == square
