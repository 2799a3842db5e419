"""Observability as code: the Grafana dashboards and the alert rules the chart ships.

Build tooling, not part of the installed ``hetfed`` package: ``python scripts/gen_observability.py`` writes
the checked-in files from these modules, and ``tests/observability/test_dashboards.py`` fails on drift.
"""
