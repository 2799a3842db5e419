"""Differential privacy end to end (docs/privacy.md): a real aggregator process, real client processes (and, to see
what crosses the wire, in-process clients whose every request is recorded) over loopback gRPC.

* the privacy ledger outlives a client killed with SIGKILL, and the aggregator accepts every ε its restart declares;
* an organization whose budget affords fewer rounds than the run leaves it (exit status 3) and the others finish;
* a bad [privacy] table, [privacy] without state_dir or a budget already spent stops ``hetfed client`` in one
  line, exit 2, before it joins;
* a ledger that first joins a run past round 1 stops its client before any training; a run refuses ephemeral
  ledgers or an ε above its max_epsilon, and the client stops;
* Fed-CMA killed between its ledger's write and its setup push sends the same N̂ and class counts again;
* every algorithm DP serves declares its σ and C on every upload, and FedAvg's uploaded weights carry noise of the
  declared scale;
* ``hetfed run --set privacy.epsilon_budget=3`` keeps every organization within ε = 3.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetfed.cli.localrun import (
    LocalFederation,
    LocalPlan,
    LocalRunOptions,
    aggregator_config,
    client_config,
    plan,
)
from hetfed.client.privacy.ledger import FILE_NAME, Ledger, Release, epsilon_of
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.v1 import payloads_pb2 as ppb
from hetfed.wire.messages import RunStatus
from hetfed.wire.payloads import EvalMetrics
from tests.conftest import wait_until
from tests.e2e.recording import run_recorded

pytestmark = pytest.mark.e2e

# Small organizations: 160 training examples each of 60 features and 10 classes, a linear model.
SMALL = {"synthetic_samples": 200}
BATCH, STEPS, DELTA = 16, 4, 1e-5


def _options(clients: int, rounds: int, privacy: dict[str, Any], algorithms: tuple[str, ...] = ("fedavg",),
             **kw: Any) -> LocalRunOptions:
    return LocalRunOptions(algorithms=algorithms, clients=clients, rounds=rounds, dataset="synthetic", data=SMALL,
                           train={"batch_size": BATCH}, privacy=privacy, quiet=True,
                           extra_algorithm_config={a: {"local_steps": STEPS} for a in algorithms}, **kw)


def _ledger(path: Path) -> dict[str, Any]:
    """The ledger file as it is on disk now ({} before the first one; it is replaced atomically)."""
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except FileNotFoundError:
        return {}


def _rounds(ledger: dict[str, Any]) -> dict[int, float]:
    return {int(k): float(v) for k, v in ledger.get("rounds", {}).items()}


def _run(fed: LocalFederation, run_id: str) -> RunStatus:
    return next(s for s in fed.status() if s.run_id == run_id)


def _org(status: RunStatus, org: str) -> Any:
    return next(o for o in status.organization_status if o.organization == org)


def _no_failure(fed: LocalFederation, ignore: tuple[str, ...] = ()) -> bool:
    """Fail at once when a client process not in ``ignore`` exited with an error; False otherwise (so that a wait's
    condition can begin with it)."""
    for name, proc in fed.clients.items():
        code = proc.poll()
        if name not in ignore and code not in (None, 0):
            pytest.fail(f"{name} exited with {code}:\n{fed.log_tail(name)}")
    return False


def _finished(fed: LocalFederation, run_id: str, ignore: tuple[str, ...] = ()) -> RunStatus | None:
    """The run's status once it finished (failing at once when a client not in ``ignore`` failed)."""
    _no_failure(fed, ignore)
    status = _run(fed, run_id)
    return status if status.finished else None


# The example count's release at the default count_noise_multiplier.
COUNT = Release(1.0, 20.0)


def _released_examples(cfg: dict[str, Any]) -> int:
    """N̂ the organization of client config ``cfg`` releases (its noise seed is fixed by hetfed run)."""
    import torch

    from hetfed.client.data import DataConfig, load_client_data
    from hetfed.client.privacy.config import PrivacyConfig
    from hetfed.client.privacy.session import PrivacySession

    n = len(load_client_data(DataConfig(**cfg["data"])).train)
    session = PrivacySession(PrivacyConfig(**cfg["privacy"]), cfg["run"], cfg["organization"], None, n,
                             torch.device("cpu"))
    return session.release_examples()


# ------------------------------------------------------------------------------------------------ kill -9
def _kill(fed: LocalFederation, name: str, ledger_path: Path) -> dict[str, Any]:
    """SIGKILL a client process; the ledger as the killed process left it."""
    proc = fed.clients.pop(name)
    proc.kill()
    assert proc.wait(timeout=30) in (-9, 128 + 9)
    return _ledger(ledger_path)


