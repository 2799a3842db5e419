"""Distributed differential privacy under secure aggregation: the distributed Skellam mechanism (Agarwal, Kairouz
and Liu, NeurIPS 2021), its Rényi-DP accounting, and the choice of its parameters. numpy only.

Each of n organizations turns its float vector x (dimension d) into a vector of Z_{2^b} (``Plan.encode``):

1. clip x to L2 norm c (``clip``);
2. scale by s (``scale``: the granularity is 1/s) and pad with zeros to D, the next power of two;
3. flatten with a randomized Walsh-Hadamard rotation H·diag(ξ)/√D whose signs ξ come from a seed all
   organizations share (``Rotation``), so no coordinate holds much of the norm and the sum can be un-rotated;
4. round each coordinate stochastically to an integer, unbiased, drawing again until the rounded vector's L2
   norm is at most the paper's bound (conditional randomized rounding, ``rounded_l2_bound``; β = 0: once);
5. add its share of the noise: Skellam Sk(0, μ/t) per coordinate, the difference of two Poisson(μ/(2t));
6. reduce mod 2^b.

Secure aggregation sums the vectors mod 2^b; the server (``Plan.decode``) centres the sum into [-2^(b-1),
2^(b-1)), un-rotates it and divides by s. Skellam is closed under sums: the t honest organizations' shares add up
to Sk(0, μ), the noise the accountant counts, whatever the n - t others do (they may know and subtract their own
shares). The other shares only add noise.

Privacy (``Plan.rdp``, ``Plan.epsilon``). The sum of integer vectors whose neighbouring values differ by at most
Δ2 in L2 and Δ1 in L1, plus Sk(0, μ) per coordinate, is (α, ε(α))-RDP for every integer α > 1 with

    ε(α) = α Δ2² / (2μ) + min( ((2α - 1) Δ2² + 6 Δ1) / (4μ²), 3 Δ1 / (2μ) )

(Agarwal, Kairouz and Liu 2021, Theorem 3.5; reference code: google-research/federated,
distributed_dp/accounting_utils.py, ``_skellam_rdp``). Rounds compose by adding RDP; ε at δ comes from the
conversion of Canonne, Kamath and Steinke (2020, Prop. 12), the one dp-accounting uses. The neighbours, after
rounding, in the integer domain (``Plan.sensitivity``):

* ``sensitivity`` None, the paper's unit: one organization's whole vector present or absent. The rounded vector
  of norm at most ``rounded_l2_bound(c·s, β, D)`` (conditional rounding makes it so) is the sensitivity.
* ``sensitivity`` Δ (floats, ≤ c): neighbouring data sets move the organization's clipped vector by at most Δ
  (one example of a sum of per-example clipped terms). Clipping to a ball does not expand distances and the
  rotation keeps them, so the scaled vectors differ by at most s·Δ. Stochastic rounding with the same uniforms u
  gives z = ⌈y - u⌉ on both, so each coordinate moves by at most ⌈|y - y'|⌉ < |y - y'| + 1: Δ2 = s·Δ + √D. A
  coupling that bounds the move almost surely bounds the Rényi divergence (it is jointly quasi-convex). Conditional
  rounding would break the coupling, so this unit needs β = 0.

In both, Δ1 = Δ2 · min(√D, Δ2): Cauchy-Schwarz, and |v| ≤ v² for an integer v (reference code,
``rounded_l1_norm_bound``). Modular reduction is post-processing: it costs no privacy, only a wrap-around.

Wrap-around (``Plan.wrap_bound``). A coordinate of the sum wraps when it leaves [-2^(b-1), 2^(b-1)). It is
S + R + N: S = s·(H diag(ξ) Σx)_j, with ‖Σx‖ ≤ n·c, is sub-Gaussian of variance proxy (n c s)²/D over the signs
ξ (Hoeffding); |R| < n (each rounding error is below 1); N, every organization's noise, is Skellam of variance
n·μ/t, with E e^(θN) = exp(nμ/t·(cosh θ - 1)). Chernoff over θ and a union over 2D tails bound the probability
that any coordinate wraps, for any inputs, over the rotation's signs and the noise. ``choose`` picks the largest
scale s at which k standard deviations of the sum fit in half the ring, the paper's rule (Kairouz et al. 2021,
Section 4.4; reference code ``skellam_params``, k = 3), with the noise solved for the target ε at each s.

Subsampling does not apply: every organization takes part in every round, and its vector uses all its data.

Masking an encoded vector (``exact_field``, ``Plan.field_values``, ``Plan.ring_sum``). Secure aggregation's
``Encoding`` scales each field by level / bound, with level = 2^(q-1) - 1 for q value bits, and rounds. A field
whose bound is the level itself scales by exactly 1, so integers pass through it unchanged (float64 holds every
integer below 2^53 exactly, and stochastic rounding leaves an integer as it is). An organization gives its
encoded vector, centred into [-2^(b-1), 2^(b-1)), as such a field: with b <= q - 1 every element lies within the
level, so strict encoding accepts it, and a sum of n of them stays within n times the level, which the secure
sum checks and decodes exactly (its ring has at least q + log2(n) bits). The server reduces that integer sum
mod 2^b: the plain ring sum of the encoded vectors, which ``Plan.decode`` takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hetfed.secagg.errors import SecAggError
from hetfed.secagg.ring import MAX_RING_BITS, Field, reduce, ring_dtype

# RDP orders: the integers 2..128 and 256 (reference code, distributed_dp/accounting_utils.py:23); Theorem 3.5
# holds at integer orders.
ORDERS: tuple[int, ...] = (*range(2, 129), 256)
# Conditional rounding draws again at most this often (each draw passes with probability at least 1 - β).
MAX_ROUNDING_DRAWS = 1000
# The largest local variance: numpy's Poisson sampler (PTRS, float64) keeps the variance to 0.1% at λ = 2^40 and
# 2^44 (2·10^6 draws each) but gives 1.4 times it at λ = 10^16; hetfed's own choice, measured by
# tests/secagg/test_ddp.py::test_numpy_poisson_keeps_its_variance_up_to_the_cap.
MAX_LOCAL_VARIANCE = 2.0**41
# The default bound on the probability that a round's sum wraps around (hetfed's own choice: a wrap spoils the
# round's sum, and in a 32-bit ring the scale it costs leaves rounding far below the noise).
MAX_WRAP = 1e-6


def padded(dim: int) -> int:
    """D: the smallest power of two at least ``dim`` (the Walsh-Hadamard transform's length)."""
    if dim < 1:
        raise SecAggError("bad_parameters", f"dimension {dim} must be >= 1")
    return 1 << (dim - 1).bit_length()


def hadamard(x: np.ndarray) -> np.ndarray:
    """H·x for the unnormalised Walsh-Hadamard matrix H (entries ±1, H·H = D·I) along the last axis, whose
    length D is a power of two; exact on integers (int64), a new array."""
    size = x.shape[-1]
    if size & (size - 1):
        raise SecAggError("bad_parameters", f"a Walsh-Hadamard transform needs a power of two, not {size}")
    y = np.array(x, copy=True)
    lead = y.shape[:-1]
    h = 1
    while h < size:
        y = y.reshape(*lead, size // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = np.stack((a + b, a - b), axis=-2)
        h *= 2
    return y.reshape(*lead, size)


@dataclass(frozen=True)
class Rotation:
    """The randomized Walsh-Hadamard rotation U = H·diag(ξ)/√D of R^D, its signs ξ from ``seed`` (shared by all
    organizations of a round, public): orthogonal, so U⁻¹ = Uᵀ = diag(ξ)·H/√D."""

    dim: int
    seed: int

    @property
    def size(self) -> int:
        return padded(self.dim)

    def signs(self) -> np.ndarray:
        """ξ: D signs ±1 (int64) from the seed."""
        bits = np.random.Generator(np.random.PCG64(np.random.SeedSequence(self.seed))).integers(0, 2, self.size)
        return (2 * bits - 1).astype(np.int64)

    def forward(self, x: np.ndarray) -> np.ndarray:
        """U·x for x of length ``dim`` (zero-padded to D), float64."""
        if x.shape != (self.dim,):
            raise SecAggError("malformed", f"a vector of shape {x.shape}, the rotation takes ({self.dim},)")
        y = np.zeros(self.size, np.float64)
        y[: self.dim] = x
        y *= self.signs()
        return hadamard(y) / math.sqrt(self.size)

    def inverse(self, y: np.ndarray) -> np.ndarray:
        """U⁻¹·y, float64, truncated to the first ``dim`` coordinates (the padding's)."""
        if y.shape != (self.size,):
            raise SecAggError("malformed", f"a vector of shape {y.shape}, the rotation takes ({self.size},)")
        x = hadamard(np.asarray(y, np.float64)) / math.sqrt(self.size)
        x *= self.signs()
        return x[: self.dim]


def rounded_l2_bound(norm: float, beta: float, size: int) -> float:
    """The L2 norm bound after conditional stochastic rounding of a vector of norm ``norm`` (already scaled) in
    ``size`` dimensions: min(norm + √D, √(norm² + D/4 + √(2 ln(1/β))·(norm + √D/2))); β = 0: the first, which
    holds for every draw (Kairouz, Liu and Steinke 2021, Theorem 1 / Proposition 22; reference code,
    ``rounded_l2_norm_bound``)."""
    if not 0 <= beta < 1:
        raise SecAggError("bad_parameters", f"beta {beta} must be in [0, 1)")
    always = norm + math.sqrt(size)
    if beta == 0:
        return always
    squared = norm**2 + size / 4 + math.sqrt(2 * math.log(1 / beta)) * (norm + math.sqrt(size) / 2)
    return min(always, math.sqrt(squared))


def skellam_rdp(l2: float, l1: float, variance: float, orders: tuple[int, ...] = ORDERS) -> np.ndarray:
    """ε(α) at each integer order of Sk(0, ``variance``) per coordinate on an integer query of L2 and L1
    sensitivities ``l2`` and ``l1`` (Agarwal, Kairouz and Liu 2021, Theorem 3.5), float64."""
    if variance <= 0:
        return np.full(len(orders), np.inf)
    a = np.asarray(orders, np.float64)
    if (a < 2).any() or (a != np.floor(a)).any():
        raise SecAggError("bad_parameters", "Skellam RDP holds at integer orders >= 2")
    mu = float(variance)
    extra = np.minimum(((2 * a - 1) * l2**2 + 6 * l1) / (4 * mu**2), 3 * l1 / (2 * mu))
    out: np.ndarray = a * l2**2 / (2 * mu) + extra
    return out


def epsilon_from_rdp(rdp: np.ndarray, delta: float, orders: tuple[int, ...] = ORDERS) -> float:
    """(ε at δ) of a mechanism with RDP ``rdp`` at ``orders``: the minimum over α of
    ε(α) + ln(1 - 1/α) - ln(δα)/(α - 1) (Canonne, Kamath and Steinke 2020, Prop. 12), 0 where ε(α) is so small
    that δ² > 1 - exp(-ε(α)) (the KL bound): the conversion dp-accounting makes."""
    if not 0 < delta < 1:
        raise SecAggError("bad_parameters", f"delta {delta} must be in (0, 1)")
    best = math.inf
    for a, r in zip(orders, rdp, strict=True):
        if not math.isfinite(r):
            continue
        if delta**2 + math.expm1(-r) > 0:
            return 0.0
        best = min(best, r + math.log1p(-1 / a) - math.log(delta * a) / (a - 1))
    return max(0.0, best)


def skellam_tail(threshold: float, variance: float, subgaussian: float = 0.0) -> float:
    """An upper bound on P(X > threshold) for X = G + N, G sub-Gaussian of variance proxy ``subgaussian`` and N
    Skellam of variance ``variance``, independent: min over θ > 0 of exp(-θa + θ²σ²/2 + V(cosh θ - 1)) (Chernoff),
    found where the exponent's derivative -a + θσ² + V sinh θ vanishes. 1 when ``threshold`` ≤ 0."""
    a, v, g = float(threshold), float(variance), float(subgaussian)
    if a <= 0:
        return 1.0
    if v == 0 and g == 0:
        return 0.0

    def slope(theta: float) -> float:
        return -a + theta * g + v * math.sinh(theta)

    hi = min(a / g if g > 0 else math.inf, math.asinh(a / v) if v > 0 else math.inf)
    lo = 0.0
    for _ in range(200):  # the slope rises with θ: bisect for its root in (0, hi]
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if slope(mid) < 0 else (lo, mid)
    theta = hi
    exponent = -theta * a + theta**2 * g / 2 + v * (math.cosh(theta) - 1)
    return min(1.0, math.exp(exponent))


@dataclass(frozen=True)
class Plan:
    """One round's distributed Skellam mechanism: every organization encodes with it, the server decodes with it,
    and each organization's ledger records it (``rdp`` per round).

    ``local_variance``: the Skellam variance each organization adds per coordinate, in the integer domain; the
    accountant counts ``honest`` of the ``clients`` shares (the declared assumption: at least ``honest``
    organizations follow the protocol and keep their noise secret)."""

    dim: int
    clip: float
    scale: float
    local_variance: float
    clients: int
    honest: int
    ring_bits: int
    beta: float = 0.0
    sensitivity: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise SecAggError("bad_parameters", f"clip {self.clip} must be finite and > 0")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise SecAggError("bad_parameters", f"scale {self.scale} must be finite and > 0")
        if self.clip * self.scale >= 2.0**52:
            raise SecAggError("bad_parameters", (
                f"clip x scale = {self.clip * self.scale:.6g} leaves float64 no fraction to round stochastically "
                "(it must stay below 2^52)"))
        if not 0 <= self.local_variance <= MAX_LOCAL_VARIANCE:
            raise SecAggError("bad_parameters", (
                f"local variance {self.local_variance} must be in [0, 2^41] (numpy's Poisson draws are exact enough "
                "below): use a smaller scale"))
        if not 1 <= self.honest <= self.clients:
            raise SecAggError("bad_parameters", f"honest {self.honest} must be in [1, clients = {self.clients}]")
        if not 2 <= self.ring_bits <= MAX_RING_BITS:
            raise SecAggError("bad_parameters", f"ring_bits {self.ring_bits} must be in [2, {MAX_RING_BITS}]")
        if not 0 <= self.beta < 1:
            raise SecAggError("bad_parameters", f"beta {self.beta} must be in [0, 1)")
        if self.sensitivity is not None:
            if not (math.isfinite(self.sensitivity) and 0 < self.sensitivity <= self.clip):
                raise SecAggError("bad_parameters", f"sensitivity {self.sensitivity} must be in (0, clip]")
            if self.beta != 0:
                raise SecAggError("bad_parameters", (
                    "a sensitivity below the whole vector is bounded through rounding with shared uniforms, which "
                    "conditional rounding breaks: it needs beta = 0"))
        padded(self.dim)

    # ------------------------------------------------------------------ sizes and bounds
    @property
    def size(self) -> int:
        """D, the padded dimension: ring elements in one encoded vector."""
        return padded(self.dim)

    @property
    def dtype(self) -> type[np.unsignedinteger]:
        return ring_dtype(self.ring_bits)

    @property
    def norm_bound(self) -> float:
        """The L2 norm every rounded vector keeps (integer domain): conditional rounding draws until it holds."""
        return rounded_l2_bound(self.clip * self.scale, self.beta, self.size)

    @property
    def central_variance(self) -> float:
        """μ: the noise variance per coordinate the accountant counts, the honest organizations' shares."""
        return self.honest * self.local_variance

    def sensitivity_bounds(self) -> tuple[float, float]:
        """(Δ2, Δ1): how far neighbouring data sets move the sum of the rounded vectors, integer domain."""
        if self.sensitivity is None:
            l2 = self.norm_bound
        else:
            l2 = self.sensitivity * self.scale + math.sqrt(self.size)
        return l2, l2 * min(math.sqrt(self.size), l2)

    def rdp(self, orders: tuple[int, ...] = ORDERS) -> np.ndarray:
        """ε(α) of one round at each order."""
        l2, l1 = self.sensitivity_bounds()
        return skellam_rdp(l2, l1, self.central_variance, orders)

    def epsilon(self, rounds: int, delta: float) -> float:
        """ε at δ of ``rounds`` rounds of this mechanism (and nothing else)."""
        return epsilon_from_rdp(rounds * self.rdp(), delta)

    def wrap_bound(self) -> float:
        """An upper bound on the probability that any coordinate of the decoded sum wraps around, when all
        ``clients`` organizations follow the protocol (module docstring)."""
        n, size = self.clients, self.size
        signal = (n * self.clip * self.scale) ** 2 / size
        threshold = 2.0 ** (self.ring_bits - 1) - 1 - n
        return min(1.0, 2 * size * skellam_tail(threshold, n * self.local_variance, signal))

    def local_std(self) -> float:
        """The standard deviation of the noise each organization adds, in the vector's float units."""
        return math.sqrt(self.local_variance) / self.scale

    def central_std(self) -> float:
        """The standard deviation of the noise the accountant counts (the honest shares' sum), in float units."""
        return math.sqrt(self.central_variance) / self.scale

    # ------------------------------------------------------------------ the client's half
    def rounded(self, x: np.ndarray, rotation_seed: int, rng: np.random.Generator) -> np.ndarray:
        """Steps 1 to 4: x clipped to ``clip``, scaled, rotated and rounded (conditionally), int64 of length D.
        ``rng`` draws the rounding's uniforms."""
        y = np.array(x, dtype=np.float64).reshape(-1)
        if not np.isfinite(y).all():
            raise SecAggError("out_of_range", "the vector holds a value that is not finite")
        norm = float(np.linalg.norm(y))
        if norm > self.clip:
            y *= self.clip / norm
        y = Rotation(self.dim, rotation_seed).forward(y) * self.scale
        low = np.floor(y)
        frac = y - low
        bound = self.norm_bound
        for _ in range(MAX_ROUNDING_DRAWS):
            z = low.astype(np.int64) + (rng.random(y.size) < frac)
            if math.sqrt(float(np.dot(z.astype(np.float64), z.astype(np.float64)))) <= bound:
                return z
        raise SecAggError("bad_parameters", f"conditional rounding failed {MAX_ROUNDING_DRAWS} times (beta too small?)")

    def noise(self, rng: np.random.Generator) -> np.ndarray:
        """Step 5: this organization's share, Sk(0, local_variance) per coordinate, int64 of length D."""
        lam = self.local_variance / 2
        if lam == 0:
            return np.zeros(self.size, np.int64)
        out: np.ndarray = rng.poisson(lam, self.size) - rng.poisson(lam, self.size)
        return out.astype(np.int64)

    def encode(self, x: np.ndarray, rotation_seed: int, rng: np.random.Generator) -> np.ndarray:
        """Steps 1 to 6: the vector secure aggregation masks, ``dtype`` of length D."""
        z = self.rounded(x, rotation_seed, rng) + self.noise(rng)
        return reduce(z.view(np.uint64).astype(self.dtype), self.ring_bits)

    # ------------------------------------------------------------------ the server's half
    def centred(self, ring_sum: np.ndarray) -> np.ndarray:
        """The sum mod 2^b as signed integers in [-2^(b-1), 2^(b-1)), int64."""
        if ring_sum.shape != (self.size,):
            raise SecAggError("malformed", f"a sum of shape {ring_sum.shape}, not ({self.size},)")
        z = np.asarray(ring_sum).astype(np.uint64)
        if self.ring_bits < 64:
            z &= np.uint64((1 << self.ring_bits) - 1)
        signed = z.view(np.int64).copy()
        if self.ring_bits < 64:
            signed[signed >= 1 << (self.ring_bits - 1)] -= 1 << self.ring_bits
        return signed

    def field_values(self, encoded: np.ndarray) -> np.ndarray:
        """An encoded vector (``encode``'s, mod 2^b) as the float64 values of an ``exact_field``: its elements
        centred into [-2^(b-1), 2^(b-1)), each an integer held exactly."""
        return self.centred(encoded).astype(np.float64)

    def ring_sum(self, field_sum: np.ndarray) -> np.ndarray:
        """The decoded secure sum of ``exact_field`` values (integers as float64) as the ring sum mod 2^b of the
        encoded vectors, ``dtype``; refused unless every element is an integer below 2^53."""
        x = np.asarray(field_sum, np.float64).reshape(-1)
        if x.shape != (self.size,) or not np.isfinite(x).all() or (np.abs(x) >= 2.0**53).any() or \
                (x != np.rint(x)).any():
            raise SecAggError("malformed", f"a secure sum of {x.shape} that is not {self.size} exact integers")
        z = x.astype(np.int64).view(np.uint64)
        if self.ring_bits < 64:
            z = z & np.uint64((1 << self.ring_bits) - 1)
        return z.astype(self.dtype)

    def decode(self, ring_sum: np.ndarray, rotation_seed: int, inputs: int) -> np.ndarray:
        """The noisy float sum of ``inputs`` organizations' clipped vectors: centred, un-rotated, divided by s.
        Refused for fewer than ``honest`` inputs: such a sum cannot hold the honest shares the accountant counted
        (at least ``honest`` inputs is necessary for the assumption, not sufficient)."""
        if not self.honest <= inputs <= self.clients:
            raise SecAggError("below_threshold" if inputs < self.honest else "bad_parameters", (
                f"a sum of {inputs} inputs; the plan counts the noise of {self.honest} honest ones of "
                f"{self.clients}"))
        return Rotation(self.dim, rotation_seed).inverse(self.centred(ring_sum).astype(np.float64)) / self.scale


def exact_field(name: str, size: int, value_bits: int) -> Field:
    """A field of ``size`` elements that an ``Encoding`` of ``value_bits`` passes through exactly: its bound is the
    encoding's level 2^(q-1) - 1, so it scales by 1 (module docstring). It carries ``Plan.field_values`` of a plan
    of at most ``value_bits`` - 1 ring bits."""
    if not 3 <= value_bits <= 53:
        raise SecAggError("bad_parameters", f"value_bits {value_bits} must be in [3, 53] for an exact field")
    return Field(name, (size,), float(2 ** (value_bits - 1) - 1))


def solve_variance(plan: Plan, epsilon: float, delta: float, rounds: int) -> float:
    """The smallest local variance (to 0.01%) at which ``rounds`` rounds of ``plan``'s mechanism spend at most
    ``epsilon`` at ``delta``."""

    def spent(local: float) -> float:
        return Plan(**{**plan.__dict__, "local_variance": local}).epsilon(rounds, delta)

    lo, hi = 0.0, 1.0
    while spent(hi) > epsilon:
        lo, hi = hi, hi * 2
        if hi > MAX_LOCAL_VARIANCE:
            raise SecAggError("bad_parameters", f"no local variance up to 2^41 reaches epsilon {epsilon} at delta "
                              f"{delta} at scale {plan.scale:.6g}")
    while hi - lo > 1e-4 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if spent(mid) <= epsilon else (mid, hi)
    return hi


def choose(*, epsilon: float, delta: float, rounds: int, dim: int, clip: float, clients: int, honest: int,
           ring_bits: int, sensitivity: float | None = None, beta: float = 0.0, k: float | None = None,
           max_wrap: float = MAX_WRAP) -> Plan:
    """The plan for a target (ε, δ) over ``rounds`` rounds: the largest scale s at which the sum fits the ring,
    with the local variance μ/t solved for the target at that s (and at most ``MAX_LOCAL_VARIANCE``).

    "Fits": with ``k``, the paper's rule, k standard deviations of a coordinate of the sum,
    k·√(n²c²s²/D + n/4 + n·μ/t), within 2^(b-1) (Kairouz et al. 2021, Section 4.4; the reference code's
    ``skellam_params`` solves the same equation: k = 3 by default, accounting_utils.py:579, and 4 in its FL runs,
    fl_run.py:83); it bounds one coordinate's wrap, not all D of them.
    Without ``k`` (the default): ``wrap_bound`` at most ``max_wrap``, for every coordinate at once."""
    n = clients
    half = 2.0 ** (ring_bits - 1)

    def planned(scale: float) -> Plan | None:
        draft = Plan(dim, clip, scale, 0.0, clients, honest, ring_bits, beta, sensitivity)
        try:
            local = solve_variance(draft, epsilon, delta, rounds)
        except SecAggError:
            return None
        return Plan(**{**draft.__dict__, "local_variance": local})

    def fits(plan: Plan | None) -> bool:
        if plan is None:
            return False
        if k is None:
            return plan.wrap_bound() <= max_wrap
        spread = (n * clip * plan.scale) ** 2 / plan.size + n / 4 + n * plan.local_variance
        return k * math.sqrt(spread) <= half

    lo, hi = 1e-9, 1.0
    if not fits(planned(lo)):
        raise SecAggError("bad_parameters", f"{ring_bits} ring bits cannot hold {n} clients' noisy sum at any scale")
    while fits(planned(hi)):
        lo, hi = hi, hi * 2
    while hi / lo > 1.0001:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if fits(planned(mid)) else (lo, mid)
    best = planned(lo)
    assert best is not None
    return best
