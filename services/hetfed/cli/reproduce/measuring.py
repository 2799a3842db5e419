"""Measuring a grid: each federation started with the same processes as ``hetfed run``, and the figures read from
its results."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetfed.cli.localrun import LocalFederation, LocalRunOptions, federate
from hetfed.cli.reproduce.grids import EPSILON_AXIS, BytesReference, Grid, GridFigure, Method
from hetfed.cli.reproduce.pages import _num
from hetfed.wire.messages import RunStatus
from hetfed.wire.payloads import WITHHELD
from hetfed.wire.phases import Phase


def federation_options(grid: Grid, method: Method, cell: Mapping[str, Any], seed: int, *, artifacts: bool,
                       rounds: int | None = None) -> LocalRunOptions:
    """The ``hetfed run`` options of one federation of the grid (``rounds``: instead of the grid's)."""
    config = dict(method.config)
    privacy = dict(method.privacy)
    settings: dict[str, Any] = {**grid.data, **method.options}
    for name, value in cell.items():
        if name.startswith("config."):
            config[name.removeprefix("config.")] = value
        elif name.startswith("data."):
            settings["data"] = {**settings.get("data", {}), name.removeprefix("data."): value}
        elif name.startswith("privacy."):
            privacy[name.removeprefix("privacy.")] = value
        elif name != EPSILON_AXIS:
            settings[name] = value
    if EPSILON_AXIS in cell:
        privacy = {**privacy, "epsilon_budget": cell[EPSILON_AXIS]} if cell[EPSILON_AXIS] else {}
    if privacy:
        config.update(method.private_config)
        config.update(method.epsilon_config.get(str(cell.get(EPSILON_AXIS)), {}))
        # Each organization then keeps its own exact figures in its artifacts (own_final_test_accuracy): its
        # uploads withhold them.
        artifacts = True
    return LocalRunOptions(
        algorithms=(method.algorithm,), seed=seed, rounds=rounds or method.rounds or grid.rounds,
        models=method.models, latent_dim=method.latent_dim, artifacts=artifacts, quiet=True, timeout=4 * 3600,
        extra_algorithm_config={method.algorithm: config}, timing=grid.throughput, privacy=privacy, **settings,
    )


@dataclass
class _CpuProbe:
    """The aggregator's CPU seconds when round 2 opens and when training ends (sampled at Status polls)."""

    marks: dict[str, tuple[float, float]] = field(default_factory=dict)

    def __call__(self, fed: LocalFederation, status: list[RunStatus]) -> None:
        if fed.aggregator is None or not status:
            return
        run = status[0]
        if "start" not in self.marks and run.round >= 2:
            self.marks["start"] = (time.monotonic(), _cpu_seconds(fed.aggregator.pid))
        if "start" in self.marks and "end" not in self.marks and run.phase is not Phase.TRAIN:
            self.marks["end"] = (time.monotonic(), _cpu_seconds(fed.aggregator.pid))

    def rate(self) -> float | None:
        """The aggregator's CPU seconds per wall second while training."""
        if "start" not in self.marks or "end" not in self.marks:
            return None
        (t0, c0), (t1, c1) = self.marks["start"], self.marks["end"]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else None


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def steady_bytes(summary: Mapping[str, Any]) -> float:
    """Mean bytes (up + down) per training round after the first (which has no global state to send down)."""
    last = summary["rounds"][-1]["round"]
    rounds = [r for r in summary["rounds"] if 2 <= r["round"] < last] or [r for r in summary["rounds"] if r["round"] >= 1]
    return statistics.fmean(sum(r["bytes_up"].values()) + sum(r["bytes_down"].values()) for r in rounds)


def throughput(summary: Mapping[str, Any], aggregator_rate: float | None) -> dict[str, float]:
    """Rounds per second over loopback and where the CPU and wall time go (rounds 2..T, from client timing)."""
    train = [r for r in summary["rounds"] if r["round"] >= 2][:-1]
    if len(train) < 2:
        return {}
    a, b = train[0]["per_organization"], train[-1]["per_organization"]
    keys = ("train_cpu_seconds", "train_wall_seconds", "process_cpu_seconds")
    # Under [privacy] an organization withholds its timing (it grows with its data): no throughput then.
    if not all(m.get(k, WITHHELD) != WITHHELD for m in (*a.values(), *b.values()) for k in keys):
        return {}
    rounds = train[-1]["round"] - train[0]["round"]
    wall = sum(r["duration_seconds"] for r in train[1:])
    d = {org: {k: b[org][k] - a[org][k] for k in keys} for org in a if org in b}
    clients_cpu = sum(x["process_cpu_seconds"] for x in d.values())
    train_cpu = sum(x["train_cpu_seconds"] for x in d.values())
    aggregator_cpu = aggregator_rate * wall if aggregator_rate is not None else float("nan")
    walls = [x["train_wall_seconds"] / wall for x in d.values()]
    return {
        "rounds_per_second": rounds / wall,
        "train_cpu_ms_per_round": 1000 * train_cpu / rounds,
        "client_other_cpu_ms_per_round": 1000 * (clients_cpu - train_cpu) / rounds,
        "aggregator_cpu_ms_per_round": 1000 * aggregator_cpu / rounds,
        "cpu_share_outside_training": 1 - train_cpu / (clients_cpu + aggregator_cpu),
        "wall_share_in_training_slowest": max(walls),
        "wall_share_in_training_mean": statistics.fmean(walls),
    }


def _over_organizations(kind: str, key: str, report: Mapping[str, Mapping[str, float]]) -> float | None:
    """A per-organization figure over one round's reports: their mean, or pooled (weighted by test examples)."""
    # An organization that withheld the figure (or its test count, to pool) under its privacy settings is left out.
    if kind == "mean":
        values = [m[key] for m in report.values() if key in m and m[key] != WITHHELD]
        return statistics.fmean(values) if values else None
    shown = [m for m in report.values() if key in m and WITHHELD not in (m[key], m["num_test_examples"])]
    n = sum(m["num_test_examples"] for m in shown)
    return sum(m[key] * m["num_test_examples"] for m in shown) / n if n else None


def per_round(kind: str, key: str, summary: Mapping[str, Any]) -> dict[int, float]:
    """A per-organization figure (``mean`` or ``pooled``) of every evaluated round, by the round it scores.

    A round's reports count once per evaluated round (the later report wins: an evaluate round repeats the last
    training round's with more figures); rounds where no organization reports ``key`` are left out.
    """
    out: dict[int, float] = {}
    for entry in summary["rounds"]:
        report = entry["per_organization"]
        value = _over_organizations(kind, key, report) if report else None
        if value is None:
            continue
        evaluated = [m["evaluated_round"] for m in report.values() if key in m and "evaluated_round" in m]
        out[int(max(evaluated)) if evaluated else int(entry["round"])] = value
    return out


def best_rounds_mean(values: Mapping[int, float], n: int) -> float | None:
    """The mean of the ``n`` largest values (all of them when fewer were evaluated); None when there are none."""
    top = sorted(values.values(), reverse=True)[:n]
    return statistics.fmean(top) if top else None


def at_lowest(values: Mapping[int, float], selector: Mapping[int, float]) -> float | None:
    """``values`` at the round where ``selector`` is lowest among the rounds both hold, the later round on ties;
    None when no round holds both."""
    best: int | None = None
    for r in sorted(set(values) & set(selector)):
        if best is None or selector[r] <= selector[best]:
            best = r
    return None if best is None else values[best]


def figure_value(fig: GridFigure, summary: Mapping[str, Any], workdir: Path, seed: int) -> float | None:
    """One figure of one federation's summary."""
    final = summary["rounds"][-1]["per_organization"]
    kind, _, key = fig.source.partition(":")
    if fig.source == "bytes_per_round":
        return steady_bytes(summary)
    if fig.source == "epsilon":
        eps = (summary.get("privacy") or {}).get("epsilon_max")
        return None if eps is None else float(eps)
    if kind == "figure":
        value = summary["final_figures"].get(key)
        return None if value in (None, WITHHELD) else float(value)
    if kind in ("mean", "pooled"):
        if fig.best_rounds:
            return best_rounds_mean(per_round(kind, key, summary), fig.best_rounds)
        if fig.at_lowest:
            by_kind, _, by_key = fig.at_lowest.partition(":")
            return at_lowest(per_round(kind, key, summary), per_round(by_kind, by_key, summary))
        return _over_organizations(kind, key, final)
    if kind == "diagnostic":
        from hetfed.client.catalog import diagnostic

        return diagnostic(key, workdir, summary, seed)
    value = summary.get(fig.source)
    return None if value in (None, WITHHELD) else float(value)  # a withheld figure has no number


def federation_dir(root: Path, method: Method, cell: Mapping[str, Any], seed: int) -> Path:
    """Where one federation of a grid runs (its logs and, with artifacts, its clients' snapshots)."""
    return root / "-".join([method.id, *(f"{k}{v}" for k, v in cell.items()), f"s{seed}"]).replace("/", "_")


def run_federation(grid: Grid, method: Method, cell: Mapping[str, Any], seed: int, root: Path,
                   rounds: int | None = None) -> dict[str, Any]:
    """One federation of the grid; returns its row of measurements."""
    workdir = federation_dir(root, method, cell, seed)
    workdir.mkdir(parents=True, exist_ok=True)
    artifacts = grid.artifacts or any(f.source.startswith("diagnostic:") for f in grid.figures)
    probe = _CpuProbe()
    t0 = time.monotonic()
    (summary,) = federate(federation_options(grid, method, cell, seed, artifacts=artifacts, rounds=rounds),
                          workdir, on_status=probe)
    wall = time.monotonic() - t0
    figures = {f.key: figure_value(f, summary, workdir, seed) for f in grid.figures}
    row = {"method": method.id, "cell": dict(cell), "seed": seed, "wall_seconds": wall,
           "rounds": summary["rounds"][-1]["round"], "figures": figures}
    if grid.throughput:
        row["throughput"] = throughput(summary, probe.rate())
    if left := (summary.get("privacy") or {}).get("budget_spent"):
        row["budget_spent"] = list(left)  # organizations that left: their privacy budget was spent
    shown = "  ".join(f"{f.label} {_num(figures[f.key], f.percent)}" for f in grid.figures)
    print(f"  {method.label:<26} {' '.join(f'{k}={v}' for k, v in cell.items())} seed={seed}  {shown}  "
          f"{wall:5.0f}s", flush=True)
    return row


def run_bytes_reference(grid: Grid, ref: BytesReference, root: Path) -> float:
    """Bytes per training round of a short reference federation."""
    method = Method(id=f"ref-{ref.algorithm}", label=ref.label, algorithm=ref.algorithm, models=ref.models,
                    latent_dim=ref.latent_dim, rounds=ref.rounds, config=ref.config)
    cell = grid.cells()[0] if grid.axes else {}
    workdir = root / f"bytes-{ref.algorithm}-{'_'.join(ref.models) or 'default'}"
    workdir.mkdir(parents=True, exist_ok=True)
    (summary,) = federate(federation_options(grid, method, cell, grid.seeds[0], artifacts=False, rounds=ref.rounds),
                          workdir)
    return steady_bytes(summary)
