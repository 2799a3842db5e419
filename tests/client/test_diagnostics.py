"""The latent client-discriminator: chance when organizations' latents match, perfect when they are apart."""

from __future__ import annotations

import numpy as np

from hetfed.client.diagnostics import discriminator_accuracy


def test_discriminator_is_near_chance_for_aligned_latents() -> None:
    rng = np.random.default_rng(0)
    aligned = [rng.random((400, 4)) for _ in range(4)]  # the same distribution at every organization
    assert discriminator_accuracy(aligned, seed=1) < 0.25 + 0.08


def test_discriminator_separates_shifted_latents() -> None:
    rng = np.random.default_rng(0)
    apart = [rng.random((400, 4)) + 2.0 * i for i in range(4)]
    assert discriminator_accuracy(apart, seed=1) == 1.0


def test_discriminator_is_deterministic() -> None:
    rng = np.random.default_rng(3)
    latents = [rng.normal(size=(100, 3)) + 0.3 * i for i in range(3)]
    assert discriminator_accuracy(latents, seed=5) == discriminator_accuracy(latents, seed=5)
