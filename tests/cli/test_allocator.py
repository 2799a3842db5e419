"""The allocator tuning the aggregator and client processes start with: freed megabyte buffers are reused
instead of being returned to the kernel and faulted in again, and an operator's own settings win."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's allocator only")

# Copies a 4 MiB buffer twice per iteration (a bytearray, then bytes of it), as a round's receive path does,
# and counts the page faults of 20 iterations after a warm-up.
PROBE = """
import json, os, resource, sys
from hetfed.cli import allocator
tuned = allocator.tune(arenas=allocator.AGGREGATOR_ARENAS) if sys.argv[1] == "tune" else {}
data = os.urandom(4 << 20)
for _ in range(3):
    bytes(bytearray(data))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    bytes(bytearray(data))
print(json.dumps({"tuned": tuned, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def probe(mode: str, **env: str) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "HETFED_ALLOC"))}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, **env}, capture_output=True, text=True,
                         timeout=60, check=True)
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_tuned_processes_reuse_freed_buffers_instead_of_faulting_them_in_again() -> None:
    tuned, default = probe("tune"), probe("none")
    assert tuned["tuned"] == {"mmap_threshold": 32 << 20, "trim_threshold": 64 << 20, "arena_max": 1}
    # glibc's defaults map and unmap the buffers: about 2 x 1,024 faults per iteration.
    assert default["faults"] > 20 * 1024
    assert tuned["faults"] < default["faults"] / 100


def test_the_operators_settings_win() -> None:
    assert probe("tune", HETFED_ALLOCATOR="default")["tuned"] == {}
    assert probe("tune", MALLOC_ARENA_MAX="4")["tuned"] == {}
    assert probe("tune", GLIBC_TUNABLES="glibc.malloc.trim_threshold=1000000")["tuned"] == {}
