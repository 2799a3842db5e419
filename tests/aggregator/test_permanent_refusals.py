"""Refusals no retry can fix: the client exits 2 with one line; the aggregator shows the organization in Status,
an Event and a metric, and stops holding rounds open for it. A run whose state conflicts with its config (another
algorithm under the same id) or a finished run is refused for that run only, visibly; the others are served."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from hetfed.aggregator.observe import k8s_events
from hetfed.cli.k8s_status import build_rows, format_table
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire.messages import run_status_from_proto
from hetfed.wire.payloads import EvalMetrics, ModelWeights, PayloadKind
from tests.conftest import RawClient, run_config, wait_until

W = np.array([1.0, 2.0], np.float32)
DECL = [(PayloadKind.MODEL_WEIGHTS, "w", W)]


class Events:
    """Stands in for the Kubernetes Event recorder: keeps (reason, note, warning)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, bool]] = []

    def record(self, reason: str, note: str, *, warning: bool = False, action: str | None = None) -> bool:
        self.seen.append((reason, note, warning))
        return True

    def close(self, timeout: float = 2.0) -> None:
        pass


@pytest.fixture
def events() -> Iterator[Events]:
    rec = Events()
    k8s_events.install(rec)  # type: ignore[arg-type]
    yield rec
    k8s_events.install(None)


def client_config(org: str, index: int, port: int, latent: int = 0) -> dict[str, Any]:
    return {"organization": org, "run": "r", "aggregator": f"127.0.0.1:{port}", "threads": 1, "device": "cpu",
            "data": {"dataset": "digits", "partition": "iid", "num_clients": 3, "client_index": index},
            "model": {"name": "mlp", "latent_dim": latent},
            "retry": {"initial_backoff_seconds": 0.05, "max_backoff_seconds": 0.5}}


