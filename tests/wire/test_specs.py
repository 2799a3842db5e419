"""Specs: presets are an algorithm's config under another name; halves bind to a spec by import."""

from __future__ import annotations

import pytest

from hetfed.wire.config import ConfigError
from hetfed.wire.specs import REGISTERED, SPECS, load_half, register
from hetfed.wire.specs.ditto import DittoConfig


def test_a_preset_sets_defaults_the_table_can_still_override() -> None:
    spec = SPECS["ditto_cos"]
    assert spec.config_type is DittoConfig and spec.family == "ditto" and not spec.client
    assert (spec.config().measure, spec.config().lam, spec.config().mu) == ("cosine", 0.01, 1.0)
    assert spec.parse({"mu": 0.5}).mu == 0.5 and spec.parse({"mu": 0.5}).measure == "cosine"
    assert SPECS["ditto"].parse({}).measure == "none"
    with pytest.raises(ConfigError, match="mu must be >= 0"):
        spec.parse({"mu": -1.0})


def test_a_preset_of_a_preset_keeps_the_algorithm() -> None:
    twice = SPECS["fedl2r"].preset("fedl2r_sq", "FedL2R, squared", l2r_squared=True)
    assert twice.family == "fedsr" and twice.config().l2r_squared and twice.config().alpha_cmi == 0.0


def test_a_half_binds_to_its_family_once_and_the_presets_share_it() -> None:
    spec = SPECS["fedavg"].derive(name="bind_probe", summary="a family of its own")
    preset = spec.preset("bind_probe_preset", "its preset", lr=0.5)

    class Probe:
        pass

    assert spec.server_half(Probe) is Probe and spec.server_half(Probe) is Probe  # binding again is a no-op
    assert preset.half("server") is Probe and spec.half("client") is None
    assert SPECS["fedavg"].half("server") is not Probe  # the spec it was derived from keeps its own
    with pytest.raises(ValueError, match=r"'bind_probe' has a server half already: .*Probe, not Other"):
        spec.server_half(type("Other", (), {}))
    assert load_half(preset, Probe, "server") is Probe
    with pytest.raises(ValueError, match=r"^algorithm 'bind_probe_preset': .* is not a int$"):
        load_half(preset, int, "server")


def test_a_half_that_cannot_be_loaded_is_named() -> None:
    unbound = SPECS["fedavg"].derive(name="unbound_probe", summary="no half bound")
    with pytest.raises(ValueError, match=r"^algorithm 'unbound_probe': its client half cannot be loaded: no class "
                                         r"is bound to it \(@SPEC.client_half\) and the spec names none"):
        load_half(unbound, object, "client")
    missing = unbound.derive(name="missing_probe", client="no_such_module:Client")
    with pytest.raises(ValueError, match=r"^algorithm 'missing_probe': its client half 'no_such_module:Client' "
                                         r"cannot be loaded: No module named 'no_such_module'$"):
        load_half(missing, object, "client")


def test_the_registry_is_imports_and_hetfeds_specs_name_no_half_as_a_string() -> None:
    assert all(isinstance(spec, type(SPECS["fedavg"])) for spec in REGISTERED)
    assert [spec.name for spec in REGISTERED] == [name for name in SPECS if name in {s.name for s in REGISTERED}]
    assert [(spec.name, spec.server, spec.client) for spec in REGISTERED if spec.server or spec.client] == []


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
