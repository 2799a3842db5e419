"""The aggregators a server half folds updates into (numpy only, float64): a streaming weighted mean, a streaming
coordinate-wise trimmed mean and the coordinate-wise median; and the norm clipping applied before them.

Each aggregator takes one organization's named arrays at a time (``add``), gives the aggregate (``mean``) and
forgets everything (``reset``): a server half picks one by its config and calls any of them the same way.
Each gives the same bits whatever order the arrays are added in (sums go through ``ExactSum``), so a run's
result does not depend on which organization pushes first, nor on the order a restart replays the round in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from hetfed.wire.pages import drop_pages


class ExactSum:
    """An order-independent sum of float64 arrays of one shape: the same bits whatever order the terms come in.

    Float64 addition is not associative, so a running ``+=`` depends on arrival order. This accumulator
    (reproducible summation after Demmel & Nguyen, the idea of ReproBLAS) cuts every term on a grid fixed in
    absolute terms: level L holds integer multiples of 2^(L·W), W = 32. Per element it keeps K = 3 levels,
    ``top`` and the two below it, where ``top`` is the lowest level whose range holds every term of that
    element so far (|t| < 2^((top+1)·W - 1)). A term t is extracted from the top level down (r = t first):
    q_L = rint(r / 2^(L·W)) · 2^(L·W), r -= q_L, level L += q_L; what is left below the lowest kept level is
    dropped.

    Why the kept levels do not depend on the order of the adds:

    * every step is exact: scaling by a power of two (``ldexp``), ``rint``, r − q_L (q_L is r rounded on a
      coarser grid, the difference is r's own low bits) and the level sums (each holds integers times
      2^(L·W), each term adds at most 2^(W-1) of them, exact below ``MAX_TERMS`` = 2^(53-W) terms);
    * a term's extraction at level L depends only on the term and L: at every level above the term's own top,
      |t| < 2^(L·W - 1), so q = 0 there, and below, each q_L is a function of t and the levels above it. The
      window a term was added under only decides which of its levels are kept;
    * a larger term raises ``top``: the window moves up (zero levels on top, the lowest dropped). Every level
      of the final window was in the window of every earlier add or above it (where those terms put 0),
      so a kept level holds exactly the sum over all terms of their extraction at that level.

    ``total`` adds the kept levels top down in float64: the same bits for the same levels. Precision: per
    element, each term loses less than 2^(-2W) = 2^-64 of the largest |term| of that element (below float64's
    2^-53); n terms are within n·2^-64 of their exact sum relative to that largest term, and the total is
    that rounded to float64 (within an ulp). Memory: K float64 and one int8 per element, whatever the
    number of terms.
    """

    W = 32
    K = 3
    # Lowest top: 2^(±L·W) of every kept level is a normal float64 (the lowest grid is 2^-992; smaller terms
    # are dropped, an error below 2^-993 each).
    TOP_MIN = -(1022 // W) + K - 1
    # Highest top: a level's sum (< 2^53 units of 2^(top·W)) stays finite; terms up to 2^(31·32 - 1) = 2^991.
    TOP_MAX = (1023 - 53) // W
    # Terms per element before a level's integer sum could pass 2^53.
    MAX_TERMS = 1 << (53 - W)
    # Elements taken at a time: the block's float64 scratch stays in cache.
    BLOCK = 1 << 16

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = tuple(shape)
        size = math.prod(self.shape)
        self._levels = np.zeros((self.K, size), np.float64)  # row j: level top - j
        self._top = np.full(size, self.TOP_MIN, np.int8)
        self.count = 0

    def add(self, values: np.ndarray, scale: float = 1.0) -> None:
        """Add the float64 terms fl(values × scale), a block at a time (no float64 copy of the whole array)."""
        a = np.asarray(values)
        if a.shape != self.shape:
            raise ValueError(f"terms of shape {a.shape}, the sum's is {self.shape}")
        if self.count >= self.MAX_TERMS:
            raise OverflowError(f"more than {self.MAX_TERMS} terms in one exact sum")
        flat = a.reshape(-1)
        n = min(self.BLOCK, flat.size)
        scratch = _Scratch(n)
        for lo in range(0, flat.size, self.BLOCK):
            hi = min(lo + self.BLOCK, flat.size)
            part = scratch.terms[:hi - lo]
            np.multiply(flat[lo:hi], scale, out=part, dtype=np.float64)
            self._add_block(lo, part, scratch)
        self.count += 1

    def _add_block(self, lo: int, r: np.ndarray, s: _Scratch) -> None:
        """Fold the terms ``r`` (overwritten with the residual) into elements [lo, lo + len(r))."""
        n = r.size
        levels, top = self._levels[:, lo:lo + n], self._top[lo:lo + n]
        q = s.q[:n]
        high = int(top.max())
        if high == int(top.min()) and max(float(r.max()), -float(r.min())) < 2.0 ** ((high + 1) * self.W - 1):
            # One window for the whole block and no term above it (the usual case after the first add).
            # fl(r + M) - M with M = 1.5·2^(L·W + 52) is r rounded to a multiple of 2^(L·W), ties to even,
            # exactly: |r| < 2^(L·W + W - 1) keeps r + M in [2^(L·W + 52), 2^(L·W + 53)), whose spacing is
            # 2^(L·W) (the same q as rint(r / 2^(L·W)) · 2^(L·W), in two passes instead of three).
            for j in range(self.K):
                magic = 1.5 * 2.0 ** ((high - j) * self.W + 52)
                np.add(r, magic, out=q)
                q -= magic
                levels[j] += q
                if j + 1 < self.K:
                    r -= q
            return
        mant, exp, shift = s.mant[:n], s.exp[:n], s.shift[:n]
        np.frexp(r, out=(mant, exp))  # |r| < 2^exp
        # The lowest top with |r| < 2^((top+1)·W - 1): ceil((exp + 1) / W) - 1; a zero term needs none.
        np.add(exp, self.W, out=exp)
        np.floor_divide(exp, self.W, out=exp)
        np.subtract(exp, 1, out=exp)
        np.copyto(exp, self.TOP_MIN, where=r == 0)
        if self.count == 0:  # every level is still 0: the window is set, nothing moves
            if int(exp.max()) > self.TOP_MAX:
                self._raise(lo, np.arange(n), exp)
            np.maximum(top, exp, out=top, casting="unsafe")
        else:
            raised = np.flatnonzero(exp > top)
            if raised.size:
                self._raise(lo, raised, exp[raised])
        np.multiply(top, self.W, out=shift, dtype=np.int32)  # L·W of the top level
        for j in range(self.K):
            np.negative(shift, out=exp)
            np.ldexp(r, exp, out=q)
            np.rint(q, out=q)
            np.ldexp(q, shift, out=q)
            levels[j] += q
            if j + 1 < self.K:
                r -= q
                shift -= self.W

    def _raise(self, lo: int, idx: np.ndarray, need: np.ndarray) -> None:
        """Move the window of elements lo + idx up to ``need``: new zero levels on top, the lowest dropped."""
        if int(need.max()) > self.TOP_MAX:
            raise ValueError(f"a term of magnitude {2.0 ** (self.W * self.TOP_MAX):.3g} or more cannot be summed")
        at = lo + idx
        old = self._levels[:, at]
        rows = np.arange(self.K)[:, None] - (need - self._top[at])[None, :]  # old row of each new row
        moved = np.take_along_axis(old, np.clip(rows, 0, self.K - 1), axis=0)
        moved[rows < 0] = 0.0
        self._levels[:, at] = moved
        self._top[at] = need

    def total(self, out: np.ndarray | None = None, divisor: float = 1.0) -> np.ndarray:
        """The sum of the kept levels (top down, each addition's rounding error carried along and added last:
        within an ulp of the exact sum of the levels), divided by ``divisor`` and rounded into ``out`` (float64
        of the sum's shape when None), a block at a time. The same levels give the same bits."""
        if out is None:
            out = np.empty(self.shape, np.float64)
        flat = out.reshape(-1)
        size = flat.size
        buffers = np.empty((5, min(self.BLOCK, size)), np.float64)  # made once: no allocation per block
        for lo in range(0, size, self.BLOCK):
            hi = min(lo + self.BLOCK, size)
            s, err, t, bv, x = buffers[:, :hi - lo]
            np.copyto(s, self._levels[0, lo:hi])
            err[:] = 0.0
            for j in range(1, self.K):  # s + err = the levels so far, exactly (TwoSum: Knuth)
                b = self._levels[j, lo:hi]
                np.add(s, b, out=t)
                np.subtract(t, s, out=bv)
                np.subtract(t, bv, out=x)  # err += (s - (t - bv)) + (b - bv)
                np.subtract(s, x, out=x)
                err += x
                np.subtract(b, bv, out=x)
                err += x
                s, t = t, s
            s += err
            np.divide(s, divisor, out=flat[lo:hi], casting="unsafe")
        return out


class _Scratch:
    """The per-block buffers of ``ExactSum.add``, made once per add."""

    def __init__(self, n: int) -> None:
        self.terms = np.empty(n, np.float64)
        self.mant = np.empty(n, np.float64)
        self.q = np.empty(n, np.float64)
        self.exp = np.empty(n, np.int32)
        self.shift = np.empty(n, np.int32)


class WeightedMean:
    """A weighted sum of named arrays in float64, the same bits in any order of adds (``ExactSum``; the total
    weight as an exact fraction): memory does not grow with the clients."""

    def __init__(self) -> None:
        self._sums: dict[str, ExactSum] = {}
        self._weight = Fraction(0)
        self.count = 0

    @property
    def weight(self) -> float:
        """The sum of the weights, rounded once."""
        return float(self._weight)

    def add(self, arrays: Mapping[str, np.ndarray], weight: float) -> None:
        """Add fl(weight × arrays) to the sum (each product rounded to float64, then summed exactly)."""
        if weight <= 0:
            raise ValueError("weights must be positive")
        for name, a in arrays.items():
            a = np.asarray(a)
            acc = self._sums.get(name)
            if acc is None:
                acc = self._sums[name] = ExactSum(a.shape)
            acc.add(a, weight)
        self._weight += Fraction(weight)
        self.count += 1

    def mean(self, dtype: type[np.floating] = np.float64) -> dict[str, np.ndarray]:
        """The weighted mean of everything added: the sum in float64 divided by the weight and rounded once to
        ``dtype``, without a float64 quotient in memory."""
        if self._weight <= 0:
            raise ValueError("no contributions")
        w = self.weight
        return {k: v.total(np.empty(v.shape, dtype), w) for k, v in self._sums.items()}

    def reset(self) -> None:
        """Forget every contribution."""
        self._sums = {}
        self._weight = Fraction(0)
        self.count = 0


class TrimmedMean:
    """A running coordinate-wise trimmed mean of named arrays: per coordinate, the ``trim`` largest and ``trim``
    smallest values are dropped and the rest averaged, unweighted.

    Streaming: it keeps the ``trim`` largest values, the ``trim`` smallest of the rest and the sum of every
    other value (an ``ExactSum``: the same bits in any order), so memory is 2·trim float64 copies of the
    arrays and the sum's levels whatever the number of clients, and an extreme value is never added to the
    sum (no cancellation of 1e30 against 1e30). With fewer than
    2·trim + 1 contributions it trims (count − 1) // 2 values at each end.
    """

    def __init__(self, trim: int) -> None:
        if trim < 1:
            raise ValueError("trim must be >= 1")
        self.trim = trim
        self._high: dict[str, np.ndarray] = {}  # [<= trim, *shape] the largest values, ascending
        self._low: dict[str, np.ndarray] = {}  # [<= trim, *shape] the smallest of the rest, ascending
        self._mid: dict[str, ExactSum] = {}  # the sum of every other value, exact in any order
        self.count = 0

    def add(self, arrays: Mapping[str, np.ndarray], weight: float = 1.0) -> None:
        """Add one organization's arrays (``weight`` is ignored: the trimmed mean is unweighted)."""
        k = self.trim
        for name, a in arrays.items():
            x = np.asarray(a, dtype=np.float64)[None]
            high = self._high.get(name)
            if high is None or len(high) < k:
                self._high[name] = x if high is None else np.sort(np.concatenate([high, x]), axis=0)
                continue
            both = np.sort(np.concatenate([high, x]), axis=0)
            evicted, self._high[name] = both[:1], both[1:]
            low = self._low.get(name)
            if low is None or len(low) < k:
                self._low[name] = evicted if low is None else np.sort(np.concatenate([low, evicted]), axis=0)
                continue
            both = np.sort(np.concatenate([low, evicted]), axis=0)
            self._low[name], middle = both[:-1], both[-1]
            if name not in self._mid:
                self._mid[name] = ExactSum(middle.shape)
            self._mid[name].add(middle)
        self.count += 1

    def mean(self, dtype: type[np.floating] = np.float64) -> dict[str, np.ndarray]:
        """The trimmed mean of everything added (computed in float64, rounded to ``dtype``)."""
        return {k: v.astype(dtype, copy=False) for k, v in self._mean().items()}

    def _mean(self) -> dict[str, np.ndarray]:
        n, k = self.count, self.trim
        if n == 0:
            raise ValueError("no contributions")
        out = {}
        for name, high in self._high.items():
            if n > 2 * k:
                out[name] = self._mid[name].total(divisor=n - 2 * k)
            else:  # every value is kept in high or low: trim what the count allows, exactly
                cut = (n - 1) // 2
                ordered = np.concatenate([self._low[name], high]) if name in self._low else high
                out[name] = ordered[cut : n - cut].mean(axis=0)
        return out

    def reset(self) -> None:
        """Forget every contribution."""
        self._high, self._low, self._mid = {}, {}, {}
        self.count = 0


class CoordinateMedian:
    """The coordinate-wise median of named arrays, unweighted (``numpy.median``: the mean of the two middle
    values for an even count). Not streaming: it keeps one float64 copy of every contribution until ``reset``."""

    def __init__(self) -> None:
        self._values: dict[str, list[np.ndarray]] = {}
        self.count = 0

    def add(self, arrays: Mapping[str, np.ndarray], weight: float = 1.0) -> None:
        """Add one organization's arrays (``weight`` is ignored: the median is unweighted)."""
        for name, a in arrays.items():
            self._values.setdefault(name, []).append(np.array(a, dtype=np.float64))
        self.count += 1

    def mean(self, dtype: type[np.floating] = np.float64) -> dict[str, np.ndarray]:
        """The coordinate-wise median of everything added (computed in float64, rounded to ``dtype``; named
        ``mean`` like the other aggregators)."""
        if self.count == 0:
            raise ValueError("no contributions")
        return {name: np.median(np.stack(values), axis=0).astype(dtype, copy=False)
                for name, values in self._values.items()}

    def reset(self) -> None:
        """Forget every contribution."""
        self._values = {}
        self.count = 0


# Elements of a tensor folded at a time at a round's close (``fold_ranges``): a range's float64 state (the exact
# sum's levels, 25 bytes an element; the trimmed mean's or median's stacked values) stays tens of MB whatever the
# size of the model.
FOLD_RANGE = 1 << 20

Aggregator = WeightedMean | TrimmedMean | CoordinateMedian


@dataclass(frozen=True)
class Term:
    """One organization's contribution to a round: its arrays, its weight and, when the server-norm clip moves
    it onto the ball around the global model, the factor its distance from the centre is scaled by."""

    arrays: Mapping[str, np.ndarray]
    weight: float
    clip: float | None = None


def fold_ranges(make: Callable[[], Aggregator], terms: Sequence[Term], centre: Mapping[str, np.ndarray] | None,
                dtype: type[np.floating] = np.float32, range_elements: int = FOLD_RANGE,
                after_range: Callable[[], None] | None = None, into: Mapping[str, np.ndarray] | None = None,
                ) -> dict[str, np.ndarray]:
    """The aggregate of ``terms`` (``make()``'s kind: weighted mean, trimmed mean or median), computed a range
    of ``range_elements`` elements of one tensor at a time and written into new ``dtype`` arrays.

    Every aggregator works element by element (the exact sum keeps each element's levels apart, the trimmed mean
    and the median sort each element's values apart), so a range gives the bits the whole tensor gives: one
    model-sized result, no model-sized state. A result goes into the array of its name in ``into`` when that
    one is writable and of its shape and dtype (the old global model: each range is read, as the clip's
    centre, before it is written), else into a new array. A clipped term is moved as ``clip_to_ball`` moves it,
    ``centre + (a - centre) · clip`` in float64, a range at a time. The pages of the terms' arrays that view a
    read-only file mapping (the write-ahead log) are given back after each range (``drop_pages``), and
    ``after_range`` is called (the engine's crash point)."""
    names = list(dict.fromkeys(name for t in terms for name in t.arrays))
    out: dict[str, np.ndarray] = {}
    for name in names:
        shape = next(np.shape(t.arrays[name]) for t in terms if name in t.arrays)
        old = None if into is None else into.get(name)
        if (old is None or old.shape != shape or old.dtype != dtype or not old.flags.writeable
                or not old.flags.c_contiguous):
            old = np.empty(shape, dtype)
        result = out[name] = old
        flat_out = result.reshape(-1)
        flats = [np.asarray(t.arrays[name]).reshape(-1) if name in t.arrays else None for t in terms]
        c = None if centre is None or name not in centre else np.broadcast_to(centre[name], shape).reshape(-1)
        for lo in range(0, flat_out.size, range_elements):
            hi = min(lo + range_elements, flat_out.size)
            acc = make()
            for t, flat in zip(terms, flats, strict=True):
                if flat is None:  # counted, as a whole-model aggregator counts it, without values here
                    acc.add({}, t.weight)
                    continue
                part = flat[lo:hi]
                if t.clip is not None:
                    base = c[lo:hi] if c is not None else 0.0
                    part = base + (np.asarray(part, np.float64) - base) * t.clip
                acc.add({name: part}, t.weight)
                drop_pages(flat[lo:hi])
            flat_out[lo:hi] = acc.mean(dtype)[name]
            if after_range is not None:
                after_range()
    return out


def moved(term: Term, centre: Mapping[str, np.ndarray] | None) -> Mapping[str, np.ndarray]:
    """A term's arrays as ``fold_ranges`` adds them: clipped terms moved toward ``centre`` (float64 copies),
    others as they are."""
    if term.clip is None:
        return term.arrays
    out = {}
    for name, a in term.arrays.items():
        base = centre[name] if centre is not None and name in centre else 0.0
        out[name] = base + (np.asarray(a, np.float64) - base) * term.clip
    return out


# Elements of a tensor taken at a time by the norms below: one scratch block of this size stays in cache, so a
# norm reads each tensor once and allocates nothing the size of a model.
NORM_BLOCK = 1 << 16
# Elements between two page drops of a mapped update in a norm (a multiple of NORM_BLOCK).
DROP_EVERY = 1 << 22


def _sum_of_squares(a: np.ndarray, centre: np.ndarray | None, scratch: np.ndarray) -> float:
    """Σ (a − centre)² (centre None: Σ a²) over every element, a block at a time, in ``scratch``'s precision.

    The difference and the squares are taken in the operands' common precision (float32 for float32 weights:
    the difference is exact within a factor of two of the centre, by Sterbenz's lemma), each block is summed
    pairwise (numpy's float sums; no BLAS, whose threads a busy aggregator would wait on), and the blocks are
    added in float64: relative error of the order of 2⁻²⁴·log₂(block), 3·10⁻⁹ measured on a 1M-parameter
    model against float64, for a bound that is a ratio of norms."""
    flat = a.reshape(-1)
    ref = centre.reshape(-1) if centre is not None else None
    total = 0.0
    for lo in range(0, flat.size, NORM_BLOCK):
        hi = min(lo + NORM_BLOCK, flat.size)
        part = scratch[:hi - lo]
        if ref is None:
            np.multiply(flat[lo:hi], flat[lo:hi], out=part, casting="unsafe")
        else:
            np.subtract(flat[lo:hi], ref[lo:hi], out=part, casting="unsafe")
            np.multiply(part, part, out=part)
        total += float(part.sum())
        if hi % DROP_EVERY == 0 or hi == flat.size:
            drop_pages(flat[(hi - 1) // DROP_EVERY * DROP_EVERY:hi])  # a mapped update: its block's pages go back
    return total


def distance(arrays: Mapping[str, np.ndarray], centre: Mapping[str, np.ndarray]) -> float:
    """||arrays − centre||₂ over every tensor together (tensors missing from ``centre`` count from 0), without a
    copy of any tensor: the plausibility bound checks every update with it."""
    total = 0.0
    for k, a in arrays.items():
        a = np.asarray(a)
        c = centre.get(k)
        if c is not None:
            c = np.asarray(c)
            if c.shape != a.shape:
                c = np.broadcast_to(c, a.shape)
        dtype = np.result_type(a.dtype, np.float32) if c is None else np.result_type(a.dtype, c.dtype, np.float32)
        total += _sum_of_squares(a, c, np.empty(min(NORM_BLOCK, a.size), dtype))
    return math.sqrt(total)


def clip_to_ball(arrays: Mapping[str, np.ndarray], centre: Mapping[str, np.ndarray],
                 radius: float) -> tuple[dict[str, np.ndarray], float]:
    """``arrays`` moved onto the ball of ``radius`` around ``centre`` when outside it (float64), and their
    distance ||arrays - centre||_2 before (tensors missing from ``centre`` count from 0 and are scaled alike).

    Inside the ball (every plausible update) the arrays come back as they are, after one blocked pass
    (``distance``); only an update that is moved pays for float64 copies."""
    dist = distance(arrays, centre)
    if dist <= radius:
        return dict(arrays), dist
    scale = radius / dist
    diffs = {k: np.asarray(a, np.float64) - centre.get(k, 0.0) for k, a in arrays.items()}
    return {k: centre.get(k, 0.0) + d * scale for k, d in diffs.items()}, dist


def global_norm(arrays: Mapping[str, np.ndarray]) -> float:
    """||arrays||_2 over every tensor together, as ``distance`` computes it (float32 squares for float32 arrays,
    blocks added in float64)."""
    return distance(arrays, {})
