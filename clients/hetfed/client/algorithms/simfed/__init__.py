"""SimFed (paper 004): the client half in ``client``, its factorised layers in ``layers``."""

from hetfed.client.algorithms.simfed.client import SimFedClient, criteria_set_id

__all__ = ["SimFedClient", "criteria_set_id"]
