"""The exported model's card, as data: its format tag and the files' digests (no torch, so ``hetfed export``
reads cards without loading it)."""

from __future__ import annotations

import hashlib
from pathlib import Path

CARD_FORMAT = "hetfed-model-card/1"
"""The ``format`` field of every card hetfed writes."""

CARD_FILE = "card.json"
"""The card's file name in an exported model's folder."""


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
