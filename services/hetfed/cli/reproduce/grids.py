"""A reproduction grid as data: its methods, axes, figures, the paper's numbers and its claims, loaded from the
``<name>.bench.toml`` files of the experiment package (``hetfed.cli.experiments``) and validated."""

from __future__ import annotations

import itertools
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from hetfed.wire.config import from_mapping

GRID_SUFFIX = ".bench.toml"

# The axis whose value v is every organization's privacy budget (privacy.epsilon_budget = v); 0: no differential
# privacy in that cell (the method's privacy table is left out too).
EPSILON_AXIS = "epsilon"


@dataclass(frozen=True)
class Method:
    """One method compared: an algorithm with its architectures, config and data settings."""

    id: str
    label: str
    algorithm: str
    models: tuple[str, ...] = ()
    latent_dim: int | None = None
    rounds: int | None = None
    config: dict[str, Any] = field(default_factory=dict)
    # LocalRunOptions fields for this method only (for example train_on_public for a pooled-data baseline).
    options: dict[str, Any] = field(default_factory=dict)
    # Every organization's [privacy] fields (differential privacy, as hetfed run's --set privacy.FIELD=VALUE).
    privacy: dict[str, Any] = field(default_factory=dict)
    # Algorithm config fields for the cells under differential privacy only, over ``config`` (DP-SGD's clipped
    # gradients usually want their own step size).
    private_config: dict[str, Any] = field(default_factory=dict)
    # Algorithm config fields for the cells of one privacy budget, keyed by the ε axis value as written ("3"),
    # over ``private_config`` (a share of the budget a run-wide mechanism plans, as Fed-CMA's ddp_epsilon).
    epsilon_config: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Axis:
    """A setting the grid varies: a LocalRunOptions field (``alpha``), an algorithm config field
    (``config.mu``), a data field (``data.target_domain``), a privacy field (``privacy.clip_norm``) or the
    privacy budget (``epsilon``: privacy.epsilon_budget, 0 for no differential privacy), over these values."""

    name: str
    values: tuple[int | float | str, ...]  # int first: a whole number stays an int (a domain index)


@dataclass(frozen=True)
class GridFigure:
    """A figure every federation reports.

    ``source``: a key of the run's summary (``final_test_accuracy``; ``own_final_test_accuracy``, from the
    organizations' own records, which stays a number under differential privacy), ``figure:<key>`` (the algorithm's
    declared figure), ``mean:<key>`` (mean over organizations of a per-organization figure of the final
    report), ``pooled:<key>`` (the same, weighted by each organization's test examples), ``bytes_per_round``
    (up + down per training round after the first), ``epsilon`` (the ε spent by the end of the run, the largest
    of any organization; none without differential privacy), or ``diagnostic:<name>`` (computed from the
    clients' local snapshots by ``hetfed.client.diagnostics``).
    """

    key: str
    label: str
    source: str
    # Shown as a percentage (×100) with two decimals; else as a number.
    percent: bool = True
    # 0: the final report. N > 0 (``mean:``/``pooled:`` sources): the mean of the N best evaluated rounds, each
    # round's figure taken over the organizations that report it (FedGen's statistic: utils/plot_utils.py, TOP_N = 5).
    best_rounds: int = 0
    # "" : the final report. ``mean:<key>`` or ``pooled:<key>`` (``mean:``/``pooled:`` sources): the figure at the
    # evaluated round where that per-organization figure is lowest, the later round on ties (model selection by a
    # validation loss, with the ``<=`` of the reference code that does it: docs/benchmarks.md names it).
    at_lowest: str = ""

    def __post_init__(self) -> None:
        if self.best_rounds < 0:
            raise ValueError(f"figure {self.key!r}: best_rounds must be >= 0, got {self.best_rounds}")
        for name, on in (("best_rounds", bool(self.best_rounds)), ("at_lowest", bool(self.at_lowest))):
            if on and self.source.partition(":")[0] not in ("mean", "pooled"):
                raise ValueError(f"figure {self.key!r}: {name} needs a 'mean:' or 'pooled:' source, got {self.source!r}")
        if self.best_rounds and self.at_lowest:
            raise ValueError(f"figure {self.key!r}: best_rounds and at_lowest select rounds differently; give one")
        kind, _, key = self.at_lowest.partition(":")
        if self.at_lowest and (kind not in ("mean", "pooled") or not key):
            raise ValueError(f"figure {self.key!r}: at_lowest must be 'mean:<key>' or 'pooled:<key>', "
                             f"got {self.at_lowest!r}")


