"""The committed generated stubs match a fresh regeneration, and the .proto files pass `buf lint`."""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROTO = REPO / "proto"
GENERATED = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")


def generated_files(root: Path) -> dict[str, Path]:
    """Generated stub files under ``root``/hetfed/v1, by name."""
    d = root / "hetfed" / "v1"
    return {p.name: p for pattern in GENERATED for p in d.glob(pattern)}


def test_committed_stubs_match_a_fresh_regeneration(tmp_path: Path) -> None:
    """Runs scripts/gen_protos.sh (python -m grpc_tools.protoc) into a temporary directory and diffs."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gen_protos.sh"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"gen_protos.sh failed:\n{proc.stdout}\n{proc.stderr}"
    fresh = generated_files(tmp_path)
    committed = generated_files(PROTO)
    protos = sorted(p.stem for p in (PROTO / "hetfed" / "v1").glob("*.proto"))
    assert protos, "no .proto files found"
    for stem in protos:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert stem + suffix in fresh, f"the generator did not write {stem}{suffix}"
    missing = sorted(set(fresh) - set(committed))
    stale = sorted(set(committed) - set(fresh))
    assert not missing, f"generated stubs not committed: {missing}; run scripts/gen_protos.sh"
    assert not stale, f"committed stubs without a .proto: {stale}; delete them"
    drift = []
    for name in sorted(fresh):
        new, old = fresh[name].read_text(), committed[name].read_text()
        if new != old:
            diff = difflib.unified_diff(old.splitlines(), new.splitlines(), f"committed/{name}", f"fresh/{name}",
                                        lineterm="", n=1)
            drift.append("\n".join(list(diff)[:40]))
    assert not drift, "committed stubs differ from scripts/gen_protos.sh output:\n" + "\n\n".join(drift)


def test_buf_lint_is_clean(tmp_path: Path) -> None:
    buf = shutil.which("buf")
    if buf is None:
        pytest.fail("buf is not on PATH; install the dev extra (buf-bin)")
    # buf writes a cache under $HOME: point it at a temporary directory.
    env = dict(os.environ, HOME=str(tmp_path), BUF_CACHE_DIR=str(tmp_path / "buf-cache"))
    proc = subprocess.run([buf, "lint"], cwd=PROTO, env=env, capture_output=True, text=True, timeout=120)
    findings = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0 and not findings, f"buf lint (exit {proc.returncode}):\n{findings}"
