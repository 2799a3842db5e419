"""``hetfed run``'s plan: organizations from the partition, data fields from --data, every layer of defaults."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from hetfed.cli.localrun import (
    LocalRunOptions,
    aggregator_config,
    client_config,
    noise_seed,
    plan,
    settled_status,
)
from hetfed.wire.config import ConfigError
from hetfed.wire.messages import RunStatus
from hetfed.wire.phases import Phase


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
    # The type check of the client's own loader (from_mapping), as the client would give it reading its file.
    ({"target_domain": "two"}, r"data\.target_domain: expected an integer, got 'two'"),
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
    # Only the algorithms that need a seed set (FedH2L, FedMD) are refused, on the datasets without the rotated
    # partition, and by their partition.
    assert sorted((n, a) for n, a, _ in refused) == [(n, a) for n in ("digits", "fmnist", "gauss4", "synthetic")
                                                     for a in ("fedh2l", "fedmd")]
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


def test_an_algorithm_that_averages_a_model_of_its_own_takes_several_architectures() -> None:
    # FML averages its meme model, not the organizations' own: each may bring its own architecture.
    fml = plan(LocalRunOptions(algorithms=("fml",), models=("lenet", "mlp"), clients=3)).runs[0]
    assert fml.models == ("lenet", "mlp") and [c.model.name for c in fml.clients] == ["lenet", "mlp", "lenet"]
    with pytest.raises(ConfigError) as info:
        plan(LocalRunOptions(algorithms=("fedavg",), models=("lenet", "mlp")))
    assert str(info.value).startswith("fedavg averages one model")
    assert "fml" in str(info.value).rsplit("federate with ", 1)[1].split(", ")


def test_each_setting_is_parsed_once_and_read_back_through_the_same_dataclass(tmp_path: Path) -> None:
    """--set values are parsed by the plan; the aggregator's file carries that typed config, read back equal."""
    from hetfed.aggregator.config import DEFAULT_ROUNDS, load_aggregator_config

    p = plan(LocalRunOptions(algorithms=("fedprox", "fedavg"), train={"lr": 0.2},
                             extra_algorithm_config={"fedprox": {"mu": 0.5}}))
    assert [r.rounds for r in p.runs] == [DEFAULT_ROUNDS, DEFAULT_ROUNDS]
    path = tmp_path / "aggregator.json"
    path.write_text(json.dumps(aggregator_config(p, str(tmp_path / "state"))))
    runs = load_aggregator_config(path).runs
    assert [r.algorithm_config for r in runs] == [r.train for r in p.runs]
    assert (p.runs[0].train.mu, p.runs[0].train.lr) == (0.5, 0.2)  # type: ignore[attr-defined]


# Plans whose files carry every kind of table: the defaults; --set and --data values and [privacy]; an organization's
# own data factory with own builders of two architectures; heterogeneous built-in architectures over a seed set.
ROUND_TRIPS = {
    "defaults": LocalRunOptions(),
    "privacy": LocalRunOptions(algorithms=("fedprox",), clients=3, seed=4, train={"lr": 0.2}, timing=True,
                               test_split="fedgen", data={"permute_labels": True},
                               extra_algorithm_config={"fedprox": {"mu": 0.5, "wire_dtype": "float16"}},
                               privacy={"epsilon_budget": 3, "clip_norm": 0.5, "accountant": "pld"}),
    "own data factory": LocalRunOptions(algorithms=("fedcma", "local"), clients=2, dataset="torch",
                                        data={"factory": "tests.ownpkg.data:mnist_shares", "options": {"k": "v"}},
                                        models=("tests.ownpkg.models:tiny_cnn", "tests.ownpkg.models:tiny_mlp")),
    "heterogeneous models": LocalRunOptions(algorithms=("fedh2l",), clients=3, rounds=2, output="out",
                                            public_fraction=0.2, train_on_public=True),
}