@dataclass(frozen=True)
class PaperValue:
    """A number the paper reports for a method's figure (in the cell that ``where`` selects)."""

    method: str
    figure: str
    value: float
    where: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Claim:
    """method's figure − the better baseline's figure ≥ margin (points for percentages), paired by seed.

    Checked in every cell ``where`` selects (a list value selects any of its values), or, with
    ``average_cells``, once over all of them: each seed's difference is then its mean over those cells.
    """

    text: str
    method: str
    figure: str
    baselines: tuple[str, ...]
    margin: float
    baseline_figure: str = ""
    where: dict[str, Any] = field(default_factory=dict)
    average_cells: bool = False


@dataclass(frozen=True)
class BytesReference:
    """A short federation run only to count the bytes per round a method is compared with."""

    label: str
    algorithm: str
    models: tuple[str, ...] = ()
    latent_dim: int | None = None
    rounds: int = 3
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Grid:
    """A reproduction: what runs, what is measured, what the paper says and what is claimed."""

    name: str
    title: str
    paper: str
    results: str
    seeds: tuple[int, ...]
    rounds: int
    methods: tuple[Method, ...]
    figures: tuple[GridFigure, ...]
    # LocalRunOptions fields shared by every federation (dataset, partition, clients, ...).
    data: dict[str, Any] = field(default_factory=dict)
    axes: tuple[Axis, ...] = ()
    tuning_seeds: tuple[int, ...] = ()
    paper_values: tuple[PaperValue, ...] = ()
    claims: tuple[Claim, ...] = ()
    bytes_references: tuple[BytesReference, ...] = ()
    # Report iterations per second and the share of CPU and wall time outside training.
    throughput: bool = False
    # Also tabulate every method's figures averaged over all cells (per seed, then mean ± std over seeds).
    mean_over_cells: bool = False
    # Clients write their local snapshots (model state, probe latents) into each federation's directory
    # (always when a figure is a diagnostic); pictures are drawn from them afterwards.
    artifacts: bool = False
    summary: str = ""

    def __post_init__(self) -> None:
        ids = {m.id for m in self.methods}
        figures = {f.key for f in self.figures}
        for c in self.claims:
            for name in (c.method, *c.baselines):
                if name not in ids:
                    raise ValueError(f"{self.name}: claim {c.text!r} names unknown method {name!r}")
            for fig in (c.figure, c.baseline_figure or c.figure):
                if fig not in figures:
                    raise ValueError(f"{self.name}: claim {c.text!r} names unknown figure {fig!r}")
        for p in self.paper_values:
            if p.method not in ids or p.figure not in figures:
                raise ValueError(f"{self.name}: paper value for unknown method/figure {p.method}/{p.figure}")

    def cells(self) -> list[dict[str, Any]]:
        """Every combination of the axes' values."""
        names = [a.name for a in self.axes]
        return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(a.values for a in self.axes))]

    def method(self, method_id: str) -> Method:
        """The method with this id."""
        return next(m for m in self.methods if m.id == method_id)


def grids() -> dict[str, Path]:
    """Every declared reproduction grid, by name (the file's stem)."""
    folder = resources.files("hetfed.cli.experiments")
    out = {}
    for entry in folder.iterdir():
        if entry.name.endswith(GRID_SUFFIX):
            out[entry.name[: -len(GRID_SUFFIX)]] = Path(str(entry))
    return dict(sorted(out.items()))


def load_grid(name: str) -> Grid:
    """The grid named ``name``, validated."""
    path = grids()[name]
    data = tomllib.loads(path.read_text())
    return from_mapping(Grid, {"name": name, **data}, path.name)


def _matches(cell: Mapping[str, Any], where: Mapping[str, Any]) -> bool:
    return all(cell.get(k) in v if isinstance(v, list | tuple) else cell.get(k) == v for k, v in where.items())


def select_cells(grid: Grid, filters: Sequence[str]) -> list[dict[str, Any]]:
    """The grid's cells that every ``AXIS=V[,V...]`` filter admits (values matched as the axis spells them)."""
    axes = {a.name: a for a in grid.axes}
    cells = grid.cells() or [{}]
    for item in filters:
        name, sep, values = item.partition("=")
        if not sep or name not in axes:
            raise ValueError(f"--cell expects AXIS=V[,V...] with AXIS one of {', '.join(axes) or 'none'}, got {item!r}")
        wanted = values.split(",")
        known = {str(v) for v in axes[name].values}
        if unknown := [v for v in wanted if v not in known]:
            raise ValueError(f"--cell {name}: {', '.join(unknown)} not among {', '.join(sorted(known))}")
        cells = [c for c in cells if str(c[name]) in wanted]
    return cells
