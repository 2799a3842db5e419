"""Write docs/algorithms/README.md, the index of every registered algorithm and preset, from the registry.

    python scripts/algorithm_index.py [--check]

One row per spec of ``hetfed.wire.specs.REGISTERED`` (hetfed's own; not those ``HETFED_ALGORITHMS`` adds): its summary, the payload kinds each way, and where each of its
parts lives (spec, server half, client half, ``hetfed run`` defaults, reproduction grids, page), read from the
objects themselves: a half's file is the file of the class bound to the spec. ``--check`` writes nothing and
exits 1 when the committed index differs; ``tests/test_algorithm_index.py`` runs the same comparison.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INDEX = REPO / "docs" / "algorithms" / "README.md"
EXPERIMENTS = REPO / "services" / "hetfed" / "cli" / "experiments"
GENERATOR = "python scripts/algorithm_index.py"


def _link(path: Path, text: str | None = None) -> str:
    """A Markdown link from docs/algorithms/ to ``path`` (a file or folder of this repository)."""
    rel = path.relative_to(REPO).as_posix()
    shown = text or rel.removeprefix("proto/").removeprefix("services/").removeprefix("clients/")
    return f"[`{shown}`]({Path(os.path.relpath(path, INDEX.parent)).as_posix()})"


def _in_repo(path: Path) -> Path:
    """``path`` in this checkout: the module may have been imported from another one (an editable install)."""
    parts = path.parts
    roots = [i for i, part in enumerate(parts) if part in ("proto", "services", "clients")]
    return REPO.joinpath(*parts[roots[-1]:]) if roots else path


def _source(cls: type) -> Path:
    """The file a class is defined in; a half in a package's ``client.py`` is shown as its package (its losses
    live beside it)."""
    path = _in_repo(Path(inspect.getsourcefile(cls) or "").resolve())
    if path.name == "client.py" and (path.parent / "__init__.py").exists():
        return path.parent
    return path


def _spec_module(spec: object) -> Path:
    """The module that defines ``spec``: the one holding its config type, else any spec module naming it."""
    first = sys.modules[spec.config_type.__module__]  # type: ignore[attr-defined]
    modules = [first, *(m for name, m in sorted(sys.modules.items()) if name.startswith("hetfed.wire.specs."))]
    home = next((m for m in modules if any(value is spec for value in vars(m).values())), first)
    return _in_repo(Path(inspect.getsourcefile(home) or "").resolve())


def _grids(families: set[str]) -> dict[str, list[Path]]:
    """Each family's grids: ``<family>.bench.toml`` and ``<family>_*.bench.toml``, a grid going to the longest
    family name it starts with (``fedavg_head_x`` is fedavg_head's, not fedavg's)."""
    out: dict[str, list[Path]] = {f: [] for f in families}
    for grid in sorted(EXPERIMENTS.glob("*.bench.toml")):
        stem = grid.name.removesuffix(".bench.toml")
        owners = [f for f in families if stem == f or stem.startswith(f + "_")]
        if owners:
            out[max(owners, key=len)].append(grid)
    return out


def _kinds(kinds: frozenset) -> str:  # type: ignore[type-arg]
    return ", ".join(sorted(k.value for k in kinds)) or "none"


def render() -> str:
    """The index's Markdown."""
    from hetfed.aggregator.algorithms import server_half_type
    from hetfed.cli.experiments.algorithms import docs_page, experiment
    from hetfed.client.algorithms import client_half_type
    from hetfed.wire.specs import REGISTERED

    grids = _grids({spec.family for spec in REGISTERED})
    lines = [
        "# The algorithms",
        "",
        f"Generated from the registry (`hetfed.wire.specs.REGISTERED`) by `{GENERATOR}`; do not edit it by hand.",
        "`tests/test_algorithm_index.py` fails when this page differs from a fresh generation.",
        "",
        "An algorithm is one name across the three roots: its spec in `proto/hetfed/wire/specs/<name>.py`, its",
        "server half in `services/hetfed/aggregator/algorithms/`, its client half (and its losses) in",
        "`clients/hetfed/client/algorithms/`, each half bound to the spec by `@SPEC.server_half` or",
        "`@SPEC.client_half`. A preset shares its algorithm's halves, page and grids.",
        "How to add one: [adding.md](adding.md).",
        "",
        "## What crosses the wire",
        "",
        "| algorithm | preset of | summary | setup upload | upload | download |",
        "|---|---|---|---|---|---|",
    ]
    for spec in REGISTERED:
        lines.append(f"| `{spec.name}` | {f'`{spec.preset_of}`' if spec.preset_of else ''} | {spec.summary} | "
                     f"{_kinds(spec.setup_upload) if spec.setup_upload else ''} | {_kinds(spec.upload)} | "
                     f"{_kinds(spec.download)} |")
    lines += [
        "",
        "## Where its parts live",
        "",
        "Defaults: training settings are the spec's config (its dataclass and presets); the `hetfed run` settings per "
        "dataset (`*` is any dataset) are in the experiment module named after the algorithm.",
        "",
        "| algorithm | spec | server half | client half | defaults | grids | page |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec in REGISTERED:
        entry = experiment(spec)
        defaults = (f"{_link(EXPERIMENTS / f'{spec.family}.py')} ({', '.join(f'`{d}`' for d in entry.defaults)})"
                    if entry.defaults else "")
        page = REPO / "docs" / docs_page(spec)
        lines.append(" | ".join([
            f"| `{spec.name}`",
            _link(_spec_module(spec)),
            _link(_source(server_half_type(spec))),
            _link(_source(client_half_type(spec))),
            defaults,
            ", ".join(_link(g, g.name) for g in grids[spec.family]),
            _link(page, page.name) if page.exists() else "",
        ]) + " |")
    owned = {g for paths in grids.values() for g in paths}
    comparisons = [g for g in sorted(EXPERIMENTS.glob("*.bench.toml")) if g not in owned]
    if comparisons:
        lines += [
            "",
            "## Comparisons across algorithms",
            "",
            "Grids named after no algorithm: each runs several algorithms on one setting (`hetfed bench NAME`).",
            "",
            "| grid | compares | results |",
            "|---|---|---|",
        ]
        for grid in comparisons:
            declared = tomllib.loads(grid.read_text())
            algorithms = sorted({m["algorithm"] for m in declared.get("methods", [])})
            results = REPO / declared["results"]
            lines.append(f"| {_link(grid, grid.name)} | {', '.join(f'`{a}`' for a in algorithms)} | "
                         f"{_link(results, results.name)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed index is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not INDEX.exists() or INDEX.read_text() != text:
            print(f"{os.path.relpath(INDEX, REPO)} is stale: run {GENERATOR}", file=sys.stderr)
            return 1
        return 0
    INDEX.write_text(text)
    print(f"wrote {os.path.relpath(INDEX, REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