def test_the_ledger_survives_kill_9_and_every_declaration_is_accepted(tmp_path: Path) -> None:
    """org-0 is killed twice: once as soon as its ledger shows round 1 (the ledger is written before the upload
    leaves, so most likely before the push), once after the aggregator has its round 2 (after the push, before or
    after its state is saved). Each restart continues the ledger, and the aggregator accepts every ε it declares."""
    opts = _options(2, 3, {"noise_multiplier": 1.0, "delta": DELTA})
    fed = LocalFederation(tmp_path)
    ledger_path = tmp_path / "org-0-state" / "fedavg" / FILE_NAME
    try:
        fed.start_aggregator(aggregator_config(opts, str(tmp_path / "state")))
        configs = [{**client_config(opts, "fedavg", i, fed.port), "state_dir": str(tmp_path / f"org-{i}-state")}
                   for i in range(2)]
        for i, cfg in enumerate(configs):
            fed.start_client(f"org-{i}", cfg)
        wait_until(lambda: _no_failure(fed) or 1 in _rounds(_ledger(ledger_path)), timeout=120, interval=0.005,
                   what="org-0's ledger to show round 1")
        kept = [_kill(fed, "org-0", ledger_path)]
        assert kept[0]["epsilon"] > 0 and kept[0]["releases"]

        fed.start_client("org-0-restart-1", configs[0])
        wait_until(lambda: _no_failure(fed) or _org(_run(fed, "fedavg"), "org-0").last_round_pushed >= 2,
                   timeout=120, what="the aggregator to have org-0's round 2")
        kept.append(_kill(fed, "org-0-restart-1", ledger_path))
        assert 2 in _rounds(kept[1])

        fed.start_client("org-0-restart-2", configs[0])
        status = wait_until(lambda: _finished(fed, "fedavg"), timeout=150, what="the run to finish")
        fed.wait_clients(timeout=60)
        assert {n: p.poll() for n, p in fed.clients.items()} == {"org-1": 0, "org-0-restart-2": 0}
    finally:
        fed.stop()

    after = _ledger(ledger_path)
    logs = [(tmp_path / f"org-0-restart-{i}.log").read_text() for i in (1, 2)]
    for log, before in zip(logs, kept, strict=True):
        assert f"continued at ε={before['epsilon']:.4g}" in log
    # ε never went down: not in total, not for a round a killed process had already closed, not round to round.
    rounds = _rounds(after)
    assert {1, 2, 3} <= set(rounds)
    for before in kept:
        assert after["epsilon"] >= before["epsilon"]
        assert after["identity"] == before["identity"] and after["noise_multiplier"] == before["noise_multiplier"]
        for r, eps in _rounds(before).items():
            assert rounds[r] >= eps
    assert kept[1]["epsilon"] >= kept[0]["epsilon"]
    eps_in_order = [rounds[r] for r in sorted(rounds)]
    assert eps_in_order == sorted(eps_in_order)
    assert after["epsilon"] == pytest.approx(max(eps_in_order))
    # Every training round's STEPS batches are on it, and those of a round a kill made it redo.
    assert sum(c for _, _, c in after["releases"]) >= 3 * STEPS
    # The aggregator took every declaration: nothing refused (privacy_regressed or other), and it holds the last ε.
    assert status.refused == ()
    assert "privacy_regressed" not in (tmp_path / "aggregator.log").read_text()
    assert not any("privacy_regressed" in log for log in logs)
    org0 = _org(status, "org-0")
    assert org0.privacy_declared and org0.privacy_epsilon == pytest.approx(after["epsilon"])
    reported = [rec.reports["org-0"].extra["privacy_epsilon"] for rec in status.history if "org-0" in rec.reports]
    assert len(reported) == 4 and reported == sorted(reported)  # 3 training rounds and the evaluate round


# ------------------------------------------------------------------------------------------------ metrics
def test_released_metrics_are_noised_and_accounted_in_the_ledger(tmp_path: Path) -> None:
    """With release_metrics, each evaluation's accuracy, loss and test count leave noised, the training loss and
    count stay withheld, and the ledger's ε after each round is dp-accounting's composition of the DP-SGD steps
    and the metric releases (one Gaussian of σ_m/√3 per evaluated set, σ_m = 30σ)."""
    import dp_accounting
    from dp_accounting import rdp

    opts = _options(1, 2, {"noise_multiplier": 1.0, "delta": DELTA, "release_metrics": True, "noise_seed": 3})
    fed = LocalFederation(tmp_path)
    ledger_path = tmp_path / "org-0-state" / "fedavg" / FILE_NAME
    try:
        fed.start_aggregator(aggregator_config(opts, str(tmp_path / "state")))
        fed.start_client("org-0", {**client_config(opts, "fedavg", 0, fed.port),
                                   "state_dir": str(tmp_path / "org-0-state")})
        status = wait_until(lambda: _finished(fed, "fedavg"), timeout=150, what="the run to finish")
        fed.wait_clients(timeout=60)
    finally:
        fed.stop()

    metric_sigma = 30.0 / math.sqrt(3.0)
    ledger = _ledger(ledger_path)
    n_hat = ledger["released"]["examples"]  # q = B/N̂, from the released example count
    q = BATCH / n_hat
    assert n_hat != len(_train_examples(plan(opts)))
    assert sorted(ledger["releases"]) == [[q, 1.0, 2 * STEPS], [1.0, metric_sigma, 3], [1.0, 20.0, 1]]

    def composed(steps: int, metric_releases: int) -> float:
        acc = rdp.RdpAccountant()
        acc.compose(dp_accounting.ComposedDpEvent([
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.0)), steps),
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(metric_sigma), metric_releases),
            dp_accounting.GaussianDpEvent(20.0)]))
        return float(acc.get_epsilon(DELTA))

    # Rounds 1 and 2 train (STEPS steps) and evaluate; round 3 is the final evaluation.
    want = {1: composed(STEPS, 1), 2: composed(2 * STEPS, 2), 3: composed(2 * STEPS, 3)}
    assert set(_rounds(ledger)) == set(want)
    for r, eps in _rounds(ledger).items():
        assert math.isclose(eps, want[r], rel_tol=1e-9), (r, eps, want[r])
    assert want[3] > want[2] > composed(2 * STEPS, 0) + 1e-6  # the metric releases cost ε

    log = (tmp_path / "org-0.log").read_text()
    exact = [tuple(float(v) for v in m.groups()) for m in EXACT_LINE.finditer(log)]
    reports = [rec.reports["org-0"] for rec in status.history if "org-0" in rec.reports]
    assert len(reports) == len(exact) == 3
    for m, (_, accuracy, loss) in zip(reports, exact, strict=True):
        assert m.withheld == ("train_loss", "num_train_examples")
        assert 0.0 <= m.test_accuracy <= 1.0 and 0.0 <= m.test_loss <= 5.0 and m.num_test_examples >= 0
        assert (m.test_accuracy, m.test_loss) != pytest.approx((accuracy, loss), rel=1e-4)
    assert [m.extra["privacy_epsilon"] for m in reports] == pytest.approx([want[1], want[2], want[3]], rel=1e-9)


