"""The ``hetfed`` command: aggregator, client, and the local federation ``run``.

Subcommands import what they need lazily, so ``hetfed aggregator`` never loads torch.
"""

from __future__ import annotations

import argparse
import logging
import sys

from hetfed.cli import checkconfig, health, k8s_status


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _cmd_aggregator(args: argparse.Namespace) -> int:
    from hetfed.aggregator.config import load_aggregator_config
    from hetfed.aggregator.server import serve

    if args.check_config:
        return checkconfig.report(checkconfig.check_aggregator_config, args.config)
    serve(load_aggregator_config(args.config), ready_file=args.ready_file)
    return 0


def _cmd_client(args: argparse.Namespace) -> int:
    from hetfed.client.config import load_client_config
    from hetfed.client.runtime import ClientRuntime

    if args.check_config:
        return checkconfig.report(checkconfig.check_client_config, args.config)
    ClientRuntime(load_client_config(args.config)).run()
    return 0


def _parse_sets(items: list[str], algorithms: tuple[str, ...]) -> dict[str, dict[str, object]]:
    """``--set [ALGO.]FIELD=VALUE`` (VALUE as JSON, else a string) into per-algorithm config overrides."""
    import json

    out: dict[str, dict[str, object]] = {a: {} for a in algorithms}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"hetfed run: --set expects [ALGO.]FIELD=VALUE, got {item!r}")
        try:
            value: object = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        algo, dot, field = key.rpartition(".")
        targets = [algo] if dot else list(algorithms)
        for t in targets:
            if t not in out:
                raise SystemExit(f"hetfed run: --set names algorithm {t!r}, which is not among {list(algorithms)}")
            out[t][field] = value
    return out


def _cmd_run(args: argparse.Namespace) -> int:
    from hetfed.cli.localrun import LocalRunOptions, run_local

    algorithms = tuple(a.strip() for a in args.algorithm.split(",") if a.strip())

    opts = LocalRunOptions(
        algorithms=algorithms,
        clients=args.clients,
        rounds=args.rounds if args.rounds is not None else (500 if "fedh2l" in algorithms else 10),
        public_fraction=args.public_fraction,
        dataset=args.dataset,
        partition=args.partition,
        alpha=args.alpha,
        seed=args.seed,
        model=args.model,
        models=tuple(m.strip() for m in (args.models or "").split(",") if m.strip()),
        latent_dim=args.latent_dim,
        test_split=args.test_split,
        extra_algorithm_config=_parse_sets(args.set or [], algorithms),
        local_epochs=args.local_epochs,
        lr=args.lr,
        momentum=args.momentum,
        batch_size=args.batch_size,
        output=args.output,
        wire_dtype=args.wire_dtype,
        timeout=args.timeout,
        tls=args.tls,
    )
    return run_local(opts)


def _cmd_certs(args: argparse.Namespace) -> int:
    from hetfed.cli.certs import make_federation_certs

    orgs = [o.strip() for o in args.organizations.split(",") if o.strip()]
    try:
        certs = make_federation_certs(args.out, orgs, args.aggregator_name, days=args.days, force=args.force)
    except (ValueError, FileExistsError) as exc:
        print(f"hetfed certs: {exc}", file=sys.stderr)
        return 2
    print(f"CA:         {certs.ca} (keep {certs.ca_key} offline)")
    print(f"aggregator: {certs.aggregator}, {certs.aggregator_key}")
    for org, (cert, key) in certs.organizations.items():
        print(f"{org}: {cert}, {key}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from hetfed.cli.bench import run_benchmark

    if args.list or not args.name:
        return run_benchmark("--list", [])
    return run_benchmark(args.name, args.args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``hetfed`` command."""
    p = argparse.ArgumentParser(prog="hetfed", description="Heterogeneous federated learning over gRPC.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command")

    a = sub.add_parser("aggregator", help="run the aggregator service")
    a.add_argument("--config", required=True, help="aggregator config file (.toml or .json)")
    a.add_argument("--ready-file", help="write the bound ports as JSON here once serving")
    a.add_argument("--check-config", action="store_true", help="validate the config file and exit")
    a.set_defaults(func=_cmd_aggregator)

    c = sub.add_parser("client", help="run one organization's client")
    c.add_argument("--config", required=True, help="client config file (.toml or .json)")
    c.add_argument("--check-config", action="store_true", help="validate the config file and exit")
    c.set_defaults(func=_cmd_client)

    r = sub.add_parser(
        "run",
        help="start a real aggregator and real clients on loopback and federate a built-in data set",
        description="Starts a real aggregator and real client processes on loopback, runs each algorithm, "
        "and prints final accuracy and bytes per algorithm.",
    )
    r.add_argument("--algorithm", default="fedavg,local",
                   help="comma-separated algorithms (default: fedavg,local)")
    r.add_argument("--clients", type=int, default=4, help="organizations per algorithm (default 4)")
    r.add_argument("--rounds", type=int, default=None,
                   help="training rounds (default 10; with fedh2l 500: one round is one FedH2L iteration)")
    r.add_argument("--public-fraction", type=float, default=0.1,
                   help="partition rotated: fraction alpha of each domain in the shared seed set (default 0.1)")
    r.add_argument("--dataset", default="mnist5k", help="mnist5k, digits or synthetic (default mnist5k)")
    r.add_argument("--partition", default="dirichlet", help="iid, dirichlet or natural (default dirichlet)")
    r.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (default 0.5)")
    r.add_argument("--seed", type=int, default=0, help="seed of every random choice (default 0)")
    r.add_argument("--model", default="lenet", help="private architecture of every organization (default lenet)")
    r.add_argument("--models", help="comma-separated architectures assigned to organizations in turn "
                   "(heterogeneous federations; overrides --model)")
    r.add_argument("--latent-dim", type=int, default=0, help="latent width d_e (default: the architecture's)")
    r.add_argument("--test-split", default="proportional", choices=["proportional", "fedgen"],
                   help="own test sets of dirichlet partitions: proportional to the train labels, or FedGen's equal share per label held (default proportional)")
    r.add_argument("--set", action="append", metavar="[ALGO.]FIELD=VALUE",
                   help="override an algorithm config field (VALUE is JSON); repeatable")
    r.add_argument("--local-epochs", type=int, default=2, help="local epochs per round (default 2)")
    r.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")
    r.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    r.add_argument("--batch-size", type=int, default=32, help="minibatch size (default 32)")
    r.add_argument("--wire-dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="transport precision of floating tensors")
    r.add_argument("--output", help="directory for per-round results (results.json) and logs")
    r.add_argument("--timeout", type=float, default=1800, help="give up after this many seconds")
    r.add_argument("--tls", action="store_true",
                   help="generate a CA and certificates in the run directory and federate over mTLS")
    r.set_defaults(func=_cmd_run)

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

    b = sub.add_parser("bench", help="reproduce a paper's claim or measure the system (see docs/benchmarks.md)")
    b.add_argument("name", nargs="?", help="benchmark name (see --list)")
    b.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    b.set_defaults(func=_cmd_bench)
    health.add_parser(sub)
    k8s_status.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hetfed`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["run", *(argv or [])])
    _setup_logging(args.verbose)
    from hetfed.wire.config import ConfigError

    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"hetfed: configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
