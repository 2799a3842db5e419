"""The synthetic foundation-size model of benchmarks/large_model.py and benchmarks/flower_large.py: numpy only.

The model is a GPT-2-Large-like list of float32 tensors scaled to a declared size: 36 transformer blocks of
width ``d`` (layer norms, attention ``c_attn`` d x 3d and ``c_proj`` d x d, MLP ``c_fc`` d x 4d and ``c_proj``
4d x d, each with its bias), a position embedding 1024 x d, a final layer norm, and a token embedding whose
row count makes up the rest. ``d`` is 1280 (GPT-2 Large's) scaled by the square root of the size, in steps of
64; at 3.1 GB the list is GPT-2 Large's own. The total is the declared size to within one embedding row.

Values are generated a block of ``BLOCK`` elements at a time, so a sender holds one block, not the model:
``base`` is the same for every organization (a 1 MiB pattern of N(0, 0.02) values, rolled by position), and an
update is ``base + NOISE * (2u - 1)`` with ``u`` uniform in [0, 1) from a PCG64 seeded by (seed, organization,
round, tensor, block). The FedAvg mean of equally weighted updates is then ``base`` plus the mean noise,
computable in float64 from the same seeds.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

BLOCK = 1 << 18  # elements per generated block: 1 MiB of float32
NOISE = 1e-3
BASE_STD = 0.02
GPT2_LARGE_WIDTH = 1280
GPT2_LARGE_LAYERS = 36
GPT2_LARGE_VOCAB = 50257
GPT2_LARGE_PARAMETERS = 774_030_080  # 3.10 GB of float32
POSITIONS = 1024


def _block_shapes(i: int, d: int) -> list[tuple[str, tuple[int, ...]]]:
    p = f"h.{i}."
    return [(p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)), (p + "attn.c_attn.weight", (d, 3 * d)),
            (p + "attn.c_attn.bias", (3 * d,)), (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
            (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)), (p + "mlp.c_fc.weight", (d, 4 * d)),
            (p + "mlp.c_fc.bias", (4 * d,)), (p + "mlp.c_proj.weight", (4 * d, d)), (p + "mlp.c_proj.bias", (d,))]


def model_shapes(size_bytes: int) -> dict[str, tuple[int, ...]]:
    """GPT-2-Large-like float32 tensors totalling ``size_bytes`` (to within one token-embedding row)."""
    params = size_bytes // 4
    d = max(64, 64 * round(GPT2_LARGE_WIDTH * math.sqrt(params / GPT2_LARGE_PARAMETERS) / 64))
    per_block = 12 * d * d + 13 * d
    fixed = POSITIONS * d + 2 * d
    layers = GPT2_LARGE_LAYERS
    while layers > 1 and fixed + layers * per_block + d > params:
        layers -= 1
    vocab = max(1, (params - fixed - layers * per_block) // d)
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (vocab, d), "wpe.weight": (POSITIONS, d)}
    for i in range(layers):
        shapes.update(_block_shapes(i, d))
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    return shapes


def model_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """The float32 bytes of the tensors."""
    return sum(4 * math.prod(s) for s in shapes.values())


_PATTERN: dict[int, np.ndarray] = {}


def _pattern(seed: int) -> np.ndarray:
    """The base pattern (twice over, so that any rolled window is one slice)."""
    if seed not in _PATTERN:
        p = (np.random.default_rng([seed, 0xBA5E]).standard_normal(BLOCK) * BASE_STD).astype(np.float32)
        _PATTERN[seed] = np.concatenate([p, p])
    return _PATTERN[seed]


def base_block(seed: int, tensor: int, start: int, n: int) -> np.ndarray:
    """Elements ``start .. start + n`` (n <= BLOCK) of tensor number ``tensor``'s base values (a view)."""
    off = (start + 7919 * tensor) % BLOCK
    return _pattern(seed)[off:off + n]


def update_block(seed: int, organization: int, round_: int, tensor: int, start: int, n: int) -> np.ndarray:
    """Elements ``start .. start + n`` (a block: ``start`` a multiple of BLOCK, n <= BLOCK) of tensor number
    ``tensor`` of one organization's update: base + NOISE * (2u - 1), computed in float32 in place."""
    rng = np.random.Generator(np.random.PCG64([seed, organization, round_, tensor, start // BLOCK]))
    u = rng.random(n, np.float32)
    u *= np.float32(2 * NOISE)
    u -= np.float32(NOISE)
    u += base_block(seed, tensor, start, n)
    return u


def update_blocks(shapes: dict[str, tuple[int, ...]], seed: int, organization: int,
                  round_: int) -> Iterator[tuple[int, np.ndarray]]:
    """(tensor number, float32 block) of one organization's update, tensor after tensor, block after block."""
    for k, shape in enumerate(shapes.values()):
        size = math.prod(shape)
        for start in range(0, size, BLOCK):
            yield k, update_block(seed, organization, round_, k, start, min(BLOCK, size - start))


def update_tensor(shapes: dict[str, tuple[int, ...]], name: str, seed: int, organization: int,
                  round_: int) -> np.ndarray:
    """One whole tensor of one organization's update, exactly as ``update_blocks`` streams it (for checks)."""
    k = list(shapes).index(name)
    size = math.prod(shapes[name])
    out = np.empty(size, np.float32)
    for start in range(0, size, BLOCK):
        n = min(BLOCK, size - start)
        out[start:start + n] = update_block(seed, organization, round_, k, start, n)
    return out.reshape(shapes[name])


def base_tensor(shapes: dict[str, tuple[int, ...]], name: str, seed: int) -> np.ndarray:
    """One whole tensor of the base values (the model both sides start from)."""
    k = list(shapes).index(name)
    size = math.prod(shapes[name])
    out = np.empty(size, np.float32)
    for start in range(0, size, BLOCK):
        n = min(BLOCK, size - start)
        out[start:start + n] = base_block(seed, k, start, n)
    return out.reshape(shapes[name])
