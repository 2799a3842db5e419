"""Every client half hetfed ships: importing this module binds each to its spec (``@SPEC.client_half``).

One import per module or package that holds a client half (all of them take about 30 ms to import once
torch is loaded); never a server half.
"""

from hetfed.client.algorithms import (
    ditto,
    fedavg,
    fedavg_body,
    fedavg_head,
    fedcma,
    fedfomo,
    fedgen,
    fedh2l,
    fedmd,
    fedproto,
    fedprox,
    fedrep,
    fedsr,
    fml,
    local,
    simfed,
)

__all__ = ["ditto", "fedavg", "fedavg_body", "fedavg_head", "fedcma", "fedfomo", "fedgen", "fedh2l", "fedmd", "fedproto", "fedprox",
           "fedrep", "fedsr", "fml", "local", "simfed"]
