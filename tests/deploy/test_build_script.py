"""docker/build.sh's choices reach buildah: run with stand-in tools that record their command lines (no image
is built)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

CUDA_BASE = "docker.io/pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"


def _calls(tmp_path: Path, what: str, *, have_images: bool, **env: str) -> list[list[str]]:
    """Run docker/build.sh WHAT with buildah, podman, debootstrap and runc recording each call; the calls, as
    argument lists (tool first). ``have_images``: whether `buildah inspect` finds every image."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for tool in ("buildah", "podman", "debootstrap", "runc"):
        inspect = f'[[ " $* " == *" inspect "* ]] && exit {0 if have_images else 1}\n'
        (bin_dir / tool).write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" {tool} "$@" >>"{log}"\n'
                                    + (inspect if tool == "buildah" else "") + "echo\n")
        (bin_dir / tool).chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "docker" / "build.sh"), what], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                                           "HETFED_IMAGE_STORE": str(tmp_path / "store"), **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    words = log.read_text().split("\0")[:-1]
    calls: list[list[str]] = []
    for w in words:
        if w in ("buildah", "podman", "debootstrap", "runc"):
            calls.append([w])
        else:
            calls[-1].append(w)
    return calls


def _client_bud(calls: list[list[str]]) -> list[str]:
    (bud,) = [c for c in calls if c[0] == "buildah" and "bud" in c and "docker/client.Dockerfile" in c]
    return bud


def test_a_given_torch_base_is_the_client_images_base_and_nothing_else_is_made(tmp_path: Path) -> None:
    """HETFED_TORCH_BASE: the client's BASE build argument; no local Debian or CPU torch base is made."""
    calls = _calls(tmp_path, "client", have_images=False, HETFED_TORCH_BASE=CUDA_BASE)
    assert f"BASE={CUDA_BASE}" in _client_bud(calls)
    assert not [c for c in calls if c[0] in ("debootstrap", "podman") or (c[:1] == ["buildah"] and "from" in c)]


@pytest.mark.parametrize("what", ["client", "all"])
def test_the_default_torch_base_is_the_local_cpu_one(tmp_path: Path, what: str) -> None:
    """Without HETFED_TORCH_BASE the client is built on localhost/hetfed-torch-base:<suite>, as before."""
    calls = _calls(tmp_path, what, have_images=True)
    assert "BASE=localhost/hetfed-torch-base:bookworm" in _client_bud(calls)
