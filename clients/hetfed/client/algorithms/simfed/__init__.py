"""SimFed (paper 004: similarity matching and kernel factorization), the client's torch side.

``layers`` holds the factorised dense and convolution layers of eqs. 4-6, the function that builds any
hetfed model with a factorised encoder, the mask's L1 term of eq. 7, the sparse mask codec of the
``FactorizedWeights`` payload, and the criteria inputs x_N with their embeddings z_N = E(x_N) (eqs. 1-2).
The server's similarity matching and reflection (eqs. 3 and 8) are numpy functions in
``hetfed.aggregator.algorithms.simfed``.
"""