# ------------------------------------------------------------------------------------------------ budget
def test_an_organization_whose_budget_runs_out_leaves_and_the_others_finish(tmp_path: Path) -> None:
    sigma, afford = 1.0, 2
    opts = _options(3, 3, {"noise_multiplier": sigma, "delta": DELTA})
    n_hat = _released_examples(client_config(opts, "fedavg", 2, 1))
    one_round = Release(BATCH / n_hat, sigma, STEPS)
    eps = [epsilon_of([COUNT, *[one_round] * k], DELTA) for k in (1, 2, 3)]
    budget = (eps[afford - 1] + eps[afford]) / 2  # enough for `afford` rounds, not one more
    assert eps[afford - 1] < budget < eps[afford]

    agg = aggregator_config(opts, str(tmp_path / "state"))
    agg["runs"][0].update(min_clients=2, round_deadline_seconds=8.0)
    fed = LocalFederation(tmp_path)
    try:
        fed.start_aggregator(agg)
        for i in range(3):
            cfg = client_config(opts, "fedavg", i, fed.port)
            if i == 2:
                cfg["privacy"]["epsilon_budget"] = budget
                cfg["state_dir"] = str(tmp_path / "org-2-state")
            fed.start_client(f"org-{i}", cfg)
        status = wait_until(lambda: _finished(fed, "fedavg", ignore=("org-2",)), timeout=150,
                            what="the run to finish")
        fed.wait_clients(timeout=60)
        codes = {n: p.poll() for n, p in fed.clients.items()}
    finally:
        fed.stop()

    assert codes == {"org-0": 0, "org-1": 0, "org-2": 3}
    log = (tmp_path / "org-2.log").read_text()
    assert f"privacy budget ε={budget:g}" in log and "would be exceeded by the next round" in log
    last = log.strip().splitlines()[-1]
    assert last.startswith("hetfed client: org-2: privacy budget") and "would be exceeded" in last
    assert "Traceback" not in log
    ledger = _ledger(tmp_path / "org-2-state" / "fedavg" / FILE_NAME)
    assert ledger["epsilon"] <= budget
    assert _rounds(ledger) == pytest.approx({r: eps[r - 1] for r in range(1, afford + 1)})
    assert _org(status, "org-2").privacy_epsilon <= budget
    assert _org(status, "org-2").last_round_pushed <= afford
    # The others closed the rounds after it left at the deadline, by the quorum of two, and finished.
    # Its leave notice was refused as such, so no round waited for it.
    assert status.finished and [(r.organization, r.reason) for r in status.refused] == [("org-2", "privacy_budget_spent")]
    for rec in status.history:
        if rec.round > afford:
            assert sorted(rec.reports) == ["org-0", "org-1"]


# ------------------------------------------------------------------------------------------------ bad input
def _client(config: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hetfed.cli", "client", "--config", str(config)],
                          capture_output=True, text=True, timeout=timeout, cwd=config.parent)


