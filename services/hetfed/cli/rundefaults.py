"""The defaults table of ``hetfed run --help``: what a run of each algorithm uses on a data set.

Every value comes from ``localrun.plan``, the code path a run takes (the dataset's and the algorithm's
defaults, layered over the algorithm's declared config), so the help cannot state a default that a run does
not use. On the default data set the training columns are the algorithm's declared config itself: what a
hand-written aggregator file or the chart that leaves them out trains with.
"""

from __future__ import annotations

HEADER = ("algorithm", "rounds", "local work", "lr", "momentum", "batch", "clients", "partition", "models", "d_e")


def rows(dataset: str) -> tuple[list[tuple[str, ...]], dict[str, str]]:
    """(one row of HEADER's columns per algorithm a run alone can use, {algorithm: why not} for the rest)."""
    from hetfed.cli.localrun import LocalRunOptions, plan
    from hetfed.wire.config import ConfigError
    from hetfed.wire.specs import SPECS

    table: list[tuple[str, ...]] = []
    refused: dict[str, str] = {}
    for name in SPECS:
        try:
            p = plan(LocalRunOptions(algorithms=(name,), dataset=dataset))
        except ConfigError as exc:
            refused[name] = str(exc)
            continue
        r = p.runs[0]
        cfg = r.train
        n, unit = (cfg.local_steps, "step") if cfg.local_steps else (cfg.local_epochs, "epoch")
        work = f"{n} {unit}" + ("s" if n != 1 else "")
        table.append((name, str(r.rounds), work, f"{cfg.lr:g}", f"{cfg.momentum:g}", str(cfg.batch_size),
                      str(p.clients), p.partition, ",".join(r.models), str(r.latent_dim) if r.latent_dim else "-"))
    return table, refused


def defaults_table(dataset: str) -> str:
    """The epilog of ``hetfed run --help``: every algorithm's defaults on ``dataset``, aligned in columns."""
    table, refused = rows(dataset)
    lines = [f"Defaults on {dataset}, each algorithm run alone (algorithms run together share one partition;",
             "d_e -: the architecture's latent width). Put --dataset NAME before --help for another data set.",
             "lr, momentum, batch and local work not set by a data set are the algorithm's own defaults, the",
             "same an aggregator file or the Helm chart gets when it leaves them out."]
    if not table and len(set(refused.values())) == 1:  # the data set itself is unavailable
        return "\n".join([*lines, "", f"  {next(iter(refused.values()))}"])
    widths = [max(len(row[i]) for row in [HEADER, *table]) for i in range(len(HEADER))]
    lines.append("")
    for row in [HEADER, *table]:
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if refused:
        lines += ["", f"Not on {dataset}:"]
        lines += [f"  {name}: {why}" for name, why in refused.items()]
    return "\n".join(lines)
