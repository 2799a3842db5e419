"""``hetfed run``'s plan: organizations from the partition, data fields from --data, every layer of defaults."""

from __future__ import annotations

import pytest

from hetfed.cli.localrun import LocalRunOptions, aggregator_config, client_config, plan
from hetfed.wire.config import ConfigError


def test_the_partition_sets_the_number_of_organizations_unless_the_user_does() -> None:
    p = plan(LocalRunOptions(algorithms=("fedsr",)))
    assert (p.partition, p.clients) == ("rotated_lodo", 5)
    assert plan(LocalRunOptions(algorithms=("fedsr",), clients=2)).clients == 2
    assert plan(LocalRunOptions(algorithms=("fedavg",))).clients == 4
    (run,) = aggregator_config(p, "state")["runs"]
    assert run["organizations"] == [f"org-{i}" for i in range(5)]


def test_data_fields_reach_every_organization_and_the_spec_defaults_apply() -> None:
    p = plan(LocalRunOptions(algorithms=("fedavg", "fedsr"), data={"target_domain": 5}))
    assert p.partition == "rotated_lodo"  # the partition FedSR needs, shared by the run
    for i in range(5):
        data = client_config(p, "fedsr", i, 1234)["data"]
        assert (data["target_domain"], data["client_index"], data["num_clients"]) == (5, i, 5)
    runs = {r.spec.name: r for r in p.runs}
    sr = runs["fedsr"]
    assert (sr.rounds, sr.models, sr.latent_dim) == (100, ("rmnist_cnn",), 64)
    assert {k: sr.config[k] for k in ("local_steps", "batch_size", "lr", "momentum", "weight_decay")} == {
        "local_steps": 5, "batch_size": 64, "lr": 0.01, "momentum": 0.9, "weight_decay": 5e-4}


@pytest.mark.parametrize(("data", "match"), [
    ({"target_domain": 9}, r"data\.target_domain must be <= data\.num_clients \(5\)"),
    ({"seed": 3}, r"--data seed: set it with --seed"),
    ({"nonsense": 1}, r"--data: unknown data field 'nonsense'"),
    ({"target_domain": "two"}, r"data\.target_domain must be an integer"),
])
def test_bad_data_fields_are_one_line_errors(data: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan(LocalRunOptions(algorithms=("fedsr",), data=data))
