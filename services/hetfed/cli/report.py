"""``hetfed report``: accuracy against cumulative bytes, one curve per algorithm, and a Markdown table.

Runs under differential privacy (results.json's ``privacy``) add a second panel, accuracy against the ε spent so
far (the largest of any organization), and a line of accuracy at the final ε to the table.

Input is one or more ``results.json`` files written by ``hetfed run --output DIR``, or a Prometheus that
scraped an aggregator (``--prometheus URL``: the ``hetfed_run_*`` families). matplotlib is imported only
when a plot is drawn (it comes with the client extra; the aggregator never needs it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetfed.cli.experiments import bytes_reference
from hetfed.cli.prom import PNG_KEY, prom_query, prom_range
from hetfed.wire.payloads import WITHHELD

X_LABEL = "cumulative bytes (up + down, log scale)"
Y_LABEL = "test accuracy"
EPSILON_LABEL = "ε spent (largest of any organization)"
EPSILON_TITLE = "Accuracy against privacy"


@dataclass
class RunCurve:
    """One run's figures for the report: its accuracy-vs-bytes points and its totals."""

    run: str
    algorithm: str
    source: str
    points: list[tuple[float, float]] = field(default_factory=list)  # (cumulative bytes, accuracy)
    final_accuracy: float | None = None
    bytes_up: float = 0.0
    bytes_down: float = 0.0
    bytes_per_train_round: float = 0.0
    label: str = ""
    # Under differential privacy: (ε spent by the end of the round, accuracy), ε the largest of any organization.
    epsilon_points: list[tuple[float, float]] = field(default_factory=list)
    # The largest ε any organization spent in the run (None without DP).
    epsilon: float | None = None
    # Every organization withheld its final accuracy (docs/privacy.md): the report says "withheld", not a number.
    withheld: bool = False


def curve_from_summary(summary: dict[str, Any], source: str) -> RunCurve:
    """A run of results.json: each round's reported accuracy against the bytes moved by the end of that round."""
    final = summary.get("final_test_accuracy")
    c = RunCurve(summary["run"], summary["algorithm"], source,
                 final_accuracy=float(final) if isinstance(final, int | float) else None,
                 bytes_up=summary["bytes_up_total"], bytes_down=summary["bytes_down_total"],
                 bytes_per_train_round=summary["bytes_per_train_round"], withheld=final == WITHHELD)
    total = 0
    spent: dict[str, float] = {}  # organization -> the last ε it reported
    for r in summary["rounds"]:
        total += sum(r["bytes_up"].values()) + sum(r["bytes_down"].values())
        spent.update({org: float(m["privacy_epsilon"]) for org, m in r.get("per_organization", {}).items()
                      if "privacy_epsilon" in m})
        if isinstance(r.get("test_accuracy"), int | float):  # a withheld round has no point
            c.points.append((float(total), float(r["test_accuracy"])))
            if spent:
                c.epsilon_points.append((max(spent.values()), float(r["test_accuracy"])))
    eps = (summary.get("privacy") or {}).get("epsilon_max")
    c.epsilon = float(eps) if eps is not None else (max(spent.values()) if spent else None)
    return c