def test_bad_privacy_input_is_one_line_exit_2_and_never_joins(tmp_path: Path) -> None:
    opts = _options(1, 1, {"noise_multiplier": 1.0, "delta": DELTA})
    fed = LocalFederation(tmp_path, fork_clients=False)
    try:
        fed.start_aggregator(aggregator_config(opts, str(tmp_path / "state")))
        base = client_config(opts, "fedavg", 0, fed.port)
        # A ledger of this run and organization that has spent ε > 1 already.
        state = tmp_path / "org-0-state"
        ledger = Ledger.open(str(state), "fedavg", "org-0", delta=DELTA, accountant="rdp", noise_multiplier=1.0,
                             clip_norm=1.0)
        ledger.record(0.5, 1.0, 50)
        spent = ledger.close_round(1)
        assert spent > 1.0 and (state / "fedavg" / FILE_NAME).exists()
        no_ledger = {k: v for k, v in base["privacy"].items() if k != "ephemeral_ledger"}
        cases = {
            "no-state-dir": (no_ledger, None, "[privacy] needs state_dir: the privacy ledger is kept there, and "
                             "without it a restarted client would count ε from zero; set state_dir (or "
                             "privacy.ephemeral_ledger = true for an experiment)"),
            "sigma-zero": ({**base["privacy"], "noise_multiplier": 0}, None,
                           "privacy: noise_multiplier must be a number > 0"),
            "clip-negative": ({**base["privacy"], "clip_norm": -1}, None, "privacy: clip_norm must be a number > 0"),
            "spent": ({**base["privacy"], "epsilon_budget": 1.0}, str(state),
                      "org-0: privacy budget ε=1 is already spent in run 'fedavg'"),
        }
        for name, (privacy, state_dir, message) in cases.items():
            path = tmp_path / f"{name}.json"
            path.write_text(json.dumps({**base, "privacy": privacy, "state_dir": state_dir}))
            proc = _client(path)
            assert proc.returncode == 2, (name, proc.stderr)
            lines = proc.stderr.strip().splitlines()
            assert lines[-1].startswith("hetfed client: ") and message in lines[-1], (name, proc.stderr)
            assert "Traceback" not in proc.stderr, (name, proc.stderr)
            if state_dir is None:  # refused while reading the file: the line is all it prints
                assert len(lines) == 1, (name, proc.stderr)
            # Nothing but its own loading came before the refusal: it never joined.
            assert "joined run" not in proc.stderr
        status = _run(fed, "fedavg")
    finally:
        fed.stop()
    assert not _org(status, "org-0").joined and status.refused == ()
    assert "org-0" not in (tmp_path / "aggregator.log").read_text()
    assert json.loads((state / "fedavg" / FILE_NAME).read_text())["epsilon"] == pytest.approx(spent)  # untouched


# ------------------------------------------------------------------------------------------------ late ledgers
def test_a_ledger_that_first_joins_past_round_1_stops_its_client_before_any_training(tmp_path: Path) -> None:
    """org-0 alone takes the run past round 1; org-1 then starts with no ledger. It joins, learns the round and
    stops in one line, exit 2: a lost ledger and a first late join look the same. It trained nothing and sent
    nothing but Join; a second start is refused the same way."""
    opts = _options(2, 30, {"noise_multiplier": 1.0, "delta": DELTA})
    agg = aggregator_config(opts, str(tmp_path / "state"))
    agg["runs"][0].update(min_clients=1, round_deadline_seconds=1.0)
    fed = LocalFederation(tmp_path, fork_clients=False)
    ledger_path = tmp_path / "org-1-state" / "fedavg" / FILE_NAME
    try:
        fed.start_aggregator(agg)
        fed.start_client("org-0", {**client_config(opts, "fedavg", 0, fed.port),
                                   "state_dir": str(tmp_path / "org-0-state")})
        wait_until(lambda: _no_failure(fed) or _run(fed, "fedavg").round >= 2, timeout=120,
                   what="the run to pass round 1")
        path = tmp_path / "org-1.json"
        path.write_text(json.dumps({**client_config(opts, "fedavg", 1, fed.port),
                                    "state_dir": str(tmp_path / "org-1-state")}))
        procs = [_client(path), _client(path)]
        status = _run(fed, "fedavg")
    finally:
        fed.stop()
    joined_at = _ledger(ledger_path)["joined_at"]
    assert joined_at >= 2
    for proc in procs:
        assert proc.returncode == 2, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last == (
            f"hetfed client: org-1: privacy: run 'fedavg' was at round {joined_at} when this organization's privacy "
            f"ledger ({ledger_path}) first joined it: the ledger was lost, or the organization joins late for the "
            "first time, and hetfed cannot tell these apart; ε cannot be continued, so it sends nothing (restore "
            "the ledger, or start a new run)")
        assert "Traceback" not in proc.stderr and "privacy: σ=" not in proc.stderr
    # Its ledger holds the one release made before Join, N̂, and nothing else: nothing trained, nothing pushed.
    assert _ledger(ledger_path)["releases"] == [[1.0, 20.0, 1]] and _rounds(_ledger(ledger_path)) == {}
    org1 = _org(status, "org-1")
    assert org1.last_round_pushed <= 0 and not org1.privacy_declared


# ------------------------------------------------------------------------------------------------ run limits
def test_a_run_refuses_ephemeral_ledgers_and_an_epsilon_above_max_epsilon_and_the_clients_stop(
        tmp_path: Path) -> None:
    """Two runs of one aggregator: "eph" refuses ephemeral ledgers, "cap" accepts at most ε = 1. A client with an
    ephemeral ledger, and one whose first round declares ε ≈ 2.7, are refused at their first push: exit 2, one
    line naming the reason, the refusal in Status (tests/aggregator/test_privacy.py counts it)."""
    opts = _options(1, 2, {"noise_multiplier": 1.0, "delta": DELTA})
    agg = aggregator_config(opts, str(tmp_path / "state"))
    (run,) = agg["runs"]
    agg["runs"] = [{**run, "id": "eph", "refuse_ephemeral_ledgers": True}, {**run, "id": "cap", "max_epsilon": 1.0}]
    fed = LocalFederation(tmp_path, fork_clients=False)
    try:
        fed.start_aggregator(agg)
        base = client_config(opts, "fedavg", 0, fed.port)
        assert base["privacy"]["ephemeral_ledger"] is True and "state_dir" not in base
        configs = {"eph": {**base, "run": "eph"}, "cap": {**base, "run": "cap", "state_dir": str(tmp_path / "s")}}
        procs = {}
        for run_id, cfg in configs.items():
            path = tmp_path / f"{run_id}.json"
            path.write_text(json.dumps(cfg))
            procs[run_id] = _client(path)
        status = {run_id: _run(fed, run_id) for run_id in configs}
    finally:
        fed.stop()
    expected = {
        "eph": ("privacy_ephemeral_ledger", "organization 'org-0' keeps its privacy ledger only in its client process "
                "(privacy.ephemeral_ledger); run 'eph' refuses such ledgers (refuse_ephemeral_ledgers): give the "
                "client a state_dir"),
        "cap": ("privacy_epsilon_exceeded", "organization 'org-0' declared ε="),
    }
    for run_id, (reason, text) in expected.items():
        proc = procs[run_id]
        assert proc.returncode == 2, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"hetfed client: FAILED_PRECONDITION: the aggregator refused 'org-0' for good "
                               f"({reason}): {text}"), last
        assert "Traceback" not in proc.stderr
        assert [(r.organization, r.reason) for r in status[run_id].refused] == [("org-0", reason)]
        assert _org(status[run_id], "org-0").last_round_pushed <= 0  # no payload of it was accepted
    assert procs["cap"].stderr.strip().endswith("; run 'cap' accepts at most ε=1 (max_epsilon)")


