"""What a local run reports: each run's per-round results and final figures, and the table ``hetfed run`` prints."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hetfed.cli.experiments import experiment
from hetfed.cli.report import fmt_bytes
from hetfed.client.catalog import (
    OWN_FIGURES,
    ClientConfig,
    entry_at,
    read_own_record,
)
from hetfed.wire.messages import RunStatus
from hetfed.wire.payloads import WITHHELD, EvalMetrics
from hetfed.wire.specs import get_spec
from hetfed.wire.traffic import Direction

# What a client under differential privacy adds to each round's reported figures -> the privacy summary's key.
PRIVACY_FIGURES = {"privacy_epsilon": "epsilon", "privacy_delta": "delta", "privacy_noise_multiplier": "noise_multiplier",
                   "privacy_clip_norm": "clip_norm"}


def privacy_summary(rounds: Sequence[Mapping[str, Any]], left: Sequence[str] = ()) -> dict[str, Any]:
    """A run's differential privacy: per organization its last reported ε, δ, σ and C, the largest ε of any
    organization (None without DP), and the organizations that left because their budget was spent."""
    orgs: dict[str, dict[str, float]] = {}
    for r in rounds:
        for org, m in r["per_organization"].items():
            if "privacy_epsilon" in m:
                orgs[org] = {key: float(m[source]) for source, key in PRIVACY_FIGURES.items() if source in m}
    return {
        "organizations": dict(sorted(orgs.items())),
        "epsilon_max": max((o["epsilon"] for o in orgs.values()), default=None),
        "budget_spent": sorted(left),
    }


def _weighted(reports: Mapping[str, EvalMetrics], figure: str, weight: str) -> float | str | None:
    """``figure`` averaged over the organizations that reported it, weighted by ``weight``; WITHHELD when every
    organization that reported withheld it; None without reports or weights."""
    shown = [m for m in reports.values() if m.figure(figure) is not None and m.figure(weight) is not None]
    n = sum(getattr(m, weight) for m in shown)
    if n:
        return sum(getattr(m, figure) * getattr(m, weight) for m in shown) / n
    return WITHHELD if reports and all(m.is_withheld(figure) for m in reports.values()) else None


def _shown(m: EvalMetrics) -> dict[str, Any]:
    """One organization's figures for results.json: a withheld one as WITHHELD."""
    fixed = {name: m.figure(name) for name in ("test_accuracy", "test_loss", "train_loss", "num_test_examples")}
    out: dict[str, Any] = {k: WITHHELD if v is None else (int(v) if k == "num_test_examples" else v)
                           for k, v in fixed.items()}
    return {**out, **dict(m.extra), **{name: WITHHELD for name in m.withheld if name not in out}}


def mean_over(orgs: Mapping[str, Mapping[str, Any]], key: str) -> float | str | None:
    """The mean of ``key`` over the organizations that show a number for it: WITHHELD when every organization
    withheld it, None when one lacks it."""
    if not orgs or any(key not in m for m in orgs.values()):
        return None
    values = [m[key] for m in orgs.values() if m[key] != WITHHELD]
    return sum(values) / len(values) if values else WITHHELD


def summarize_run(status: RunStatus, left: Sequence[str] = ()) -> dict[str, Any]:
    """Per-round results of a finished run and its final figures, as JSON-ready dicts (``left``: organizations
    that left it because their privacy budget was spent). A figure an organization withheld shows as
    ``"withheld"``; means leave those organizations out and name them (``withheld_by``)."""
    spec = get_spec(status.algorithm)
    rounds: list[dict[str, Any]] = []
    for rec in status.history:
        reports = rec.reports
        gaccs = [m.extra["global_test_accuracy"] for m in reports.values() if "global_test_accuracy" in m.extra]
        gwithheld = bool(reports) and all(m.is_withheld("global_test_accuracy") for m in reports.values())
        rounds.append({
            "round": rec.round,
            "clients": rec.clients,
            "duration_seconds": rec.duration_seconds,
            "test_accuracy": _weighted(reports, "test_accuracy", "num_test_examples"),
            "global_test_accuracy": sum(gaccs) / len(gaccs) if gaccs else (WITHHELD if gwithheld else None),
            "train_loss": _weighted(reports, "train_loss", "num_train_examples"),
            # Organizations whose accuracy the means leave out: they withheld it (docs/privacy.md).
            "withheld_by": sorted(org for org, m in reports.items() if m.is_withheld("test_accuracy")),
            "bytes_up": rec.bytes(Direction.UP),
            "bytes_down": rec.bytes(Direction.DOWN),
            "per_organization": {org: _shown(m) for org, m in sorted(reports.items())},
        })
    # The last round anyone reported: a run every organization left (their privacy budgets spent) ends on a round
    # nobody pushed.
    final = next((r for r in reversed(rounds) if r["per_organization"]), rounds[-1] if rounds else {})
    orgs = final.get("per_organization", {})
    train_rounds = [r for r in rounds if r["round"] >= 1][: status.total_rounds]
    total_up = sum(sum(r["bytes_up"].values()) for r in rounds)
    total_down = sum(sum(r["bytes_down"].values()) for r in rounds)
    figures = {f.key: mean_over(orgs, f.source) for f in spec.figures}
    return {
        "run": status.run_id,
        "algorithm": status.algorithm,
        "rounds": rounds,
        "final_test_accuracy": final.get("test_accuracy"),
        "final_global_test_accuracy": final.get("global_test_accuracy"),
        "final_withheld_by": final.get("withheld_by", []),
        # The algorithm's own figures (its spec's), means over organizations in the final report (over those
        # that did not withhold it).
        "final_figures": {k: v for k, v in figures.items() if v is not None},
        "figure_labels": {f.key: experiment(spec).label(f.key) for f in spec.figures},
        "bytes_up_total": total_up,
        "bytes_down_total": total_down,
        "bytes_per_train_round": (
            sum(sum(r["bytes_up"].values()) + sum(r["bytes_down"].values()) for r in train_rounds)
            / max(1, len(train_rounds))
        ),
        "privacy": privacy_summary(rounds, left),
    }


