"""The hetfed aggregator service, numpy only, in rooms by job (docs/architecture.md).

- ``serving``: the process, its gRPC servicer, health listener and memory trimming;
- ``observe``: metrics, the per-run collector, the run observer and Kubernetes Events;
- ``run``: ``Run`` (the conductor), the run's state and transitions, its ``Aggregation`` (the server half),
  admission;
- ``journal``: the run's durable record (checkpoint, history, write-ahead log) and its group commit;
- ``config`` and ``algorithms``: the configuration and one server half per algorithm.

A room imports only the rooms listed after it (the import contract ``aggregator-rooms`` in pyproject.toml).
"""
