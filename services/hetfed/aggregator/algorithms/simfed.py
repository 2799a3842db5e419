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

Server state (``SimFedServer``).

* Per organization, its latest upload: the ``FactorizedWeights`` as decoded from the wire (u and v float32,
  mask indices int64 and values float32) and its criteria embeddings ([B, D] float32). Uploads of the open
  round wait in ``pending`` and replace the organization's entry in ``latest`` by reference when the round
  closes (an organization that missed a round keeps its older entry); nothing is copied per round and no
  older round is kept (eq. 8 needs only the latest factors). The same close computes σ (K × K float64) and
  every organization's similarity set and weights.
* Downloads are not stored: organization k's reflection is computed when it pulls its instructions (the
  engine encodes them once per round and organization), one layer at a time through float64 buffers of the
  layer's size. Because ``latest`` changes only at a close, every organization's download of a round
  reflects the same uploads, whenever it pulls.
* Size, for L factorised layers with mask shapes I_l × O_l (convolutions: I_l·F × O_l·F), n_l sent mask
  entries per organization, B criteria inputs of width D:
      per organization: 4·Σ_l (I_l + O_l) + 12·Σ_l n_l + 4·B·D bytes (u, v float32; int64 index and
      float32 value per mask entry; embeddings), so K·(that) in all, plus 8·K² bytes for σ, and as much
      again in ``pending`` while a round is open. It grows linearly in the number of organizations by
      design (personalised models); with mask density ρ it is about 12·ρ·P + 4·Σ(I_l + O_l) per
      organization for P weight entries, against 4·P for a dense model. ``state_nbytes`` measures it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hetfed.aggregator.algorithms.base import RunInfo, ServerHalf
from hetfed.wire.errors import WireError
from hetfed.wire.payloads import CriteriaEmbeddings, FactorizedLayer, FactorizedWeights, Payload, Received
from hetfed.wire.phases import Phase
from hetfed.wire.specs import simfed
from hetfed.wire.specs.simfed import SimFedConfig, decode_mask

Layout = tuple[tuple[str, int, int, tuple[int, ...]], ...]
"""An organization's factorised layers: (name, len u, len v, mask shape) each."""

