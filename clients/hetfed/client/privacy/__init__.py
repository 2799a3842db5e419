"""Differential privacy of what an organization sends: its settings, mechanisms and ledger (docs/privacy.md).

``config`` is torch-free (the CLI validates ``[privacy]`` before any process starts); ``mechanisms`` (DP-SGD
through Opacus' per-example gradients, the Gaussian class-sum release) and ``ledger`` (dp-accounting) run in the
client.
"""
