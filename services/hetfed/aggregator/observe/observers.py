"""What the outside sees of a run's transitions: Prometheus metrics, Kubernetes Events and the log.

A run (``hetfed.aggregator.run.conductor``) calls its ``RunObserver`` as it carries out each transition's
effects; the observer never changes the run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from hetfed.aggregator.journal.history import RoundRecord
from hetfed.aggregator.observe import k8s_events
from hetfed.aggregator.observe.metrics import AggregatorMetrics
from hetfed.aggregator.run.state import RefusalChanged, Refused
from hetfed.wire.payloads import EvalMetrics
from hetfed.wire.specs import Figure
from hetfed.wire.traffic import Direction, TrafficBreakdown

log = logging.getLogger("hetfed.aggregator")


class RunObserver:
    """One run's metrics and Events. Per-organization figure names and the published means are tracked so that
    a name nobody reports any more leaves the metrics: label values stay bounded by the last reports."""

    def __init__(self, run_id: str, algorithm: str, metrics: AggregatorMetrics, figures: tuple[Figure, ...]) -> None:
        self.run_id, self.algorithm, self.metrics, self._declared = run_id, algorithm, metrics, figures
        self._figure_names: dict[str, set[str]] = {}
        self._mean_names: set[str] = set()
        self._withheld_names: dict[str, set[str]] = {}
        # (organization, figure) pairs of the fixed gauges that hold a sample.
        self._sampled: set[tuple[str, str]] = set()

    def figures(self, m: EvalMetrics) -> dict[str, float]:
        """Every reported figure by name, the spec's declared figures (by their key) included."""
        out = dict(m.extra)  # a withheld extra figure is not in it
        for f in self._declared:
            value = m.figure(f.source)
            if value is not None:
                out[f.key] = value
        return out

    def folded(self, organization: str, m: EvalMetrics | None) -> None:
        """An update was folded in; ``m``: the metrics it reported."""
        if m is None:
            return
        labels = (self.run_id, self.algorithm, organization)
        for name, gauge in (("train_loss", self.metrics.client_train_loss),
                            ("test_accuracy", self.metrics.client_test_accuracy)):
            value = m.figure(name)
            if value is not None:
                gauge.labels(*labels).set(value)
                self._sampled.add((organization, name))
            elif (organization, name) in self._sampled:  # withheld: no sample, never a stale one or 0
                gauge.remove(*labels)
                self._sampled.discard((organization, name))
        for name in m.withheld:
            self.metrics.client_withheld.labels(*labels, name).set(1)
        for gone in self._withheld_names.get(organization, set()) - set(m.withheld):
            self.metrics.client_withheld.remove(*labels, gone)
        self._withheld_names[organization] = set(m.withheld)
        figures = self.figures(m)
        for name, value in figures.items():
            self.metrics.client_metric.labels(*labels, name).set(value)
        for gone in self._figure_names.get(organization, set()) - set(figures):
            self.metrics.client_metric.remove(*labels, gone)
        self._figure_names[organization] = set(figures)

    def closed(self, rec: RoundRecord) -> None:
        """A round closed: its duration, clients, the means of its figures, a log line and an Event."""
        ids = (self.run_id, self.algorithm)
        self.metrics.round_duration.labels(*ids).observe(rec.duration)
        self.metrics.clients_per_round.labels(*ids).set(rec.clients)
        figures = [self.figures(m) for m in rec.reports.values()]
        names = {n for f in figures for n in f}
        for name in names:
            values = [f[name] for f in figures if name in f]
            self.metrics.client_metric_mean.labels(*ids, name).set(sum(values) / len(values))
        if figures:
            for gone in self._mean_names - names:
                self.metrics.client_metric_mean.remove(*ids, gone)
            self._mean_names = names
        log.info("run %s closed %s round %d with %d clients in %.2fs", self.run_id, rec.phase.value, rec.round,
                 rec.clients, rec.duration)
        if rec.abandoned:
            self.metrics.secure_abandoned.labels(self.run_id).inc()
            log.warning("run %s: the secure aggregate of round %d was abandoned (%s); the model is unchanged",
                        self.run_id, rec.round, rec.abandoned)
            k8s_events.emit("SecureAggregateAbandoned", f"run {self.run_id} round {rec.round}: {rec.abandoned}",
                            warning=True)
        k8s_events.emit("RoundClosed", f"run {self.run_id} closed {rec.phase.value} round {rec.round} "
                        f"with {rec.clients} clients in {rec.duration:.2f}s")

    def round_opened(self, round_: int) -> None:
        """The run's current round."""
        self.metrics.current_round.labels(self.run_id, self.algorithm).set(round_)

    def refusal(self, change: RefusalChanged, released: bool) -> None:
        """A member's refusal was recorded or lifted. ``released``: rounds no longer wait for it."""
        org, new, old = change.organization, change.refused, change.old
        if old is not None:
            self.metrics.refused_organizations.remove(self.run_id, org, old.reason)
        if new is None:
            if old is not None:
                log.info("run %s: organization %r, refused earlier (%s), joined", self.run_id, org, old.reason)
            return
        self.metrics.refused_organizations.labels(self.run_id, org, new.reason).set(1)
        log.error("run %s: organization %r refused for good (%s): %s; %s", self.run_id, org, new.reason, new.message,
                  "rounds no longer wait for it" if released else "its earlier admission stands")
        k8s_events.emit("OrganizationRefused", f"run {self.run_id}: organization {org} refused ({new.reason}): "
                        f"{new.message}", warning=True)

    def restored(self, refused: Mapping[str, Refused]) -> None:
        """Refusals read back from the checkpoint at start-up."""
        for org, r in refused.items():
            self.metrics.refused_organizations.labels(self.run_id, org, r.reason).set(1)

    def storage_error(self) -> None:
        """A write to the run's state directory failed."""
        self.metrics.storage_errors.labels(self.run_id).inc()

    def duplicate(self) -> None:
        """An update arrived again, identical."""
        self.metrics.duplicates.labels(self.run_id).inc()

    def traffic(self, organization: str, direction: Direction, b: TrafficBreakdown) -> None:
        """Bytes exchanged with an organization, by direction and payload kind."""
        self.metrics.traffic.record(self.run_id, self.algorithm, organization, direction, b)
