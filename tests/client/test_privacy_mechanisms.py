"""The DP mechanisms' arithmetic: per-example clipping of a joint gradient, DP-SGD's noise (scale, centring,
repeatability), the Gaussian class-sum release (sensitivity, clipping, noise scale) and the secret generator.

Statistical checks draw 10^4 or more entries and allow 5 standard errors of the estimator they test."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from hetfed.client.privacy.ledger import Ledger
from hetfed.client.privacy.mechanisms import (
    PrivateStep,
    clip_and_sum,
    gaussian_class_sums,
    noisy_counts,
    secret_generator,
)

torch.set_num_threads(1)
CPU = torch.device("cpu")


def ledger() -> Ledger:
    return Ledger("run", "org", 1e-5, "rdp", 1.0, 1.0)


# ---------------------------------------------------------------------------------------------- clip_and_sum
def hand_batch() -> list[torch.Tensor]:
    """Per-example gradients of two parameters (shapes (2,) and (2, 2)) for 3 examples whose joint norms are
    5 (3 in A, 4 in B: clipping each parameter alone would differ), 0.5 and 2."""
    a = torch.tensor([[3.0, 0.0], [0.3, 0.0], [0.0, 0.0]], dtype=torch.float64)
    b = torch.tensor([[[0.0, 4.0], [0.0, 0.0]],
                      [[0.0, 0.0], [0.4, 0.0]],
                      [[1.2, 0.0], [0.0, 1.6]]], dtype=torch.float64)
    return [a, b]


def test_clip_and_sum_clips_each_example_jointly_over_parameters() -> None:
    """Σ g_i·min(1, C/‖g_i‖) with C = 1: factors 1/5, 1 and 1/2, computed by hand."""
    a, b = clip_and_sum(hand_batch(), 1.0)
    # A: 3·0.2 + 0.3 + 0 ; B: [[0, 0.8], [0, 0]] + [[0, 0], [0.4, 0]] + [[0.6, 0], [0, 0.8]]
    assert torch.allclose(a, torch.tensor([0.9, 0.0], dtype=torch.float64), rtol=0, atol=1e-6)
    assert torch.allclose(b, torch.tensor([[0.6, 0.8], [0.4, 0.8]], dtype=torch.float64), rtol=0, atol=1e-6)
    # The same by the formula, element by element, and a larger C that clips only the first example.
    grads = hand_batch()
    for c in (1.0, 3.0, 10.0):
        norms = [math.sqrt(float((grads[0][i] ** 2).sum() + (grads[1][i] ** 2).sum())) for i in range(3)]
        want = [sum((g[i] * min(1.0, c / norms[i]) for i in range(3)), torch.zeros_like(g[0])) for g in grads]
        for got, ref in zip(clip_and_sum(grads, c), want, strict=True):
            assert torch.allclose(got, ref, rtol=0, atol=1e-9), c


def test_clip_and_sum_bounds_one_example_by_c_exactly() -> None:
    """A single example of norm 5 comes out at norm C; one of norm below C is left as it is, bit for bit."""
    grads = [g[:1] for g in hand_batch()]
    out = clip_and_sum(grads, 0.7)
    assert math.sqrt(sum(float((t**2).sum()) for t in out)) == pytest.approx(0.7, abs=1e-9)
    small = [g[1:2] for g in hand_batch()]  # norm 0.5 < 1
    for got, g in zip(clip_and_sum(small, 1.0), small, strict=True):
        assert torch.equal(got, g[0])


def test_clip_and_sum_of_no_example_is_zero_of_each_shape_and_dtype() -> None:
    out = clip_and_sum([torch.zeros((0, 2)), torch.zeros((0, 2, 3), dtype=torch.float64)], 1.0)
    assert [t.shape for t in out] == [(2,), (2, 3)]
    assert [t.dtype for t in out] == [torch.float32, torch.float64]
    assert all(float(t.abs().sum()) == 0.0 for t in out)


def test_clip_and_sum_keeps_float32_gradients_float32() -> None:
    grads = [g.float() for g in hand_batch()]
    a, b = clip_and_sum(grads, 1.0)
    assert a.dtype == b.dtype == torch.float32
    assert torch.allclose(a.double(), torch.tensor([0.9, 0.0], dtype=torch.float64), atol=1e-6)


# ---------------------------------------------------------------------------------------------- DP-SGD noise
def noise_of(sigma: float, clip: float, expected_batch: float, seed: int) -> torch.Tensor:
    """The gradient of a step over an empty sample (noise alone) on Linear(100, 100): 10,100 entries."""
    model = nn.Linear(100, 100)
    step = PrivateStep(sigma, clip, 0.01, expected_batch, torch.Generator().manual_seed(seed), ledger())
    params = list(model.parameters())
    step.backward(model, params, torch.zeros(()), 0)
    assert all(p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype for p in params)
    return torch.cat([p.grad.reshape(-1) for p in params]).double()  # type: ignore[union-attr]


def test_step_noise_has_std_sigma_c_over_expected_batch_and_mean_zero() -> None:
    sigma, clip, expected = 1.3, 0.7, 8.0
    noise = noise_of(sigma, clip, expected, seed=11)
    n = noise.numel()
    want = sigma * clip / expected
    # Standard error of the sample std of n normals: std/√(2(n-1)); of the mean: std/√n.
    assert abs(float(noise.std()) / want - 1) < 5 / math.sqrt(2 * (n - 1))
    assert abs(float(noise.mean())) < 5 * want / math.sqrt(n)
    # Gaussian shape: 68.27% within one std (binomial standard error).
    inside = float((noise.abs() < want).double().mean())
    assert abs(inside - 0.6827) < 5 * math.sqrt(0.6827 * 0.3173 / n)


def test_step_noise_is_the_seeds_bit_for_bit_and_another_seeds_differs() -> None:
    a, b, c = noise_of(1.0, 1.0, 4.0, seed=3), noise_of(1.0, 1.0, 4.0, seed=3), noise_of(1.0, 1.0, 4.0, seed=4)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert float((a - c).abs().max()) > 0.1


def test_step_noise_scales_linearly_with_sigma_and_c() -> None:
    """Same generator state: σ·C twice as large gives noise exactly twice as large (the draw is N(0, σC))."""
    a = noise_of(0.5, 1.0, 4.0, seed=5)
    b = noise_of(1.0, 1.0, 4.0, seed=5)
    assert torch.allclose(b, 2 * a, rtol=1e-6, atol=0)


def test_zero_sigma_adds_no_noise() -> None:
    assert float(noise_of(0.0, 1.0, 4.0, seed=1).abs().max()) == 0.0


# ---------------------------------------------------------------------------------------------- class sums
def embeddings(n: int = 40, d: int = 6, k: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, d, generator=g, dtype=torch.float64) * 2  # norms around 2√6: most are clipped at C = 1
    y = torch.arange(n) % k
    return z, y


def test_class_sums_without_noise_are_the_clipped_sums_and_the_counts() -> None:
    z, y = embeddings()
    sums, counts = gaussian_class_sums(z, y, 5, 1.0, 0.0, torch.Generator().manual_seed(0))
    assert sums.dtype == counts.dtype == torch.float64 and sums.shape == (5, 6) and counts.shape == (5,)
    clipped = torch.stack([r * min(1.0, 1.0 / float(r.norm())) for r in z])
    for k in range(5):
        assert torch.allclose(sums[k], clipped[y == k].sum(0), rtol=0, atol=1e-12)
    assert counts.tolist() == [10.0, 10.0, 10.0, 10.0, 0.0]


def test_class_sums_move_by_at_most_c_and_one_count_when_one_example_is_removed() -> None:
    """The sensitivity the release is accounted with: removing any one row moves one class's sum by ≤ C (= C when
    the row is clipped) and that class's count by exactly 1; nothing else moves."""
    z, y = embeddings()
    z[7] = z[7] / z[7].norm() * 0.25  # one row inside the ball: it moves its sum by its own norm
    clip = 1.0
    gen = torch.Generator().manual_seed(0)
    full_sums, full_counts = gaussian_class_sums(z, y, 4, clip, 0.0, gen)
    for i in range(len(y)):
        keep = torch.arange(len(y)) != i
        sums, counts = gaussian_class_sums(z[keep], y[keep], 4, clip, 0.0, gen)
        moved = (full_sums - sums).norm(dim=1)
        assert float(moved.max()) <= clip + 1e-12
        assert float(moved[y[i]]) == pytest.approx(min(clip, float(z[i].norm())), abs=1e-12)
        assert float(moved.sum() - moved[y[i]]) == 0.0
        diff = full_counts - counts
        assert diff.tolist() == [1.0 if k == int(y[i]) else 0.0 for k in range(4)]


