"""Fed-CMA (Algorithm 1, worker side): the client half in ``client``, its loss terms in ``losses``."""

from hetfed.client.algorithms.fedcma.client import FedCMAClient

__all__ = ["FedCMAClient"]
