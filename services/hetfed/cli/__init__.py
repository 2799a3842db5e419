"""The ``hetfed`` command: aggregator, client, the local federation ``run``, certificates and benchmarks.

Subcommands import what they need lazily, so ``hetfed aggregator`` never loads torch. The choices of
``hetfed run`` and their help come from the registries (algorithm specs, and the datasets, partitions and
models of ``hetfed.client.catalog``), and every user error prints one line and exits with status 2, before any
process starts. ``hetfed client`` runs the client runtime; no other command imports client code but the
catalog.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import re
import signal
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from hetfed.cli import allocator, checkconfig, export, health, k8s_status, report
from hetfed.wire.config import ConfigError

if TYPE_CHECKING:
    from hetfed.cli.localrun import LocalRunOptions

USAGE_ERROR = 2
# `hetfed client`: the organization's privacy budget would be exceeded by the next round, so it left the run
# (not a failure: the run goes on for the other organizations under its quorum rules; docs/privacy.md).
PRIVACY_BUDGET_SPENT = 3
# `hetfed run` gives up on a federation that has not finished after this many seconds (--timeout).
RUN_TIMEOUT_SECONDS = 1800.0


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (with where to look) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE (see PROG --help)`` and exit 2."""
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _cmd_aggregator(args: argparse.Namespace) -> int:
    from hetfed.aggregator.config import load_aggregator_config
    from hetfed.aggregator.journal.store import StateError
    from hetfed.aggregator.serving.server import serve

    if args.check_config:
        return checkconfig.report(checkconfig.check_aggregator_config, args.config)
    allocator.tune(arenas=allocator.AGGREGATOR_ARENAS)
    try:
        serve(load_aggregator_config(args.config), ready_file=args.ready_file)
    except StateError as exc:  # a state directory that cannot be resumed: one clear line, no traceback
        print(f"hetfed aggregator: {exc}", file=sys.stderr)
        return USAGE_ERROR
    return 0


def _cmd_client(args: argparse.Namespace) -> int:
    # The client's entry point: the one command that runs client code (pyproject.toml's import contract names it).
    from hetfed.client.config import load_client_config
    from hetfed.client.runtime import ClientError, ClientRuntime

    if args.check_config:
        return checkconfig.report(checkconfig.check_client_config, args.config)
    allocator.tune()
    try:
        ClientRuntime(load_client_config(args.config)).run()
    except ClientError as exc:
        print(f"hetfed client: {exc}", file=sys.stderr)
        return _client_exit_status(exc)
    return 0


def _client_exit_status(exc: Exception) -> int:
    """The exit status of a client that stopped on ``exc``: PRIVACY_BUDGET_SPENT when its organization's privacy
    budget is spent (the runtime's PrivacyBudgetSpent), 2 when no retry can succeed, else 1."""
    from hetfed.client.runtime import PrivacyBudgetSpent

    if isinstance(exc, PrivacyBudgetSpent):
        return PRIVACY_BUDGET_SPENT
    return USAGE_ERROR if getattr(exc, "permanent", False) else 1


# ``--set privacy.FIELD=VALUE``: a field of every organization's [privacy] table, not of an algorithm's config.
PRIVACY_PREFIX = "privacy."


