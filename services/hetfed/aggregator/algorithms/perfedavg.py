"""Per-FedAvg's server half: FedAvg's, bound to this spec too.

Algorithm 1 of the paper ends each round with the server's average of the returned models, w ← 1/(rn)·Σ w_i:
FedAvg's average under ``weighting = "uniform"`` (the config's default). Everything Per-FedAvg adds is on the
client (the meta-step and the personalising step before evaluation).
"""

from hetfed.aggregator.algorithms.fedavg import FedAvgServer
from hetfed.wire.specs import perfedavg

perfedavg.SPEC.server_half(FedAvgServer)
