"""Distributed differential privacy in a secure round: one summed payload kind goes through the distributed
Skellam mechanism (``hetfed.secagg.ddp``) instead of the secure sum's fixed-point encoding.

A run's algorithm config says which kind and with which parameters (``TrainConfig.distributed_sum``); both sides
build the same ``DistributedSum`` from the run's config, its number of organizations and of training rounds, so
the plan needs no message of its own. In a secure round:

* the aggregator declares, in the round's encoding, one exact field (``hetfed.secagg.ddp.exact_field``) in place
  of the kind's weighted form (its named arrays and its weight, ``hetfed.wire.summation``): ``shapes``;
* each organization flattens the kind's weighted form (the arrays in name order, then the weight) into one vector,
  encodes it with the plan (clip, scale, rotate, round, add its Skellam share, mod 2^b) and gives it as that
  field, centred (``encode``); secure aggregation masks it like any field and sums it exactly;
* the aggregator reduces the sum mod 2^b, refuses fewer than the plan's honest inputs, un-rotates and rescales it
  (``Plan.decode``) and reads the kind's weighted form back (``decode``), which the server half takes as it
  takes any secure sum. Post-processing, free of privacy cost: each weight rounded and floored at 0, and every
  value of a weight-0 row set to 0 (a class the noise leaves empty adds nothing).

The rotation's seed is public and the same on both sides: a hash of the run seed and the round
(``rotation_seed``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from hetfed.secagg import ddp
from hetfed.secagg.errors import SecAggError
from hetfed.secagg.ring import Field
from hetfed.wire.errors import WireError, from_secagg
from hetfed.wire.payloads import PayloadKind
from hetfed.wire.summation import WEIGHT

# The secure sum's field that carries the encoded vector: "<kind>#ddp" (no "/", so no kind's value; no
# "#weight", so no kind's weight).
SUFFIX = "#ddp"


def rotation_seed(run_seed: int, round_: int) -> int:
    """The round's public rotation seed (63 bits), from the run seed and the round: both sides compute it."""
    digest = hashlib.sha256(f"hetfed-ddp-rotation:{run_seed}:{round_}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass(frozen=True)
class DistributedSum:
    """The distributed Skellam mechanism on one summed kind (module docstring): the kind, the shapes of its
    weighted form (``hetfed.wire.summation``: each ``<kind>/<name>`` array and ``<kind>#weight``) and the plan."""

    kind: PayloadKind
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    plan: ddp.Plan

    @classmethod
    def choose(cls, kind: PayloadKind, shapes: Mapping[str, tuple[int, ...]], *, epsilon: float, delta: float,
               rounds: int, clients: int, honest: int, clip: float, sensitivity: float,
               ring_bits: int) -> DistributedSum:
        """The plan ``ddp.choose`` gives for these targets, on the kind's weighted form of ``shapes``."""
        named = tuple(sorted((n, tuple(s)) for n, s in shapes.items()))
        dim = sum(math.prod(s) for _, s in named)
        try:
            plan = ddp.choose(epsilon=epsilon, delta=delta, rounds=rounds, dim=dim, clip=clip, clients=clients,
                              honest=honest, ring_bits=ring_bits, sensitivity=sensitivity)
        except SecAggError as exc:
            raise WireError("invalid_value", f"distributed DP: {exc}") from None
        return cls(kind, named, plan)

    def __post_init__(self) -> None:
        names = [n for n, _ in self.shapes]
        prefix = self.kind.value + "/"
        if not names or any(not (n.startswith(prefix) or n == self.kind.value + WEIGHT) for n in names):
            raise ValueError(f"the shapes {names} are not {self.kind.value}'s weighted form")
        if sum(math.prod(s) for _, s in self.shapes) != self.plan.dim:
            raise ValueError(f"the plan's dimension {self.plan.dim} is not the weighted form's")

    @property
    def name(self) -> str:
        """The secure sum's field that carries the encoded vector."""
        return self.kind.value + SUFFIX

    def field(self, value_bits: int) -> Field:
        """The exact field of the round's encoding (``value_bits`` the encoding's); refused when the plan's ring
        does not fit its level."""
        if self.plan.ring_bits > value_bits - 1:
            raise WireError("invalid_value", (
                f"distributed DP: a plan of {self.plan.ring_bits} ring bits needs a secure encoding of at least "
                f"{self.plan.ring_bits + 1} value bits, the run's has {value_bits}"))
        return ddp.exact_field(self.name, self.plan.size, value_bits)

    def replace_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The secure round's shapes with the kind's weighted form replaced by the encoded vector; refused when
        the run's schema declares the kind otherwise than the plan."""
        own = {n: tuple(s) for n, s in shapes.items() if n in dict(self.shapes)}
        if own != dict(self.shapes):
            raise WireError("shape_mismatch", (
                f"distributed DP plans {self.kind.value} as {dict(self.shapes)}, the run declares {own}"))
        out = {n: tuple(s) for n, s in shapes.items() if n not in own}
        out[self.name] = (self.plan.size,)
        return out

    def vector(self, values: Mapping[str, np.ndarray]) -> np.ndarray:
        """The kind's weighted form flattened into one float64 vector (arrays in name order)."""
        parts = []
        for name, shape in self.shapes:
            a = np.asarray(values[name], np.float64)
            if a.shape != shape:
                raise WireError("shape_mismatch", f"{name} has shape {a.shape}, the plan {shape}")
            parts.append(a.reshape(-1))
        return np.concatenate(parts)

    def rounded(self, values: Mapping[str, np.ndarray], seed: int, rng: np.random.Generator) -> np.ndarray:
        """The clipped, scaled, rotated and rounded vector before any noise (int64, length D): what one
        organization's data moves (``Plan.sensitivity_bounds``)."""
        return self.plan.rounded(self.vector(values), seed, rng)

    def encode(self, values: Mapping[str, np.ndarray], seed: int,
               rng: np.random.Generator) -> dict[str, np.ndarray]:
        """``values`` (the secure sum's named arrays) with the kind's weighted form replaced by its encoded
        vector, with this organization's Skellam share, as the exact field's values; ``rng`` draws the rounding
        and the noise (it must be secret: whoever knows it can subtract the share)."""
        try:
            encoded = self.plan.encode(self.vector(values), seed, rng)
        except SecAggError as exc:
            raise from_secagg(exc) from None
        out = {n: a for n, a in values.items() if n not in dict(self.shapes)}
        out[self.name] = self.plan.field_values(encoded)
        return out

    def decode(self, values: Mapping[str, np.ndarray], seed: int, inputs: int) -> dict[str, np.ndarray]:
        """The decoded secure sum's named arrays with the encoded vector read back as the kind's weighted form
        (module docstring); refused (``below_threshold``) for fewer than the plan's honest inputs."""
        try:
            flat = self.plan.decode(self.plan.ring_sum(values[self.name]), seed, inputs)
        except SecAggError as exc:
            raise from_secagg(exc) from None
        out = {n: a for n, a in values.items() if n != self.name}
        start = 0
        for name, shape in self.shapes:
            size = math.prod(shape)
            out[name] = flat[start:start + size].reshape(shape).copy()
            start += size
        weight_name = self.kind.value + WEIGHT
        weight = np.maximum(np.rint(out[weight_name]), 0.0)
        out[weight_name] = weight
        for name, _ in self.shapes:
            if name != weight_name and weight.ndim == 1 and out[name].shape[:1] == weight.shape:
                out[name][weight == 0] = 0.0
        return out
