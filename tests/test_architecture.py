"""Checks that keep the architecture true: import contracts, generic modules free of algorithm and dataset
names, registries in step with their typed names, every package installed."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The generic layers: every module of the CLI but its experiment settings (hetfed.cli.experiments, which
# declare what each algorithm and dataset uses), the client runtime, the aggregator's rooms and the wire
# package's messages and gRPC adapter.
CLI_MODULES = sorted(str(p.relative_to(REPO)) for p in (REPO / "services/hetfed/cli").glob("*.py"))
# Every module of the aggregator's rooms (run, journal, serving, observe): only the server halves in
# hetfed.aggregator.algorithms name algorithms. Two name the FedAvg baseline every run is compared with: the
# config's declared reference (fedavg_model_bytes) and the collector that exports it.
BASELINE_REFERENCE = {"services/hetfed/aggregator/observe/run_metrics.py"}
AGGREGATOR_ROOMS = sorted(str(p.relative_to(REPO)) for room in ("run", "journal", "serving", "observe")
                          for p in (REPO / "services/hetfed/aggregator" / room).glob("*.py")
                          if str(p.relative_to(REPO)) not in BASELINE_REFERENCE)
GENERIC = [
    *CLI_MODULES,
    "clients/hetfed/client/runtime.py",
    "clients/hetfed/client/rounds.py",
    "clients/hetfed/client/pending.py",
    "clients/hetfed/client/training.py",
    "clients/hetfed/client/algorithms/base.py",
    *AGGREGATOR_ROOMS,
    "services/hetfed/aggregator/algorithms/base.py",
    "services/hetfed/aggregator/algorithms/aggregators.py",
    "proto/hetfed/wire/rpc.py",
    "proto/hetfed/wire/messages.py",
]
# Names that are also ordinary words (or a file suffix, npz): matched only as whole string literals or identifiers.
ORDINARY_WORDS = {"local", "digits", "synthetic", "npz"}
# Names that are also a library generic modules use (the data set of own torch Datasets is named after it): only
# a string literal names the data set.
LIBRARY_WORDS = {"torch"}


def test_import_contracts_hold() -> None:
    """import-linter: the aggregator imports neither hetfed.client nor torch, only hetfed.wire imports
    hetfed.v1, the layers hold, and no import cycle exists anywhere (contracts in pyproject.toml)."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe is not None, "lint-imports is missing: install the dev extra (import-linter)"
    proc = subprocess.run([exe, "--no-cache", "--no-logo"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = re.findall(r"KEPT", proc.stdout)
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert len(kept) == len(contracts) >= 5


def test_orchestrating_commands_load_no_torch() -> None:
    """`hetfed run` plans through the client package's catalog (registries as data): importing it, the run
    command's module and the bench runner loads neither torch nor the client runtime."""
    code = ("import sys, hetfed.client.catalog, hetfed.cli.localrun, hetfed.cli.reproduce, hetfed.cli.report; "
            "print(sorted(m for m in ('torch', 'hetfed.client.runtime', 'hetfed.client.training') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _names() -> dict[str, str]:
    from hetfed.client.data import DATASETS
    from hetfed.wire.specs import SPECS

    return {**dict.fromkeys(SPECS, "algorithm"), **dict.fromkeys(DATASETS, "dataset")}


def _pattern(name: str) -> re.Pattern[str]:
    # "fedcma" also matches "Fed-CMA" and "fed_cma": a separator may follow a leading "fed".
    body = re.escape(name).replace("fed", "fed[-_ ]?", 1) if name.startswith("fed") else re.escape(name)
    return re.compile(rf"(?<![A-Za-z0-9_]){body}(?![A-Za-z0-9_])", re.IGNORECASE)


@pytest.mark.parametrize("path", GENERIC)
def test_generic_modules_name_no_algorithm_or_dataset(path: str) -> None:
    source = (REPO / path).read_text()
    tree = ast.parse(source)
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    identifiers = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    found = []
    for name, kind in _names().items():
        if name in LIBRARY_WORDS:
            if name in strings:
                found.append(f"{kind} {name!r} as a literal")
        elif name in ORDINARY_WORDS:
            if name in strings or name in identifiers:
                found.append(f"{kind} {name!r} as a literal or identifier")
        else:
            for lineno, line in enumerate(source.splitlines(), start=1):
                if _pattern(name).search(line):
                    found.append(f"{kind} {name!r} at line {lineno}: {line.strip()[:80]}")
    assert not found, f"{path} must ask the registries, not name them:\n" + "\n".join(found)


def test_the_name_check_catches_what_it_should() -> None:
    assert _pattern("fedcma").search("FedCMA's server") and _pattern("fedcma").search("see Fed-CMA")
    assert _pattern("fedavg").search("'fedavg'") and not _pattern("fedavg").search("fedavg_head_x")
    assert _pattern("mnist5k").search("dataset mnist5k") and not _pattern("npz").search("npzfile")


def test_registries_match_their_typed_names() -> None:
    from hetfed.client.data.registry import DATASETS, PARTITIONS, DatasetName, PartitionName

    assert set(typing.get_args(DatasetName)) == set(DATASETS)
    assert set(typing.get_args(PartitionName)) == set(PARTITIONS)
    for name, entry in DATASETS.items():
        assert set(entry.partitions) <= set(PARTITIONS), name


def test_every_package_directory_is_installed() -> None:
    """A package added under proto/, services/ or clients/ must be listed in pyproject.toml, or a wheel misses it."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for root in ("proto", "services", "clients"):
        for init in (REPO / root).rglob("__init__.py"):
            found.add(".".join(init.parent.relative_to(REPO / root).parts))
    assert found == listed, f"missing from pyproject: {sorted(found - listed)}; stale: {sorted(listed - found)}"


def test_every_algorithm_has_both_halves_paired_with_its_config() -> None:
    from hetfed.aggregator.algorithms import server_half_type
    from hetfed.client.algorithms import client_half_type
    from hetfed.wire.specs import SPECS

    def config_type(half: type) -> type:
        for cls in half.__mro__:
            for base in getattr(cls, "__orig_bases__", ()):
                args = typing.get_args(base)
                if args and isinstance(args[0], type):
                    return args[0]
        raise AssertionError(f"{half.__name__} is not generic in a config type")

    for name, spec in SPECS.items():
        for half in (server_half_type(spec), client_half_type(spec)):
            assert issubclass(spec.config_type, config_type(half)), (name, half)
