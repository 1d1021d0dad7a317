"""Box arithmetic in global tensor coordinates.

DCP stores every tensor as chunks ``(offsets, sizes)`` inside its global shape. Everything
reshard does with tensors (completeness, reading a box, resharding) reduces to a few
questions about such boxes, answered here exactly and without touching bytes.
"""
from __future__ import annotations

import heapq
from bisect import bisect_left
from dataclasses import dataclass
from math import prod
from typing import Iterable, Sequence

import numpy as np


@dataclass(frozen=True, slots=True)
class Box:
    """An axis-aligned box ``[offsets, offsets + sizes)`` in a tensor's global coordinates."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.sizes) if self.sizes else 1

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def is_empty(self) -> bool:
        return any(s == 0 for s in self.sizes)

    def intersect(self, other: "Box") -> "Box | None":
        """The common box, or None when the two do not overlap (empty boxes never overlap)."""
        if len(self.offsets) != len(other.offsets):
            raise ValueError("boxes of different rank")
        offs, sizes = [], []
        for a0, a1, b0, b1 in zip(self.offsets, self.ends, other.offsets, other.ends):
            lo, hi = max(a0, b0), min(a1, b1)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        if not self.offsets and (self.is_empty() or other.is_empty()):
            return None
        return Box(tuple(offs), tuple(sizes))

    def relative_to(self, outer: "Box") -> "Box":
        """This box expressed in the local coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(o - p for o, p in zip(self.offsets, outer.offsets)), self.sizes)

    def contains(self, other: "Box") -> bool:
        if len(self.offsets) != len(other.offsets):
            raise ValueError("boxes of different rank")
        return all(
            a0 <= b0 and b1 <= a1
            for a0, a1, b0, b1 in zip(self.offsets, self.ends, other.offsets, other.ends)
        )

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))


def contiguous_run(rel: Box, sizes: Sequence[int]) -> int | None:
    """The flat element index where ``rel`` (a box in the local coordinates of a C-contiguous
    array of shape ``sizes``) starts, when its elements are one contiguous run; else None.

    Contiguous exactly when every dim after the last non-full one is full (true by
    definition) and every dim before it has size 1. The run holds ``rel.numel`` elements.
    Byte splicing (`reshard.engine.splice`) and byte comparison (`reshard.verification.compare`) both
    decide with it whether a box can be moved or compared as one range.
    """
    n = len(sizes)
    k = n - 1
    while k >= 0 and rel.sizes[k] == sizes[k]:
        k -= 1
    if any(rel.sizes[j] != 1 for j in range(k)):
        return None
    flat = 0
    for o, s in zip(rel.offsets, sizes):
        flat = flat * s + o
    return flat


def whole(shape: Sequence[int]) -> Box:
    return Box(tuple(0 for _ in shape), tuple(int(s) for s in shape))


@dataclass(frozen=True)
class CoverageProblem:
    """Why a set of chunks does not tile a global shape exactly once."""

    kind: str  # "out_of_bounds" | "overlap" | "gap" | "rank_mismatch"
    detail: str


# Corners per box of the exact-tiling identity: 2 ** (dims whose chunks are not all full).
# Past this many dims the identity is skipped and the sweep decides alone.
_MAX_CORNER_DIMS = 6
# Pairwise comparisons the sweep may spend when three or more dims vary across chunks and the
# layout has already failed the exact-tiling identity (a hostile layout, never a real one).
PAIRWISE_BUDGET = 2_000_000