# An organization under [privacy] without an own record (its client had no output_dir): no own figures.
NO_OWN_RECORD = "no own record"


def own_final(summary: Mapping[str, Any], clients: Sequence[ClientConfig], workdir: Path) -> dict[str, Any]:
    """What a run's summary gains from the organizations' own records: ``own_final_test_accuracy``, the final
    test accuracy weighted by test examples, and under [privacy] ``own_final``, each organization's own final
    figures. A local run owns every organization, so it reads their records on this machine; the aggregator saw
    those figures withheld. Without [privacy] the uploads carried the exact figures: ``final_test_accuracy``."""
    if not any(c.privacy.enabled for c in clients):
        return {"own_final_test_accuracy": summary.get("final_test_accuracy")}
    reported = [r for r in summary.get("rounds", []) if r["per_organization"]]
    if not reported:
        return {"own_final_test_accuracy": None, "own_final": {}}
    final = reported[-1]
    dirs = {c.organization: c.output_dir for c in clients}
    figures: dict[str, Any] = {}
    for org in sorted(final["per_organization"]):
        # Clients run with the work directory as their current directory: a relative output_dir is under it.
        folder = dirs.get(org)
        record = read_own_record(workdir / folder / OWN_FIGURES) if folder else None
        entry = entry_at(record, final["round"]) if record is not None else None
        figures[org] = NO_OWN_RECORD if entry is None else entry
    entries = [e for e in figures.values() if e != NO_OWN_RECORD]
    n = sum(e["num_test_examples"] for e in entries)
    mean = sum(e["test_accuracy"] * e["num_test_examples"] for e in entries) / n if n else None
    return {"own_final_test_accuracy": None if len(entries) < len(figures) else mean, "own_final": figures}


def _pct(v: float | str | None) -> str:
    if v == WITHHELD:
        return WITHHELD
    return f"{100 * v:.2f}%" if isinstance(v, int | float) else "-"


TABLE_HEAD = ("algorithm", "own-test acc", "global-test acc", "bytes up", "bytes down", "bytes/round", "time",
              "ε", "figures")


def epsilon_cell(privacy: Mapping[str, Any] | None) -> str:
    """The table's ε: the largest any organization spent, and who left because its budget was spent; — without DP."""
    if not privacy:
        return "—"
    eps = privacy.get("epsilon_max")
    left = privacy.get("budget_spent") or []
    text = f"{eps:.2f}" if eps is not None else "—"
    return text + (f" ({', '.join(left)} left: budget spent)" if left else "")


def table_rows(results: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The final table's rows: accuracy, bytes and the algorithm's own figures per run."""
    rows: list[tuple[str, ...]] = []
    for r in results:
        figures = "  ".join(f"{r['figure_labels'][k]} {_pct(v)}" for k, v in r["final_figures"].items())
        own = _pct(r["final_test_accuracy"])
        withheld_by = r.get("final_withheld_by") or []
        if withheld_by and r["final_test_accuracy"] != WITHHELD:  # a mean that leaves organizations out says so
            own += f" ({len(withheld_by)} withheld)"
        rows.append((
            r["algorithm"], own, _pct(r["final_global_test_accuracy"]),
            fmt_bytes(r["bytes_up_total"]), fmt_bytes(r["bytes_down_total"]), fmt_bytes(r["bytes_per_train_round"]),
            f"{r.get('wall_seconds', 0):.0f}s", epsilon_cell(r.get("privacy")), figures or "-",
        ))
    return rows
