"""Paper reproductions as data: one runner for every algorithm's declared grid, results rendered from JSON.

A grid (``<algorithm>.bench.toml`` in the experiment package, ``hetfed.cli.experiments``) declares the data
settings, the axes of the grid (for example Dirichlet α), the seeds, the methods compared (an algorithm with
its models and config), the figures each federation reports, the paper's numbers and the claims. The runner
starts every federation with the same ``hetfed aggregator`` and ``hetfed client`` processes as ``hetfed
run``, one at a time, and saves every measurement to a JSON file; the results page is rendered from that
file. Every claim is reported as paired per-seed differences against its baseline: their mean, a 95%
confidence interval (Student's t) and how many seeds clear the margin, so a fragile claim shows as fragile.

Its rooms: ``grids`` (the grid as data), ``measuring`` (federations and their figures), ``statistics`` (the
claims), ``pages`` (the Markdown page) and ``command`` (``hetfed bench NAME``). Everything other code uses is
importable from here.
"""

from __future__ import annotations

from hetfed.cli.reproduce.command import main
from hetfed.cli.reproduce.grids import (
    EPSILON_AXIS,
    GRID_SUFFIX,
    Axis,
    BytesReference,
    Claim,
    Grid,
    GridFigure,
    Method,
    PaperValue,
    grids,
    load_grid,
    select_cells,
)
from hetfed.cli.reproduce.measuring import (
    at_lowest,
    best_rounds_mean,
    federation_dir,
    federation_options,
    figure_value,
    per_round,
    run_bytes_reference,
    run_federation,
    steady_bytes,
    throughput,
)
from hetfed.cli.reproduce.pages import BEGIN, END, _settings, portable_command, render, write_page
from hetfed.cli.reproduce.statistics import ClaimResult, check_claims, mean_ci

__all__ = [
    "BEGIN", "END", "EPSILON_AXIS", "GRID_SUFFIX", "Axis", "BytesReference", "Claim", "ClaimResult", "Grid",
    "GridFigure", "Method", "PaperValue", "_settings", "at_lowest", "best_rounds_mean", "check_claims",
    "federation_dir", "federation_options", "figure_value", "grids", "load_grid", "main", "mean_ci", "per_round",
    "portable_command", "render", "run_bytes_reference", "run_federation", "select_cells", "steady_bytes",
    "throughput", "write_page",
]