@pytest.mark.parametrize("name", ROUND_TRIPS)
def test_every_file_reads_back_as_the_plans_typed_config(tmp_path: Path, name: str) -> None:
    """The plan builds each process's typed config once; its file, written less the dataclasses' defaults, reads back
    equal through the loader the process uses (the aggregator's RunConfig, each organization's ClientConfig)."""
    import dataclasses

    from hetfed.aggregator.config import load_aggregator_config
    from hetfed.cli.localrun import aggregator_settings, client_settings
    from hetfed.client.config import load_client_config

    p = plan(ROUND_TRIPS[name])
    path = tmp_path / "aggregator.json"
    path.write_text(json.dumps(aggregator_config(p, str(tmp_path / "state"))))
    loaded = load_aggregator_config(path)
    assert loaded == aggregator_settings(p, str(tmp_path / "state"))
    assert loaded.runs == tuple(r.run for r in p.runs)
    assert [r.algorithm_config for r in loaded.runs] == [r.train for r in p.runs]
    for r in p.runs:
        assert len(r.clients) == p.clients
        for i, planned in enumerate(r.clients):
            path = tmp_path / f"client-{r.run_id}-org-{i}.json"
            path.write_text(json.dumps(client_config(p, r.run_id, i, 5678)))
            cfg = load_client_config(path)
            assert cfg == client_settings(p, r.run_id, i, 5678) == dataclasses.replace(planned, aggregator="127.0.0.1:5678")
            assert cfg.data == p.data[i] and cfg.run == r.run_id and cfg.organization == f"org-{i}"
    if name == "privacy":
        (run,) = p.runs
        assert run.run.require_privacy and run.train.lr == 0.2 and run.train.wire_dtype == "float16"
        assert [c.privacy.noise_seed for c in run.clients] == [noise_seed(4, i) for i in range(3)]
        assert all((c.privacy.epsilon_budget, c.privacy.accountant, c.report_timing) == (3.0, "pld", True)
                   for c in run.clients)


def test_the_files_leave_out_what_the_dataclasses_default() -> None:
    p = plan(LocalRunOptions(algorithms=("fedavg",), clients=2))
    assert client_config(p, "fedavg", 0, 1) == {
        "organization": "org-0", "run": "fedavg", "aggregator": "127.0.0.1:1", "threads": 1,
        "data": {"dataset": "mnist5k", "partition": "dirichlet", "num_clients": 2, "client_index": 0, "seed": 0},
        "model": {"name": "lenet", "latent_dim": 0}, "retry": {"give_up_after_seconds": 120.0}}
    agg = aggregator_config(p, "state")
    assert agg["server"] == {"listen": "127.0.0.1:0", "metrics_port": 0, "metrics_host": "127.0.0.1",
                             "state_dir": "state"}
    (run,) = agg["runs"]
    # hetfed run trains FedAvg at the algorithm's declared defaults, so its file restates none of them.
    assert set(run) == {"id", "algorithm", "organizations", "rounds"}


def test_an_algorithms_own_training_defaults_are_stated_once_in_its_config() -> None:
    """The command's and the dataset's training knobs skip those an algorithm's config declares its own default for
    (FedSR's schedule, SimFed's paper values), so no experiment entry restates them; the command line still wins."""
    from hetfed.wire.specs.fedsr import FedSRConfig
    from hetfed.wire.specs.simfed import SimFedConfig

    sr = plan(LocalRunOptions(algorithms=("fedsr",), dataset="synthetic")).runs[0].train
    assert (sr.batch_size, sr.lr, sr.momentum, sr.weight_decay, sr.local_steps) == (
        FedSRConfig.batch_size, FedSRConfig.lr, FedSRConfig.momentum, FedSRConfig.weight_decay, FedSRConfig.local_steps)
    sim = plan(LocalRunOptions(algorithms=("simfed",), dataset="synthetic")).runs[0].train
    assert (sim.batch_size, sim.lr, sim.weight_decay, sim.momentum) == (
        SimFedConfig.batch_size, SimFedConfig.lr, SimFedConfig.weight_decay, 0.0)
    avg = plan(LocalRunOptions(algorithms=("fedavg",), dataset="synthetic")).runs[0].train
    assert (avg.batch_size, avg.weight_decay) == (10, 0.001)  # the dataset's, where the config keeps the shared ones
    given = plan(LocalRunOptions(algorithms=("fedsr",), train={"batch_size": 7})).runs[0].train
    assert given.batch_size == 7


