"""Sizes of hetfed's product code: the largest classes and functions, and where each algorithm's parts live.

    python scripts/code_sizes.py [--tree TREE]           # Markdown tables on stdout
    python scripts/code_sizes.py [--tree TREE] --json    # the same figures as JSON

TREE (default: this checkout) is any source tree of hetfed, e.g. an older commit unpacked with ``git archive``.

Product code is every module under proto/hetfed, services/hetfed and clients/hetfed except generated stubs.
tests/test_code_sizes.py holds the limits: no class over 300 lines, no function over 100.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("proto/hetfed", "services/hetfed", "clients/hetfed")
CLASS_LIMIT = 300
FUNCTION_LIMIT = 100


def definitions(root: Path = ROOT) -> list[tuple[int, str, str]]:
    """(lines, "class" or "def", "path:qualified name") of every class and function in the product code."""
    found: list[tuple[int, str, str]] = []
    for top in PRODUCT:
        for path in sorted((root / top).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            rel = path.relative_to(root).as_posix()
            found.extend(_walk(ast.parse(path.read_text()), rel, ""))
    return sorted(found, key=lambda row: (-row[0], row[2]))


def _walk(node: ast.AST, rel: str, prefix: str) -> list[tuple[int, str, str]]:
    rows: list[tuple[int, str, str]] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            kind = "class" if isinstance(child, ast.ClassDef) else "def"
            name = f"{prefix}{child.name}"
            rows.append((child.end_lineno - child.lineno + 1, kind, f"{rel}:{name}"))
            rows.extend(_walk(child, rel, f"{name}."))
        else:
            rows.extend(_walk(child, rel, prefix))
    return rows


def over_limits(root: Path = ROOT) -> list[str]:
    """Each class over CLASS_LIMIT lines and each function over FUNCTION_LIMIT, as "path:name (N lines)"."""
    return [f"{where} ({n} lines)" for n, kind, where in definitions(root)
            if n > (CLASS_LIMIT if kind == "class" else FUNCTION_LIMIT)]


def algorithm_files(name: str, root: Path = ROOT) -> list[str]:
    """Files whose path names the algorithm, under the product roots, the docs and the experiments."""
    hits = []
    for top in (*PRODUCT, "docs/algorithms"):
        for path in sorted((root / top).rglob("*")):
            rel = path.relative_to(root).as_posix()
            if path.is_file() and "__pycache__" not in rel and name in rel.split("/", 2)[-1]:
                hits.append(rel)
    return hits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--tree", type=Path, default=ROOT)
    args = parser.parse_args(argv)
    rows = definitions(args.tree)
    classes = [r for r in rows if r[1] == "class"][: args.top]
    functions = [r for r in rows if r[1] == "def"][: args.top]
    algorithms = {a: algorithm_files(a, args.tree) for a in ("fedcma", "fedh2l", "fedsr", "simfed", "ditto")}
    if args.json:
        json.dump({"classes": classes, "functions": functions, "algorithms": algorithms,
                   "over_limits": over_limits(args.tree)}, sys.stdout, indent=1)
        return 0
    print("| largest classes | lines |\n|---|---|")
    print("\n".join(f"| `{w}` | {n} |" for n, _, w in classes))
    print("\n| largest functions | lines |\n|---|---|")
    print("\n".join(f"| `{w}` | {n} |" for n, _, w in functions))
    print("\n| algorithm | files naming it |\n|---|---|")
    print("\n".join(f"| {a} | {len(f)} |" for a, f in algorithms.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
