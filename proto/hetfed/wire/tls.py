"""The mutual-TLS files of one side of the federation, as configuration: a value without gRPC.

Configs (the aggregator's, a client's) hold a ``TlsConfig``; ``hetfed.wire.transport`` builds channels and servers
from it. Kept apart so that reading a config loads no gRPC.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hetfed.wire.config import check


@dataclass(frozen=True)
class TlsConfig:
    """PEM files for mutual TLS: this side's certificate and key, and the federation's CA."""

    cert: str
    key: str
    ca: str
    # Clients only: the name the aggregator's certificate was issued for, when it differs from the host.
    server_name: str = ""

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            check(bool(getattr(self, name)), f"tls.{name} must name a PEM file")

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, private key, CA certificates) as bytes."""
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), Path(self.ca).read_bytes()

    def signature(self) -> tuple[tuple[int, int, int], ...] | None:
        """(mtime, size, inode) of the three files, following links (a Secret volume swaps its ``..data`` link);
        None while one cannot be read."""
        try:
            stats = [os.stat(p) for p in (self.cert, self.key, self.ca)]
        except OSError:
            return None
        return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in stats)
