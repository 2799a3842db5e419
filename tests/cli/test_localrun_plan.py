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


def test_every_algorithm_on_every_builtin_dataset_plans_models_that_fit_or_says_why_in_one_line() -> None:
    """No default sends a model to data it cannot take (SimFed's LeNet once met Synthetic's 60 features in a
    client process, as a traceback): each plan's models fit the dataset's input shape, or the plan refuses."""
    from hetfed.client.data import DATASETS
    from hetfed.client.model_registry import input_mismatch
    from hetfed.wire.specs import SPECS

    refused: list[tuple[str, str, str]] = []
    for name, entry in DATASETS.items():
        if not entry.builtin:
            continue
        assert entry.input_shape is not None, name
        for algorithm in SPECS:
            try:
                p = plan(LocalRunOptions(algorithms=(algorithm,), dataset=name))
            except ConfigError as exc:
                refused.append((name, algorithm, str(exc)))
                continue
            for model in p.runs[0].models:
                assert input_mismatch(model, entry.input_shape) is None, (name, algorithm, model)
    # Only FedH2L is refused, on the datasets without its rotated partition, and by its partition.
    assert sorted((n, a) for n, a, _ in refused) == [(n, "fedh2l") for n in ("digits", "fmnist", "gauss4", "synthetic")]
    assert all("'rotated' partition" in why and "\n" not in why for _, _, why in refused)
    simfed = plan(LocalRunOptions(algorithms=("simfed",), dataset="synthetic")).runs[0]
    assert simfed.models == ("mlp",)


@pytest.mark.parametrize(("dataset", "model", "message"), [
    ("synthetic", "lenet", "model 'lenet' needs images (C, H, W), got inputs of shape (60,) (dataset 'synthetic'); "
                           "choose one with --model: mlp, mlp1, linear"),
    ("digits", "rmnist_cnn", "model 'rmnist_cnn' needs images of at least 10x10 pixels, got (1, 8, 8) "
                             "(dataset 'digits'); choose one with --model: mlp, mlp1, lenet, lenet_wide, "
                             "fedgen_cnn, cnn_small, cnn, linear, resnet18, mobilenet_v2"),
])
def test_a_model_the_data_does_not_fit_is_refused_before_any_process(dataset: str, model: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        plan(LocalRunOptions(algorithms=("fedavg",), dataset=dataset, models=(model,)))
    assert str(info.value) == message