class _Federation:
    """What settled_status reads of a local federation: Status replies in turn, departures, failures."""

    def __init__(self, replies: list[list[RunStatus]], left: Sequence[str] = (), fail_at: int = -1) -> None:
        self.replies, self.left, self.fail_at, self.reads = replies, list(left), fail_at, 0

    def status(self) -> list[RunStatus]:
        reply = self.replies[min(self.reads, len(self.replies) - 1)]
        self.reads += 1
        return reply

    def left_clients(self) -> list[str]:
        return self.left

    def raise_if_failed(self) -> None:
        if self.reads == self.fail_at:
            raise RuntimeError("client-a-org-1 failed")


def _run(run_id: str, phase: Phase, rounds: int = 3) -> RunStatus:
    return RunStatus(run_id=run_id, algorithm="fedavg", phase=phase, round=rounds, total_rounds=rounds,
                     organizations=("org-0", "org-1"))


def test_the_summary_waits_for_the_last_round_to_close_after_the_clients_exit() -> None:
    """A race once seen: the loop's last read came before the final round closed; later reads finish it."""
    running, done = _run("a", Phase.TRAIN), _run("a", Phase.FINISHED)
    fed = _Federation([[running], [running], [done]])
    by_run = {"a": ["client-a-org-0", "client-a-org-1"]}
    assert settled_status(fed, [running], by_run, poll=0.0) == [done]  # type: ignore[arg-type]
    assert fed.reads == 3
    # A finished run is not read again; nor is one whose organizations all left (privacy budgets spent).
    quiet = _Federation([[running]], left=["client-a-org-0", "client-a-org-1"])
    assert settled_status(quiet, [done], by_run) == [done]  # type: ignore[arg-type]
    assert settled_status(quiet, [running], by_run) == [running] and quiet.reads == 0  # type: ignore[arg-type]
    # A run that never finishes gives its last read at the deadline; a failure on the way is raised.
    stuck = _Federation([[running]])
    assert settled_status(stuck, [running], by_run, timeout=0.05, poll=0.01) == [running]  # type: ignore[arg-type]
    assert stuck.reads >= 1
    with pytest.raises(RuntimeError, match="client-a-org-1 failed"):
        settled_status(_Federation([[running]], fail_at=1), [running], by_run, poll=0.0)  # type: ignore[arg-type]


def test_fedcma_under_privacy_needs_its_bounded_latents_before_any_process() -> None:
    """The authors' settings leave the sigmoid out; DP bounds the class sums by [0, 1]^d_e, so the plan says so
    in one line rather than the client at setup."""
    with pytest.raises(ConfigError, match=r"^fedcma under \[privacy\] needs bounded latents: "
                                          r"--set fedcma.bounded_latent=true$"):
        plan(LocalRunOptions(algorithms=("fedcma",), privacy={"epsilon_budget": 3.0}))
    bounded = plan(LocalRunOptions(algorithms=("fedcma",), privacy={"epsilon_budget": 3.0},
                                   extra_algorithm_config={"fedcma": {"bounded_latent": True}}))
    assert bounded.runs[0].train.bounded_latent is True  # type: ignore[attr-defined]
    assert plan(LocalRunOptions(algorithms=("fedcma_paper",), privacy={"epsilon_budget": 3.0})).runs
