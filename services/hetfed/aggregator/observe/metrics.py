"""The aggregator's Prometheus metrics, on a registry of its own (several aggregators may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hetfed.wire.traffic import TrafficMetrics


class AggregatorMetrics:
    """Traffic, rounds, rejections and the training figures clients report."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.traffic = TrafficMetrics(r, "aggregator")
        self.rejected = Counter(
            "hetfed_rejected_messages", "Messages rejected, by reason", ["run", "reason"], registry=r
        )
        self.duplicates = Counter(
            "hetfed_duplicate_pushes", "Retried pushes of an already accepted update (acknowledged, not re-applied)",
            ["run"], registry=r,
        )
        self.partial_pushes_dropped = Counter(
            "hetfed_partial_pushes_dropped", "Pushes cut mid-stream whose received part was dropped (or never kept), "
            "by reason: expired, round_closed, over_size, replaced, refused; at start-up also invalid, torn, unsynced",
            ["reason"], registry=r,
        )
        self.storage_errors = Counter(
            "hetfed_storage_errors", "Writes to the state directory that failed (a push answered storage_unavailable, "
            "a join or round close retried); nothing acknowledged was lost", ["run"], registry=r,
        )
        self.secure_abandoned = Counter(
            "hetfed_secure_rounds_abandoned", "Rounds whose secure aggregate was abandoned (too few survivors or "
            "shares); they closed with the model unchanged", ["run"], registry=r,
        )
        self.round_duration = Histogram(
            "hetfed_round_duration_seconds", "Wall time from a round's opening to its close",
            ["run", "algorithm"], registry=r,
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
        )
        self.clients_per_round = Gauge(
            "hetfed_clients_per_round", "Organizations whose update the last closed round used",
            ["run", "algorithm"], registry=r,
        )
        self.refused_organizations = Gauge(
            "hetfed_refused_organizations", "1 for each member organization refused for a reason no retry can fix "
            "(it no longer holds rounds open), by its latest reason", ["run", "organization", "reason"], registry=r,
        )
        self.refused_runs = Gauge(
            "hetfed_refused_runs", "1 for each configured run the aggregator does not host: its stored state "
            "conflicts with its config (Status and the log say why)", ["run"], registry=r,
        )
        self.current_round = Gauge("hetfed_current_round", "The open round", ["run", "algorithm"], registry=r)
        self.client_train_loss = Gauge(
            "hetfed_reported_train_loss", "Training loss an organization reported for its last round",
            ["run", "algorithm", "organization"], registry=r,
        )
        self.client_test_accuracy = Gauge(
            "hetfed_reported_test_accuracy", "Test accuracy an organization reported for its last round",
            ["run", "algorithm", "organization"], registry=r,
        )
        self.client_metric = Gauge(
            "hetfed_reported_metric", "A named figure an organization reported for its last round "
            "(EvalMetrics.extra, e.g. wdp, cdp, acc)", ["run", "algorithm", "organization", "name"], registry=r,
        )
        self.client_withheld = Gauge(
            "hetfed_reported_withheld", "1 for each figure an organization withheld in its last round: computed "
            "from private data and not released under its privacy settings (docs/privacy.md); its other gauges "
            "then have no sample for it, never 0", ["run", "algorithm", "organization", "name"], registry=r,
        )
        self.client_metric_mean = Gauge(
            "hetfed_reported_metric_mean", "Mean over the organizations of a named figure in the last closed round "
            "(organizations that withheld it are left out)",
            ["run", "algorithm", "name"], registry=r,
        )
