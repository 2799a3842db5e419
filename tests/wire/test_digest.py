"""hetfed.wire.digest is BLAKE3: the published test vectors, and incremental hashing equal to one call."""

from __future__ import annotations

import numpy as np

from hetfed.wire import digest

# BLAKE3's official test vectors (test_vectors.json of the BLAKE3 repository: input i % 251, default 32-byte hash),
# and the specification's "abc".
VECTORS = {
    0: "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262",
    1: "2d3adedff11b61f14c886e35afa036736dcd87a74d27b5c1510225d0f592e213",
    1024: "42214739f095a406f3fc83deb889744ac00df831c10daa55189b5d121c855af7",
}


def test_the_digest_is_blake3() -> None:
    for n, want in VECTORS.items():
        assert digest.digest(bytes(i % 251 for i in range(n))).hex() == want
    assert digest.digest(b"abc").hex() == "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"
    assert digest.SIZE == len(digest.digest(b"")) == 32 and digest.NAME == "BLAKE3"


def test_pieces_hash_as_the_whole_and_any_buffer_is_taken() -> None:
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    h = digest.hasher()
    for lo in range(0, data.size, 1 << 20):
        h.update(memoryview(data)[lo:lo + (1 << 20)])
    assert h.digest() == digest.digest(data.tobytes()) == digest.digest(memoryview(data))
