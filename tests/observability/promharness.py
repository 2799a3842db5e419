"""A real Prometheus (Debian's ``prometheus``) on a free loopback port, scraping a local run's file_sd targets."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from hetfed.cli.localrun import TARGETS_FILE, free_port
from hetfed.cli.prom import prom_query, prom_range

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "docs" / "examples" / "prometheus-rules.yml"


def require(tool: str) -> str:
    """The path of ``tool``; skip without it, except under CI (``.ci/run`` installs it), where it fails."""
    path = shutil.which(tool)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is not installed; .ci/run installs it")
        pytest.skip(f"{tool} is not installed (apt-get install prometheus)")
    return path


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll until ``predicate()`` is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Prometheus:
    """A Prometheus process scraping ``targets_dir/prometheus-targets.json`` every second, with hetfed's rules."""

    def __init__(self, workdir: Path, targets_dir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: ['{RULES}']\n"
            "scrape_configs:\n"
            "  - job_name: hetfed\n"
            f"    file_sd_configs: [{{files: ['{targets_dir / TARGETS_FILE}'], refresh_interval: 1s}}]\n"
        )
        check = subprocess.run([require("promtool"), "check", "config", str(config)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        self.log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [require("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=workdir,
        )
        wait_for(self._ready, 60, "Prometheus to be ready")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited: {(self.workdir / 'prometheus.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query."""
        return prom_query(self.url, expr, at)

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        """A range query."""
        return prom_range(self.url, expr, start, end, step)

    def get(self, path: str) -> Any:
        """A JSON API answer's data."""
        import json

        with urllib.request.urlopen(self.url + path, timeout=10) as resp:
            return json.loads(resp.read())["data"]

    def stop(self) -> None:
        """Terminate the process."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
