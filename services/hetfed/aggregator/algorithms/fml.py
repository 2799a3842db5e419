"""FML's server half: FedAvg's, bound to FML's spec (numpy).

The server of FML (Shen et al. 2020) averages the organizations' meme models as FedAvg averages its model:
weighted by example counts, or uniformly as the authors' code does (``weighting``, Node.py:61-67), with FedAvg's
plausibility bounds. The organizations' private models never reach it.
"""

from hetfed.aggregator.algorithms.fedavg import FedAvgServer
from hetfed.wire.specs import fml

fml.SPEC.server_half(FedAvgServer)

__all__ = ["FedAvgServer"]
