"""Write the checked-in observability files from their sources: the Grafana dashboards and the alert rules.

    python scripts/gen_observability.py [ROOT]

The sources are ``scripts/observability/dashboards.py`` and ``scripts/observability/alerts.py``. ROOT (default:
this repository) receives ``helm/hetfed/dashboards/*.json``, ``helm/hetfed/rules/hetfed-alerts.yaml`` and
``docs/examples/prometheus-rules.yml``. ``tests/observability/test_dashboards.py`` runs this script into a
temporary directory and fails when a committed file differs from what it writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.observability import alerts, dashboards  # noqa: E402

# The folders whose every file this script writes (a file there it does not write is stale).
GENERATED_DIRS = ("helm/hetfed/dashboards", "helm/hetfed/rules")


def files(root: Path) -> dict[Path, str]:
    """Every generated file's text, by path under ``root``."""
    out = {root / "helm" / "hetfed" / "dashboards" / name: dashboards.render_json(d)
           for name, d in dashboards.dashboards().items()}
    out.update(alerts.files(root))
    return out


def main(argv: list[str] | None = None) -> int:
    """Write the dashboards and the alert rules under ROOT."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", nargs="?", type=Path, default=REPO, help="where to write (default: the repository)")
    args = p.parse_args(argv)
    for path, text in files(args.root).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