# ------------------------------------------------------------------------------------------------ kill -9, Fed-CMA
def test_fedcma_killed_between_its_ledger_write_and_its_setup_push_sends_the_same_counts_again(
        tmp_path: Path) -> None:
    """The client kills itself (SIGKILL) right after its setup round's ledger write, before the push. Restarted,
    it sends the class counts that write kept, declares the same N̂ at Join and in every payload, and releases
    neither again: ε goes on from where the killed process left it."""
    opts = _wire_options("fedcma", True)
    p = plan(opts)
    fed = LocalFederation(tmp_path, fork_clients=False)
    ledger_path = tmp_path / "org-0-state" / "fedcma" / FILE_NAME
    try:
        fed.start_aggregator(aggregator_config(p, str(tmp_path / "state")))
        cfg = {**client_config(p, "fedcma", 0, fed.port), "state_dir": str(tmp_path / "org-0-state")}
        path = tmp_path / "org-0.json"
        path.write_text(json.dumps(cfg))
        killed = subprocess.run([sys.executable, "-m", "hetfed.cli", "client", "--config", str(path)],
                                capture_output=True, text=True, timeout=120, cwd=tmp_path,
                                env={**fed.env, "HETFED_CLIENT_CRASH_AT": "privacy.ledger_written"})
        assert killed.returncode == -9, killed.stderr
        before = _ledger(ledger_path)
        assert _run(fed, "fedcma").round == 0 and _run(fed, "fedcma").pushed_this_round == ()  # setup not pushed
        sent, _ = run_recorded(cfg)
        status = wait_until(lambda: _finished(fed, "fedcma"), timeout=60, what="the run to finish")
    finally:
        fed.stop()
    after = _ledger(ledger_path)
    n_hat, counts = before["released"]["examples"], before["released"]["class_counts"]
    assert after["released"] == before["released"] and sum(counts) > 0
    joins = [req for method, req in sent if method.endswith("/Join")]
    assert joins and all(j.num_train_examples == n_hat for j in joins)
    updates = [apb.Update.FromString(b"".join(r.chunk.data for r in items))
               for method, items in sent if method.endswith("/PushUpdate")]
    setup = updates[0]
    assert setup.envelope.round == 0 and [p.WhichOneof("kind") for p in setup.payloads] == ["class_counts"]
    from hetfed.wire import codec

    assert codec.payload_from_proto(setup.payloads[0]).counts.tolist() == counts
    assert setup.privacy.epsilon == pytest.approx(before["epsilon"], rel=1e-12)  # nothing released again
    for update in updates[1:]:
        for payload in update.payloads:
            kind = payload.WhichOneof("kind")
            if kind == "head_weights":
                assert payload.head_weights.num_examples == n_hat
            if kind == "eval_metrics":  # figures of private data, the count among them, are withheld
                assert "num_train_examples" in payload.eval_metrics.withheld
                assert payload.eval_metrics.num_train_examples == 0
    # One release of N̂ and one of the class counts (σ_d = 10·σ), whatever the kill made it redo.
    releases = {(q, sigma): c for q, sigma, c in after["releases"]}
    assert releases[1.0, 20.0] == 1 and releases[1.0, 10.0 * SIGMA] == 1
    assert after["epsilon"] >= before["epsilon"]
    assert status.refused == ()


# ------------------------------------------------------------------------------------------------ the wire
# The algorithms DP serves, with what each needs to run under it; each runs once with DP and once without.
LR, FEDAVG_SIGMA, SIGMA, CLIP = 0.1, 50.0, 1.0, 0.5
WIRE: dict[str, dict[str, Any]] = {
    "fedavg": {"local_steps": 1, "momentum": 0.0, "lr": LR},
    "fedprox": {"mu": 0.1},
    "fedavg_head": {},
    "local": {},
    "ditto": {},
    # DP bounds Fed-CMA's class sums by its sigmoid's [0, 1]^d_e, which its authors' settings leave out.
    "fedcma": {"bounded_latent": True},
    "fedh2l": {},
    "simfed": {},
    "fedsr": {"alpha_cmi": 0.0},
}


# The aggregator hosting every run of the wire tests, and each run's plan by (algorithm, with DP).
Wire = tuple[LocalFederation, dict[tuple[str, bool], LocalPlan]]


