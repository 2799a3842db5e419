"""``privacy.secure_mode``: the ChaCha20 byte source, uniforms and Box-Muller on known bytes, the floating-point
guard's variance by construction, the secure sampler's moments, fresh noise per generator, the refusal of a seed,
and DP-SGD steps (per record and per group) drawing from it.

The secure draws cannot be seeded. Each statistical check below states its tolerance and its failure probability
for a correct sampler; together they stay below 1e-9."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from scipy import stats
from torch import nn

from hetfed.client.privacy import mechanisms
from hetfed.client.privacy.config import PrivacyConfig
from hetfed.client.privacy.ledger import Ledger, Release
from hetfed.client.privacy.mechanisms import (
    GUARD_DRAWS,
    ChaChaStream,
    PrivacyError,
    PrivateData,
    PrivateStep,
    SecureGenerator,
    box_muller,
    gaussian_class_sums,
    guarded_gaussian,
    included,
    secret_generator,
    uniforms,
)
from hetfed.client.privacy.session import PrivacySession
from hetfed.client.training import Batch, DeviceData, Objective, cross_entropy, fit
from hetfed.wire.config import ConfigError

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
CPU = torch.device("cpu")


def ledger() -> Ledger:
    return Ledger("run", "org", 1e-5, "rdp", 1.0, 1.0)


# ---------------------------------------------------------------------------------------------- exact pieces
def test_chacha_stream_is_the_keystream_under_a_new_nonce_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """With os.urandom fixed to a known key: call k gives ChaCha20's keystream under nonce (counter 0, k), so no
    keystream byte is used twice under one key."""
    key = bytes(range(32))
    monkeypatch.setattr(mechanisms.os, "urandom", lambda n: key[:n])
    stream = ChaChaStream()
    for call in range(3):
        nonce = bytes(4) + call.to_bytes(12, "little")
        want = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor().update(bytes(100))
        assert stream(100) == want
    # RFC 8439 section 2.3.2's block: key 00..1f, counter 1, nonce 00 00 00 09 00 00 00 4a 00 00 00 00.
    block = Cipher(algorithms.ChaCha20(key, bytes.fromhex("01000000000000090000004a00000000")),
                   mode=None).encryptor().update(bytes(4))
    assert block == bytes.fromhex("10f1e7e4")


def test_uniforms_are_the_top_53_bits_plus_one_over_two_to_the_53() -> None:
    """Words 0, 2^64 − 1, 2^63 and 2^11·(2^52 − 1) give 2^-53, 1, 1/2 + 2^-53 and 1/2 exactly: never 0, so
    log(u) is finite."""
    raw = np.array([0, 2**64 - 1, 2**63, (2**52 - 1) << 11], dtype="<u8").tobytes()
    assert uniforms(raw).tolist() == [2.0**-53, 1.0, 0.5 + 2.0**-53, 0.5]


def test_box_muller_on_known_uniforms() -> None:
    """u1 = 1 gives radius 0; u1 = 2^-53, u2 = 1/2 gives (−√(106 ln 2), √(106 ln 2)·sin π); u1 = e^-2 (radius 2),
    u2 = 1/4 gives (2 cos(π/2), 2)."""
    z = box_muller(np.array([1.0, 2.0**-53, math.exp(-2.0)]), np.array([0.3, 0.5, 0.25]))
    r = math.sqrt(106 * math.log(2))
    want = [0.0, -r, 2 * math.cos(math.pi / 2), 0.0, r * math.sin(math.pi), 2.0]
    assert z.tolist() == pytest.approx(want, rel=0, abs=1e-12)


def test_the_guard_sums_four_draws_and_has_variance_std_squared_by_construction() -> None:
    """A deterministic stand-in for the standard Gaussian source: draw j at position i is the sign s_ij of the
    i-th of the 16 vectors of {−1, 1}^4 (each draw has mean 0 and mean square 1, any two are orthogonal).
    The guard asks for exactly 4 draws of n and returns (Σ_j s_ij)·std/2: with std = σC = 1.5·0.5 its mean over
    the 16 positions is 0 and its mean square is σ²C² = 0.5625 exactly, in float64."""
    signs = np.array([[1.0 if (i >> j) & 1 else -1.0 for j in range(4)] for i in range(16)])
    calls: list[int] = []

    def standard(n: int) -> np.ndarray:
        calls.append(n)
        return signs[:, len(calls) - 1].copy()

    std = 1.5 * 0.5
    out = guarded_gaussian(standard, std, 16)
    assert calls == [16] * GUARD_DRAWS and GUARD_DRAWS == 4
    assert out.tolist() == (signs.sum(1) * std / 2).tolist()
    assert float(out.mean()) == 0.0
    assert float((out**2).mean()) == std**2 == 0.5625


def test_secure_generator_on_a_stand_in_byte_source() -> None:
    """The generator's draws follow its byte source: Box-Muller on 2·⌈n/2⌉ uniforms, the first half u1; zero
    noise at std 0; a permutation in the order of the source's words."""
    words = np.array([2**64 - 1, 0, 2**63, 5, 3, 9], dtype="<u8")
    gen = SecureGenerator(lambda n: words[: n // 8].tobytes())
    u = uniforms(words[:4].tobytes())
    assert gen.standard_normal(3).tolist() == box_muller(u[:2], u[2:])[:3].tolist()
    assert torch.equal(gen.normal(0.0, (2, 3)), torch.zeros(2, 3, dtype=torch.float64))
    assert gen.randperm(4).tolist() == [1, 3, 2, 0]
    assert gen.rand(2).tolist() == [1.0, 2.0**-53]


# ---------------------------------------------------------------------------------------------- statistics
def test_secure_noise_has_mean_zero_and_variance_std_squared() -> None:
    """n = 10^6 guarded draws of std 0.75 (the sum of 4 × 10^6 Box-Muller Gaussians). For a correct sampler the
    sample mean is N(0, std²/n) and Σz²/std² is χ²(n) (each draw is exactly Gaussian in real arithmetic).
    Tolerances: |mean| < 6.5·std/√n, failure probability 8.0e-11; Σz²/std² within χ²(n)'s 1e-10 and 1 − 1e-10
    quantiles, failure probability 2e-10. The kurtosis must be within 0.12 of 3: 24 of its standard errors
    √(24/n), a failure probability far below 1e-100 in the normal approximation, while a uniform's 1.8 or a sum
    of two uniforms' 2.4 fails it."""
    n, std = 10**6, 0.75
    z = SecureGenerator().normal(std, (n,)).numpy()
    assert z.dtype == np.float64 and z.shape == (n,)
    assert abs(z.mean()) < 6.5 * std / math.sqrt(n)
    chi2 = float((z**2).sum()) / std**2
    assert stats.chi2.ppf(1e-10, n) < chi2 < stats.chi2.isf(1e-10, n)
    kurtosis = float((z**4).mean()) / float((z**2).mean()) ** 2
    assert abs(kurtosis - 3.0) < 0.12


def test_secure_poisson_inclusion_rate_is_q() -> None:
    """10^6 secure inclusions at q = 0.3: the count is Binomial(n, q), within 8 standard deviations σ = √(nq(1−q));
    Bernstein's inequality bounds the failure probability by 2·exp(−64σ²/(2σ² + 16σ/3)) < 1e-13."""
    n, q = 10**6, 0.3
    count = int(included(SecureGenerator(), n, q).sum())
    assert abs(count - q * n) < 8 * math.sqrt(n * q * (1 - q))
    assert bool(included(SecureGenerator(), 1000, 1.0).all())


def test_two_secure_generators_draw_different_noise() -> None:
    """Each generator has its own key: two give different noise (equal with probability about 2^-53 per entry),
    and so do two rounds of one secure session."""
    a = SecureGenerator().normal(1.0, (1000,))
    b = SecureGenerator().normal(1.0, (1000,))
    assert not torch.equal(a, b)
    s = PrivacySession(PrivacyConfig(noise_multiplier=1.0, secure_mode=True), "run", "org", None, 100, CPU)
    g1, g2 = s.generator(1, 5), s.generator(1, 5)
    assert isinstance(g1, SecureGenerator) and isinstance(g2, SecureGenerator)
    assert not torch.equal(g1.normal(1.0, (100,)), g2.normal(1.0, (100,)))


# ---------------------------------------------------------------------------------------------- config and use
def test_secure_mode_with_a_fixed_noise_seed_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"secure_mode refuses a fixed noise_seed \(3\): the noise must be "
                                          r"unpredictable; leave noise_seed at -1$") as err:
        PrivacyConfig(noise_multiplier=1.0, secure_mode=True, noise_seed=3)
    assert "\n" not in str(err.value)
    with pytest.raises(PrivacyError, match=r"secure_mode refuses a fixed noise_seed \(3\)"):
        secret_generator(3, ["x"], CPU, secure=True)
    assert isinstance(secret_generator(-1, ["x"], CPU, secure=True), SecureGenerator)
    assert isinstance(secret_generator(3, ["x"], CPU), torch.Generator)  # the default path is torch's, as before
    assert PrivacyConfig().secure_mode is False


def test_a_dp_sgd_step_runs_in_secure_mode() -> None:
    """A record-level step on a secure generator: the gradient minus the σ = 0 one is float64 noise of standard
    deviation σC/qN per entry (15 entries: only finiteness and non-zero are asserted), one release recorded."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])

    def grads(step: PrivateStep) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Linear(4, 3).double()
        seen: list[torch.Tensor] = []
        fit([Objective(model, torch.optim.SGD(model.parameters(), lr=0.1), [cross_entropy],
                       before_step=lambda: seen.extend(p.grad.clone() for p in model.parameters()))],  # type: ignore[union-attr]
            [Batch(x, y, private=step)])
        return seen

    led = ledger()
    noisy = grads(PrivateStep(1.0, 0.5, 0.25, 4.0, SecureGenerator(), led))
    clean = grads(PrivateStep(0.0, 0.5, 0.25, 4.0, SecureGenerator(), ledger()))
    for n, c in zip(noisy, clean, strict=True):
        assert torch.isfinite(n).all() and not torch.equal(n, c)
    assert led.pending == [Release(0.25, 1.0, 1)]


def test_poisson_and_group_batches_draw_from_the_secure_generator() -> None:
    """Record and group sampling in secure mode: 200 steps at q = 0.1 over 500 examples (or 50 groups of 10 with
    a cap of 4), batches marked private, each batch group from one data group. The total drawn is Binomial
    (100,000 or 10,000 trials, q): within 8 of its standard deviations, Bernstein's bound on failing is 6e-14 and
    4e-13."""
    n, q, steps = 500, 0.1, 200
    idx = torch.arange(n, dtype=torch.float32)
    data = DeviceData(torch.stack([idx, idx], 1), torch.arange(n) % 10)
    step = PrivateStep(1.0, 1.0, q, q * n, SecureGenerator(), ledger())
    sizes = [len(b.y) for b in PrivateData(data, step).poisson_batches(steps)]
    assert abs(sum(sizes) - q * n * steps) < 8 * math.sqrt(n * steps * q * (1 - q))
    gstep = PrivateStep(1.0, 1.0, q, q * 50, SecureGenerator(), ledger(), grouped=True)
    groups = np.arange(n) // 10
    counts = []
    for b in PrivateData(data, gstep, groups, 4).poisson_batches(steps):
        assert b.private is gstep and b.groups is not None
        in_batch = int(b.groups.max()) + 1 if len(b.y) else 0
        assert len(b.y) == 4 * in_batch
        rows = b.x[:, 0].long().numpy()
        for j in range(in_batch):
            assert len(set(groups[rows[b.groups.numpy() == j]].tolist())) == 1
        counts.append(in_batch)
    assert abs(sum(counts) - q * 50 * steps) < 8 * math.sqrt(50 * steps * q * (1 - q))


def test_class_sums_take_secure_noise() -> None:
    """Fed-CMA's class sums and counts draw from a secure generator too (float64)."""
    z = torch.ones(6, 2, dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1, 1, 2])
    sums, counts = gaussian_class_sums(z, y, 3, 10.0, 0.0, SecureGenerator())
    assert counts.tolist() == [2.0, 3.0, 1.0] and sums[:, 0].tolist() == [2.0, 3.0, 1.0]
    sums, counts = gaussian_class_sums(z, y, 3, 10.0, 1.0, SecureGenerator())
    assert sums.dtype == torch.float64 and not torch.equal(counts, torch.tensor([2.0, 3.0, 1.0], dtype=torch.float64))
