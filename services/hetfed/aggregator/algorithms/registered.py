"""Every server half hetfed ships: importing this module binds each to its spec (``@SPEC.server_half``).

One import per module that holds a server half; numpy only, never a client half.
"""

from hetfed.aggregator.algorithms import (
    fedavg,
    fedavg_head,
    fedcma,
    fedfomo,
    fedgen,
    fedh2l,
    fedmd,
    fedproto,
    fml,
    local,
    simfed,
)

__all__ = ["fedavg", "fedavg_head", "fedcma", "fedfomo", "fedgen", "fedh2l", "fedmd", "fedproto", "fml", "local",
           "simfed"]
