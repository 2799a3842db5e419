"""The files of a local federation: the aggregator's and each organization's, written from the plan's typed configs
(``to_sparse_mapping``: only what differs from a dataclass default); each process reads its file back through
the same dataclasses."""

from __future__ import annotations

import dataclasses
from typing import Any

from hetfed.aggregator.config import AggregatorConfig, ServerConfig
from hetfed.cli.localrun.planning import LocalPlan, LocalRunOptions, plan
from hetfed.cli.localrun.processes import LOOPBACK
from hetfed.client.catalog import ClientConfig
from hetfed.wire.config import to_sparse_mapping
from hetfed.wire.transport import TlsConfig

# The orchestrator's own certificate under --tls: a name no run lists, good only for the read-only Status.
OPERATOR_ORGANIZATION = "hetfed-operator"

# Written to the files even at their dataclass defaults, so that each file says which data, which share of it
# and which latent width its organization uses, and a run's rounds (under DP, ``client_file`` adds the noise seed).
ALWAYS_WRITTEN = ("data.dataset", "data.partition", "data.num_clients", "data.client_index", "data.seed",
                  "model.latent_dim", "runs.rounds")


def aggregator_settings(opts: LocalRunOptions | LocalPlan, state_dir: str,
                        tls: TlsConfig | None = None) -> AggregatorConfig:
    """The aggregator config of a local federation: the plan's runs, served on loopback (``tls``: its certificate,
    under mTLS, where the orchestrator reads every run's Status)."""
    p = opts if isinstance(opts, LocalPlan) else plan(opts)
    server = ServerConfig(listen=f"{LOOPBACK}:0", metrics_port=0, metrics_host=LOOPBACK, state_dir=state_dir, tls=tls,
                          operators=(OPERATOR_ORGANIZATION,) if tls is not None else ())
    return AggregatorConfig(runs=tuple(r.run for r in p.runs), server=server)


def aggregator_config(opts: LocalRunOptions | LocalPlan, state_dir: str, tls: TlsConfig | None = None) -> dict[str, Any]:
    """The aggregator's file of a local federation (``aggregator_settings``, less what its dataclasses default)."""
    return to_sparse_mapping(aggregator_settings(opts, state_dir, tls), ALWAYS_WRITTEN)


def client_settings(opts: LocalRunOptions | LocalPlan, run_id: str, index: int, port: int,
                    tls: TlsConfig | None = None) -> ClientConfig:
    """The client config of organization ``index`` in run ``run_id``: the plan's, with the aggregator's port on
    loopback (``tls``: the organization's certificate, under mTLS)."""
    p = opts if isinstance(opts, LocalPlan) else plan(opts)
    r = next(r for r in p.runs if r.run_id == run_id)
    return dataclasses.replace(r.clients[index], aggregator=f"{LOOPBACK}:{port}", tls=tls)


def client_file(cfg: ClientConfig) -> dict[str, Any]:
    """A client config as its file carries it: what its dataclasses do not default, and ``ALWAYS_WRITTEN``."""
    return to_sparse_mapping(cfg, (*ALWAYS_WRITTEN, *(("privacy.noise_seed",) if cfg.privacy.enabled else ())))


def client_config(opts: LocalRunOptions | LocalPlan, run_id: str, index: int, port: int,
                  tls: TlsConfig | None = None) -> dict[str, Any]:
    """The file of organization ``index`` in run ``run_id`` (``client_settings``, as ``client_file`` writes it)."""
    return client_file(client_settings(opts, run_id, index, port, tls))
