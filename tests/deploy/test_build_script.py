"""docker/build.sh's choices reach buildah: run with stand-in tools that record their command lines (no image
is built)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

CUDA_BASE = "docker.io/pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"


def _calls(tmp_path: Path, what: str | list[str], *, have_images: bool, **env: str) -> list[list[str]]:
    """Run docker/build.sh WHAT (one target, or its arguments) with buildah, podman, debootstrap and runc
    recording each call; the calls, as argument lists (tool first). ``have_images``: whether `buildah inspect`
    finds every image."""
    args = [what] if isinstance(what, str) else what
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir(parents=True)
    for tool in ("buildah", "podman", "debootstrap", "runc"):
        inspect = f'[[ " $* " == *" inspect "* ]] && exit {0 if have_images else 1}\n'
        # podman import reads the base's tar from a pipe: drain it, or tar dies of SIGPIPE.
        drain = 'if [[ " $* " == *" import "* ]]; then cat >/dev/null; fi\n'
        (bin_dir / tool).write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" {tool} "$@" >>"{log}"\n'
                                    + {"buildah": inspect, "podman": drain}.get(tool, "") + "echo\n")
        (bin_dir / tool).chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "docker" / "build.sh"), *args], capture_output=True, text=True,
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


def test_the_torch_base_flag_is_the_client_images_base_and_wins_over_the_variable(tmp_path: Path) -> None:
    """--torch-base IMAGE: the client's BASE (pulled where missing); HETFED_TORCH_BASE yields to it."""
    calls = _calls(tmp_path, ["--torch-base", CUDA_BASE, "client"], have_images=False,
                   HETFED_TORCH_BASE="localhost/other:1")
    bud = _client_bud(calls)
    assert f"BASE={CUDA_BASE}" in bud and "--pull=never" not in bud
    assert not [c for c in calls if c[0] in ("debootstrap", "podman") or (c[:1] == ["buildah"] and "from" in c)]
    assert f"BASE={CUDA_BASE}" in _client_bud(_calls(tmp_path / "eq", [f"--torch-base={CUDA_BASE}", "client"],
                                                     have_images=False))


def test_local_bases_are_never_pulled(tmp_path: Path) -> None:
    """Every build on an image this script made says --pull=never: a missing one fails, nothing asks localhost."""
    calls = _calls(tmp_path, "example", have_images=False)
    buds = [c for c in calls if c[0] == "buildah" and "bud" in c]
    assert len(buds) == 2 and all("--pull=never" in c for c in buds)  # the client image, then the example's
    (made,) = [c for c in calls if c[0] == "buildah" and "from" in c]
    assert "--pull=never" in made
    aggregator = _calls(tmp_path / "a", "aggregator", have_images=True)
    (bud,) = [c for c in aggregator if c[0] == "buildah" and "bud" in c]
    assert "--pull=never" in bud and "BASE=localhost/hetfed-base:bookworm" in bud


@pytest.mark.parametrize(("env", "index"), [({}, "https://download.pytorch.org/whl/cpu"),
                                            ({"HETFED_TORCH_INDEX": "https://mirror.example/simple"},
                                             "https://mirror.example/simple"),
                                            ({"HETFED_TORCH_INDEX": ""}, "")])
def test_the_local_torch_base_installs_the_cpu_build(tmp_path: Path, env: dict[str, str], index: str) -> None:
    """The local base's pip reads PyTorch's CPU index unless told another (the public index's is CUDA's)."""
    calls = _calls(tmp_path, "client", have_images=False, **env)
    (run,) = [c for c in calls if c[0] == "buildah" and "run" in c]
    assert run[-2:] == ["torch==2.13.0", index]
    assert '${1:+--index-url "$1"}' in run[-3]
    flagged = _calls(tmp_path / "flag", ["--torch-index", "https://flag.example/simple", "client"],
                     have_images=False, **env)
    (run,) = [c for c in flagged if c[0] == "buildah" and "run" in c]
    assert run[-1] == "https://flag.example/simple"


def test_help_names_every_flag_and_a_mistake_exits_2() -> None:
    """--help prints the header (usage, flags, environment) and builds nothing; an unknown word exits 2."""
    script = str(REPO / "docker" / "build.sh")
    shown = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0 and shown.stdout.startswith("Builds the hetfed images")
    for flag in ("--torch-base IMAGE", "--torch-index URL", "HETFED_TORCH_BASE", "aggregator|client|all|example"):
        assert flag in shown.stdout
    for bad in (["--torch-bass", "x"], ["clients"], ["--torch-base"]):
        proc = subprocess.run(["bash", script, *bad], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "docker/build.sh --help" in proc.stderr
