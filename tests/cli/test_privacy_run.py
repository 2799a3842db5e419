"""``hetfed run`` under differential privacy: ``--set privacy.*``, the configs it writes, organizations leaving
when their budget is spent, results.json's privacy summary, the ε column, the report's panel and the bench grid."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from hetfed.aggregator.config import aggregator_config_from_mapping
from hetfed.cli import PRIVACY_BUDGET_SPENT, _client_exit_status, build_parser, run_options
from hetfed.cli import localrun as lr
from hetfed.cli import reproduce as rp
from hetfed.cli.localrun import running
from hetfed.cli.prom import PNG_KEY
from hetfed.cli.report import EPSILON_LABEL, load_results, markdown_table, plot
from hetfed.client.config import load_client_config
from hetfed.wire.config import ConfigError
from hetfed.wire.messages import RoundSummary, RunStatus, TrafficCount
from hetfed.wire.payloads import EvalMetrics
from hetfed.wire.phases import Phase


def options(*argv: str) -> lr.LocalRunOptions:
    return run_options(build_parser().parse_args(["run", *argv]))


# ------------------------------------------------------------------------------------------------ --set privacy.*
def test_privacy_sets_are_not_algorithm_config() -> None:
    opts = options("--algorithm", "fedavg,local", "--set", "privacy.epsilon_budget=3", "--set", "lr=0.05",
                   "--set", "privacy.accountant=pld", "--set", "fedavg.local_steps=4")
    assert opts.privacy == {"epsilon_budget": 3, "accountant": "pld"}
    assert opts.extra_algorithm_config == {"fedavg": {"lr": 0.05, "local_steps": 4}, "local": {"lr": 0.05}}
    assert options().privacy == {}


@pytest.mark.parametrize(("privacy", "message"), [
    ({"epsilon_budgt": 3}, "--set privacy: unknown field 'epsilon_budgt' (did you mean 'epsilon_budget'?)"),
    # The field's own check (PrivacyConfig's), behind where it was set.
    ({"epsilon_budget": 0}, "--set privacy: epsilon_budget must be a number > 0"),
    ({"epsilon_budget": -1}, "--set privacy: epsilon_budget must be a number > 0"),
    ({"epsilon_budget": 3, "clip_norm": 0}, "--set privacy: clip_norm must be a number > 0"),
    ({"epsilon_budget": "three"}, "--set privacy.epsilon_budget: "),
    ({"clip_norm": 2}, "--set privacy: differential privacy needs privacy.epsilon_budget, privacy.target_epsilon or "
                       "privacy.noise_multiplier (got only clip_norm)"),
])
def test_a_bad_privacy_field_is_refused_by_the_plan(privacy: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        lr.plan(lr.LocalRunOptions(algorithms=("fedavg",), privacy=privacy))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_bad_privacy_field_is_one_line_and_exit_2_before_any_process(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "hetfed.cli", "run", "--set", "privacy.epsilon_budget=-1",
                           "--output", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("hetfed run: error: --set privacy: epsilon_budget must be a number > 0") and "-1" in line
    assert not out.exists() or not any(out.iterdir())


# ------------------------------------------------------------------------------------------------ configs
def test_every_client_config_carries_privacy_and_every_run_requires_it(tmp_path: Path) -> None:
    p = lr.plan(options("--algorithm", "fedavg,local", "--seed", "7", "--set", "privacy.epsilon_budget=3",
                        "--set", "privacy.clip_norm=0.5"))
    agg = aggregator_config_from_mapping(lr.aggregator_config(p, str(tmp_path / "state")))
    # No quorum workaround: a client whose budget is spent sends a leave notice, and rounds stop waiting for it.
    assert [(r.id, r.require_privacy, r.min_clients) for r in agg.runs] == [("fedavg", True, 0), ("local", True, 0)]
    seeds = []
    for run_id in ("fedavg", "local"):
        for i in range(4):
            cfg = lr.client_config(p, run_id, i, 1234)
            # No --output: the run's directory is temporary, so are the ledgers, and the clients declare it.
            assert cfg["privacy"] == {"epsilon_budget": 3.0, "clip_norm": 0.5, "noise_seed": lr.noise_seed(7, i),
                                      "ephemeral_ledger": True}
            assert "state_dir" not in cfg
            path = tmp_path / f"{run_id}-{i}.json"
            path.write_text(json.dumps(cfg))
            privacy = load_client_config(path).privacy  # what the client reads back
            assert (privacy.enabled, privacy.epsilon_budget, privacy.clip_norm, privacy.noise_seed) == (
                True, 3.0, 0.5, lr.noise_seed(7, i))
            seeds.append(privacy.noise_seed)
    # The same seed for an organization in every run of the federation, another for every organization.
    assert seeds[:4] == seeds[4:] and len(set(seeds[:4])) == 4


def test_the_noise_seed_follows_the_runs_seed_unless_given() -> None:
    assert lr.noise_seed(0, 0) == lr.noise_seed(0, 0) == 1317414476
    assert len({lr.noise_seed(s, i) for s in range(3) for i in range(4)}) == 12
    assert all(0 <= lr.noise_seed(s, i) < 2 ** 31 for s in (-5, 0, 10 ** 9) for i in range(3))
    p = lr.plan(options("--set", "privacy.noise_multiplier=1.1", "--set", "privacy.noise_seed=-1"))
    assert lr.client_config(p, "fedavg", 2, 1)["privacy"] == {"noise_multiplier": 1.1, "noise_seed": -1,
                                                              "ephemeral_ledger": True}


def test_with_output_every_ledger_is_kept_in_it(tmp_path: Path) -> None:
    """--output: each organization keeps its state (its privacy ledger) under <output>/client-state/<organization>,
    so its ledger is not ephemeral."""
    p = lr.plan(options("--set", "privacy.epsilon_budget=3", "--output", str(tmp_path)))
    for i in range(4):
        cfg = lr.client_config(p, "fedavg", i, 1)
        assert cfg["state_dir"] == f"client-state/org-{i}" and "ephemeral_ledger" not in cfg["privacy"]
    no_dp = lr.plan(options("--output", str(tmp_path)))
    assert "state_dir" not in lr.client_config(no_dp, "fedavg", 0, 1)


def test_secure_mode_gets_no_noise_seed_from_the_runs_seed() -> None:
    """A local run fixes no noise seed under secure_mode, which refuses one: the clients draw fresh keys."""
    p = lr.plan(options("--seed", "7", "--set", "privacy.noise_multiplier=1.1", "--set", "privacy.secure_mode=true"))
    cfg = lr.client_config(p, "fedavg", 0, 1)["privacy"]
    assert cfg == {"noise_multiplier": 1.1, "secure_mode": True, "noise_seed": -1, "ephemeral_ledger": True}


def test_without_privacy_nothing_changes(tmp_path: Path) -> None:
    p = lr.plan(lr.LocalRunOptions(algorithms=("fedavg",)))
    assert "privacy" not in lr.client_config(p, "fedavg", 0, 1)
    (run,) = lr.aggregator_config(p, str(tmp_path))["runs"]
    assert "require_privacy" not in run and "min_clients" not in run


# ------------------------------------------------------------------------------------------------ leaving
def test_a_client_whose_budget_is_spent_exits_3_not_2() -> None:
    from hetfed.client.runtime import ClientError, PrivacyBudgetSpent

    assert PRIVACY_BUDGET_SPENT == 3
    spent = PrivacyBudgetSpent("the next round would spend ε = 3.2 > 3")
    assert spent.permanent and _client_exit_status(spent) == 3
    assert _client_exit_status(ClientError("refused", permanent=True)) == 2
    assert _client_exit_status(ClientError("unreachable")) == 1


def test_exit_3_is_leaving_not_failing(tmp_path: Path) -> None:
    fed = lr.LocalFederation(tmp_path, fork_clients=False)
    try:
        for name, code in (("client-a-org-0", 0), ("client-a-org-1", 3)):
            fed.clients[name] = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
            fed.clients[name].wait()
        fed.raise_if_failed()
        assert fed.failed_client() is None and fed.left_clients() == ["client-a-org-1"]
        assert fed.exited("client-a-org-0") and fed.exited("client-a-org-1")
        fed.clients["client-a-org-2"] = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
        fed.clients["client-a-org-2"].wait()
        with pytest.raises(RuntimeError, match="client-a-org-2 failed"):
            fed.raise_if_failed()
    finally:
        fed.stop()


def _report(acc: float, eps: float | None, n: int = 100) -> EvalMetrics:
    extra = {} if eps is None else {"privacy_epsilon": eps, "privacy_delta": 1e-4, "privacy_noise_multiplier": 1.25,
                                    "privacy_clip_norm": 1.0}
    return EvalMetrics(train_loss=0.5, num_train_examples=100, test_accuracy=acc, num_test_examples=n, extra=extra)


def _status(phase: Phase = Phase.FINISHED) -> RunStatus:
    """fedavg, 2 rounds and the evaluation; org-1 reports ε up to round 1 only (it left), org-0 to the end."""
    traffic = (TrafficCount("up", "model_weights", 1000, 2, 250), TrafficCount("down", "model_weights", 500, 2, 125))
    history = (
        RoundSummary(1, 2, 1.0, traffic, {"org-0": _report(0.5, 1.0), "org-1": _report(0.7, 1.5)}),
        RoundSummary(2, 1, 1.0, traffic, {"org-0": _report(0.6, 2.0)}),
        RoundSummary(3, 1, 1.0, (), {"org-0": _report(0.8, 2.0)}),
    )
    return RunStatus("fedavg", "fedavg", phase, 3, 2, ("org-0", "org-1"), history=history)


def test_results_json_summarizes_each_organizations_privacy() -> None:
    summary = lr.summarize_run(_status(), ["org-1"])
    assert summary["privacy"] == {
        "organizations": {
            "org-0": {"epsilon": 2.0, "delta": 1e-4, "noise_multiplier": 1.25, "clip_norm": 1.0},
            "org-1": {"epsilon": 1.5, "delta": 1e-4, "noise_multiplier": 1.25, "clip_norm": 1.0},
        },
        "epsilon_max": 2.0,
        "budget_spent": ["org-1"],
    }
    assert summary["rounds"][0]["per_organization"]["org-1"]["privacy_epsilon"] == 1.5
    plain = RunStatus("fedavg", "fedavg", Phase.FINISHED, 2, 1, ("org-0",),
                      history=(RoundSummary(1, 1, 1.0, (), {"org-0": _report(0.5, None)}),))
    assert lr.summarize_run(plain)["privacy"] == {"organizations": {}, "epsilon_max": None, "budget_spent": []}


def test_the_table_shows_the_largest_epsilon_and_who_left() -> None:
    private = {**lr.summarize_run(_status(), ["org-1"]), "wall_seconds": 12.0}
    plain = {**private, "privacy": {"organizations": {}, "epsilon_max": None, "budget_spent": []}}
    legacy = {k: v for k, v in private.items() if k != "privacy"}  # a results.json written before DP
    column = lr.TABLE_HEAD.index("ε")
    assert lr.TABLE_HEAD[column + 1] == "figures"
    rows = lr.table_rows([private, plain, legacy])
    assert [r[column] for r in rows] == ["2.00 (org-1 left: budget spent)", "—", "—"]
    assert rows[0][:7] == ("fedavg", "80.00%", "-", "2.00 KB", "1.00 KB", "1.50 KB", "12s")


def test_federate_goes_on_when_organizations_leave_and_ends_a_run_they_all_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """No aggregator and no client process: a stand-in federation whose org-1 leaves after the first poll and
    org-0 after the second, the run still open; federate reports each departure once and returns the run."""

    class Fake:
        port, metrics_port, aggregator = 1, -1, None

        def __init__(self, workdir: Path, tls: object = None, warm: object = ()) -> None:
            self.polls = 0
            self.names: list[str] = []
            self.stopped = False

        def start_aggregator(self, config: dict[str, Any]) -> None:
            (run,) = config["runs"]
            assert run["require_privacy"] is True

        def start_client(self, name: str, config: dict[str, Any]) -> None:
            assert config["privacy"]["epsilon_budget"] == 1.0
            self.names.append(name)

        def raise_if_failed(self) -> None:
            pass

        def left_clients(self) -> list[str]:
            return [n for n in self.names if n.endswith("org-1")] + (
                [n for n in self.names if n.endswith("org-0")] if self.polls >= 2 else [])

        def exited(self, name: str) -> bool:
            return name in self.left_clients()

        def status(self) -> list[RunStatus]:
            self.polls += 1
            return [_status(Phase.TRAIN)]

        def wait_clients(self, timeout: float) -> None:
            pass

        def stop(self) -> None:
            self.stopped = True

    monkeypatch.setattr(running, "LocalFederation", Fake)
    monkeypatch.setattr(running.time, "sleep", lambda _s: None)
    opts = lr.LocalRunOptions(algorithms=("fedavg",), clients=2, privacy={"epsilon_budget": 1})
    (summary,) = lr.federate(opts, tmp_path)
    out = capsys.readouterr().out
    assert out.count("org-1 left run fedavg: its privacy budget is spent") == 1
    assert out.count("org-0 left run fedavg: its privacy budget is spent") == 1
    assert summary["privacy"]["budget_spent"] == ["org-0", "org-1"] and summary["privacy"]["epsilon_max"] == 2.0


# ------------------------------------------------------------------------------------------------ report
def _results(tmp_path: Path, *runs: dict[str, Any]) -> Path:
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"options": {}, "runs": list(runs)}))
    return path


def test_the_report_adds_accuracy_against_epsilon_when_a_run_has_it(tmp_path: Path) -> None:
    private = lr.summarize_run(_status(), ["org-1"])
    plain = {**lr.summarize_run(_status()), "run": "local", "algorithm": "local",
             "privacy": {"organizations": {}, "epsilon_max": None, "budget_spent": []}}
    for r in plain["rounds"]:
        for m in r["per_organization"].values():
            for key in [k for k in m if k.startswith("privacy_")]:
                del m[key]
    curves = load_results([_results(tmp_path, private, plain)])
    # Accuracy per round against the largest ε spent by then: org-1's 1.5 in round 1, org-0's 2.0 later.
    assert curves[0].epsilon_points == [(1.5, 0.6), (2.0, 0.6), (2.0, 0.8)] and curves[0].epsilon == 2.0
    assert curves[1].epsilon_points == [] and curves[1].epsilon is None
    assert markdown_table(curves).splitlines()[-1] == (
        "Accuracy against ε (the largest any organization spent): fedavg 80.00% at ε = 2.00.")
    png = tmp_path / "report.png"
    desc = plot(curves, png)
    with Image.open(png) as im:
        assert im.size == (1400, 500)
        meta = json.loads(im.text[PNG_KEY])
    assert meta == desc
    assert desc["epsilon_panel"]["xlabel"] == EPSILON_LABEL
    assert desc["epsilon_panel"]["lines"] == [{"label": "fedavg", "points": 3, "epsilon": 2.0}]
    assert [line["label"] for line in desc["lines"]] == ["fedavg", "local"]


def test_the_report_without_privacy_has_one_panel_and_no_epsilon_line(tmp_path: Path) -> None:
    plain = {k: v for k, v in lr.summarize_run(_status()).items() if k != "privacy"}
    for r in plain["rounds"]:
        r["per_organization"] = {}
    curves = load_results([_results(tmp_path, plain)])
    assert curves[0].epsilon is None and "ε" not in markdown_table(curves)
    desc = plot(curves, tmp_path / "p.png")
    assert "epsilon_panel" not in desc
    with Image.open(tmp_path / "p.png") as im:
        assert im.size == (800, 500)


# ------------------------------------------------------------------------------------------------ bench
def test_the_epsilon_axis_sets_the_budget_and_zero_turns_privacy_off() -> None:
    grid = rp.Grid(name="g", title="t", paper="p", results="docs/results/g.md", seeds=(0,), rounds=2,
                   data={"dataset": "mnist5k", "clients": 2},
                   methods=(rp.Method("a", "A", "fedavg", privacy={"clip_norm": 0.5, "accountant": "pld"}),),
                   figures=(rp.GridFigure("eps", "ε", "epsilon", percent=False),),
                   axes=(rp.Axis("epsilon", (0, 1, 8)),))
    method = grid.methods[0]
    assert rp.federation_options(grid, method, {"epsilon": 0}, 0, artifacts=False).privacy == {}
    assert rp.federation_options(grid, method, {"epsilon": 8}, 3, artifacts=False).privacy == {
        "clip_norm": 0.5, "accountant": "pld", "epsilon_budget": 8}
    opts = rp.federation_options(grid, method, {"epsilon": 1, "privacy.clip_norm": 2.0}, 0, artifacts=False)
    assert opts.privacy == {"clip_norm": 2.0, "accountant": "pld", "epsilon_budget": 1}
    assert opts.seed == 0 and opts.dataset == "mnist5k"  # the axis is no LocalRunOptions field
    assert lr.plan(opts).privacy == {"clip_norm": 2.0, "accountant": "pld", "epsilon_budget": 1.0}
    assert rp._settings(grid, method)[3] == 'privacy = {"clip_norm": 0.5, "accountant": "pld"}'


def test_the_epsilon_figure_is_the_largest_final_epsilon() -> None:
    fig = rp.GridFigure("eps", "ε", "epsilon", percent=False)
    assert rp.figure_value(fig, lr.summarize_run(_status()), Path("."), 0) == 2.0
    plain = {k: v for k, v in lr.summarize_run(_status()).items() if k != "privacy"}
    assert rp.figure_value(fig, plain, Path("."), 0) is None


def test_the_privacy_grid_declares_the_epsilon_axis_and_its_privacy_table() -> None:
    grid = rp.load_grid("privacy")
    assert grid.results == "docs/results/privacy.md" and grid.seeds == (0, 1, 2)
    assert [(a.name, a.values) for a in grid.axes] == [("epsilon", (0, 1, 3, 8))]
    # fedcma_secure: Fed-CMA under secure aggregation with distributed DP (tests/cli/test_privacy_grid.py).
    assert [(m.id, m.algorithm) for m in grid.methods] == [("fedavg", "fedavg"), ("fedcma", "fedcma_paper"),
                                                           ("fedcma_secure", "fedcma_paper"), ("fedh2l", "fedh2l")]
    assert all(m.privacy == {"clip_norm": 1.0} for m in grid.methods)
    assert {f.source for f in grid.figures} >= {"epsilon", "bytes_per_round"}
    assert len(grid.cells()) * len(grid.seeds) * len(grid.methods) == 48
    for method in grid.methods:
        for cell in grid.cells():
            p = lr.plan(rp.federation_options(grid, method, cell, 0, artifacts=False))
            assert p.clients == 4
            assert p.privacy == ({} if cell["epsilon"] == 0 else {"clip_norm": 1.0,
                                                                   "epsilon_budget": float(cell["epsilon"])})


def test_the_page_shows_the_epsilon_spent_beside_accuracy_and_bytes() -> None:
    grid = rp.load_grid("privacy")
    rows = [{"method": "fedavg", "cell": {"epsilon": eps}, "seed": seed, "wall_seconds": 30.0, "rounds": 11,
             "figures": {"acc": acc, "epsilon": spent, "bytes": 3280968.0}}
            for eps, runs in ((0, ((0, 0.70, None), (1, 0.72, None))), (3, ((0, 0.60, 2.99), (1, 0.64, 2.97))))
            for seed, acc, spent in runs]
    text = rp.render(grid, {"command": "hetfed bench privacy", "date": "d", "machine": "m", "wall_seconds": 60.0,
                            "load": [0.0, 0.0], "rows": rows, "bytes_references": {}})
    assert "| FedAvg | `fedavg` | lenet | 8 | local_steps = 20, batch_size = 64, lr = 0.01, momentum = 0.9, " \
           'privacy = {"clip_norm": 1.0}, under DP = {"lr": 0.1} |' in text
    assert "| method | own-test acc (each organization's own record) | ε spent (largest) | bytes / round |" in text
    no_dp, dp = text.split("### epsilon = 0", 1)[1].split("### epsilon = 3", 1)
    assert "| FedAvg | 71.00 ± 1.41 | - | 3,280,968 ± 0 |" in no_dp
    assert "| FedAvg | 62.00 ± 2.83 | 2.98 ± 0.014 | 3,280,968 ± 0 |" in dp


def test_a_run_everyone_left_reports_its_last_reported_round() -> None:
    status = RunStatus("fedavg", "fedavg", Phase.TRAIN, 3, 6, ("org-0",), history=(
        RoundSummary(1, 1, 1.0, (), {"org-0": _report(0.25, 1.0)}),
        RoundSummary(2, 1, 1.0, (), {"org-0": _report(0.5, 1.7)}),
        RoundSummary(3, 0, 1.0, (), {}),  # the round nobody pushed: org-0 left before it
    ))
    summary = lr.summarize_run(status, ["org-0"])
    assert (summary["final_test_accuracy"], summary["privacy"]["epsilon_max"]) == (0.5, 1.7)
    assert summary["privacy"]["budget_spent"] == ["org-0"]


def test_private_config_applies_to_the_dp_cells_only() -> None:
    """A method's private_config (DP-SGD's own step size) is used in the cells under DP and nowhere else."""
    grid = rp.load_grid("privacy")
    fedavg = grid.method("fedavg")
    plain = rp.federation_options(grid, fedavg, {"epsilon": 0}, 0, artifacts=False)
    private = rp.federation_options(grid, fedavg, {"epsilon": 3}, 0, artifacts=False)
    assert plain.extra_algorithm_config["fedavg"]["lr"] == 0.01 and dict(plain.privacy) == {}
    assert private.extra_algorithm_config["fedavg"]["lr"] == 0.1
    assert dict(private.privacy) == {"clip_norm": 1.0, "epsilon_budget": 3}
