"""FedADG's server half: FedAvg's, bound to FedADG's spec.

The authors' server averages the uploaded feature extractor, classifier and generator parameter by parameter,
unweighted (models/Fed.py:5-27). That is FedAvg's server half on the named tensors of one ModelWeights under
``weighting = "uniform"``: the client sends F's and C's tensors under the model's names and G's under
``generator.*``, and the discriminator never reaches the wire.
"""

from hetfed.aggregator.algorithms.fedavg import FedAvgServer
from hetfed.wire.specs import fedadg

fedadg.SPEC.server_half(FedAvgServer)
