"""Secure aggregation (SecAgg+): the aggregator learns the sum of the clients' inputs and nothing else about any
one of them. The cryptographic and arithmetic core, shared by the aggregator (numpy, no torch) and the client;
it imports only numpy, the standard library and ``cryptography``, and no Protobuf (a wire layer maps its stage
messages, plain dataclasses, to Protobuf).

Protocol (Bell, Bogetoft, Guha, Kaur, Raykova, CCS 2020, after Bonawitz et al., CCS 2017), one run per round:

0. Setup (``RoundConfig``). The server publishes the run and round, the roster of clients, the degree k of the
   neighbourhood graph, its 32-byte seed, the threshold t and the input encoding. Every client computes the same
   Harary graph H(k, n) over the roster in the seed's order (``graph``); with k = n - 1 it is complete (SecAgg).
1. Advertise keys. Each client makes two fresh X25519 key pairs: one to seal shares, one to derive masks.
   The server gives each client the keys of its neighbours that advertised.
2. Share keys. Each client draws a 32-byte self-mask seed b_u and Shamir-shares b_u and its mask private key
   s_u, t-out-of-(its live neighbours), over the field of 2^521 - 1 (``shamir``). It seals each neighbour's pair
   of shares with ChaCha20-Poly1305 under an X25519 + HKDF-SHA256 key bound to run, round and both names, with
   associated data binding sender, receiver, run and round (``keys``). The server routes the sealed shares.
3. Mask. Each client encodes its input into Z_{2^b} (``ring``: clip to the declared range and norm bound, or
   refuse in strict mode; seeded stochastic rounding to q bits) and sends
   y_u = x_u + PRG(b_u) + sum over neighbours v that shared of ±PRG(s_uv) mod 2^b, with + when u < v, so each
   pair's masks cancel. s_uv is X25519(s_u, S_v) through HKDF; PRG is AES-256-CTR (``prg``).
4. Unmask. The survivors are the clients whose masked input arrived. Each survivor reveals, for each neighbour
   that masked with it, the share of b_v if v survived or the share of s_v if v dropped, never both for one peer
   (a request asking both is refused, and a client answers one request per round). The server rebuilds each b_u
   and each dropped s_v from t shares, removes all masks and decodes the sum, refusing it if any element lies
   beyond (number of survivors) x (the declared bound).

Dropouts. A client missing before masking (or left with fewer than t live neighbours) is excluded: nobody masks
with it. After masking, a dropout's pairwise masks are removed with its rebuilt key. If a survivor or a masked-
with dropout has fewer than t surviving neighbours, the server abandons the round before asking for any share;
if fewer than t answer the unmask request, it abandons it with the shares received unused (``AbandonedError``).

Threat model. Inputs stay hidden from the server and from up to t - 1 colluding clients among any client's
neighbours, as long as the server follows the protocol (honest-but-curious): a client's self mask needs t shares
of b_u, and its pairwise masks with honest neighbours need their keys. Against a server that lies about who
dropped, the client-side rules (one request per round, never both shares of a peer, the request's lists equal to
the neighbours it masked with, at least t survivors among them) and t > k/2 (enforced: ``RoundConfig``) keep any
two disjoint groups of honest neighbours from giving both of a client's secrets, so such a server colluding with
c of a client's neighbours learns nothing of it while c < 2t - k. With k < n - 1 the server also learns the
partial sums of any parts that the colluding clients cut the graph into; a Harary graph of degree k stays
connected while fewer than k clients collude (test_primitives). Not covered here: a server that substitutes
public keys (the wire layer binds each organization's keys to its mTLS identity), the consistency-check round
of the malicious-secure variants (signed survivor lists), a server that picks the graph seed to surround a
client with colluders (moot with k = n - 1), a client that submits a masked value outside its declared range
(only the unmasked sum is checked), and what the sum itself reveals (distributed differential privacy adds
noise for that: ``ddp``, the distributed Skellam mechanism and its accounting, which a secure round applies to
the summed kind an algorithm's config plans: ``hetfed.wire.distributed``).

What the tests prove (tests/secagg): the unmasked sum equals the plain sum of the encoded inputs exactly, for
n = 2..10, every allowed degree, fields of every shape (test_protocol); dropouts after masking down to the
threshold are recovered and more abandon the round, with no client's seed and key shares both received
(test_protocol); one masked input, alone, passes chi-square and Kolmogorov-Smirnov uniformity tests that the
encoded input fails (test_adversary); a share readdressed or replayed into another round fails to open, a
request for both shares of a peer or a second request is refused, and a server that splits a client's
neighbours between "survived" and "dropped" gets too few shares of either secret (test_adversary); any t
Shamir shares rebuild the secret and t - 1 are distributed alike whatever it is (test_shamir); encoding errors
stay within a grid step and a ring that could wrap is refused (test_ring).

Parameters. k (``degree``, ``default_degree``: n - 1, the complete graph), t (``threshold``, default floor(k/2) + 1, in (k/2, k]: tolerates
k - t dropouts per neighbourhood), q (``value_bits``, default 16) and b (``ring_bits``, the smallest of 32 or 64
with n (2^(q-1) - 1) < 2^(b-1); a smaller b that could wrap is refused). Randomness: ``keys.system_entropy``
(os.urandom) in real rounds; ``keys.SeededEntropy`` reproduces a round in tests and benchmarks.
"""

from hetfed.secagg.client import ClientSession
from hetfed.secagg.errors import AbandonedError, SecAggError
from hetfed.secagg.keys import SeededEntropy, system_entropy
from hetfed.secagg.messages import (
    Aggregate,
    EncryptedShare,
    KeyAdvert,
    MaskedInput,
    PeerKeys,
    PeerShares,
    RevealedShare,
    RoundConfig,
    SharedKeys,
    UnmaskReply,
    UnmaskRequest,
    default_degree,
    default_threshold,
)
from hetfed.secagg.ring import Encoding, Field, ring_bits_for
from hetfed.secagg.server import ServerSession

__all__ = [
    "AbandonedError",
    "Aggregate",
    "ClientSession",
    "Encoding",
    "EncryptedShare",
    "Field",
    "KeyAdvert",
    "MaskedInput",
    "PeerKeys",
    "PeerShares",
    "RevealedShare",
    "RoundConfig",
    "SecAggError",
    "SeededEntropy",
    "ServerSession",
    "SharedKeys",
    "UnmaskReply",
    "UnmaskRequest",
    "default_degree",
    "default_threshold",
    "ring_bits_for",
    "system_entropy",
]