def _wire_options(algorithm: str, dp: bool) -> LocalRunOptions:
    privacy = {"noise_multiplier": FEDAVG_SIGMA if algorithm == "fedavg" else SIGMA, "clip_norm": CLIP,
               "delta": DELTA, "noise_seed": 7}
    config = {"local_steps": 2, "batch_size": BATCH, **WIRE[algorithm]}
    dataset: dict[str, Any] = {"dataset": "synthetic", "data": SMALL}
    if algorithm == "fedh2l":  # it teaches on a shared seed set of rotated domains
        dataset = {"dataset": "mnist5k", "partition": "rotated", "models": ("mlp",)}
    return LocalRunOptions(algorithms=(algorithm,), clients=1, rounds=1, privacy=privacy if dp else {}, quiet=True,
                           extra_algorithm_config={algorithm: config}, **dataset)


def _run_id(algorithm: str, dp: bool) -> str:
    return f"{algorithm.replace('_', '-')}-{'dp' if dp else 'plain'}"


@pytest.fixture(scope="module")
def wire(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wire]:
    """One aggregator process hosting every algorithm's run twice, with DP and without, one organization each."""
    workdir = tmp_path_factory.mktemp("privacy-wire")
    plans: dict[tuple[str, bool], LocalPlan] = {}
    runs = []
    for algorithm in WIRE:
        for dp in (True, False):
            p = plans[algorithm, dp] = plan(_wire_options(algorithm, dp))
            (run,) = aggregator_config(p, str(workdir / "state"))["runs"]
            runs.append({**run, "id": _run_id(algorithm, dp)})
    agg = aggregator_config(plans["fedavg", True], str(workdir / "state"))
    agg["runs"] = runs
    fed = LocalFederation(workdir, fork_clients=False)
    try:
        fed.start_aggregator(agg)
        yield fed, plans
    finally:
        fed.stop()


def _record(wire: Wire, algorithm: str, dp: bool) -> list[apb.Update]:
    """Run the organization in this process with every request recorded; its updates as they were sent."""
    fed, plans = wire
    p = plans[algorithm, dp]
    cfg = {**client_config(p, p.runs[0].run_id, 0, fed.port), "run": _run_id(algorithm, dp)}
    sent, _ = run_recorded(cfg)
    return [apb.Update.FromString(b"".join(req.chunk.data for req in items))
            for method, items in sent if method.endswith("/PushUpdate")]


def _tensors(update: apb.Update) -> dict[tuple[str, str], np.ndarray]:
    """Every tensor of the update's payloads (but its metrics), by (payload kind, name), as float64."""
    from hetfed.wire import codec

    out = {}
    for p in update.payloads:
        kind = p.WhichOneof("kind")
        if kind == "eval_metrics":
            continue
        payload = codec.payload_from_proto(p)
        for name, arr in getattr(payload, "tensors", {}).items():
            out[kind, name] = np.asarray(arr, dtype=np.float64)
    return out


def _metrics(update: apb.Update) -> ppb.EvalMetrics | None:
    """The update's metrics (None for an upload without them: FedCMA's setup sends its class counts alone)."""
    return next((p.eval_metrics for p in update.payloads if p.WhichOneof("kind") == "eval_metrics"), None)


