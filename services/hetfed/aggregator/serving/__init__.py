"""Serving: the aggregator process and its gRPC face.

The asyncio server with its health service, metrics endpoint and graceful stop; the servicer (identity, rate and
push limits, run lookup) in front of each ``Run``; the plaintext health listener for probes; and returning a
refused push's memory to the system.
"""
