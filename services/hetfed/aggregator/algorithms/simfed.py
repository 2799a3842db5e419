"""SimFed's server math (numpy only): similarity matching (eq. 3) and personalised knowledge reflection (eq. 8).

Each organization k uploads, after local training, its factors θ_k (u, v and the sparse mask μ of every
factorised layer) and its embeddings z_{N,k} = E_k(x_N) of the shared criteria inputs. The server:

1. σ_kj = cos(z_{N,k}, z_{N,j}) (eq. 3). The paper feeds a *single* criteria input, so z is one
   d-vector; with B inputs the [B, D] embeddings of an organization are flattened row-major into one
   B·D vector (their concatenation) and the cosine is taken between those, which is eq. 3 exactly when
   B = 1. An all-zero embedding (e.g. a dead ReLU latent) has similarity 0 with every other organization
   and 1 with itself, so it is matched with itself only.
2. J_k = {j : σ_kj ≥ τ}; k is always in J_k (σ_kk = 1 ≥ τ for any τ ≤ 1, and forced for the zero case).
3. w_kj = softmax_{j∈J_k}(α·σ_kj), computed as exp(α·σ_kj − m − log Σ_l exp(α·σ_kl − m)), m = max, so
   that α = 30 (the paper's) or any larger α neither overflows nor loses the weights' ratio.
4. θ_k ← θ_k + Σ_{j∈J_k} w_kj·(θ_j − θ_k) (eq. 8), for u, v and μ separately, in float64. The paper
   typesets the weight outside the sum with an unbound j; it is read as the weight of each term. Because
   Σ_j w_kj = 1 and k ∈ J_k this equals the convex combination Σ_{j∈J_k} w_kj·θ_j; the difference form
   is kept because it is the paper's and because it returns θ_k bit for bit when J_k = {k}. Sparse masks
   are reflected on their dense float64 scatter; the result's support is the union of the members'
   supports (minus exact cancellations), returned as increasing flat indices.
5. Round 1 has no reflection (Algorithm 1: ``if r > 1``): every organization starts from the same seeded
   initial factors, so the first download is nothing; from round 2 on, organization k receives the
   reflection of the latest uploads (a per-organization download, not a broadcast).

Design note: server state (for the server half of phase 2).

* The state is, per organization, its latest upload: a ``FactorizedWeights`` (read-only numpy arrays as
  decoded from the wire: u and v float32, mask indices int64 and values float32) and its criteria
  embeddings ([B, D] float32). Hold them in a dict organization → latest payload and replace an entry by
  reference when the organization uploads again; never copy them per round, and never keep older rounds
  (eq. 8 needs only the latest factors).
* At a round's close the server computes σ (K×K float64, K organizations) and J_k, w_kj from the
  embeddings, then each organization's personalised download, one organization and one layer at a time
  through a float64 scratch buffer of the layer's size (dense scatter of the members' masks), cast to
  float32 and re-sparsified. The downloads replace the previous round's (they are what the organizations
  pull next) and the uploads they came from may then be dropped, so in steady state the server holds
  K uploads or K downloads, and 2·K payloads only while a round closes.
* Size, for L factorised layers with mask shapes I_l × O_l (convolutions: I_l·F × O_l·F), n_l sent mask
  entries per organization, B criteria inputs of width D:
      per organization: 4·Σ_l (I_l + O_l) + 12·Σ_l n_l + 4·B·D bytes (u, v float32; int64 index and
      float32 value per mask entry; embeddings), so K·(that) in all, plus 8·K² bytes for σ. It grows
      linearly in the number of organizations by design (personalised models), and with density ρ of
      the masks it is about 12·ρ·P + 4·Σ(I_l + O_l) per organization for P weight entries, against 4·P
      for a dense model. Downloads can be denser than uploads (union of supports) unless re-thresholded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hetfed.wire.payloads import FactorizedLayer, FactorizedWeights

__all__ = [
    "cosine_similarity_matrix",
    "match",
    "personalised_downloads",
    "random_similarity_sets",
    "reflect",
    "reflect_factorized",
    "reflect_sparse",
    "reflection_weights",
    "similarity_sets",
    "sparse_from_dense",
]


def cosine_similarity_matrix(embeddings: Sequence[np.ndarray]) -> np.ndarray:
    """σ [K, K] float64: cosine similarity of the organizations' flattened criteria embeddings (diagonal 1)."""
    if len(embeddings) == 0:
        raise ValueError("need the criteria embeddings of at least one organization")
    rows = [np.asarray(z, dtype=np.float64).reshape(-1) for z in embeddings]
    shapes = {np.shape(z) for z in embeddings}
    if len(shapes) != 1:
        raise ValueError(
            f"criteria embeddings of every organization must have one shape, got {sorted(shapes)}"
        )
    if rows[0].size == 0:
        raise ValueError("criteria embeddings are empty")
    z = np.stack(rows)
    if not np.all(np.isfinite(z)):
        raise ValueError("criteria embeddings hold non-finite values")
    norms = np.linalg.norm(z, axis=1)
    unit = np.divide(z, norms[:, None], out=np.zeros_like(z), where=norms[:, None] > 0)
    sigma = np.clip(unit @ unit.T, -1.0, 1.0)
    np.fill_diagonal(sigma, 1.0)
    return sigma


