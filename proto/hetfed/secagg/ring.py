"""Fixed-point encoding of float arrays into the ring Z_{2^b}, and decoding of a sum of n encoded inputs.

A value x of a field with declared bound c is clipped to [-c, c] (or refused, in strict mode), scaled by
s = (2^(q-1) - 1) / c and rounded to an integer z with |z| <= 2^(q-1) - 1 (q: ``value_bits``), stochastically
(unbiased, from a seeded generator) or to the nearest integer. z is stored as z mod 2^b (two's complement in b
bits). A sum of n such integers has |Σz| <= n (2^(q-1) - 1), so it decodes exactly, without wrap-around, as long
as that bound is at most 2^(b-1) - 1: ``Encoding`` refuses any (n, q, b) that breaks it (``ring_bits_for`` gives
the smallest b). Decoding checks that the unmasked sum lies within the bound and refuses it otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from hetfed.secagg.errors import SecAggError

MAX_RING_BITS = 64


def ring_bits_for(max_inputs: int, value_bits: int) -> int:
    """The smallest ring size b (bits) in which a sum of ``max_inputs`` values of ``value_bits`` never wraps."""
    bound = max_inputs * (2 ** (value_bits - 1) - 1)
    return bound.bit_length() + 1


def ring_dtype(ring_bits: int) -> type[np.unsignedinteger]:
    """The unsigned integer type that stores elements of Z_{2^ring_bits}."""
    return np.uint32 if ring_bits <= 32 else np.uint64


def reduce(vector: np.ndarray, ring_bits: int) -> np.ndarray:
    """``vector`` (an array of ``ring_dtype``, in place) reduced mod 2^ring_bits."""
    if ring_bits not in (32, 64):
        vector &= vector.dtype.type((1 << ring_bits) - 1)
    return vector


@dataclass(frozen=True)
class Field:
    """One named array of the summed input: its shape, the bound c of each value (|x| <= c) and, optionally,
    a bound on its L2 norm."""

    name: str
    shape: tuple[int, ...]
    bound: float
    norm_bound: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bound) and self.bound > 0):
            raise SecAggError("bad_parameters", f"field {self.name!r}: bound {self.bound} must be finite and > 0")
        if self.norm_bound is not None and not (math.isfinite(self.norm_bound) and self.norm_bound > 0):
            raise SecAggError("bad_parameters", f"field {self.name!r}: norm bound {self.norm_bound} must be > 0")
        if any(d < 0 for d in self.shape):
            raise SecAggError("bad_parameters", f"field {self.name!r}: negative dimension in {self.shape}")

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Encoding:
    """How an input (named float arrays) becomes one vector of Z_{2^ring_bits}, and a sum of at most
    ``max_inputs`` such vectors becomes floats again."""

    fields: tuple[Field, ...]
    value_bits: int
    ring_bits: int
    max_inputs: int
    stochastic: bool = True

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise SecAggError("bad_parameters", f"field names repeat: {names}")
        if not 2 <= self.value_bits <= 53:
            raise SecAggError("bad_parameters", f"value_bits {self.value_bits} must be in [2, 53]")
        if not 2 <= self.ring_bits <= MAX_RING_BITS:
            raise SecAggError("bad_parameters", f"ring_bits {self.ring_bits} must be in [2, {MAX_RING_BITS}]")
        if self.max_inputs < 1:
            raise SecAggError("bad_parameters", f"max_inputs {self.max_inputs} must be >= 1")
        need = ring_bits_for(self.max_inputs, self.value_bits)
        if need > self.ring_bits:
            raise SecAggError("bad_parameters", (
                f"a sum of {self.max_inputs} values of {self.value_bits} bits could wrap around in "
                f"{self.ring_bits} bits: it needs {need}"))

    @classmethod
    def for_inputs(cls, fields: tuple[Field, ...], max_inputs: int, value_bits: int = 16,
                   stochastic: bool = True) -> Encoding:
        """The encoding with the smallest ring (32 or 64 bits, the native widths) that holds the sum."""
        need = ring_bits_for(max_inputs, value_bits)
        return cls(fields, value_bits, 32 if need <= 32 else 64, max_inputs, stochastic)

    @property
    def level(self) -> int:
        """The largest |z| of one encoded value."""
        return 2 ** (self.value_bits - 1) - 1

    @property
    def length(self) -> int:
        """Ring elements in one encoded input."""
        return sum(f.size for f in self.fields)

    @property
    def dtype(self) -> type[np.unsignedinteger]:
        return ring_dtype(self.ring_bits)

    def encode(self, arrays: Mapping[str, np.ndarray], rng: np.random.Generator | None = None,
               strict: bool = False) -> np.ndarray:
        """The input as one ring vector. ``rng`` draws the stochastic rounding (required when ``stochastic``);
        ``strict`` refuses values out of range instead of clipping them."""
        if set(arrays) != {f.name for f in self.fields}:
            declared = [f.name for f in self.fields]
            raise SecAggError("malformed", f"fields {sorted(arrays)} are not the declared {declared}")
        if self.stochastic and rng is None:
            raise SecAggError("bad_parameters", "stochastic rounding needs a seeded generator")
        out = np.empty(self.length, self.dtype)
        start = 0
        for field in self.fields:
            z = self._quantize(field, np.asarray(arrays[field.name]), rng, strict)
            out[start:start + field.size] = z.view(np.uint64)  # two's complement, truncated to the dtype
            start += field.size
        return reduce(out, self.ring_bits)

    def _quantize(self, field: Field, x: np.ndarray, rng: np.random.Generator | None, strict: bool) -> np.ndarray:
        """The field's integers z (int64), |z| <= level; works in one float64 copy of the input, in place."""
        if x.shape != field.shape:
            raise SecAggError("malformed", f"field {field.name!r} has shape {x.shape}, declared {field.shape}")
        y = np.array(x, dtype=np.float64).reshape(-1)
        if not np.isfinite(y).all():
            raise SecAggError("out_of_range", f"field {field.name!r} holds a value that is not finite")
        peak = float(np.max(np.abs(y))) if y.size else 0.0
        if strict and peak > field.bound:
            raise SecAggError("out_of_range", f"field {field.name!r}: |x| reaches {peak:.6g} > bound {field.bound:.6g}")
        np.clip(y, -field.bound, field.bound, out=y)
        if field.norm_bound is not None:
            norm = float(np.linalg.norm(y))
            if norm > field.norm_bound:
                if strict:
                    raise SecAggError("out_of_range", (
                        f"field {field.name!r}: L2 norm {norm:.6g} > bound {field.norm_bound:.6g}"))
                y *= field.norm_bound / norm
        y *= self.level / field.bound
        np.clip(y, -self.level, self.level, out=y)
        if not self.stochastic:
            return np.rint(y, out=y).astype(np.int64)
        assert rng is not None
        low = np.floor(y)
        y -= low  # the fraction: rounded up with that probability
        up = rng.random(y.size) < y
        z = low.astype(np.int64)
        z += up
        return z

    def signed(self, ring_sum: np.ndarray) -> np.ndarray:
        """A ring vector as signed integers (int64), each in [-2^(b-1), 2^(b-1))."""
        if ring_sum.dtype != self.dtype or ring_sum.shape != (self.length,):
            raise SecAggError("malformed", (
                f"a sum of {ring_sum.dtype} {ring_sum.shape}, not {self.length} ring elements"))
        if self.ring_bits == 64:
            return ring_sum.view(np.int64)
        z = ring_sum.astype(np.int64)
        z[z >= 1 << (self.ring_bits - 1)] -= 1 << self.ring_bits
        return z

    def decode_sum(self, ring_sum: np.ndarray, inputs: int) -> dict[str, np.ndarray]:
        """The float sum of ``inputs`` encoded inputs, per field; refused (``sum_out_of_range``) where a value
        exceeds ``inputs`` times the field's bound, which no ``inputs`` honest encodings can produce."""
        if not 1 <= inputs <= self.max_inputs:
            raise SecAggError("bad_parameters", f"{inputs} inputs, the encoding sums 1 to {self.max_inputs}")
        z = self.signed(ring_sum)
        limit = inputs * self.level
        outside = (z > limit) | (z < -limit)
        if outside.any():
            bad = int(np.argmax(outside))
            raise SecAggError("sum_out_of_range", (
                f"element {bad} of the unmasked sum is {int(z[bad])}, beyond {inputs} x {self.level}"))
        out: dict[str, np.ndarray] = {}
        start = 0
        for field in self.fields:
            part = z[start:start + field.size].astype(np.float64) * (field.bound / self.level)
            out[field.name] = part.reshape(field.shape)
            start += field.size
        return out
