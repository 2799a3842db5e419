"""FedSR (Nguyen, Torr and Lim, NeurIPS 2022): simple representations for federated domain generalisation.

A probabilistic encoder p(z|x) = N(μ(x), σ(x)²) with a linear classifier on a reparameterised sample z,
trained with cross-entropy plus an L2 penalty on z (L2R, eq. 11) and an upper bound of the conditional
mutual information I(x; z | y) (CMI, eq. 18: the analytic KL to a learnable per-class Gaussian r(z|y)).
``losses`` holds the model wrapper, the sampled prediction and the two terms; ``nets`` the paper's
Rotated MNIST network.
"""