__all__ = [
    "SimFedServer",
    "cosine_similarity_matrix",
    "match",
    "personalised_downloads",
    "random_similarity_sets",
    "ranked_similarity_sets",
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


def similarity_sets(sigma: np.ndarray, tau: float, minimum: int = 1) -> list[np.ndarray]:
    """J_k = {j : σ_kj ≥ τ} ∪ the ``minimum`` organizations of highest σ_kj (k first), as increasing int64 arrays.

    ``minimum`` = 1 is the paper's set (k is always in it). A larger ``minimum`` is the authors' floor
    (``minimum_aggr``, server.py): the top max(|{σ ≥ τ}|, minimum) by σ; ties go to the lower index.
    """
    s = _square(sigma)
    if not math.isfinite(tau):
        raise ValueError(f"tau must be finite, got {tau}")
    if minimum < 1:
        raise ValueError(f"the minimum similarity-set size must be >= 1, got {minimum}")
    sets = []
    for k in range(s.shape[0]):
        member = s[k] >= tau
        member[k] = True
        if minimum > 1:
            others = np.array([j for j in range(s.shape[0]) if j != k], dtype=np.int64)
            ranked = others[np.lexsort((others, -s[k, others]))]  # σ descending, then index
            member[ranked[: minimum - 1]] = True
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


def ranked_similarity_sets(sigma: np.ndarray, partners: int, *, most_similar: bool) -> list[np.ndarray]:
    """J_k = {k} plus the ``partners`` others of highest σ_kj (``most_similar``) or of lowest σ_kj (the paper's
    "worst matching", Table 3), as increasing int64 arrays; ties go to the lower index."""
    s = _square(sigma)
    if partners < 0:
        raise ValueError(f"partners must be >= 0, got {partners}")
    sets = []
    for k in range(s.shape[0]):
        others = np.array([j for j in range(s.shape[0]) if j != k], dtype=np.int64)
        ranked = others[np.lexsort((others, -s[k, others] if most_similar else s[k, others]))]
        sets.append(np.sort(np.concatenate([[k], ranked[:partners]]).astype(np.int64)))
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
    base = decode_mask(own[0], own[1], (size,), np.float64)
    dense = [decode_mask(i, v, (size,), np.float64) for i, v in members]
    return sparse_from_dense(reflect(base, dense, weights), threshold)


def match(
    embeddings: Sequence[np.ndarray], tau: float, alpha: float, minimum: int = 1
) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Similarity matching: σ, the sets J_k (σ_kj ≥ τ, with k, at least ``minimum``) and softmax(α·σ_kj)."""
    sigma = cosine_similarity_matrix(embeddings)
    sets = similarity_sets(sigma, tau, minimum)
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


# ================================================================================================ server half
# Stream of the run seed for the random-matching ablation's draws (one generator per round).
RANDOM_MATCHING_STREAM = 0x5AD


@simfed.SPEC.server_half
class SimFedServer(ServerHalf[SimFedConfig]):
    """Similarity matching and personalised reflection; each organization receives its own factors."""

    broadcast = False

    def __init__(self, config: SimFedConfig, run: RunInfo) -> None:
        super().__init__(config, run)
        # The latest factors and criteria embeddings of every organization (as of the last closed round).
        self.latest: dict[str, FactorizedWeights] = {}
        self.embeddings: dict[str, np.ndarray] = {}
        # The open round's uploads (they replace the latest entries when it closes).
        self.pending: dict[str, tuple[FactorizedWeights, np.ndarray]] = {}
        # σ over ``order`` (the organizations with a latest upload, in the run's order), and each one's
        # similarity set (organization names) with its reflection weights.
        self.order: tuple[str, ...] = ()
        self.sigma = np.zeros((0, 0))
        self.sets: dict[str, tuple[tuple[str, ...], np.ndarray]] = {}
        self.closed_round = 0
        # Each organization's layer layout (name, len u, len v, mask shape), fixed by its first upload:
        # organizations with different architectures reflect only between those of one layout. The run's
        # criteria set and embedding shape are fixed by the first upload.
        self.layouts: dict[str, Layout] = {}
        self.criteria_set_id = ""
        self.embedding_shape: tuple[int, ...] | None = None

    # ----------------------------------------------------------------------------------------- uploads
    def validate(self, phase: Phase, organization: str, update: Received) -> None:
        """Factors of the run's layer layout with well-formed sparse masks; embeddings of the run's criteria set."""
        if phase is not Phase.TRAIN:
            return
        fw, ce = update.get(FactorizedWeights), update.get(CriteriaEmbeddings)

        def bad(reason: str, message: str) -> WireError:
            return WireError(reason, f"simfed upload from {organization!r}: {message}")

        layout = _layout(fw, bad)
        earlier = self.layouts.get(organization)
        if earlier is not None and layout != earlier:
            raise bad("schema_mismatch", f"factorised layers {_describe(layout)} differ from those it sent "
                                         f"before, {_describe(earlier)}")
        for layer in fw.layers:
            for what, arr in (("u", layer.u), ("v", layer.v), ("mask_values", layer.mask_values)):
                if np.asarray(arr).dtype.kind != "f":
                    raise bad("dtype_mismatch", f"{layer.name}.{what} must be floating, got {np.asarray(arr).dtype}")
                if not np.all(np.isfinite(arr)):
                    raise bad("non_finite", f"{layer.name}.{what} holds non-finite values")
            idx = np.asarray(layer.mask_indices)
            if idx.size and (idx.dtype.kind not in "iu" or idx[0] < 0 or idx[-1] >= math.prod(layer.mask_shape)
                             or np.any(np.diff(idx) <= 0)):
                raise bad("invalid_value", f"{layer.name}: mask indices must be strictly increasing integers in "
                                           f"[0, {math.prod(layer.mask_shape)})")
        z = np.asarray(ce.embeddings)
        if not ce.criteria_set_id:
            raise bad("invalid_value", "criteria embeddings name no criteria set")
        if self.criteria_set_id and ce.criteria_set_id != self.criteria_set_id:
            raise bad("invalid_value", f"criteria set {ce.criteria_set_id[:64]!r}, the run's is "
                                       f"{self.criteria_set_id!r}")
        if z.ndim != 2 or z.size == 0 or z.dtype.kind != "f":
            raise bad("shape_mismatch", f"criteria embeddings must be a non-empty float [B, D], got "
                                        f"{z.dtype}{list(z.shape)}")
        if self.embedding_shape is not None and z.shape != self.embedding_shape:
            raise bad("shape_mismatch", f"criteria embeddings {list(z.shape)}, the run's are "
                                        f"{list(self.embedding_shape)}")
        if not np.all(np.isfinite(z)):
            raise bad("non_finite", "criteria embeddings hold non-finite values")

    def accumulate(self, phase: Phase, organization: str, update: Received) -> None:
        """Hold the upload (by reference) until the round closes; the first one fixes the run's layout."""
        if phase is not Phase.TRAIN:
            return
        fw, ce = update.get(FactorizedWeights), update.get(CriteriaEmbeddings)
        if not self.criteria_set_id:
            self.criteria_set_id = ce.criteria_set_id
            self.embedding_shape = tuple(np.shape(ce.embeddings))
        self.layouts.setdefault(organization, _layout(fw, WireError))
        self.pending[organization] = (fw, np.asarray(ce.embeddings))

    # ----------------------------------------------------------------------------------------- the close
    def close_round(self, phase: Phase, round_: int) -> None:
        """The round's uploads become the latest; σ, the similarity sets and the weights are recomputed."""
        if phase is not Phase.TRAIN:
            self.pending = {}
            return
        for org, (fw, z) in self.pending.items():
            self.latest[org] = fw
            self.embeddings[org] = z
        self.pending = {}
        self.closed_round = round_
        self._match(round_)

    def _match(self, round_: int) -> None:
        self.order = tuple(o for o in self.run.organizations if o in self.latest)
        if not self.order:
            self.sigma, self.sets = np.zeros((0, 0)), {}
            return
        self.sigma = cosine_similarity_matrix([self.embeddings[o] for o in self.order])
        matching = self.config.matching
        if matching == "random":
            sets = random_similarity_sets(len(self.order), self.config.random_partners,
                                          [self.run.seed, RANDOM_MATCHING_STREAM, round_])
        elif matching in ("top", "bottom"):
            sets = ranked_similarity_sets(self.sigma, self.config.random_partners, most_similar=matching == "top")
        else:
            sets = similarity_sets(self.sigma, self.config.tau, self.config.min_similarity_set)
        # Factors reflect only between organizations of one layer layout (one architecture): hetfed's own rule
        # for heterogeneous architectures, which the paper (one architecture) never meets.
        sets = [m[[self.layouts[self.order[j]] == self.layouts[self.order[k]] for j in m]] for k, m in enumerate(sets)]
        if self.config.match_weights == "equal":
            weights = [np.full(m.size, 1.0 / m.size) for m in sets]
        else:
            weights = [reflection_weights(self.sigma[k], m, self.config.alpha) for k, m in enumerate(sets)]
        self.sets = {org: (tuple(self.order[j] for j in sets[k]), weights[k]) for k, org in enumerate(self.order)}

    # ----------------------------------------------------------------------------------------- downloads
    def payloads_for(self, phase: Phase, round_: int, organization: str) -> list[Payload]:
        """Round 1 and evaluation: nothing. Later rounds: this organization's reflection (eq. 8) of the latest
        factors of its similarity set."""
        if phase is not Phase.TRAIN or organization not in self.sets:
            return []
        members, weights = self.sets[organization]
        return [reflect_factorized(self.latest[organization], [self.latest[m] for m in members], weights)]

    # ----------------------------------------------------------------------------------------- durability
    def state(self) -> dict[str, np.ndarray]:
        """The latest factors and embeddings of every organization, σ, and what fixes the run's layout; by
        organization name, so the same uploads give the same bytes whatever order they arrived in."""
        latest = sorted(self.latest.items())
        meta = {"closed_round": self.closed_round, "criteria_set_id": self.criteria_set_id,
                "layouts": {org: [[n, u, v, list(s)] for n, u, v, s in layout]
                            for org, layout in sorted(self.layouts.items())},
                "organizations": {org: [fw.num_examples, [layer.name for layer in fw.layers]]
                                  for org, fw in latest}}
        out: dict[str, np.ndarray] = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                                      "sigma": self.sigma, "sigma_order":
                                      np.frombuffer(json.dumps(list(self.order)).encode(), dtype=np.uint8)}
        for org, fw in latest:
            out[f"z/{org}"] = self.embeddings[org]
            for i, layer in enumerate(fw.layers):
                for field in ("u", "v", "mask_indices", "mask_values"):
                    out[f"f/{org}/{i}/{field}"] = getattr(layer, field)
        return out

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore from ``state()`` (σ and the sets are recomputed from the embeddings, as at the close)."""
        if "meta" not in arrays:
            return
        meta = json.loads(bytes(arrays["meta"]).decode())
        self.closed_round = int(meta["closed_round"])
        self.criteria_set_id = str(meta["criteria_set_id"])
        def layout_of(rows: list[Any]) -> Layout:
            return tuple((str(n), int(u), int(v), tuple(int(d) for d in s)) for n, u, v, s in rows)

        if "layouts" in meta:
            self.layouts = {org: layout_of(rows) for org, rows in meta["layouts"].items()}
        else:  # a checkpoint of one run-wide layout
            self.layouts = {org: layout_of(meta["layout"]) for org in meta["organizations"]}
        self.latest, self.embeddings, self.pending = {}, {}, {}
        for org, (num_examples, names) in meta["organizations"].items():
            shapes = {n: s for n, _, _, s in self.layouts[org]}
            layers = tuple(FactorizedLayer(name, arrays[f"f/{org}/{i}/u"], arrays[f"f/{org}/{i}/v"],
                                           arrays[f"f/{org}/{i}/mask_indices"], arrays[f"f/{org}/{i}/mask_values"],
                                           shapes[name])
                           for i, name in enumerate(names))
            self.latest[org] = FactorizedWeights(layers, int(num_examples))
            self.embeddings[org] = arrays[f"z/{org}"]
        self.embedding_shape = next((tuple(z.shape) for z in self.embeddings.values()), None)
        self._match(self.closed_round)

    def state_nbytes(self) -> int:
        """Bytes of the arrays the server holds for the run (latest factors, embeddings, σ, open uploads)."""
        held = [*self.latest.values(), *(fw for fw, _ in self.pending.values())]
        total = sum(np.asarray(a).nbytes for fw in held for layer in fw.layers
                    for a in (layer.u, layer.v, layer.mask_indices, layer.mask_values))
        total += sum(z.nbytes for z in self.embeddings.values()) + sum(z.nbytes for _, z in self.pending.values())
        return total + self.sigma.nbytes


def _layout(fw: FactorizedWeights, fail: Callable[[str, str], WireError]) -> Layout:
    """(name, len u, len v, mask shape) of every layer, checked for shape consistency."""
    out = []
    for layer in fw.layers:
        u, v = np.asarray(layer.u), np.asarray(layer.v)
        shape = tuple(int(d) for d in layer.mask_shape)
        # v is empty when it is not shared (shared_factors = "u"): the organization keeps its own.
        if u.ndim != 1 or v.ndim != 1 or len(shape) != 2 or shape[0] != u.size or v.size not in (0, shape[1]):
            raise fail("shape_mismatch", f"{layer.name}: u {list(u.shape)} and v {list(v.shape)} must be vectors "
                                         f"of the mask's shape {list(shape)} (v may be empty)")
        idx, val = np.asarray(layer.mask_indices), np.asarray(layer.mask_values)
        if idx.ndim != 1 or val.ndim != 1 or idx.size != val.size:
            raise fail("shape_mismatch", f"{layer.name}: mask indices {list(idx.shape)} and values "
                                         f"{list(val.shape)} must be vectors of one length")
        out.append((layer.name, u.size, v.size, shape))
    if not out:
        raise fail("invalid_value", "factorised weights hold no layer")
    if len({n for n, *_ in out}) != len(out):
        raise fail("invalid_value", "factorised weights name a layer twice")
    return tuple(out)


def _describe(layout: Sequence[tuple[str, int, int, tuple[int, ...]]]) -> str:
    return ", ".join(f"{n} {list(s)}" for n, _, _, s in layout)
