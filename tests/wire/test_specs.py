"""Specs: presets are an algorithm's config under another name; a spec names its halves as module:Class."""

from __future__ import annotations

import pytest

from hetfed.wire.config import ConfigError
from hetfed.wire.specs import SPECS, register
from hetfed.wire.specs.ditto import DittoConfig


def test_a_preset_sets_defaults_the_table_can_still_override() -> None:
    spec = SPECS["ditto_cos"]
    assert spec.config_type is DittoConfig and spec.family == "ditto" and spec.client == SPECS["ditto"].client
    assert (spec.config().measure, spec.config().lam, spec.config().mu) == ("cosine", 0.01, 1.0)
    assert spec.parse({"mu": 0.5}).mu == 0.5 and spec.parse({"mu": 0.5}).measure == "cosine"
    assert SPECS["ditto"].parse({}).measure == "none"
    with pytest.raises(ConfigError, match="mu must be >= 0"):
        spec.parse({"mu": -1.0})


def test_a_preset_of_a_preset_keeps_the_algorithm() -> None:
    twice = SPECS["fedl2r"].preset("fedl2r_sq", "FedL2R, squared", l2r_squared=True)
    assert twice.family == "fedsr" and twice.config().l2r_squared and twice.config().alpha_cmi == 0.0


def test_halves_must_be_named_as_module_and_class() -> None:
    with pytest.raises(ValueError, match="module:Class"):
        SPECS["fedavg"].derive(name="x", client="hetfed.client.algorithms.fedavg")
    with pytest.raises(TypeError):  # the preset's fields must exist in the config type
        SPECS["fedavg"].preset("y", "y", no_such_field=1)


def test_a_name_registers_once() -> None:
    assert register("hetfed.wire.specs.fedavg:SPEC") is SPECS["fedavg"]  # the same spec again: a no-op
    with pytest.raises(ValueError, match="registered twice"):
        register("tests.wire.test_specs:_IMPOSTOR")


_IMPOSTOR = SPECS["fedavg"].derive(summary="another spec under fedavg's name")
