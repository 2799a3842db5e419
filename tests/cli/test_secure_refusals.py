"""An algorithm, or a config of one, that needs each organization's own payloads is refused for secure
aggregation in one line before any process starts: at ``hetfed run``'s plan, and where the aggregator loads
its runs (so no secure run of it exists for a client to join)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hetfed.cli import main as hetfed_main
from hetfed.cli.localrun import LocalRunOptions, plan
from hetfed.wire.config import ConfigError
from hetfed.wire.specs import REGISTERED

REFUSED = [s for s in REGISTERED if not s.summed_upload]
# A config option of a summing algorithm under which its server half needs each update.
NEEDS_EACH = [("fedavg", {"aggregation": "median"}, "aggregation = 'median' needs each update"),
              ("fedprox", {"aggregation": "trimmed_mean"}, "aggregation = 'trimmed_mean' needs each update"),
              ("fedsr", {"update_norm_policy": "clip"}, "update_norm_policy = 'clip' needs each update's distance"),
              ("ditto", {"aggregation": "median"}, "aggregation = 'median' needs each update")]


@pytest.mark.parametrize("spec", REFUSED, ids=lambda s: s.name)
def test_the_plan_refuses_an_algorithm_that_needs_each_payload_in_one_line(spec) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as err:
        plan(LocalRunOptions(algorithms=(spec.name,), secure_aggregation=True))
    message = str(err.value)
    assert message.startswith("run ") and message.endswith(f": secure_aggregation: {spec.secure_aggregation_refusal()}")
    assert "\n" not in message and f"algorithm {spec.name!r} cannot run with secure_aggregation = true: " in message
    assert plan(LocalRunOptions(algorithms=(spec.name,))).runs  # the same plan without it goes through


@pytest.mark.parametrize(("name", "fields", "why"), NEEDS_EACH, ids=[n for n, _, _ in NEEDS_EACH])
def test_the_plan_refuses_a_config_that_needs_each_update(name: str, fields: dict[str, object], why: str) -> None:
    with pytest.raises(ConfigError, match=f"^run {name}: secure_aggregation: algorithm '{name}' cannot run with "
                                          f"secure_aggregation = true: {why}"):
        plan(LocalRunOptions(algorithms=(name,), secure_aggregation=True, extra_algorithm_config={name: fields}))
    assert plan(LocalRunOptions(algorithms=(name,), secure_aggregation=True)).runs  # its default config sums


@pytest.mark.parametrize(("algorithm", "extra", "why"), [
    ("fedfomo", "", "the server sends each organization some of its peers' own models"),
    ("fedavg", '[runs.algorithm_config]\naggregation = "median"\n', "aggregation = 'median' needs each update"),
])
def test_the_aggregator_refuses_to_load_such_a_secure_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        algorithm: str, extra: str, why: str) -> None:
    """No secure run of it is ever hosted, so no Join to one can happen: ``hetfed aggregator`` exits 2."""
    f = tmp_path / "aggregator.toml"
    f.write_text(f'[[runs]]\nid = "r"\nalgorithm = "{algorithm}"\norganizations = ["a", "b"]\n'
                 f"secure_aggregation = true\n{extra}")
    assert hetfed_main(["aggregator", "--config", str(f), "--check-config"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "secure_aggregation: " in err and why in err, err
    f.write_text(f.read_text().replace("secure_aggregation = true\n", ""))
    assert hetfed_main(["aggregator", "--config", str(f), "--check-config"]) == 0


def test_hetfed_run_exits_2_with_one_line_for_fedh2l(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "fedh2l", "--clients", "2",
                           "--rounds", "1", "--secure-aggregation", "--output", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("hetfed run: error: run fedh2l: secure_aggregation: algorithm 'fedh2l' cannot run with "
                           "secure_aggregation = true: the server relays each organization's posteriors to its "
                           "peers\n")
    assert not (tmp_path / "out").exists()  # nothing started
