"""Code comments give reasons, not references to the tracker or the calendar.

A comment that cites a ticket number or a date ages the day the ticket closes or the date passes, and tells a
reader nothing the code's history does not. Docs and results pages may keep the dates of their measurements;
comments and docstrings in code may not. An upstream reference such as ``grpc/grpc#42194`` names a bug outside
hetfed and stays.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

from tests.conftest import REPO

CODE_ROOTS = ("proto", "services", "clients", "tests", "scripts", "benchmarks", "helm", "docker", ".ci/run")
# Generated stubs, data and pictures hold no hand-written comments.
SKIP_SUFFIXES = {".json", ".png", ".svg", ".pyc", ".md", ".npz", ".pem", ".pyi"}
SKIP_DIRS = {"__pycache__", "node_modules", ".mypy_cache", ".ruff_cache"}

CITATION = re.compile(
    r"\bissues?\s*#?\s*\d+"                                  # a ticket by number
    r"|\b(?:PR|pull request)\s*#?\d+"
    r"|(?<![\w&/])#\d+\b"                                     # a hash and a number, unless after owner/repo
    r"|\b(?:19|20)\d\d-[01]\d(?:-[0-3]\d)?\b"                 # a year and month, with or without the day
    r"|\b(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?\s+(?:\d{1,2},\s+)?(?:19|20)\d\d\b",
    re.IGNORECASE,
)
# Where a line of a non-Python file starts a comment: shell, TOML, YAML and Dockerfiles (#), protobuf (//),
# Helm templates ({{/* and {{- /*).
LINE_COMMENT = re.compile(r"^\s*(?:#|//|\{\{-?\s*/\*)|\s#\s")


def code_files() -> list[Path]:
    """Every hand-written file under the code roots."""
    files = []
    for root in CODE_ROOTS:
        top = REPO / root
        for path in [top] if top.is_file() else sorted(top.rglob("*")):
            if (path.is_file() and path.suffix not in SKIP_SUFFIXES and not SKIP_DIRS & set(path.parts)
                    and not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))):
                files.append(path)
    return files


def python_comments(text: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python source."""
    found, previous = [], tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            found.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            found.append((tok.start[0], tok.string))  # a string standing alone as a statement: a docstring
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            previous = tok.type
    return found


def comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment in ``path``."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return []
    if path.suffix == ".py":
        return python_comments(text)
    return [(i, line) for i, line in enumerate(text.splitlines(), 1) if LINE_COMMENT.search(line)]


def citations(path: Path) -> list[str]:
    """``path:line: match`` for every ticket number or date in a comment of ``path``."""
    return [f"{path.relative_to(REPO)}:{line + body[:m.start()].count(chr(10))}: {m.group(0)!r}"
            for line, body in comments(path) for m in CITATION.finditer(body)]


def test_no_code_comment_cites_a_ticket_or_a_date() -> None:
    """Every comment and docstring under the code roots is free of ticket numbers and dates."""
    files = code_files()
    assert len(files) > 300  # the roots were found
    found = [hit for path in files for hit in citations(path)]
    assert found == [], "rewrite each to give the reason instead:\n" + "\n".join(found)


@pytest.mark.parametrize(("source", "hits"), [
    ('"""Fixed in issue 54."""\n', ["'issue 54'"]),
    ("x = 1  # see #12, measured (2026-12-07)\n", ["'#12'", "'2026-12-07'"]),
    ("def f():\n    \"\"\"Ok.\n\n    Since December 2026 and 2026-11.\"\"\"\n", ["'December 2026'", "'2026-11'"]),
    ("x = 1  # grpc/grpc#42194 reads the wrong field; colour '#1f77b4'\n", []),
    ('log = "2026-12-01 21:40 issue 3"  # a string, not a comment\n', []),
])
def test_the_check_finds_citations_in_comments_and_docstrings_only(source: str, hits: list[str]) -> None:
    """Comments and docstrings are read, string values are not, and upstream references are allowed."""
    assert [repr(m.group(0)) for _, body in python_comments(source) for m in CITATION.finditer(body)] == hits


def test_non_python_comments_are_read_by_their_comment_markers() -> None:
    """Shell, TOML and YAML (#), protobuf (//) and Helm template ({{/*) comments are read; values are not."""
    lines = ["# measured 2026-12-05", "  // before December 2026", "{{- /* issue 7 */}}", 'date = "2026-12-05"',
             "key: value  # issue 9"]
    flagged = [line for line in lines if LINE_COMMENT.search(line) and CITATION.search(line)]
    assert flagged == ["# measured 2026-12-05", "  // before December 2026", "{{- /* issue 7 */}}",
                       "key: value  # issue 9"]
