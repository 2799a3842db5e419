"""FedH2L (Li et al., Algorithm 1): the client half in ``client``, its loss terms in ``losses``."""

from hetfed.client.algorithms.fedh2l.client import FedH2LClient

__all__ = ["FedH2LClient"]
