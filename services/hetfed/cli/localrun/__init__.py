"""``hetfed run``: a real aggregator and real client processes on loopback, one run per algorithm.

Nothing is simulated: the aggregator and every organization are separate processes started with the same
``hetfed aggregator`` / ``hetfed client`` commands a Kubernetes deployment runs, talking gRPC. Its rooms:

- ``planning``: the options, every default resolved and every choice validated before any process starts;
- ``files``: the aggregator's and each organization's config files, written from the plan's typed configs;
- ``processes``: starting, watching and stopping the processes (and the Prometheus targets of a scrape);
- ``results``: each run's per-round results, final figures and the printed table;
- ``running``: the command end to end.

Everything other code uses is importable from here.
"""

from __future__ import annotations

from hetfed.cli.localrun.files import (
    ALWAYS_WRITTEN,
    OPERATOR_ORGANIZATION,
    aggregator_config,
    aggregator_settings,
    client_config,
    client_file,
    client_settings,
)
from hetfed.cli.localrun.planning import (
    BASE,
    CLIENT_STATE,
    DEFAULT_CLIENTS,
    TRAIN_KNOBS,
    LocalPlan,
    LocalRunOptions,
    RunPlan,
    artifacts_dir,
    client_state_dir,
    noise_seed,
    plan,
    run_id_of,
)
from hetfed.cli.localrun.processes import (
    LOOPBACK,
    TARGETS_FILE,
    FederationFailedError,
    LocalFederation,
    client_metrics,
    free_port,
    stop_all,
    write_targets,
)
from hetfed.cli.localrun.results import (
    NO_OWN_RECORD,
    PRIVACY_FIGURES,
    TABLE_HEAD,
    epsilon_cell,
    mean_over,
    own_final,
    privacy_summary,
    summarize_run,
    table_rows,
)
from hetfed.cli.localrun.running import federate, output_dir, run_local, settled_status

__all__ = [
    "ALWAYS_WRITTEN", "BASE", "CLIENT_STATE", "DEFAULT_CLIENTS", "LOOPBACK", "NO_OWN_RECORD", "OPERATOR_ORGANIZATION",
    "PRIVACY_FIGURES", "TABLE_HEAD", "TARGETS_FILE", "TRAIN_KNOBS", "FederationFailedError", "LocalFederation",
    "LocalPlan", "LocalRunOptions", "RunPlan", "aggregator_config", "aggregator_settings", "artifacts_dir",
    "client_config", "client_file", "client_metrics", "client_settings", "client_state_dir", "epsilon_cell",
    "federate", "free_port", "mean_over", "noise_seed", "output_dir", "own_final", "plan", "privacy_summary",
    "run_id_of", "run_local", "settled_status", "stop_all", "summarize_run", "table_rows", "write_targets",
]
