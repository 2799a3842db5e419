"""Claims as paired per-seed differences against their baseline: the mean, a 95% confidence interval (Student's t)
and how many seeds clear the margin, so a fragile claim shows as fragile."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetfed.cli.reproduce.grids import Claim, Grid, _matches

# Two-sided 95% quantiles of Student's t by degrees of freedom (1..30); beyond, the normal's 1.96.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


def mean_ci(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, lower, upper) of a 95% confidence interval for the mean (Student's t; one value: no width)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, m, m
    half = (_T95[len(values) - 2] if len(values) - 1 <= len(_T95) else 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return m, m - half, m + half


@dataclass(frozen=True)
class ClaimResult:
    """A claim checked on the measurements of one cell."""

    claim: Claim
    cell: dict[str, Any]
    baseline: str
    differences: dict[int, float]  # seed -> method − baseline (in the figure's units: points for percentages)
    mean: float
    lower: float
    upper: float
    clearing: int

    @property
    def verdict(self) -> str:
        """holds (the whole 95% interval clears the margin), holds on average only, or fails; no verdict from
        a single seed, which gives no interval."""
        if len(self.differences) < 2:
            return "no verdict (one seed, no interval)"
        if self.lower >= self.claim.margin:
            return "holds"
        if self.mean >= self.claim.margin:
            return "holds on average only (fragile)"
        return "fails"


def _values(rows: Sequence[Mapping[str, Any]], method: str, figure: str, cell: Mapping[str, Any]) -> dict[int, float]:
    return {r["seed"]: r["figures"][figure] for r in rows
            if r["method"] == method and r["cell"] == dict(cell) and r["figures"].get(figure) is not None}


def _averaged(rows: Sequence[Mapping[str, Any]], method: str, figure: str,
              cells: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """Per seed, the mean of a method's figure over ``cells`` (seeds measured in every one of them)."""
    per_cell = [_values(rows, method, figure, c) for c in cells]
    seeds = set.intersection(*(set(v) for v in per_cell)) if per_cell else set()
    return {s: statistics.fmean(v[s] for v in per_cell) for s in sorted(seeds)}


def _averaged_name(cells: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The label of a group of cells: each axis that varies among them as 'mean of a, b'."""
    out: dict[str, Any] = {}
    for k in cells[0] if cells else ():
        values = list(dict.fromkeys(c[k] for c in cells))
        out[k] = values[0] if len(values) == 1 else "mean of " + ", ".join(map(str, values))
    return out


def check_claims(grid: Grid, rows: Sequence[Mapping[str, Any]]) -> list[ClaimResult]:
    """Every claim on every cell it applies to (or on their average), paired by seed against the baseline
    with the higher mean."""
    out = []
    scale = {f.key: 100.0 if f.percent else 1.0 for f in grid.figures}
    for claim in grid.claims:
        cells = [c for c in grid.cells() or [{}] if _matches(c, claim.where)]
        groups: list[tuple[dict[str, Any], list[dict[str, Any]]]] = (
            [(_averaged_name(cells), cells)] if claim.average_cells and cells else [(c, [c]) for c in cells])
        for cell, members in groups:
            mine = _averaged(rows, claim.method, claim.figure, members)
            bfig = claim.baseline_figure or claim.figure
            candidates = {b: _averaged(rows, b, bfig, members) for b in claim.baselines}
            candidates = {b: v for b, v in candidates.items() if v}
            if not mine or not candidates:
                continue
            best = max(candidates, key=lambda b: statistics.fmean(candidates[b].values()))
            seeds = sorted(set(mine) & set(candidates[best]))
            if not seeds:
                continue
            diffs = {s: scale[claim.figure] * mine[s] - scale[bfig] * candidates[best][s] for s in seeds}
            m, lo, hi = mean_ci(list(diffs.values()))
            out.append(ClaimResult(claim, dict(cell), best, diffs, m, lo, hi,
                                   sum(d >= claim.margin for d in diffs.values())))
    return out
