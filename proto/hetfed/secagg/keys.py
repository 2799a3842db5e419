"""Key agreement and authenticated encryption of the stages, and the randomness they draw.

Each client makes two X25519 key pairs per round: one whose agreements key the encryption of its Shamir shares,
one whose agreements seed its pairwise masks. An agreement is X25519 followed by HKDF-SHA256 whose ``info``
binds the protocol, the purpose, the run, the round and both identities (sorted, so both ends derive the same
key). Shares travel under ChaCha20-Poly1305 with associated data binding sender, receiver, run and round, so
a ciphertext replayed to another round, run or receiver fails to open.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from hetfed.secagg.errors import SecAggError

DOMAIN = b"hetfed-secagg-v1"
KEY_BYTES = 32
NONCE_BYTES = 12
SHARE_PURPOSE = b"share-encryption"
MASK_PURPOSE = b"pairwise-mask"

Entropy = Callable[[int], bytes]


def system_entropy(n: int) -> bytes:
    """``n`` bytes from the operating system's cryptographic generator: what a real round draws."""
    return os.urandom(n)


class SeededEntropy:
    """Reproducible bytes from a seed (a ChaCha20 keystream): for tests and benchmarks, never for a real round,
    where anyone who knows the seed knows every key and mask."""

    def __init__(self, seed: int | str) -> None:
        key = hashlib.sha256(DOMAIN + b"/seeded-entropy/" + str(seed).encode()).digest()
        self._stream = Cipher(algorithms.ChaCha20(key, bytes(16)), None).encryptor()

    def __call__(self, n: int) -> bytes:
        return self._stream.update(bytes(n))


def length_prefixed(*parts: bytes) -> bytes:
    """An unambiguous concatenation: each part preceded by its length (4 bytes)."""
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def split_prefixed(data: bytes, count: int) -> list[bytes]:
    """The ``count`` parts of a ``length_prefixed`` concatenation; ``malformed`` if it is not one."""
    parts, at = [], 0
    for _ in range(count):
        if at + 4 > len(data):
            raise SecAggError("malformed", "a length-prefixed field is cut")
        n = int.from_bytes(data[at:at + 4], "big")
        if at + 4 + n > len(data):
            raise SecAggError("malformed", "a length-prefixed field is cut")
        parts.append(data[at + 4:at + 4 + n])
        at += 4 + n
    if at != len(data):
        raise SecAggError("malformed", "bytes after the last length-prefixed field")
    return parts


@dataclass(frozen=True)
class KeyPair:
    """An X25519 key pair as raw 32-byte strings."""

    private: bytes
    public: bytes

    @classmethod
    def generate(cls, entropy: Entropy) -> KeyPair:
        key = X25519PrivateKey.from_private_bytes(entropy(KEY_BYTES))
        return cls(key.private_bytes_raw(), key.public_key().public_bytes_raw())


def binding(purpose: bytes, run_id: str, round_no: int, *names: str) -> bytes:
    """The context a key or a ciphertext is bound to."""
    return length_prefixed(DOMAIN, purpose, run_id.encode(), round_no.to_bytes(8, "big"),
                           *(n.encode() for n in names))


def agree(private: bytes, peer_public: bytes, purpose: bytes, run_id: str, round_no: int, a: str, b: str) -> bytes:
    """The 32-byte key that ``a`` and ``b`` share for ``purpose`` in this run and round."""
    if len(peer_public) != KEY_BYTES:
        raise SecAggError("bad_keys", f"a public key has {KEY_BYTES} bytes, not {len(peer_public)}")
    try:
        peer = X25519PublicKey.from_public_bytes(peer_public)
        shared = X25519PrivateKey.from_private_bytes(private).exchange(peer)
    except ValueError as exc:  # a low-order public key gives the all-zero secret
        raise SecAggError("bad_keys", f"key agreement failed: {exc}") from None
    lo, hi = sorted((a, b))
    info = binding(purpose, run_id, round_no, lo, hi)
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(shared)


def seal(key: bytes, plaintext: bytes, associated: bytes, entropy: Entropy) -> bytes:
    """``plaintext`` encrypted and authenticated under ``key`` with ``associated`` data: nonce || ciphertext."""
    nonce = entropy(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def open_sealed(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    """The plaintext of ``seal``; ``share_authentication_failed`` when the key, the data or the binding differ."""
    if len(sealed) < NONCE_BYTES + 16:
        raise SecAggError("malformed", "a sealed message is shorter than its nonce and tag")
    try:
        return ChaCha20Poly1305(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
    except InvalidTag:
        raise SecAggError("share_authentication_failed", "the share does not open under its binding") from None
