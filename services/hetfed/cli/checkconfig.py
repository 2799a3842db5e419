"""``hetfed aggregator --check-config`` and ``hetfed client --check-config``: validate a file and exit.

The same loaders the processes use check every field (names, types, ranges, the algorithm's config);
the client check also resolves the model name against the installed architectures (the client package's
check, ``hetfed.client.catalog``). Nothing starts, nothing is read but the file. A bad file exits 2 with the field's path (``hetfed.cli.main``).
"""

from __future__ import annotations

from collections.abc import Callable


def report(check: Callable[[str], str], path: str) -> int:
    """Print ``check(path)``'s summary and return the exit status 0 (a ConfigError propagates)."""
    print(check(path))
    return 0


def check_aggregator_config(path: str) -> str:
    """Validate an aggregator config file; a one-line summary, or ConfigError."""
    from hetfed.aggregator.config import load_aggregator_config

    cfg = load_aggregator_config(path)
    runs = "; ".join(
        f"{r.id} ({r.algorithm}, {len(r.organizations)} organizations, {r.rounds} rounds)" for r in cfg.runs
    )
    tls = "mTLS" if cfg.server.tls else "plaintext"
    return f"{path}: aggregator config OK: listen {cfg.server.listen} ({tls}); runs {runs}"


def check_client_config(path: str) -> str:
    """Validate a client config file and its model name; a one-line summary, or ConfigError."""
    from hetfed.client.catalog import check_client_file

    cfg = check_client_file(path)
    tls = "mTLS" if cfg.tls else "plaintext"
    return (f"{path}: client config OK: organization {cfg.organization} in run {cfg.run} via {cfg.aggregator} "
            f"({tls}); data {cfg.data.dataset}/{cfg.data.partition} part {cfg.data.client_index} of "
            f"{cfg.data.num_clients}; model {cfg.model.reference} on {cfg.device}")