def _square(sigma: np.ndarray) -> np.ndarray:
    s = np.asarray(sigma, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] != s.shape[1] or s.shape[0] == 0:
        raise ValueError(f"similarities must form a non-empty square matrix, got shape {s.shape}")
    if not np.all(np.isfinite(s)):
        raise ValueError("similarities must be finite")
    return s


def similarity_sets(sigma: np.ndarray, tau: float) -> list[np.ndarray]:
    """J_k = {j : σ_kj ≥ τ} for every k, as increasing int64 index arrays that always contain k."""
    s = _square(sigma)
    if not math.isfinite(tau):
        raise ValueError(f"tau must be finite, got {tau}")
    sets = []
    for k in range(s.shape[0]):
        member = s[k] >= tau
        member[k] = True
        sets.append(np.flatnonzero(member).astype(np.int64))
    return sets


def random_similarity_sets(
    num_organizations: int, partners: int, seed: int | Sequence[int]
) -> list[np.ndarray]:
    """The "random matching" ablation (paper Table 3): J_k = {k} plus ``partners`` others drawn uniformly."""
    if num_organizations < 1 or partners < 0:
        raise ValueError(
            f"need num_organizations >= 1 and partners >= 0, got {num_organizations}, {partners}"
        )
    rng = np.random.default_rng(seed)
    sets = []
    for k in range(num_organizations):
        others = np.array([j for j in range(num_organizations) if j != k], dtype=np.int64)
        picked = rng.choice(others, size=min(partners, others.size), replace=False) if others.size else others
        sets.append(np.sort(np.concatenate([[k], picked]).astype(np.int64)))
    return sets


def reflection_weights(sigma_row: np.ndarray, members: np.ndarray, alpha: float) -> np.ndarray:
    """w_j = softmax_{j∈J}(α·σ_j) over the members J, by log-sum-exp (float64, sums to 1)."""
    row = np.asarray(sigma_row, dtype=np.float64).reshape(-1)
    idx = np.asarray(members, dtype=np.int64).reshape(-1)
    if idx.size == 0:
        raise ValueError("a similarity set is never empty (it holds the organization itself)")
    if idx.min() < 0 or idx.max() >= row.size:
        raise ValueError(f"similarity set members must lie in [0, {row.size}), got {idx.tolist()}")
    if not (math.isfinite(alpha) and alpha >= 0.0):
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha}")
    logits = alpha * row[idx]
    if not np.all(np.isfinite(logits)):
        raise ValueError("similarities must be finite")
    shifted = logits - logits.max()
    return np.exp(shifted - np.log(np.exp(shifted).sum()))


def reflect(own: np.ndarray, members: Sequence[np.ndarray], weights: np.ndarray) -> np.ndarray:
    """Eq. 8 on dense arrays: θ_k + Σ_j w_j·(θ_j − θ_k), in float64 (``members`` include θ_k's own slot)."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if len(members) != w.size:
        raise ValueError(f"{len(members)} member arrays but {w.size} weights")
    base = np.asarray(own, dtype=np.float64)
    if not np.all(np.isfinite(base)):
        raise ValueError("the organization's own factors hold non-finite values")
    delta = np.zeros_like(base)
    for theta, wj in zip(members, w, strict=True):
        t = np.asarray(theta, dtype=np.float64)
        if t.shape != base.shape:
            raise ValueError(f"member factors have shape {t.shape}, expected {base.shape}")
        if not np.all(np.isfinite(t)):
            raise ValueError("member factors hold non-finite values")
        delta += wj * (t - base)
    return base + delta


def _scatter(indices: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    idx = np.asarray(indices)
    val = np.asarray(values)
    if idx.ndim != 1 or val.ndim != 1 or idx.shape != val.shape:
        raise ValueError(
            f"sparse mask indices and values must be 1-D of one length, got {idx.shape}, {val.shape}"
        )
    if idx.size and not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"sparse mask indices must be integers, got {idx.dtype}")
    if idx.size and (idx.min() < 0 or idx.max() >= size or np.unique(idx).size != idx.size):
        raise ValueError(f"sparse mask indices must be distinct and lie in [0, {size})")
    if not np.all(np.isfinite(val)):
        raise ValueError("sparse mask values hold non-finite numbers")
    out = np.zeros(size, dtype=np.float64)
    out[idx.astype(np.int64)] = val.astype(np.float64)
    return out


def sparse_from_dense(dense: np.ndarray, threshold: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Increasing flat int64 indices and float64 values of the entries with |x| > threshold."""
    if not (math.isfinite(threshold) and threshold >= 0.0):
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold}")
    flat = np.asarray(dense, dtype=np.float64).reshape(-1)
    idx = np.flatnonzero(np.abs(flat) > threshold).astype(np.int64)
    return idx, flat[idx]


