"""The masks' pseudorandom generator: a 32-byte seed expanded by AES-256 in counter mode into ring elements.

Each seed is used for one stream only (seeds are derived per round, per pair and per purpose), so the fixed
all-zero initial counter is safe. The keystream's bytes are read as little-endian unsigned integers and reduced
mod 2^b: since 2^b divides 2^32 (or 2^64), every element is uniform in Z_{2^b} if the keystream is.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from hetfed.secagg.ring import reduce, ring_dtype

SEED_BYTES = 32
# Bytes of keystream written per call into the output: large enough to amortise the call, small enough for a
# zero input that stays in cache.
_CHUNK = 1 << 22
_ZEROS = bytes(_CHUNK)


def expand(seed: bytes, length: int, ring_bits: int) -> np.ndarray:
    """``length`` pseudorandom elements of Z_{2^ring_bits} from ``seed`` (32 bytes)."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed has {SEED_BYTES} bytes, not {len(seed)}")
    out = np.empty(length, ring_dtype(ring_bits))
    raw = out.data.cast("B")
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    for start in range(0, len(raw), _CHUNK):
        stop = min(start + _CHUNK, len(raw))
        encryptor.update_into(memoryview(_ZEROS)[: stop - start], raw[start:stop])
    if out.dtype.byteorder == ">":
        out.byteswap(inplace=True)
    return reduce(out, ring_bits)


def pairwise_sign(me: str, peer: str) -> int:
    """+1 if ``me`` adds the mask it shares with ``peer``, -1 if it subtracts it: the pair's masks cancel."""
    return 1 if me < peer else -1