@pytest.mark.parametrize("algorithm", list(WIRE))
def test_every_upload_declares_its_privacy_and_differs_from_the_plain_run(
        wire: Wire, algorithm: str) -> None:
    from hetfed.client.algorithms import client_half_type
    from hetfed.wire.specs import get_spec

    dp, plain = _record(wire, algorithm, True), _record(wire, algorithm, False)
    assert len(dp) == len(plain) >= 2  # (setup,) the training round and the evaluate round
    sigma = FEDAVG_SIGMA if algorithm == "fedavg" else SIGMA
    mechanism = client_half_type(get_spec(algorithm)).privacy_mechanism
    epsilons = []
    for update in dp:
        assert update.HasField("privacy")
        d = update.privacy
        assert (d.mechanism, d.noise_multiplier, d.clip_norm, d.delta, d.accountant) == (
            mechanism, sigma, CLIP, DELTA, "rdp")
        assert math.isfinite(d.epsilon) and d.epsilon > 0
        epsilons.append(d.epsilon)
        metrics = _metrics(update)
        if metrics is not None:
            extra = dict(metrics.extra)
            assert extra["privacy_epsilon"] == pytest.approx(d.epsilon)
            assert extra["privacy_delta"] == pytest.approx(DELTA)
            assert (extra["privacy_noise_multiplier"], extra["privacy_clip_norm"]) == pytest.approx((sigma, CLIP))
            # Nothing computed from private data: every field withheld, only public figures in extra.
            assert list(metrics.withheld)[:5] == list(EvalMetrics.FIELDS)
            assert (metrics.train_loss, metrics.test_accuracy, metrics.test_loss, metrics.num_test_examples,
                    metrics.num_train_examples) == (0.0, 0.0, 0.0, 0, 0)
            assert set(extra) <= {"evaluated_round", "privacy_epsilon", "privacy_delta", "privacy_noise_multiplier",
                                  "privacy_clip_norm"}, extra
    assert epsilons == sorted(epsilons)
    for update in plain:
        assert not update.HasField("privacy")
        metrics = _metrics(update)
        assert metrics is None or not any(k.startswith("privacy_") for k in metrics.extra)
    # The same payload kinds go up with DP; what the training round uploads differs from the plain run's.
    for a, b in zip(dp, plain, strict=True):
        assert [p.WhichOneof("kind") for p in a.payloads] == [p.WhichOneof("kind") for p in b.payloads]
    trained = next(i for i, u in enumerate(plain) if u.envelope.round == 1)
    got, ref = _tensors(dp[trained]), _tensors(plain[trained])
    if ref:
        shared = set(got) & set(ref)
        assert set(got) != set(ref) or any(not np.array_equal(got[k], ref[k]) for k in shared)
    else:  # Local uploads its metrics alone: under DP they carry nothing of the data, without DP its loss
        with_dp, without = _metrics(dp[trained]), _metrics(plain[trained])
        assert with_dp is not None and without is not None and not without.withheld and without.train_loss > 0
        assert "train_loss" in with_dp.withheld and with_dp.train_loss == 0.0
    # The aggregator accepted every declaration and shows the last one.
    fed, _ = wire
    status = _run(fed, _run_id(algorithm, True))
    assert status.finished and status.refused == ()
    org = _org(status, "org-0")
    assert org.privacy_declared and org.privacy_epsilon == pytest.approx(epsilons[-1])
    assert not _org(_run(fed, _run_id(algorithm, False)), "org-0").privacy_declared

    if algorithm == "fedavg":
        # One plain SGD step (momentum 0) from the same initial weights: w_dp - w_plain is -lr·N(0, σ²C²)/(qN) per
        # entry, up to the clipping's change of the gradient (its std is under a tenth of the noise's at σ = 50).
        p = wire[1]["fedavg", True]
        n = len(_train_examples(p))
        expected = LR * FEDAVG_SIGMA * CLIP / (min(1.0, BATCH / n) * n)
        assert set(got) == set(ref)
        diff = np.concatenate([(got[k] - ref[k]).ravel() for k in sorted(ref)])
        assert diff.size >= 600
        assert 0.85 < diff.std() / expected < 1.15, (diff.std(), expected)
        assert abs(diff.mean()) < 5 * expected / math.sqrt(diff.size)
        # Gaussian: about 68% of the entries within one standard deviation.
        assert 0.60 < np.mean(np.abs(diff) < expected) < 0.76


def _train_examples(p: LocalPlan) -> Any:
    from hetfed.client.data import DataConfig, load_client_data

    return load_client_data(DataConfig(**client_config(p, p.runs[0].run_id, 0, 1)["data"])).train


# ------------------------------------------------------------------------------------------------ hetfed run
def test_hetfed_run_with_a_budget_keeps_every_organization_within_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "fedavg", "--rounds", "2",
                           "--set", "privacy.epsilon_budget=3", "--clients", "2", "--dataset", "synthetic",
                           "--data", "synthetic_samples=200", "--local-epochs", "1", "--no-report",
                           "--output", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    privacy = run["privacy"]
    assert sorted(privacy["organizations"]) == ["org-0", "org-1"] and privacy["budget_spent"] == []
    for org, figures in privacy["organizations"].items():
        assert 0 < figures["epsilon"] <= 3, org
        assert figures["noise_multiplier"] > 0 and figures["clip_norm"] == 1.0 and 0 < figures["delta"] < 1
        # σ was solved to spend the budget over the planned rounds.
        assert figures["epsilon"] > 2.5, org
        per_round = [r["per_organization"][org]["privacy_epsilon"] for r in run["rounds"]]
        assert per_round == sorted(per_round) and per_round[-1] == figures["epsilon"]
        # --output keeps each ledger in it, with N̂ and the ε last declared.
        ledger = _ledger(out / "client-state" / org / "fedavg" / FILE_NAME)
        assert ledger["epsilon"] == pytest.approx(figures["epsilon"]) and ledger["released"]["examples"] > 0
    assert 0 < privacy["epsilon_max"] <= 3
    # Nothing computed from private data reached the aggregator: every figure is "withheld", never 0 or a mean.
    assert run["final_test_accuracy"] == "withheld" and run["final_withheld_by"] == ["org-0", "org-1"]
    reported = [r for r in run["rounds"] if r["per_organization"]]
    assert len(reported) == 3  # two training rounds and the evaluate round
    for r in reported:
        assert (r["test_accuracy"], r["train_loss"], r["withheld_by"]) == ("withheld", "withheld", ["org-0", "org-1"])
        for m in r["per_organization"].values():
            assert {k: m[k] for k in ("test_accuracy", "test_loss", "train_loss", "num_test_examples")} == dict.fromkeys(
                ("test_accuracy", "test_loss", "train_loss", "num_test_examples"), "withheld")
            assert {k for k, v in m.items() if v != "withheld"} == {"evaluated_round", *[f"privacy_{k}" for k in (
                "epsilon", "delta", "noise_multiplier", "clip_norm")]}
    lines = [line for line in proc.stdout.splitlines() if line.strip().strip("│|").strip().startswith("fedavg")]
    row, progress = lines[-1], lines[:-1]  # the table's row comes last, after the progress lines
    assert row.split()[1] == "withheld", row
    assert any("acc withheld" in line for line in progress) and not any("acc " in line and "%" in line
                                                                        for line in progress), progress
    # The organizations' exact figures (in their own logs only) appear nowhere the aggregator wrote or served.
    exact = _exact_figures(out)
    assert len(exact) >= 2 * 3  # two organizations, three rounds, a test loss each at least
    # results.json's own_final keys are the local run reading the organizations' own records, not the aggregator.
    served = {k: v for k, v in run.items() if k not in ("own_final", "own_final_test_accuracy")}
    shown = _numbers(json.dumps(served)) | {n for f in (out / "state").rglob("*") if f.is_file() for n in
                                         _numbers(f.read_bytes().decode("utf-8", "replace"))}
    assert not [v for v in exact if any(math.isclose(v, n, rel_tol=5e-6) for n in shown)]
    # What hetfed run wrote: a [privacy] table in every client config, require_privacy in the run config.
    assert json.loads((out / "aggregator.json").read_text())["runs"][0]["require_privacy"] is True
    for i in range(2):
        assert json.loads((out / f"client-fedavg-org-{i}.json").read_text())["privacy"]["epsilon_budget"] == 3