def reflect_sparse(
    own: tuple[np.ndarray, np.ndarray],
    members: Sequence[tuple[np.ndarray, np.ndarray]],
    weights: np.ndarray,
    size: int,
    threshold: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 8 on sparse masks given as (flat indices, values) into ``size`` entries; returns the same form.

    The masks are scattered into float64 buffers, reflected with :func:`reflect`, and the entries with
    |μ| > ``threshold`` (default: every non-zero) are returned.
    """
    if size < 0:
        raise ValueError(f"mask size must be >= 0, got {size}")
    base = _scatter(own[0], own[1], size)
    dense = [_scatter(i, v, size) for i, v in members]
    return sparse_from_dense(reflect(base, dense, weights), threshold)


def match(
    embeddings: Sequence[np.ndarray], tau: float, alpha: float
) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Similarity matching: σ, the sets J_k (σ_kj ≥ τ, with k) and the reflection weights softmax(α·σ_kj)."""
    sigma = cosine_similarity_matrix(embeddings)
    sets = similarity_sets(sigma, tau)
    return sigma, sets, [reflection_weights(sigma[k], members, alpha) for k, members in enumerate(sets)]


def reflect_factorized(
    own: FactorizedWeights, members: Sequence[FactorizedWeights], weights: np.ndarray, threshold: float = 0.0
) -> FactorizedWeights:
    """Eq. 8 layer by layer on u, v and the sparse mask separately; float64 inside, float32 out."""
    if len(members) != np.asarray(weights).size:
        raise ValueError(f"{len(members)} member payloads but {np.asarray(weights).size} weights")
    layers = []
    for pos, layer in enumerate(own.layers):
        size = math.prod(layer.mask_shape)
        peers = []
        for m in members:
            if len(m.layers) != len(own.layers):
                raise ValueError(f"a member payload has {len(m.layers)} layers, expected {len(own.layers)}")
            peer = m.layers[pos]
            if peer.name != layer.name or tuple(peer.mask_shape) != tuple(layer.mask_shape):
                raise ValueError(
                    f"layer {pos}: member has {peer.name!r} {tuple(peer.mask_shape)}, "
                    f"expected {layer.name!r} {tuple(layer.mask_shape)}"
                )
            peers.append(peer)
        u = reflect(layer.u, [p.u for p in peers], weights)
        v = reflect(layer.v, [p.v for p in peers], weights)
        idx, val = reflect_sparse(
            (layer.mask_indices, layer.mask_values),
            [(p.mask_indices, p.mask_values) for p in peers],
            weights,
            size,
            threshold,
        )
        layers.append(
            FactorizedLayer(
                name=layer.name,
                u=u.astype(np.float32),
                v=v.astype(np.float32),
                mask_indices=idx,
                mask_values=val.astype(np.float32),
                mask_shape=tuple(layer.mask_shape),
            )
        )
    return FactorizedWeights(layers=tuple(layers), num_examples=own.num_examples)


def personalised_downloads(
    round_number: int,
    uploads: Sequence[FactorizedWeights],
    sets: Sequence[np.ndarray],
    weights: Sequence[np.ndarray],
    threshold: float = 0.0,
) -> list[FactorizedWeights] | None:
    """What each organization k receives before training round ``round_number`` (eq. 8 over J_k).

    Round 1 has no reflection (Algorithm 1): None, every organization keeps its seeded initial factors.
    From round 2 on, ``uploads`` are the latest factors of round − 1, and ``sets``/``weights`` come from
    :func:`match` (or an ablation's sets) on that round's criteria embeddings.
    """
    if round_number < 1:
        raise ValueError(f"rounds count from 1, got {round_number}")
    if round_number == 1:
        return None
    if not (len(uploads) == len(sets) == len(weights)):
        raise ValueError(
            f"{len(uploads)} uploads, {len(sets)} similarity sets and {len(weights)} weight rows"
        )
    out = []
    for k, (members, w) in enumerate(zip(sets, weights, strict=True)):
        idx = np.asarray(members, dtype=np.int64)
        if idx.size == 0 or idx.min() < 0 or idx.max() >= len(uploads) or k not in idx:
            raise ValueError(
                f"similarity set {k} must hold {k} and indices below {len(uploads)}, got {idx.tolist()}"
            )
        out.append(reflect_factorized(uploads[k], [uploads[j] for j in idx], w, threshold))
    return out
