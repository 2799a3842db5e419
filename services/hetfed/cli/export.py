"""``hetfed export DIR``: list the trained models clients exported under DIR, from their cards alone.

A client with ``output_dir`` set writes ``<output_dir>/model/`` at the end of a run (``hetfed.client.export``):
``model.ts``, ``state_dict.pt`` and ``card.json``. A local federation (``hetfed.cli.localrun``) that gives its
clients an ``output_dir`` gives each ``<work dir>/artifacts/<run>/<organization>``, so its models are
``<work dir>/artifacts/<run>/<organization>/model/``. This command reads the JSON cards only (no torch): one line
per model, or ``--json``; ``--verify`` also checks each file against the SHA-256 its card records.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hetfed.client.catalog import CARD_FILE, CARD_FORMAT, file_sha256


def find_cards(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    """(model folder, card) of every exported model under ``root`` (``root`` itself included), by path."""
    found = []
    for path in sorted(root.rglob(CARD_FILE)):
        try:
            card = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            print(f"hetfed export: skipping {path}: {exc}", file=sys.stderr)
            continue
        if isinstance(card, dict) and card.get("format") == CARD_FORMAT:
            found.append((path.parent, card))
    return found


def verify(folder: Path, card: dict[str, Any]) -> list[str]:
    """What does not match the card in ``folder``: a missing file or another SHA-256 (empty: all match)."""
    problems = []
    for name, meta in card.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif file_sha256(path) != meta.get("sha256"):
            problems.append(f"{name} does not match its SHA-256")
    return problems


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def line(folder: Path, card: dict[str, Any]) -> str:
    """One model as a line: organization, algorithm, test accuracy, bytes sent and received, folder."""
    acc = card.get("accuracy", {}).get("test_accuracy")
    sent, received = (int(card.get("bytes", {}).get(k, 0)) for k in ("sent", "received"))
    shown = format(acc, ".4f") if isinstance(acc, int | float) else "-"
    return (f"{card.get('organization', '?'):<16} {card.get('algorithm', '?'):<14} test accuracy {shown:>6}  "
            f"sent {_size(sent):>9}  received {_size(received):>9}  {folder}")


def main(args: argparse.Namespace) -> int:
    """List (and with --verify check) the exported models under ``args.dir``; 1 when none is found or one fails."""
    root = Path(args.dir)
    if not root.is_dir():
        print(f"hetfed export: {root} is not a directory", file=sys.stderr)
        return 2
    cards = find_cards(root)
    if not cards:
        print(f"hetfed export: no exported model under {root} (a client with output_dir set in its config writes "
              "one into <output_dir>/model/ at the end of a run; docs/export.md)", file=sys.stderr)
        return 1
    failed = {folder: verify(folder, card) for folder, card in cards} if args.verify else {}
    if args.json:
        out = [{"path": str(folder), **card, **({"verified": not failed[folder]} if args.verify else {})}
               for folder, card in cards]
        print(json.dumps(out, indent=2))
    else:
        for folder, card in cards:
            print(line(folder, card) + (f"  ({'; '.join(failed[folder]) or 'verified'})" if args.verify else ""))
    return 1 if any(failed.values()) else 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``hetfed export``."""
    p = subparsers.add_parser(
        "export",
        help="list the trained models clients exported under a directory (docs/export.md)",
        description="Finds every <output_dir>/model/card.json under DIR (a client's output_dir, or a local run's "
        "work directory: DIR/artifacts/<run>/<organization>/model/) and prints one line per model: organization, "
        "algorithm, test accuracy, bytes sent and received, folder. Reads the cards only, never torch.",
    )
    p.add_argument("dir", help="directory to search (recursively)")
    p.add_argument("--json", action="store_true", help="print the cards as a JSON list, each with its folder (path)")
    p.add_argument("--verify", action="store_true", help="also check every file against its card's SHA-256 "
                   "(exit 1 on a mismatch)")
    p.set_defaults(func=main)