def test_an_embedding_of_norm_10_is_clipped_to_norm_c() -> None:
    z = torch.tensor([[6.0, 8.0, 0.0]], dtype=torch.float64)
    sums, counts = gaussian_class_sums(z, torch.tensor([1]), 2, 1.0, 0.0, torch.Generator().manual_seed(0))
    assert float(sums[1].norm()) == pytest.approx(1.0, abs=1e-9)
    assert torch.allclose(sums[1], torch.tensor([0.6, 0.8, 0.0], dtype=torch.float64), atol=1e-9)
    assert float(sums[0].abs().sum()) == 0.0 and counts.tolist() == [0.0, 1.0]
    # float32 input is released in float64 all the same.
    s32, _ = gaussian_class_sums(z.float(), torch.tensor([1]), 2, 2.5, 0.0, torch.Generator().manual_seed(0))
    assert s32.dtype == torch.float64 and float(s32[1].norm()) == pytest.approx(2.5, abs=1e-6)


def test_class_sum_noise_is_sigma_c_on_sums_and_sigma_on_counts() -> None:
    k, d, sigma, clip = 2000, 5, 1.7, 0.4
    z, y = embeddings(n=300, d=d, k=k, seed=1)
    clean_sums, clean_counts = gaussian_class_sums(z, y, k, clip, 0.0, torch.Generator().manual_seed(0))
    sums, counts = gaussian_class_sums(z, y, k, clip, sigma, torch.Generator().manual_seed(9))
    for noise, want in (((sums - clean_sums).reshape(-1), sigma * clip), (counts - clean_counts, sigma)):
        n = noise.numel()
        assert abs(float(noise.std()) / want - 1) < 5 / math.sqrt(2 * (n - 1)), want
        assert abs(float(noise.mean())) < 5 * want / math.sqrt(n), want
    # Repeatable from the generator's seed.
    again, again_counts = gaussian_class_sums(z, y, k, clip, sigma, torch.Generator().manual_seed(9))
    assert torch.equal(again, sums) and torch.equal(again_counts, counts)


