"""FedSR (Nguyen, Torr and Lim, NeurIPS 2022): the client half in ``client``, its loss terms in ``losses``."""

from hetfed.client.algorithms.fedsr.client import REFERENCE_PREFIX, FedSRClient

__all__ = ["REFERENCE_PREFIX", "FedSRClient"]