def start_client(tmp_path: Path, name: str, cfg: dict[str, Any]) -> subprocess.Popen[str]:
    (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
    return subprocess.Popen([sys.executable, "-m", "hetfed.cli", "client", "--config", str(tmp_path / f"{name}.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def statuses(c: RawClient, run_id: str = "") -> list[Any]:
    return [run_status_from_proto(s) for s in c.stub.Status(apb.StatusRequest(run_id=run_id), timeout=10).runs]


def test_a_permanently_refused_client_exits_2_and_the_others_finish_without_waiting(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient], events: Events, tmp_path: Path) -> None:
    agg = aggregator(run_config(organizations=["a", "b", "c"], rounds=2, round_deadline_seconds=900))
    start = time.monotonic()
    procs = {org: start_client(tmp_path, org, client_config(org, i, agg.port)) for i, org in enumerate("ab")}
    run = agg.service.runs["r"]
    wait_until(lambda: run.declared == {"a", "b"}, timeout=120, what="a and b to declare their tensors")
    # c's model has another latent width: its tensors do not match the run's schema (the README example's mistake).
    c = start_client(tmp_path, "c", client_config("c", 2, agg.port, latent=16))
    _, err = c.communicate(timeout=120)
    assert c.returncode == 2, err
    refusal = [line for line in err.splitlines() if line.startswith("hetfed client:")]
    assert len(refusal) == 1 and "refused 'c' for good (schema_mismatch)" in refusal[0]
    for p in procs.values():
        assert p.wait(timeout=180) == 0, p.communicate()[1]
    assert time.monotonic() - start < 300  # never the 900 s deadline: rounds closed once a and b pushed
    assert run.status().finished and [h.clients for h in run.history] == [2, 2, 2]
    shown = statuses(raw_client(agg.port, "a"))[0]
    assert [(r.organization, r.reason) for r in shown.refused] == [("c", "schema_mismatch")]
    sample = agg.service.metrics.registry.get_sample_value(
        "hetfed_refused_organizations", {"run": "r", "organization": "c", "reason": "schema_mismatch"})
    assert sample == 1.0
    refused_events = [e for e in events.seen if e[0] == "OrganizationRefused"]
    assert len(refused_events) == 1 and refused_events[0][2]
    assert refused_events[0][1].startswith("run r: organization c refused (schema_mismatch): ")
    table = format_table(build_rows([], [shown]), [shown])
    assert "organization c refused for good (schema_mismatch)" in table


def test_a_refused_organization_that_joins_after_all_is_waited_for_again(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient], events: Events) -> None:
    agg = aggregator(run_config(organizations=["a", "b"], rounds=2, round_deadline_seconds=900))
    a, b = raw_client(agg.port, "a"), raw_client(agg.port, "b")
    a.join(DECL)
    with pytest.raises(grpc.RpcError, match="schema_mismatch"):
        b.join([(PayloadKind.MODEL_WEIGHTS, "w", np.zeros(3, np.float32))])
    run = agg.service.runs["r"]
    assert set(run.refused) == {"b"}
    b.join(DECL)  # its operator fixed the model: it holds rounds open again
    assert run.refused == {}
    a.push(1, [ModelWeights({"w": W}, 1), EvalMetrics(test_accuracy=0.5, num_test_examples=1)])
    assert run.round == 1


def test_a_member_refused_at_a_push_holds_only_that_round_and_is_remembered(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient], events: Events) -> None:
    """Its client exits on the refusal: round 1 still waits for a corrected update (until its deadline), later
    rounds close without it. The refusal is on disk at once: a restarted aggregator shows and applies it."""
    agg = aggregator(run_config(organizations=["a", "b", "c"], rounds=3, min_clients=2, round_deadline_seconds=0.5))
    a, b, c = (raw_client(agg.port, o) for o in "abc")
    for cl in (a, b, c):
        cl.join(DECL)
    good = [ModelWeights({"w": W}, 1), EvalMetrics(test_accuracy=0.5, num_test_examples=1)]
    with pytest.raises(grpc.RpcError) as err:
        c.push(1, [ModelWeights({"w": np.array([np.nan, 1.0], np.float32)}, 1),
                   EvalMetrics(test_accuracy=0.5, num_test_examples=1)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    run = agg.service.runs["r"]
    assert set(run.refused) == {"c"} and run.refused["c"].at_push
    agg.stop()  # before any round closed: only the refusal's own checkpoint can carry it

    def restarted(deadline: float) -> tuple[Any, Any, RawClient, RawClient]:
        agg = aggregator(run_config(organizations=["a", "b", "c"], rounds=3, min_clients=2,
                                    round_deadline_seconds=deadline))
        return agg, agg.service.runs["r"], raw_client(agg.port, "a"), raw_client(agg.port, "b")

    agg, run, a, b = restarted(0.5)
    assert set(run.refused) == {"c"}, "the refusal was persisted when it happened"
    assert [(r.organization, r.reason) for r in statuses(a)[0].refused] == [("c", "non_finite")]
    a.push(1, good)
    b.push(1, good)
    assert run.round == 1  # c may still send a good update in round 1
    wait_until(lambda: run.round == 2, timeout=10, what="round 1 to close on its deadline")
    agg.stop()
    agg, run, a, b = restarted(900)
    a.push(2, good)
    b.push(2, good)
    assert run.round == 3, "round 2 closed as soon as a and b pushed: the deadline is 900 s"


def test_another_algorithm_under_the_same_id_refuses_that_run_only(
        aggregator: Callable[..., Any], raw_client: Callable[..., RawClient], events: Events) -> None:
    agg = aggregator(run_config(id="r"), run_config(id="s"))
    raw_client(agg.port, "a", "r").join(DECL)
    agg.stop()
    agg = aggregator(run_config(id="r", algorithm="fedprox"), run_config(id="s"))
    assert sorted(agg.service.runs) == ["s"] and sorted(agg.service.refused_runs) == ["r"]
    s = raw_client(agg.port, "a", "s")
    assert s.join(DECL).run_id == "s"  # the other run is served
    with pytest.raises(grpc.RpcError) as err:
        raw_client(agg.port, "a", "r").join(DECL)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "written by algorithm 'fedavg', the config now names 'fedprox'" in (err.value.details() or "")
    shown = {st.run_id: st for st in statuses(s)}
    assert "written by algorithm 'fedavg'" in shown["r"].refused_reason and shown["s"].refused_reason == ""
    assert agg.service.metrics.registry.get_sample_value("hetfed_refused_runs", {"run": "r"}) == 1.0
    assert any(e[0] == "RunRefused" and e[2] and "run r is not served" in e[1] for e in events.seen)
    table = format_table(build_rows([], list(shown.values())), list(shown.values()))
    assert re.search(r"run r \(fedprox\): REFUSED: run 'r': its state in \S+ was written by algorithm", table)


def test_the_aggregator_process_keeps_serving_with_a_conflicting_run(tmp_path: Path,
                                                                     raw_client: Callable[..., RawClient]) -> None:
    from tests.conftest import free_port

    port = free_port()
    state = tmp_path / "state"

    def config(algorithm: str) -> Path:
        path = tmp_path / f"{algorithm}.json"
        path.write_text(json.dumps({"server": {"listen": f"127.0.0.1:{port}", "metrics_port": -1,
                                               "state_dir": str(state)},
                                    "runs": [run_config(id="r", algorithm=algorithm), run_config(id="s")]}))
        return path

    for algorithm in ("fedavg", "fedprox"):
        ready = tmp_path / f"ready-{algorithm}"
        proc = subprocess.Popen([sys.executable, "-m", "hetfed.cli", "aggregator", "--config", str(config(algorithm)),
                                 "--ready-file", str(ready)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        try:
            wait_until(lambda r=ready, p=proc: r.exists() or p.poll() is not None, timeout=60,  # type: ignore[misc]
                       what="the aggregator to start")
            assert proc.poll() is None, proc.communicate()[0]  # before: exit 2 and a crash loop
            assert raw_client(port, "a", "s").join(DECL).run_id == "s"
        finally:
            proc.terminate()
            out = proc.communicate(timeout=60)[0]
    assert "run r is not served: run 'r': its state in" in out


def test_joining_a_finished_run_is_refused_visibly(aggregator: Callable[..., Any], raw_client: Callable[..., RawClient],
                                                   events: Events) -> None:
    agg = aggregator(run_config(organizations=["a"], rounds=1))
    a = raw_client(agg.port, "a")
    a.join(DECL)
    a.push(1, [ModelWeights({"w": W}, 1), EvalMetrics(test_accuracy=0.5, num_test_examples=1)])
    a.push(2, [EvalMetrics(test_accuracy=0.5, num_test_examples=1)])
    agg.stop()
    agg = aggregator(run_config(organizations=["a"], rounds=1))  # e.g. a reinstall onto the kept state claim
    a = raw_client(agg.port, "a")
    with pytest.raises(grpc.RpcError) as err:
        a.join(DECL)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "run 'r' finished after 2 rounds" in (err.value.details() or "")
    shown = statuses(a)[0]
    assert shown.finished and [(r.organization, r.reason) for r in shown.refused] == [("a", "run_finished")]
    assert any(e[0] == "OrganizationRefused" and "run_finished" in e[1] for e in events.seen)