def coverage_problems(shape: Sequence[int], chunks: Iterable[Box]) -> list[CoverageProblem]:
    """Check that ``chunks`` tile ``shape`` exactly: no chunk outside, no overlap, no gap.

    Exact, and O(n log n) in the number of chunks whenever at most two dims vary across
    chunks (every layout FSDP, TP and FSDP x TP write; 1-D and 2-D tensors always); with more,
    accepting a tiling is O(n 2^d) and a failing layout costs at most O(n log n) plus
    ``PAIRWISE_BUDGET`` comparisons. A forged `.metadata` can declare tens of
    thousands of chunks in a layout (a staircase) on which comparing each chunk with every
    chunk it may overlap is quadratic (8,000 chunks took minutes).

    1. Every chunk is checked against the rank and the bounds (first problems found win).
    2. Accept in O(n 2^d): the indicator of a box ``[a, b)`` is the signed sum of the
       orthant indicators at its ``2^d`` corners, and orthant indicators at distinct corners
       are linearly independent, so the chunks tile the shape exactly once iff their signed
       corner counts equal the whole shape's. Dims every chunk spans fully factor out.
    3. Otherwise find the first overlap with a sweep along the dim with the most distinct
       cut positions. The chunks active at a sweep position all contain it, so (having no
       overlap so far) their extents on the other dims are pairwise disjoint: with one other
       dim that varies across chunks they are disjoint intervals, and the only candidate for
       a new chunk is the active interval starting last before its end (a Fenwick tree over
       the interval starts finds it in O(log n)). With two or more other varying dims the
       active chunks are compared pairwise, at most ``PAIRWISE_BUDGET`` times; past that the
       verdict stays exact (not a tiling) and the volumes name a problem that exists: an
       overlap when they reach the shape's volume, else a gap (an overlap may exist too).
    4. With no overlap, a gap exists exactly when the in-bounds volumes fall short.

    The problem reported for an overlap is always the same pair: the first chunk in sweep
    order that overlaps an earlier one, and the first earlier chunk it overlaps.
    """
    shape = tuple(int(s) for s in shape)
    chunks = list(chunks)
    if tiles_exactly_fast(shape, chunks):
        return []
    total = prod(shape) if shape else 1
    problems: list[CoverageProblem] = []
    boxes = []
    for c in chunks:
        if len(c.offsets) != len(shape) or len(c.sizes) != len(shape):
            problems.append(CoverageProblem("rank_mismatch", f"chunk {c.offsets}+{c.sizes} has rank {len(c.sizes)}, tensor rank {len(shape)}"))
            continue
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(c.offsets, c.sizes, shape)):
            problems.append(CoverageProblem("out_of_bounds", f"chunk at {list(c.offsets)} size {list(c.sizes)} lies outside {list(shape)}"))
            continue
        if c.numel == 0:
            continue
        boxes.append(c)
    if problems:
        return problems
    if not shape:
        if len(boxes) > 1:
            problems.append(CoverageProblem("overlap", f"{len(boxes)} chunks for a scalar"))
        elif not boxes:
            problems.append(CoverageProblem("gap", "scalar tensor has no chunk"))
        return problems
    covered = sum(b.numel for b in boxes)
    if covered == total and _tiles_exactly(shape, boxes):
        return problems
    # Sweep along the dim with the most distinct cut positions (dim 0 for FSDP, dim 1 for
    # row-parallel TP); ties go to the lowest dim.
    sweep = max(range(len(shape)), key=lambda d: len({b.offsets[d] for b in boxes}))
    boxes.sort(key=lambda b: (b.offsets[sweep], b.offsets))
    found = _first_overlap(boxes, sweep)
    if isinstance(found, tuple):
        i, j = found
        a, b = boxes[i], boxes[j]
        problems.append(CoverageProblem(
            "overlap",
            f"chunks at {list(a.offsets)} size {list(a.sizes)} and at {list(b.offsets)} size {list(b.sizes)} overlap",
        ))
    elif found == "budget" and covered >= total:
        # Not a tiling (step 2) with the volumes adding up: some element is covered twice.
        problems.append(CoverageProblem(
            "overlap", f"chunks cover {covered} elements counted with repeats, for {total} elements of {list(shape)}"))
    elif covered != total:
        problems.append(CoverageProblem("gap", f"chunks cover {covered} of {total} elements of {list(shape)}"))
    return problems