def load_results(paths: list[Path]) -> list[RunCurve]:
    """Every run of every results.json."""
    out = []
    for p in paths:
        try:
            data = json.loads(p.read_text())
            runs = data["runs"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{p}: not a hetfed results.json ({exc})") from None
        out += [curve_from_summary(r, str(p)) for r in runs]
    return out


def curves_from_prometheus(url: str, start: float, end: float, step: float) -> list[RunCurve]:
    """Runs as a Prometheus holds them: accuracy against the run's cumulative bytes at each step."""
    key = ("run", "algorithm")
    acc = prom_range(url, "hetfed_run_test_accuracy", start, end, step)
    total = prom_range(url, "sum by (run, algorithm) (hetfed_run_bytes_total)", start, end, step)
    runs: dict[tuple[str, str], RunCurve] = {}
    for s in total:
        k = tuple(s["metric"].get(n, "") for n in key)
        runs[k] = RunCurve(k[0], k[1], url)  # type: ignore[index]
    by_time = {tuple(s["metric"].get(n, "") for n in key): dict(s["values"]) for s in total}
    for s in acc:
        k = tuple(s["metric"].get(n, "") for n in key)
        if k not in runs:
            continue
        for t, v in s["values"]:
            b = by_time[k].get(t)
            point = (float(b), float(v)) if b is not None else None
            if point is not None and (not runs[k].points or runs[k].points[-1] != point):  # type: ignore[index]
                runs[k].points.append(point)  # type: ignore[index]

    def latest(query: str) -> dict[tuple[str, ...], float]:
        return {tuple(s["metric"].get(n, "") for n in key): float(s["value"][1])
                for s in prom_query(url, f"last_over_time(({query})[{int(end - start) + 1}s:{max(1, int(step))}s])",
                                    at=end)}

    final = latest("hetfed_run_final_test_accuracy")
    up = latest('sum by (run, algorithm) (hetfed_run_bytes_total{direction="up"})')
    down = latest('sum by (run, algorithm) (hetfed_run_bytes_total{direction="down"})')
    per_round = latest('sum by (run, algorithm) (hetfed_run_bytes_total{phase="train"}) / '
                       'sum by (run, algorithm) (hetfed_run_rounds_closed_total{phase="train"})')
    for k, c in runs.items():
        c.final_accuracy = final.get(k)
        c.bytes_up, c.bytes_down, c.bytes_per_train_round = up.get(k, 0.0), down.get(k, 0.0), per_round.get(k, 0.0)
    return sorted(runs.values(), key=lambda c: (c.algorithm, c.run))


# ------------------------------------------------------------------ table and plot
def _labels(curves: list[RunCurve]) -> None:
    """One label per curve: the algorithm, qualified by run (and file) only where algorithms repeat."""
    for c in curves:
        same = [d for d in curves if d.algorithm == c.algorithm]
        if len(same) == 1:
            c.label = c.algorithm
        elif len({d.run for d in same}) == len(same):
            c.label = f"{c.algorithm} ({c.run})"
        else:
            c.label = f"{c.algorithm} ({c.run}, {Path(c.source).parent.name or c.source})"


def reference_run(c: RunCurve, curves: list[RunCurve]) -> RunCurve | None:
    """The run of the bytes reference (the experiments' ``bytes_reference``) to compare ``c`` with: from the same
    source when there is one, else the first."""
    name, _ = bytes_reference()
    refs = [d for d in curves if name and d.algorithm == name and d.bytes_per_train_round > 0]
    same = [d for d in refs if d.source == c.source]
    return (same or refs)[0] if refs else None


def fmt_bytes(n: float) -> str:
    """Bytes in B, KB, MB or GB (powers of 1000)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def _missing(c: RunCurve) -> str:
    """A run's final accuracy where it has no number: withheld by every organization, or not reported."""
    return WITHHELD if c.withheld else "-"


def markdown_table(curves: list[RunCurve]) -> str:
    """Final accuracy, bytes up and down, bytes per train round and the ratio to the bytes reference's, one row
    per run."""
    _labels(curves)
    reference = bytes_reference()[1] or "reference"
    rows = [f"| algorithm | final accuracy | bytes up | bytes down | bytes per round | ratio to {reference} |",
            "|---|---:|---:|---:|---:|---:|"]
    for c in curves:
        ref = reference_run(c, curves)
        ratio = f"{c.bytes_per_train_round / ref.bytes_per_train_round:.3g}x" if ref is not None else "-"
        acc = f"{100 * c.final_accuracy:.2f}%" if c.final_accuracy is not None else _missing(c)
        rows.append(f"| {c.label} | {acc} | {fmt_bytes(c.bytes_up)} | {fmt_bytes(c.bytes_down)} | "
                    f"{fmt_bytes(c.bytes_per_train_round)} | {ratio} |")
    private = [c for c in curves if c.epsilon is not None]
    if private:
        at = "; ".join(f"{c.label} {100 * c.final_accuracy:.2f}% at ε = {c.epsilon:.2f}" if c.final_accuracy is not None
                       else f"{c.label} {_missing(c)} at ε = {c.epsilon:.2f}" for c in private)
        rows += ["", f"Accuracy against ε (the largest any organization spent): {at}."]
    return "\n".join(rows) + "\n"


def plot(curves: list[RunCurve], png: Path, title: str = "Accuracy against communication") -> dict[str, Any]:
    """Draw accuracy against cumulative bytes (log x), one line per curve; returns the description it embeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _labels(curves)
    private = [c for c in curves if c.epsilon_points]
    # A second panel, accuracy against ε, when any run trained under differential privacy.
    fig, axes = plt.subplots(1, 2 if private else 1, figsize=(14 if private else 8, 5), dpi=100, squeeze=False)
    ax = axes[0][0]
    try:
        drawn = [c for c in curves if c.points]
        for c in drawn:
            xs, ys = zip(*c.points, strict=True)
            ax.plot(xs, ys, marker="o", markersize=3, label=c.label)
        ax.set_xscale("log")
        ax.set_xlabel(X_LABEL)
        ax.set_ylabel(Y_LABEL)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if drawn:
            ax.legend()
        desc: dict[str, Any] = {"xlabel": X_LABEL, "ylabel": Y_LABEL, "xscale": "log", "title": title,
                                "lines": [{"label": c.label, "points": len(c.points)} for c in drawn]}
        if private:
            eps_ax = axes[0][1]
            for c in private:
                xs, ys = zip(*c.epsilon_points, strict=True)
                eps_ax.plot(xs, ys, marker="o", markersize=3, label=c.label)
            eps_ax.set_xlabel(EPSILON_LABEL)
            eps_ax.set_ylabel(Y_LABEL)
            eps_ax.set_title(EPSILON_TITLE)
            eps_ax.grid(True, alpha=0.3)
            eps_ax.legend()
            fig.tight_layout()
            desc["epsilon_panel"] = {"xlabel": EPSILON_LABEL, "ylabel": Y_LABEL, "xscale": "linear",
                                     "title": EPSILON_TITLE,
                                     "lines": [{"label": c.label, "points": len(c.epsilon_points),
                                                "epsilon": c.epsilon} for c in private]}
        png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(png, metadata={"Title": title, PNG_KEY: json.dumps(desc)})
    finally:
        plt.close(fig)
    return desc


def write_report(results: list[Path], out_dir: Path) -> Path:
    """``report.png`` and ``report.md`` in ``out_dir`` from results.json files; returns the PNG's path."""
    curves = load_results(results)
    png = out_dir / "report.png"
    plot(curves, png)
    (out_dir / "report.md").write_text(markdown_table(curves))
    return png


# ------------------------------------------------------------------ command
def add_parser(subparsers: Any) -> None:
    """Register ``hetfed report`` on the ``hetfed`` command's subparsers."""
    r = subparsers.add_parser(
        "report", help="plot accuracy against bytes and tabulate communication cost per algorithm",
        description="From results.json files (hetfed run --output DIR) or a Prometheus, write a PNG of accuracy "
        "against cumulative bytes (one curve per algorithm, log-scaled bytes), beside it accuracy against ε when runs "
        "trained under differential privacy, and print a Markdown table.",
    )
    r.add_argument("results", nargs="*", type=Path, help="results.json files")
    r.add_argument("--prometheus", metavar="URL", help="read the hetfed_run_* families from this Prometheus")
    r.add_argument("--since", type=float, default=3600.0,
                   help="with --prometheus: seconds of history to read (default 3600)")
    r.add_argument("--out", type=Path, default=Path("report.png"), help="PNG to write (default report.png)")
    r.add_argument("--markdown", type=Path, help="also write the table to this file")
    r.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """The ``hetfed report`` command."""
    if not args.results and not args.prometheus:
        print("hetfed report: give results.json files or --prometheus URL", file=sys.stderr)
        return 2
    try:
        curves = load_results(args.results)
        if args.prometheus:
            end = time.time()
            step = float(max(1, int(args.since / 600)))  # whole seconds: PromQL durations are integers
            curves += curves_from_prometheus(args.prometheus, end - args.since, end, step)
    except (ValueError, OSError) as exc:
        print(f"hetfed report: {exc}", file=sys.stderr)
        return 2
    plot(curves, args.out)
    table = markdown_table(curves)
    if args.markdown:
        args.markdown.write_text(table)
    print(table, end="")
    print(f"plot: {args.out}")
    return 0
