"""Per-run figures read from each run's round history at scrape time, so they survive an aggregator restart.

The traffic counters (``hetfed_aggregator_bytes_total``) start from zero in every aggregator process. The
families here are computed on each scrape from the run's closed-round records, which the aggregator
persists and restores from its state directory, plus the open round's record: cumulative bytes per run,
rounds closed, the reported accuracy per round and at the end, participation, the open round's age against
its deadline, and a declared FedAvg reference (``fedavg_model_bytes`` in the run config). The privacy families
(``hetfed_privacy_*``) read the run's organization ledger, which the checkpoint and the log restore.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hetfed.aggregator.journal.history import RoundRecord
from hetfed.aggregator.run.conductor import Run
from hetfed.wire.payloads import EvalMetrics
from hetfed.wire.phases import Phase
from hetfed.wire.traffic import Direction, KindCount

RUN_LABELS = ["run", "algorithm"]
PRIVACY_LABELS = ["run", "organization"]
Family = CounterMetricFamily | GaugeMetricFamily


def weighted_accuracy(reports: dict[str, EvalMetrics]) -> float | None:
    """Test accuracy over every organization's test examples (as ``summarize_run`` computes it); organizations
    that withheld their accuracy or test count are left out, and None when none reported both."""
    shown = [m for m in reports.values()
             if m.figure("test_accuracy") is not None and m.figure("num_test_examples") is not None]
    n = sum(m.num_test_examples for m in shown)
    if not n:
        return None
    return sum(m.test_accuracy * m.num_test_examples for m in shown) / n


def rounds_missed(history: list[RoundRecord], organization: str) -> int:
    """Consecutive most recent closed rounds without this organization's update (setup rounds skipped).

    An organization's presence is read from the round's reports: every train and evaluate update carries
    its EvalMetrics.
    """
    missed = 0
    for rec in reversed(history):
        if rec.phase is Phase.SETUP:
            continue
        if organization in rec.reports:
            break
        missed += 1
    return missed


class RunMetricsCollector(Collector):
    """Collects the per-run families from the runs ``runs()`` returns, reading a snapshot of each."""

    def __init__(self, runs: Callable[[], Iterable[Run]], clock: Callable[[], float] = time.monotonic) -> None:
        self._runs = runs
        self._clock = clock

    def describe(self) -> Iterable[Metric]:
        """The families this collector exports (without samples)."""
        return list(self._families().values())

    @staticmethod
    def _families() -> dict[str, Family]:
        rl = RUN_LABELS
        return {
            "bytes": CounterMetricFamily(
                "hetfed_run_bytes", "Serialized bytes of the run so far (closed rounds from the persisted history, "
                "plus the open round), by phase, direction and payload kind",
                labels=[*rl, "phase", "direction", "payload_kind"]),
            "rounds": CounterMetricFamily("hetfed_run_rounds_closed", "Rounds of the run closed so far, by phase",
                                          labels=[*rl, "phase"]),
            "fedavg": CounterMetricFamily(
                "hetfed_run_fedavg_reference_bytes", "What FedAvg with the model the run declares "
                "(fedavg_model_bytes) would have moved in the run's closed train rounds: 2 x clients x model bytes",
                labels=rl),
            "last_bytes": GaugeMetricFamily("hetfed_run_last_round_bytes",
                                            "Bytes of the last closed round, by direction", labels=[*rl, "direction"]),
            "accuracy": GaugeMetricFamily(
                "hetfed_run_test_accuracy", "Test accuracy of the last closed round with reports, over every "
                "organization's own test examples", labels=rl),
            "final": GaugeMetricFamily("hetfed_run_final_test_accuracy",
                                       "Test accuracy of the finished run's evaluation round", labels=rl),
            "finished": GaugeMetricFamily("hetfed_run_finished", "1 once the run has finished, else 0", labels=rl),
            "organizations": GaugeMetricFamily("hetfed_run_organizations", "Organizations the run lists",
                                               labels=rl),
            "age": GaugeMetricFamily(
                "hetfed_run_round_age_seconds", "Seconds since the open round opened (0 until an organization "
                "joins, and once the run has finished)", labels=rl),
            "deadline": GaugeMetricFamily("hetfed_run_round_deadline_seconds",
                                          "The run's round deadline (round_deadline_seconds)", labels=rl),
            "missed": GaugeMetricFamily(
                "hetfed_run_organization_rounds_missed", "Consecutive most recent closed rounds without the "
                "organization's update", labels=[*rl, "organization"]),
            "epsilon": GaugeMetricFamily(
                "hetfed_privacy_epsilon", "The ε of the organization's last privacy declaration: what its client "
                "accounted for everything it sent in the run so far (docs/privacy.md)", labels=PRIVACY_LABELS),
            "delta": GaugeMetricFamily(
                "hetfed_privacy_delta", "The δ of the organization's last privacy declaration",
                labels=PRIVACY_LABELS),
            "unprotected": GaugeMetricFamily(
                "hetfed_privacy_unprotected_organizations", "Organizations of the run whose last accepted update "
                "declared no differential privacy", labels=["run"]),
        }

    def collect(self) -> Iterator[Metric]:
        """One sample set per run, from a snapshot of its history and open round."""
        f = self._families()
        for run in self._runs():
            self._collect_run(run, f)
        yield from f.values()

    def _collect_run(self, run: Run, f: dict[str, Family]) -> None:
        # A snapshot without the run's lock: the history only grows, and the open round's record is replaced,
        # not cleared, when a round closes (it is in the history by then, so it is not counted twice).
        history = list(run.history)
        current, phase = run.current, run.phase
        finished = phase is Phase.FINISHED
        records = list(history)
        if not finished and not (history and history[-1] is current):
            records.append(current)
        labels = [run.cfg.id, run.cfg.algorithm]
        totals: dict[tuple[str, str, str], int] = {}
        for rec in records:
            for direction, tb in ((Direction.UP, rec.up), (Direction.DOWN, rec.down)):
                kinds: dict[str, KindCount] = dict(tb.kinds)
                for kind, c in kinds.items():
                    key = (rec.phase.value, direction.value, kind)
                    totals[key] = totals.get(key, 0) + c.bytes
        for (ph, way, kind), n in sorted(totals.items()):
            f["bytes"].add_metric([*labels, ph, way, kind], n)
        for closed in (Phase.SETUP, Phase.TRAIN, Phase.EVALUATE):
            f["rounds"].add_metric([*labels, closed.value], sum(1 for rec in history if rec.phase is closed))
        model_bytes = run.cfg.fedavg_model_bytes
        if model_bytes:
            ref = sum(2 * rec.clients * model_bytes for rec in history if rec.phase is Phase.TRAIN)
            f["fedavg"].add_metric(labels, ref)
        if history:
            last = history[-1]
            f["last_bytes"].add_metric([*labels, Direction.UP], last.up.total_bytes)
            f["last_bytes"].add_metric([*labels, Direction.DOWN], last.down.total_bytes)
        for rec in reversed(history):
            acc = weighted_accuracy(rec.reports)
            if acc is not None:
                f["accuracy"].add_metric(labels, acc)
                break
        if finished and history:
            acc = weighted_accuracy(history[-1].reports)
            if acc is not None:
                f["final"].add_metric(labels, acc)
        f["finished"].add_metric(labels, 1.0 if finished else 0.0)
        f["organizations"].add_metric(labels, len(run.cfg.organizations))
        age = 0.0 if finished or not run.joined else max(0.0, self._clock() - current.started)
        f["age"].add_metric(labels, age)
        f["deadline"].add_metric(labels, run.cfg.round_deadline_seconds)
        unprotected = 0
        for org in run.cfg.organizations:
            f["missed"].add_metric([*labels, org], rounds_missed(history, org))
            counts = run.ledger.get(org)
            if counts.privacy is not None:
                f["epsilon"].add_metric([run.cfg.id, org], counts.privacy.epsilon)
                f["delta"].add_metric([run.cfg.id, org], counts.privacy.delta)
            unprotected += counts.unprotected
        f["unprotected"].add_metric([run.cfg.id], unprotected)