def tiles_exactly_fast(shape: tuple[int, ...], chunks: list[Box]) -> bool:
    """True when ``chunks`` certainly tile ``shape`` exactly once: steps 1 and 2 of
    `coverage_problems` in numpy over all chunks at once. False means "ask the exact code",
    which finds and names the problem (or, for a layout numpy cannot encode, accepts it).

    A 1,024-rank checkpoint has a thousand chunks per tensor and a thousand tensors: the
    per-chunk Python checks and corner dictionary cost seconds that this does in milliseconds.
    """
    n, d = len(chunks), len(shape)
    if d == 0 or n == 0 or n * (1 << min(d, _MAX_CORNER_DIMS)) > 1 << 26:
        return False
    try:
        offs = np.array([c.offsets for c in chunks], dtype=np.int64)
        sizes = np.array([c.sizes for c in chunks], dtype=np.int64)
    except (ValueError, OverflowError):  # ragged ranks, or values beyond int64
        return False
    return tiles_exactly_arrays(shape, offs, sizes)


def tiles_exactly_arrays(shape: tuple[int, ...], offs: np.ndarray, sizes: np.ndarray) -> bool:
    """`tiles_exactly_fast` of chunks given as int64 ``(n, ndim)`` arrays of offsets and sizes
    (`reshard.model.checkpoint.ChunkTable`): no `Box` is made."""
    n, d = len(offs), len(shape)
    if d == 0 or n == 0 or n * (1 << min(d, _MAX_CORNER_DIMS)) > 1 << 26:
        return False
    if offs.shape != (n, d) or sizes.shape != (n, d):
        return False
    try:
        dims = np.asarray(shape, dtype=np.int64)
    except OverflowError:
        return False
    ends = offs + sizes
    if (offs < 0).any() or (sizes < 0).any() or (ends > dims).any():
        return False
    keep = (sizes > 0).all(axis=1)
    offs, ends, sizes = offs[keep], ends[keep], sizes[keep]
    if np.prod(sizes.astype(np.float64), axis=1).sum() < 2.0 ** 52:  # every product and the sum exact in int64
        volume = int(np.prod(sizes, axis=1).sum())
    else:
        volume = sum(prod(r) for r in sizes.tolist())  # Python ints: no overflow
    if volume != prod(shape):
        return False
    vary = np.flatnonzero((offs != 0).any(axis=0) | (ends != dims).any(axis=0))
    if len(vary) > _MAX_CORNER_DIMS:
        return False
    if len(vary) == 0:
        return len(offs) == 1
    radix = dims[vary] + 1
    if prod(int(r) for r in radix.tolist()) >= 1 << 62:  # corners as one int64 each
        return False
    lo, hi = offs[:, vary], ends[:, vary]
    k = len(vary)
    codes, signs = [], []
    for mask in range(1 << k):  # every corner: low or high end per varying dim
        pick = np.array([(mask >> j) & 1 for j in range(k)], dtype=bool)
        corner = np.where(pick, hi, lo)
        code = np.zeros(len(corner), dtype=np.int64)
        for j in range(k):
            code = code * radix[j] + corner[:, j]
        codes.append(code)
        signs.append(np.full(len(code), -1 if bin(mask).count("1") % 2 else 1, dtype=np.int64))
        whole = np.where(pick, dims[vary], 0)
        wcode = 0
        for j in range(k):
            wcode = wcode * int(radix[j]) + int(whole[j])
        codes.append(np.array([wcode], dtype=np.int64))
        signs.append(np.array([1 if bin(mask).count("1") % 2 else -1], dtype=np.int64))
    code = np.concatenate(codes)
    uniq, inverse = np.unique(code, return_inverse=True)
    return not np.bincount(inverse, weights=np.concatenate(signs), minlength=len(uniq)).any()


