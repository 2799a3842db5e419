"""Make the pictures of docs/metrics.md and README: a real Prometheus scrapes a real ``hetfed run``.

    python scripts/observability_pictures.py [--out docs/images] [-- HETFED RUN ARGS...]
    python scripts/observability_pictures.py --prometheus URL [--since 3600] [--out DIR]

Starts Debian's ``prometheus`` on a free loopback port, runs ``hetfed run --output DIR --metrics-linger 3``
(the default run unless arguments follow ``--``), then copies the run's ``report.png`` to
``report-default.png`` and renders the bandwidth dashboard's main panels from the live Prometheus to
``dashboard-bandwidth-preview.png``. With ``--prometheus URL`` it runs nothing and only draws that preview
from the last ``--since`` seconds of an existing Prometheus that scraped hetfed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.observability.dashboards import render_preview  # noqa: E402
from tests.observability.promharness import Prometheus  # noqa: E402

PREVIEW = "dashboard-bandwidth-preview.png"


def main() -> int:
    """Run, scrape, draw."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    p.add_argument("--prometheus", metavar="URL", help="draw only the preview, from this Prometheus")
    p.add_argument("--since", type=float, default=3600.0, help="with --prometheus: seconds of history to draw")
    p.add_argument("run_args", nargs="*", help="hetfed run arguments (after --)")
    args = p.parse_args()
    if args.prometheus:
        end = time.time()
        step = float(max(1, int(args.since / 600)))  # whole seconds: PromQL durations are integers
        print(json.dumps(render_preview(args.prometheus, args.out / PREVIEW, end - args.since, end, step)))
        print(f"wrote {args.out / PREVIEW}")
        return 0
    with tempfile.TemporaryDirectory(prefix="hetfed-pictures-") as tmp:
        base = Path(tmp)
        run_dir = base / "run"
        run_dir.mkdir()
        prom = Prometheus(base, run_dir)
        try:
            start = time.time()
            cmd = [sys.executable, "-m", "hetfed.cli", "run", *args.run_args, "--output", str(run_dir),
                   "--metrics-linger", "3"]
            print("$", " ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, check=True)
            end = time.time()
            finished = prom.query_range("min(hetfed_run_finished)", start, end, 1.0)
            last = max(float(t) for t, v in finished[0]["values"] if v == "1")
            args.out.mkdir(parents=True, exist_ok=True)
            shutil.copy(run_dir / "report.png", args.out / "report-default.png")
            shutil.copy(run_dir / "report.md", args.out / "report-default.md")
            desc = render_preview(prom.url, args.out / PREVIEW, start, last, 1.0, rate_interval="5s")
            print(json.dumps(desc))
        finally:
            prom.stop()
    print(f"wrote {args.out}/report-default.png, report-default.md and {PREVIEW}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