def test_noisy_counts_are_rounded_floored_at_zero_and_centred() -> None:
    counts = np.full(20000, 3, dtype=np.int64)
    out = noisy_counts(counts, 2.0, torch.Generator().manual_seed(2))
    assert out.dtype == np.int64 and out.min() == 0
    assert (out == 0).mean() > 0.05  # N(3, 4) is below 0.5 about 11% of the time: floored, not negative
    exact = noisy_counts(counts[:5], 0.0, torch.Generator().manual_seed(2))
    assert exact.tolist() == [3] * 5


# ---------------------------------------------------------------------------------------------- generator
def test_secret_generator_is_repeatable_from_a_seed_and_fresh_without_one() -> None:
    def draw(seed: int, parts: list[int | str]) -> torch.Tensor:
        return torch.rand(8, generator=secret_generator(seed, parts, CPU))

    assert torch.equal(draw(5, [1, 2, "org", 0]), draw(5, [1, 2, "org", 0]))
    others: list[list[int | str]] = [[2, 2, "org", 0], [1, 2, "org2", 0], [1, 2, "org", 1]]
    for other in others:
        assert not torch.equal(draw(5, [1, 2, "org", 0]), draw(5, other))
    assert not torch.equal(draw(5, [1]), draw(6, [1]))
    assert not torch.equal(draw(-1, [1]), draw(-1, [1]))  # OS entropy: a different generator each time