def _tiles_exactly(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """The corner identity of `coverage_problems` (step 2); False when it cannot be applied."""
    dims = [d for d in range(len(shape)) if any(b.offsets[d] != 0 or b.sizes[d] != shape[d] for b in boxes)]
    if len(dims) > _MAX_CORNER_DIMS:
        return False
    weight: dict[tuple[int, ...], int] = {}

    def add(lo: tuple[int, ...], hi: tuple[int, ...], sign: int) -> None:
        corners = [((), sign)]
        for a, b in zip(lo, hi):
            corners = [(c + (a,), s) for c, s in corners] + [(c + (b,), -s) for c, s in corners]
        for c, s in corners:
            w = weight.get(c, 0) + s
            if w:
                weight[c] = w
            else:
                del weight[c]

    for b in boxes:
        add(tuple(b.offsets[d] for d in dims), tuple(b.offsets[d] + b.sizes[d] for d in dims), 1)
    add(tuple(0 for _ in dims), tuple(shape[d] for d in dims), -1)
    return not weight


class _ActiveStarts:
    """A set of ranks in ``range(n)`` with insert, delete and "the k-th smallest" in O(log n)
    (a Fenwick tree of counts); holds the sweep's active intervals by the rank of their start."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0] * (n + 1)
        self.top = 1 << max(n.bit_length() - 1, 0)

    def add(self, rank: int, delta: int) -> None:
        i = rank + 1
        while i <= self.n:
            self.tree[i] += delta
            i += i & -i

    def count_below(self, rank: int) -> int:
        """How many members are smaller than ``rank``."""
        i, total = rank, 0
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total

    def kth(self, k: int) -> int:
        """The rank of the k-th smallest member (1-based); ``k`` must not exceed the size."""
        pos, step = 0, self.top
        while step:
            nxt = pos + step
            if nxt <= self.n and self.tree[nxt] < k:
                pos = nxt
                k -= self.tree[nxt]
            step >>= 1
        return pos


def _first_overlap(boxes: list[Box], sweep: int) -> "tuple[int, int] | str | None":
    """Indices ``(i, j)``, ``i < j``, of the first overlapping pair in the order of ``boxes``
    (sorted by their start along ``sweep``): the least ``j`` overlapping an earlier box, and
    the least such earlier ``i``. None when no two overlap; "budget" when the pairwise
    comparisons ran out before deciding."""
    n = len(boxes)
    # dims other than the sweep on which chunks differ; a dim where all share one interval
    # cannot separate two chunks
    others = [d for d in range(len(boxes[0].offsets)) if d != sweep
              and len({(b.offsets[d], b.sizes[d]) for b in boxes}) > 1] if n else []
    ends: list[tuple[int, int]] = []  # heap of (end along sweep, index) of the active boxes
    hit: int | None = None
    if not others:
        # chunks differ along the sweep only: two active chunks always overlap
        for j, b in enumerate(boxes):
            x = b.offsets[sweep]
            while ends and ends[0][0] <= x:
                heapq.heappop(ends)
            if ends:
                hit = j
                break
            heapq.heappush(ends, (x + b.sizes[sweep], j))
    elif len(others) == 1:
        e = others[0]
        by_start = sorted(range(n), key=lambda i: boxes[i].offsets[e])
        rank = [0] * n
        for r, i in enumerate(by_start):
            rank[i] = r
        starts = [boxes[i].offsets[e] for i in by_start]
        active = _ActiveStarts(n)
        for j, b in enumerate(boxes):
            x = b.offsets[sweep]
            while ends and ends[0][0] <= x:
                active.add(rank[heapq.heappop(ends)[1]], -1)
            # active intervals along e are disjoint: sorted by start, they are sorted by end
            # too, so the one starting last before b ends is the only candidate
            k = active.count_below(bisect_left(starts, b.offsets[e] + b.sizes[e]))
            if k and boxes[by_start[active.kth(k)]].ends[e] > b.offsets[e]:
                hit = j
                break
            active.add(rank[j], 1)
            heapq.heappush(ends, (x + b.sizes[sweep], j))
    else:
        live: dict[int, None] = {}
        budget = PAIRWISE_BUDGET
        for j, b in enumerate(boxes):
            x = b.offsets[sweep]
            while ends and ends[0][0] <= x:
                live.pop(heapq.heappop(ends)[1])
            budget -= len(live)
            if budget < 0:
                return "budget"
            if any(boxes[i].intersect(b) is not None for i in live):
                hit = j
                break
            live[j] = None
            heapq.heappush(ends, (x + b.sizes[sweep], j))
    if hit is None:
        return None
    b = boxes[hit]
    return next(i for i in range(hit) if boxes[i].intersect(b) is not None), hit