EXACT_LINE = re.compile(r"\(exact, not sent\): train_loss=(\S+) test_accuracy=(\S+) test_loss=(\S+)")


def _exact_figures(out: Path) -> list[float]:
    """The exact figures the organizations logged in ``out`` (their own logs), but for whole numbers (an accuracy
    of 0 or 1 equals a round number or C by chance)."""
    values = [float(v) for log in out.glob("client-*.log") for m in EXACT_LINE.finditer(log.read_text())
              for v in m.groups()]
    return [v for v in values if v != round(v)]


def _numbers(text: str) -> set[float]:
    """Every decimal number written in ``text``."""
    return {float(t) for t in re.findall(r"-?\d+\.\d+(?:[eE][-+]?\d+)?", text)}


def _run_cli(out: Path, *args: str) -> dict[str, Any]:
    """``hetfed run`` of FedAvg on two small synthetic organizations into ``out``; its one run's results."""
    proc = subprocess.run([sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "fedavg", "--clients", "2",
                           "--dataset", "synthetic", "--data", "synthetic_samples=200", "--local-epochs", "1",
                           "--no-report", "--output", str(out), *args], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    return dict(run)


def test_hetfed_run_reads_the_organizations_own_records_which_the_aggregator_never_saw(tmp_path: Path) -> None:
    from hetfed.client.catalog import OWN_FIGURES
    from hetfed.client.data import DataConfig, load_client_data

    out = tmp_path / "out"
    run = _run_cli(out, "--rounds", "1", "--set", "privacy.noise_multiplier=2")
    assert run["final_test_accuracy"] == "withheld"
    records = {org: json.loads((out / "artifacts" / "fedavg" / org / OWN_FIGURES).read_text())
               for org in ("org-0", "org-1")}
    final = {org: r["rounds"][-1] for org, r in records.items()}
    assert all(e["round"] == 2 for e in final.values())  # one training round, then the evaluate round
    n = sum(e["num_test_examples"] for e in final.values())
    assert n > 0 and run["own_final_test_accuracy"] == sum(
        e["test_accuracy"] * e["num_test_examples"] for e in final.values()) / n
    assert 0 <= run["own_final_test_accuracy"] <= 1 and run["own_final"] == final
    for org, record in records.items():
        assert (record["organization"], record["run"], [e["round"] for e in record["rounds"]]) == (org, "fedavg", [1, 2])
        cfg = json.loads((out / f"client-fedavg-{org}.json").read_text())
        train = load_client_data(DataConfig(**cfg["data"])).train
        assert {e["num_train_examples"] for e in record["rounds"]} == {len(train)}  # the true count, not N̂
    # The record holds what the organizations logged as exact; none of it reached the aggregator's state.
    exact = [v for r in records.values() for e in r["rounds"] for v in (e["train_loss"], e["test_accuracy"],
                                                                         e["test_loss"]) if v != round(v)]
    assert len(exact) >= 2 * 3  # per organization its three losses at least (the evaluate round trains none)
    logged = _exact_figures(out)
    assert logged and all(any(math.isclose(v, x, rel_tol=5e-6) for x in exact) for v in logged)
    state = [f.read_bytes() for f in (out / "state").rglob("*") if f.is_file()]
    assert state and not [v for v in exact if any(repr(v).encode() in b for b in state)]
    shown = {x for b in state for x in _numbers(b.decode("utf-8", "replace"))}
    assert not [v for v in exact if any(math.isclose(v, x, rel_tol=5e-6) for x in shown)]


def test_hetfed_run_without_privacy_writes_no_own_record(tmp_path: Path) -> None:
    run = _run_cli(tmp_path / "out", "--rounds", "1")
    assert isinstance(run["final_test_accuracy"], float) and "own_final" not in run
    assert run["own_final_test_accuracy"] == run["final_test_accuracy"]
    assert list((tmp_path / "out").rglob("own-figures.json")) == []


def test_hetfed_run_in_a_temporary_directory_declares_its_ledgers_ephemeral_in_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "hetfed.cli", "run", "--algorithm", "fedavg", "--rounds", "1",
                           "--set", "privacy.epsilon_budget=3", "--clients", "1", "--dataset", "synthetic",
                           "--data", "synthetic_samples=200", "--local-epochs", "1"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [line for line in proc.stdout.splitlines() if "ephemeral" in line]
    assert said == ["hetfed run: privacy ledgers are ephemeral (privacy.ephemeral_ledger): they end with this "
                    "temporary run; give --output to keep them"]
