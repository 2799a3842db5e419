"""Ditto with latent-space drift constraints (Ayromlou & Emerson, "Adaptive Latent-Space Constraints in Personalized FL").

Each organization keeps a global model w_G (trained on cross-entropy and averaged by the server) and a personal
model w_L (never sent) trained on cross-entropy + (λ/2)·‖w_L − w̄‖² + μ·D(f(b; θ_L), f(b; θ̄)) (eq. 4), where D
is one of the drift measures of :mod:`hetfed.client.algorithms.ditto.losses`: MK-MMD (§3.3), MMD-D (§3.4) or
the cosine baseline.
"""

from hetfed.client.algorithms.ditto.client import DittoClient

__all__ = ["DittoClient"]
