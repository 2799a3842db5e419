"""The aggregator's rooms: each sub-package says what it owns, and ``Run`` has collaborators, not friends."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
AGGREGATOR = REPO / "services/hetfed/aggregator"
CONDUCTOR = AGGREGATOR / "run/conductor.py"
ROOMS = ("run", "journal", "serving", "observe")


def run_private_members() -> set[str]:
    """Every private name ``Run`` defines: its methods and the attributes it assigns on ``self``."""
    tree = ast.parse(CONDUCTOR.read_text())
    run = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Run")
    names = {n.name for n in run.body if isinstance(n, ast.FunctionDef)}
    names |= {t.attr for n in ast.walk(run) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
              and isinstance(n.value, ast.Name) and n.value.id == "self" for t in [n]}
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_run_defines_the_private_members_this_check_looks_for() -> None:
    # The check below is only as good as this list: it must hold the lock and the locked helpers.
    assert {"_lock", "_apply_locked", "_try_close_locked", "_close_locked", "_board"} <= run_private_members()


def test_no_module_outside_runs_own_file_touches_a_private_member_of_it() -> None:
    private = run_private_members()
    found = []
    for path in sorted([*REPO.glob("services/**/*.py"), *REPO.glob("clients/**/*.py"), *REPO.glob("proto/**/*.py"),
                        *REPO.glob("tests/**/*.py"), *REPO.glob("benchmarks/**/*.py")]):
        if path == CONDUCTOR or "_pb2" in path.name:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"})):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: .{node.attr}")
    assert not found, "Run's private members used outside run/conductor.py:\n" + "\n".join(found)


@pytest.mark.parametrize("room", ROOMS)
def test_each_room_says_what_it_owns(room: str) -> None:
    module = importlib.import_module(f"hetfed.aggregator.{room}")
    doc = module.__doc__ or ""
    assert len(doc.split()) >= 20, f"hetfed.aggregator.{room} needs a docstring that says what it owns"


def test_the_aggregator_package_holds_only_its_rooms_config_and_server_halves() -> None:
    flat = sorted(p.name for p in AGGREGATOR.glob("*.py"))
    assert flat == ["__init__.py", "config.py"]
    assert sorted(p.name for p in AGGREGATOR.iterdir() if p.is_dir() and p.name != "__pycache__") == \
        sorted([*ROOMS, "algorithms"])


def test_fault_injection_tooling_is_not_in_the_product() -> None:
    # The failing disk of the tests and the fault harness lives with the tests; only the crash points' hook
    # (HETFED_CRASH_AT, off unless set) stays on the write path.
    assert not list(REPO.glob("services/**/faults.py"))
    assert (REPO / "tests/faults.py").exists()


# The run's pure core: its rules, admission checks, resumption and instructions. They build and check values; the
# gRPC adapter (hetfed.wire.rpc) and grpc itself are the serving room's business.
RUN_CORE = ("state", "admission", "resume", "instructions")


def test_the_pure_run_core_imports_no_grpc() -> None:
    modules = ", ".join(f"hetfed.aggregator.run.{m}" for m in RUN_CORE)
    code = (f"import sys, {modules}; "
            "print(sorted(m for m in sys.modules if m == 'grpc' or m.startswith(('grpc.', 'hetfed.wire.rpc'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def _spans(path: Path) -> dict[str, tuple[str, int]]:
    """Kind ("class" or "function") and lines of every class and function in ``path``, by name
    (``Class.method`` for methods)."""
    spans: dict[str, tuple[str, int]] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                spans[name] = (kind, (child.end_lineno or child.lineno) - child.lineno + 1)
                walk(child, name + ".")

    walk(ast.parse(path.read_text()), "")
    return spans


# The conductors and the rooms they conduct: each part read in one sitting.
CONDUCTED = [*sorted((AGGREGATOR / "run").glob("*.py")), REPO / "clients/hetfed/client/runtime.py",
             REPO / "clients/hetfed/client/rounds.py", REPO / "clients/hetfed/client/diagnostics.py"]
LIMITS = {"class": 300, "function": 100}


def test_the_conductors_stay_short() -> None:
    # Secure aggregation's dispatch lives in SecureStages, the lock-free reads in RunView.
    assert _spans(CONDUCTOR)["Run"][1] < 250
    assert _spans(REPO / "clients/hetfed/client/runtime.py")["ClientRuntime._run"][1] <= 40
    long = [f"{p.relative_to(REPO)}: {kind} {name} ({n} lines)" for p in CONDUCTED
            for name, (kind, n) in _spans(p).items() if n > LIMITS[kind]]
    assert not long, "classes over 300 lines or functions over 100:\n" + "\n".join(long)
