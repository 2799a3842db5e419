"""A real Prometheus scrapes a real ``hetfed run`` of two algorithms: counts add up, every panel and rule works."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from PIL import Image

from hetfed.cli import report
from hetfed.v1 import aggregator_pb2 as apb
from hetfed.wire import chunks
from scripts.observability import dashboards
from tests.conftest import RawClient
from tests.observability.promharness import Prometheus, require, wait_for

pytestmark = pytest.mark.e2e

ROUNDS, CLIENTS = 2, 2
PULL_WAIT_SECONDS = 20.0  # ClientConfig.pull_wait_seconds, which hetfed run leaves at its default
CHUNK_BYTES = 1 << 20  # ServerConfig.chunk_bytes, likewise
RUN_ARGS = ["--algorithm", "fedavg,fedavg_head", "--clients", str(CLIENTS), "--rounds", str(ROUNDS),
            "--dataset", "digits", "--model", "mlp", "--partition", "iid", "--local-epochs", "1",
            "--metrics-linger", "6"]


@dataclass
class Scraped:
    """The finished run, its results.json, and the Prometheus that scraped it."""

    prom: Prometheus
    out: Path
    results: dict[str, Any]  # run id -> summary
    start: float
    last: float  # the last time at which every aggregator series was live (the run finished by then)


def _poke_rejections(port: int) -> None:
    """Two refused messages on run fedavg: a stranger's Join and org-0's push for a closed round (a straggler)."""
    stranger, late = RawClient(port, "intruder", run="fedavg"), RawClient(port, "org-0", run="fedavg")
    try:
        with pytest.raises(grpc.RpcError):
            stranger.join()
        with pytest.raises(grpc.RpcError) as err:
            late.push_bytes(0, b"\x00" * 8)
        assert "late" in (err.value.details() or "")
    finally:
        stranger.close()
        late.close()


def _joined(port: int) -> bool:
    c = RawClient(port, "observer", run="fedavg")
    try:
        s = c.stub.Status(apb.StatusRequest(run_id="fedavg"), timeout=5).runs[0]
        return bool(s.pushed_this_round) or len(s.history) > 1
    finally:
        c.close()


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    """Start Prometheus, run ``hetfed run --metrics-linger``, poke two rejections while it runs."""
    base = tmp_path_factory.mktemp("prom")
    out = base / "out"
    out.mkdir()
    prom = Prometheus(base, out)
    start = time.time()
    log = open(base / "hetfed-run.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "hetfed.cli", "run", *RUN_ARGS, "--output", str(out)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        ready = out / "aggregator.ready"
        wait_for(lambda: ready.exists() or proc.poll() is not None, 60, "the aggregator to start")
        port = json.loads(ready.read_text())["port"]
        wait_for(lambda: _joined(port), 60, "org-0 to join run fedavg")
        _poke_rejections(port)
        assert proc.wait(timeout=180) == 0, (base / "hetfed-run.log").read_text()[-3000:]
        results = {r["run"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
        # The last scrapes of the lingering processes may land just after they exit: wait for them.
        def scraped_finished() -> list[dict[str, Any]]:
            found = prom.query_range("min(hetfed_run_finished)", start, time.time(), 1.0)
            return found if found and any(v == "1" for _, v in found[0]["values"]) else []

        finished = wait_for(scraped_finished, 15, "Prometheus to scrape the finished aggregator")
        last = max(float(t) for t, v in finished[0]["values"] if v == "1")
        yield Scraped(prom, out, results, start, last)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        prom.stop()


def _by(result: list[dict[str, Any]], *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(s["metric"].get(n, "") for n in labels): float(s["value"][1]) for s in result}


def _results_by_kind(summary: dict[str, Any]) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for r in summary["rounds"]:
        for direction in ("up", "down"):
            for kind, n in r[f"bytes_{direction}"].items():
                out[(direction, kind)] = out.get((direction, kind), 0) + n
    return out


def test_run_bytes_in_prometheus_equal_results_json_exactly(scraped: Scraped) -> None:
    got = _by(scraped.prom.query("sum by (run, direction, payload_kind) (last_over_time(hetfed_run_bytes_total[10m]))"),
              "run", "direction", "payload_kind")
    assert {k[0] for k in got} == set(scraped.results) == {"fedavg", "fedavg-head"}
    for run, summary in scraped.results.items():
        mine = {(d, k): v for (r, d, k), v in got.items() if r == run}
        assert mine == _results_by_kind(summary), run
        assert sum(v for (d, _k), v in mine.items() if d == "up") == summary["bytes_up_total"]
        assert sum(v for (d, _k), v in mine.items() if d == "down") == summary["bytes_down_total"]


def test_the_two_sides_agree_so_nothing_is_counted_twice(scraped: Scraped) -> None:
    labels = ("run", "organization", "direction", "payload_kind")
    q = "sum by (run, organization, direction, payload_kind) (last_over_time(hetfed_{}_bytes_total[10m]))"
    aggregator = _by(scraped.prom.query(q.format("aggregator")), *labels)
    client = _by(scraped.prom.query(q.format("client")), *labels)
    assert aggregator and aggregator == client
    assert {k[1] for k in aggregator} == {f"org-{i}" for i in range(CLIENTS)}

    # The aggregator's counters hold the run's history plus one closing exchange per organization (the pull that
    # is answered FINISH after the last round), which belongs to no round: every payload byte matches exactly.
    total = _by(scraped.prom.query("sum by (run, direction, payload_kind) "
                                   "(last_over_time(hetfed_aggregator_bytes_total[10m]))"),
                "run", "direction", "payload_kind")
    for run, summary in scraped.results.items():
        closing = apb.Instructions(envelope=apb.Envelope(run_id=run, round=ROUNDS + 1), action=apb.ACTION_FINISH,
                                   total_rounds=ROUNDS).SerializeToString()
        extra = {"up": sum(apb.PullInstructionsRequest(run_id=run, organization_id=f"org-{i}",
                                                       completed_round=ROUNDS + 1,
                                                       wait_seconds=PULL_WAIT_SECONDS).ByteSize()
                           for i in range(CLIENTS)),
                 "down": CLIENTS * sum(apb.PullInstructionsResponse(chunk=c).ByteSize()
                                       for c in chunks.split(closing, CHUNK_BYTES))}
        # A long-poll that expired (a round longer than PULL_WAIT_SECONDS, on a slow machine) is answered WAIT: its
        # request and reply are counted here but in no round's record, so they may add whole exchanges.
        wait = apb.Instructions(envelope=apb.Envelope(run_id=run, round=1), action=apb.ACTION_WAIT,
                                total_rounds=ROUNDS).SerializeToString()
        waits = {"up": apb.PullInstructionsRequest(run_id=run, organization_id="org-0", completed_round=0,
                                                   wait_seconds=PULL_WAIT_SECONDS).ByteSize(),
                 "down": sum(apb.PullInstructionsResponse(chunk=c).ByteSize() for c in chunks.split(wait, CHUNK_BYTES))}
        expired = set()
        for (direction, kind), n in _results_by_kind(summary).items():
            left = total[(run, direction, kind)] - n - (extra[direction] if kind == "envelope" else 0)
            if kind != "envelope":
                assert left == 0, (run, direction, kind)
                continue
            assert left >= 0 and left % waits[direction] == 0, (run, direction, left)
            expired.add(left // waits[direction])
        assert len(expired) == 1, f"{run}: unequal WAIT exchanges up and down: {expired}"


def _substitutions(scraped: Scraped) -> list[dict[str, str]]:
    """Every variable at All, and at one concrete value each."""
    return [{}, {"run": "fedavg", "algorithm": "fedavg", "organization": "org-0"}]


def test_every_panel_query_parses_and_returns_series(scraped: Scraped, tmp_path: Path) -> None:
    exprs: list[tuple[str, str, str]] = []
    for name, d in dashboards.dashboards().items():
        for values in _substitutions(scraped):
            exprs += [(name, title, dashboards.substitute(e, values)) for title, e in dashboards.panel_exprs(d)]
            for var in d["templating"]["list"]:
                if var["type"] == "query":
                    q = dashboards.variable_query(var["query"]["query"])
                    exprs.append((name, f"variable {var['name']}", dashboards.substitute(q, values)))
    rules = {"groups": [{"name": "panels", "rules": [{"record": f"panel:{i}", "expr": e}
                                                     for i, (_n, _t, e) in enumerate(exprs)]}]}
    path = tmp_path / "panels.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    check = subprocess.run([require("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    empty = [(n, t, e) for n, t, e in exprs if not scraped.prom.query(e, at=scraped.last)]
    # hetfed run trains without differential privacy: no organization declares an ε, so that panel has no
    # series. Every organization counts as unprotected instead, which the privacy stat shows.
    unprotected = _by(scraped.prom.query("max by (run) (hetfed_privacy_unprotected_organizations)", at=scraped.last),
                      "run")
    assert unprotected == {(run,): CLIENTS for run in scraped.results}
    # Nor does any organization withhold a figure (one computed from private data, under DP), so the withheld-figures
    # panel has no series either: checked here as absent, never as 0.
    assert scraped.prom.query("hetfed_reported_withheld", at=scraped.last) == []
    empty = [(n, t, e) for n, t, e in empty if "hetfed_privacy_epsilon" not in e and "hetfed_reported_withheld" not in e]
    assert empty == [], "queries without a series"


def test_alert_rules_load_and_evaluate_on_the_live_data(scraped: Scraped) -> None:
    data = scraped.prom.get("/api/v1/rules")
    rules = [r for g in data["groups"] for r in g["rules"]]
    assert sorted(r["name"] for r in rules) == ["HetfedOrganizationMissing", "HetfedRejectionsHigh",
                                                "HetfedRoundNearDeadline", "HetfedRunStalled"]
    assert all(r["health"] == "ok" for r in rules), rules


def test_dashboard_preview_and_report_from_prometheus(scraped: Scraped, tmp_path: Path) -> None:
    png = tmp_path / "preview.png"
    desc = dashboards.render_preview(scraped.prom.url, png, scraped.start, scraped.last, 1.0, rate_interval="5s")
    assert [p["title"] for p in desc["panels"]] == [s.title for s in dashboards.BANDWIDTH if s.preview]
    assert all(p["series"] >= 1 for p in desc["panels"]), desc
    with Image.open(png) as im:
        assert im.size[0] >= 1000 and im.size[1] >= 1000

    out = tmp_path / "report.png"
    args = argparse.Namespace(results=[], prometheus=scraped.prom.url, since=time.time() - scraped.start + 5,
                              out=out, markdown=tmp_path / "report.md")
    assert report.main(args) == 0
    with Image.open(out) as im:
        meta = json.loads(im.text[report.PNG_KEY])
    assert sorted(line["label"] for line in meta["lines"]) == ["fedavg", "fedavg_head"]
    table = (tmp_path / "report.md").read_text()
    assert "| fedavg_head |" in table and "| 1x |" in table


def test_hetfed_run_wrote_its_report(scraped: Scraped) -> None:
    with Image.open(scraped.out / "report.png") as im:
        assert im.size == (800, 500)
        meta = json.loads(im.text[report.PNG_KEY])
    assert meta["xlabel"] == report.X_LABEL and meta["ylabel"] == report.Y_LABEL and meta["xscale"] == "log"
    assert [(line["label"], line["points"]) for line in meta["lines"]] == [
        ("fedavg", ROUNDS + 1), ("fedavg_head", ROUNDS + 1)]
    table = (scraped.out / "report.md").read_text()
    fedavg, head = scraped.results["fedavg"], scraped.results["fedavg-head"]
    ratio = head["bytes_per_train_round"] / fedavg["bytes_per_train_round"]
    assert f"| fedavg_head | {100 * head['final_test_accuracy']:.2f}% |" in table
    assert f"| {ratio:.3g}x |" in table