def _parse_sets(items: Sequence[str], algorithms: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``--set [ALGO.]FIELD=VALUE`` (VALUE as JSON, else a string) into per-algorithm config overrides
    (``privacy.FIELD`` items are left to ``_parse_privacy``)."""
    out: dict[str, dict[str, Any]] = {a: {} for a in algorithms}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects [ALGO.]FIELD=VALUE, got {item!r}")
        if key.startswith(PRIVACY_PREFIX):
            continue
        value = _value(raw)
        algo, dot, name = key.rpartition(".")
        for target in ([algo] if dot else list(algorithms)):
            if target not in out:
                raise ConfigError(f"--set names algorithm {target!r}, which is not among {', '.join(algorithms)}")
            out[target][name] = value
    return {k: v for k, v in out.items() if v}


def _value(raw: str) -> Any:
    """A command-line VALUE: JSON when it parses, else the string as given."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _parse_privacy(items: Sequence[str]) -> dict[str, Any]:
    """``--set privacy.FIELD=VALUE`` (VALUE as JSON, else a string) into the organizations' [privacy] fields
    (validated by the run's plan)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.startswith(PRIVACY_PREFIX):
            continue
        name = key.removeprefix(PRIVACY_PREFIX)
        if not name:
            raise ConfigError(f"--set expects privacy.FIELD=VALUE, got {item!r}")
        out[name] = _value(raw)
    return out


def _parse_data(items: Sequence[str]) -> dict[str, Any]:
    """``--data FIELD=VALUE`` (VALUE as JSON, else a string) into data fields (validated by the run's plan)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--data expects FIELD=VALUE, got {item!r}")
        out[key] = _value(raw)
    return out


def _dataset_of(args: argparse.Namespace) -> str:
    """The --dataset given, else the data factory's data set when --data names a factory, else the default."""
    from hetfed.client.catalog import DEFAULT_DATASET, FACTORY_DATASET

    if args.dataset is not None:
        return str(args.dataset)
    factory = any(item.partition("=")[0] == "factory" for item in (args.data or []))
    return FACTORY_DATASET if factory else DEFAULT_DATASET


def run_options(args: argparse.Namespace) -> LocalRunOptions:
    """The options of ``hetfed run`` as parsed; unset ones stay ``None`` for the plan to resolve."""
    from hetfed.cli.localrun import LocalRunOptions

    algorithms = tuple(args.algorithm)
    models = tuple(m.strip() for m in (args.models or "").split(",") if m.strip()) or (
        (args.model,) if args.model else ())
    knobs = {"local_epochs": args.local_epochs, "lr": args.lr, "momentum": args.momentum, "batch_size": args.batch_size}
    return LocalRunOptions(
        algorithms=algorithms,
        clients=args.clients,
        rounds=args.rounds,
        public_fraction=args.public_fraction,
        dataset=_dataset_of(args),
        partition=args.partition,
        alpha=args.alpha,
        seed=args.seed,
        models=models,
        latent_dim=args.latent_dim,
        test_split=args.test_split,
        train={k: v for k, v in knobs.items() if v is not None},
        extra_algorithm_config=_parse_sets(args.set or [], algorithms),
        privacy=_parse_privacy(args.set or []),
        data=_parse_data(args.data or []),
        wire_dtype=args.wire_dtype,
        output=args.output,
        timeout=args.timeout,
        tls=args.tls,
        secure_aggregation=args.secure_aggregation,
        metrics_linger=args.metrics_linger,
        report=not args.no_report,
    )


def _cmd_run(args: argparse.Namespace) -> int:
    from hetfed.cli.localrun import FederationFailedError, run_local

    try:
        return run_local(run_options(args))
    except FederationFailedError as exc:
        return _federation_failed(args.command, exc)


def _federation_failed(command: str, exc: Exception) -> int:
    """Print a federation's failure (the process, its log's last lines) as the command's error; exit status 1."""
    print(f"hetfed {command}: error: {exc}", file=sys.stderr)
    return 1


def _cmd_certs(args: argparse.Namespace) -> int:
    from hetfed.cli.certs import make_federation_certs

    orgs = [o.strip() for o in args.organizations.split(",") if o.strip()]
    try:
        certs = make_federation_certs(args.out, orgs, args.aggregator_name, days=args.days, force=args.force)
    except (ValueError, FileExistsError) as exc:
        print(f"hetfed certs: {exc}", file=sys.stderr)
        return USAGE_ERROR
    print(f"CA:         {certs.ca} (keep {certs.ca_key} offline)")
    print(f"aggregator: {certs.aggregator}, {certs.aggregator_key}")
    for org, (cert, key) in certs.organizations.items():
        print(f"{org}: {cert}, {key}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from hetfed.cli.bench import list_benchmarks, run_benchmark
    from hetfed.cli.localrun import FederationFailedError

    if args.list or not args.name:
        return list_benchmarks()
    try:
        return run_benchmark(args.name, args.args)
    except FederationFailedError as exc:
        return _federation_failed(args.command, exc)


# ------------------------------------------------------------------------------------------------ parser
def _positive(kind: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{what} must be greater than 0, got {text}")
        return value
    return parse


def _model_choice(options: Sequence[str]) -> Callable[[str], str]:
    """A built-in architecture's name, or an organization's own builder ``package.module:function``."""
    from hetfed.client.catalog import is_reference

    named = _choice("model", options)

    def parse(text: str) -> str:
        return text if is_reference(text) else named(text)
    return parse


def _choice(name: str, options: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            import difflib

            # A choice the text begins (a prefix the user typed) before difflib's closest spelling.
            close = [o for o in options if o.startswith(text)] or difflib.get_close_matches(text, options, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise argparse.ArgumentTypeError(f"unknown {name} {text!r}{hint}; choose from {', '.join(options)}")
        return text
    return parse


def _algorithms(options: Sequence[str]) -> Callable[[str], list[str]]:
    one = _choice("algorithm", options)

    def parse(text: str) -> list[str]:
        names = [one(a.strip()) for a in text.split(",") if a.strip()]
        if not names:
            raise argparse.ArgumentTypeError("names no algorithm")
        return names
    return parse


def _listing(entries: dict[str, str]) -> str:
    return "; ".join(f"{k}: {v}" for k, v in entries.items())


class _RunHelp(argparse.Action):
    """``hetfed run --help``: the options, then every algorithm's defaults on the --dataset given before it."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from hetfed.cli.rundefaults import defaults_table
        from hetfed.client.catalog import DEFAULT_DATASET

        parser.epilog = defaults_table(namespace.dataset or DEFAULT_DATASET)
        parser.print_help()
        parser.exit()


_FROM_TABLE = "(default: the algorithm's, in the table below)"


def _add_run(sub: Any) -> None:
    from hetfed.cli.experiments import DEFAULT_COMPARISON
    from hetfed.client.catalog import (
        DATASETS,
        DEFAULT_DATASET,
        FACTORY_DATASET,
        MODELS,
        PARTITIONS,
        TEST_SPLITS,
        DataConfig,
    )
    from hetfed.wire.specs import SPECS
    from hetfed.wire.specs.base import TrainConfig, WireDtype

    builtin = [n for n, e in DATASETS.items() if e.builtin]
    r = sub.add_parser(
        "run",
        help="start a real aggregator and real clients on loopback and federate a built-in data set",
        description=textwrap.fill(
            "Starts a real aggregator and real client processes on loopback, runs each algorithm, and prints final "
            "accuracy and bytes per algorithm. Unset options take the dataset's and the algorithm's defaults, "
            "listed below the options (docs/algorithms/).", width=100),
        formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False,
    )
    r.add_argument("-h", "--help", action=_RunHelp, help="show this help, with every algorithm's defaults, and exit")
    r.add_argument("--algorithm", type=_algorithms(list(SPECS)), default=list(DEFAULT_COMPARISON), metavar="A[,A...]",
                   help=f"comma-separated algorithms (default {','.join(DEFAULT_COMPARISON)}): "
                   + _listing({k: re.split(r": |; |\.$", s.summary)[0] for k, s in SPECS.items()}))
    r.add_argument("--clients", type=_positive(int, "--clients"), default=None,
                   help="organizations per algorithm (default: the partition's, in the table below)")
    r.add_argument("--rounds", type=_positive(int, "--rounds"), default=None, help=f"training rounds {_FROM_TABLE}")
    own = [n for n, e in DATASETS.items() if not e.builtin]
    r.add_argument("--dataset", type=_choice("dataset", list(DATASETS)), default=None, metavar="NAME",
                   help=f"(default: {DEFAULT_DATASET}, or {FACTORY_DATASET} with --data factory=...) "
                   + _listing({k: DATASETS[k].summary for k in builtin})
                   + f"; an organization's own data ({', '.join(own)}) with --data path=... or factory=... "
                   "(docs/data.md)")
    r.add_argument("--partition", type=_choice("partition", list(PARTITIONS)), default=None, metavar="NAME",
                   help="(default: what the algorithms need, else the dataset's) "
                   + _listing({k: v.summary for k, v in PARTITIONS.items()}))
    r.add_argument("--alpha", type=_positive(float, "--alpha"), default=DataConfig.alpha,
                   help="concentration of label-skewed partitions (default %(default)s)")
    r.add_argument("--public-fraction", type=_positive(float, "--public-fraction"), default=DataConfig.public_fraction,
                   help="partitions with a shared seed set: its fraction of each domain (default %(default)s)")
    r.add_argument("--seed", type=int, default=DataConfig.seed, help="seed of every random choice (default %(default)s)")
    r.add_argument("--model", type=_model_choice(list(MODELS)), default=None, metavar="NAME",
                   help="one architecture for every organization (default: the algorithm's or dataset's) "
                   + _listing({k: v.summary for k, v in MODELS.items()})
                   + "; or an own builder package.module:function (docs/models.md)")
    r.add_argument("--models", default=None, metavar="M[,M...]",
                   help="architectures assigned to organizations in turn (heterogeneous federations): names above "
                   "or own builders package.module:function")
    r.add_argument("--latent-dim", type=_positive(int, "--latent-dim"), default=None,
                   help="latent width d_e (default: the algorithm's or the architecture's)")
    r.add_argument("--test-split", type=_choice("test split", list(TEST_SPLITS)), default=DataConfig.test_split,
                   help="own test sets of label-skewed partitions: proportional to the train labels, or an "
                   "equal share per label held, as one paper's code splits them (default %(default)s)")
    r.add_argument("--set", action="append", metavar="[ALGO.]FIELD=VALUE",
                   help="override an algorithm config field (VALUE is JSON); repeatable. privacy.FIELD=VALUE sets "
                   "a field of every organization's [privacy] table instead, for example privacy.epsilon_budget=3 "
                   "(differential privacy; fields: docs/privacy.md)")
    r.add_argument("--data", action="append", metavar="FIELD=VALUE",
                   help="set a data field for every organization (VALUE is JSON), for example synthetic_alpha=0, "
                   "target_domain=5 (the held-out domain of a leave-one-domain-out partition) or permute_labels=true "
                   "(each organization's labels permuted); repeatable; fields: docs/configuration.md [data]")
    r.add_argument("--local-epochs", type=_positive(int, "--local-epochs"), default=None,
                   help=f"local epochs per round {_FROM_TABLE}; where it lists steps, the steps apply instead")
    r.add_argument("--lr", type=_positive(float, "--lr"), default=None, help=f"learning rate {_FROM_TABLE}")
    r.add_argument("--momentum", type=float, default=None, help=f"SGD momentum {_FROM_TABLE}")
    r.add_argument("--batch-size", type=_positive(int, "--batch-size"), default=None,
                   help=f"minibatch size {_FROM_TABLE}")
    r.add_argument("--wire-dtype", type=_choice("wire dtype", list(WireDtype.__args__)),  # type: ignore[attr-defined]
                   default=TrainConfig.wire_dtype,
                   help="transport precision of floating tensors (default %(default)s)")
    r.add_argument("--output", help="directory for per-round results (results.json), logs and configs")
    r.add_argument("--timeout", type=_positive(float, "--timeout"), default=RUN_TIMEOUT_SECONDS,
                   help="give up after this many seconds (default %(default)s)")
    r.add_argument("--tls", action="store_true",
                   help="generate a CA and certificates in the run directory and federate over mTLS")
    r.add_argument("--secure-aggregation", action="store_true",
                   help="experimental: sum the uploads under secure aggregation (SecAgg+, docs/security.md): the "
                   "aggregator learns only their sum; for algorithms that only sum what they receive; an aggregator "
                   "restarted during a secure round resumes it, or abandons its aggregate where that is not safe")
    r.add_argument("--metrics-linger", type=float, default=0.0, metavar="SECONDS",
                   help="set the run up for a Prometheus: clients serve metrics too, <output>/prometheus-targets.json "
                   "lists every endpoint (file_sd), and processes keep serving SECONDS after the run "
                   "(default %(default)s: off)")
    r.add_argument("--no-report", action="store_true", help="do not write report.png and report.md with --output")
    r.set_defaults(func=_cmd_run)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``hetfed`` command."""
    p = _Parser(prog="hetfed", description="Heterogeneous federated learning over gRPC.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    a = sub.add_parser("aggregator", help="run the aggregator service")
    a.add_argument("--config", required=True, help="aggregator config file (.toml or .json)")
    a.add_argument("--ready-file", help="write the bound ports as JSON here once serving")
    a.add_argument("--check-config", action="store_true", help="validate the config file and exit")
    a.set_defaults(func=_cmd_aggregator)

    c = sub.add_parser("client", help="run one organization's client")
    c.add_argument("--config", required=True, help="client config file (.toml or .json)")
    c.add_argument("--check-config", action="store_true", help="validate the config file and exit")
    c.set_defaults(func=_cmd_client)

    _add_run(sub)

    k = sub.add_parser(
        "certs",
        help="make a CA, the aggregator's certificate and one client certificate per organization (mTLS)",
        description="Writes ca.pem, aggregator.pem and <org>.pem with their -key.pem files (mode 0600) for a "
        "new federation. An organization's identity is its certificate's common name.",
    )
    k.add_argument("--out", required=True, help="directory to write the PEM files to")
    k.add_argument("--organizations", required=True, help="comma-separated organization ids")
    k.add_argument("--aggregator-name", action="append", metavar="NAME",
                   help="DNS name or IP address the aggregator is reached at; repeatable "
                   "(default: localhost and 127.0.0.1)")
    k.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    k.add_argument("--force", action="store_true", help="replace existing files")
    k.set_defaults(func=_cmd_certs)

    report.add_parser(sub)
    export.add_parser(sub)

    b = sub.add_parser("bench", help="reproduce a paper's claim or measure the system (see docs/benchmarks.md)")
    b.add_argument("name", nargs="?", help="benchmark name (see --list)")
    b.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    b.set_defaults(func=_cmd_bench)
    health.add_parser(sub)
    k8s_status.add_parser(sub)
    return p


def _stop_federations_and_exit(signum: int, _frame: object) -> None:
    """SIGTERM to `hetfed run` or `hetfed bench` (a `timeout`, a job scheduler): stop the aggregators and
    clients it started, then exit with 128 + the signal's number."""
    from hetfed.cli.localrun import stop_all

    stop_all()
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hetfed`` console script."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.command is None:
        # A bare `hetfed` shows what it can do; starting a federation unasked takes minutes to interrupt.
        parser.print_help()
        return 0
    _setup_logging(args.verbose)
    if args.command in ("run", "bench"):
        signal.signal(signal.SIGTERM, _stop_federations_and_exit)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"hetfed {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    finally:
        # The interpreter's shutdown collections would traverse every object torch and the run created (several
        # seconds per process on a busy machine, so a federation's clients exited long after their run ended);
        # frozen objects are skipped, and module teardown still releases everything.
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
