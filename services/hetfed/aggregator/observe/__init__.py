"""Observation: what the outside sees of the aggregator, never changing a run.

The Prometheus metrics and the per-run collector read at scrape time, the ``RunObserver`` that turns a run's
transitions into metrics, log lines and Events, and the Kubernetes Events themselves.
"""
